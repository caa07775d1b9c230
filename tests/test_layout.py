"""The data flow stays visible in the imports: sidecar → collector → trainer, k8s beside them.

Every import in a part's modules (function-level ones too) is read from the source; a part may import only the
parts upstream of it, the shared `forge` helpers (not `forge.demo`, which drives them all), and itself.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("sidecar", "collector", "trainer", "k8s")
ALLOWED = {
    "sidecar": {"forge"},
    "collector": {"forge", "sidecar"},
    "trainer": {"forge", "sidecar", "collector"},
    "k8s": {"forge", "sidecar"},
}


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def against_the_flow(part: str) -> list[str]:
    wrong = []
    for path in sorted((ROOT / part).rglob("*.py")):
        for module in imports_of(path):
            top = module.split(".")[0]
            if top == part or top not in {*PARTS, "forge"}:
                continue
            if top not in ALLOWED[part] or module == "forge.demo" or module.startswith("forge.demo."):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    return wrong


@pytest.mark.parametrize("part", PARTS)
def test_no_part_imports_against_the_flow(part):
    assert against_the_flow(part) == []


def test_the_check_sees_a_function_level_import(tmp_path):
    module = tmp_path / "viewer.py"
    module.write_text("def f():\n    from trainer.model import prepared_model\n    return prepared_model\n")
    assert "trainer.model" in imports_of(module)
