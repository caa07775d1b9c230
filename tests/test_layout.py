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


def imported_modules(path: Path) -> set[str]:
    """``imports_of`` plus a test module imported by name from its package (``from tests.sidecar import conftest``)."""
    found = imports_of(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{a.name}" for a in node.names if is_test_module(a.name))
    return found


def is_test_module(module: str) -> bool:
    name = module.split(".")[-1]
    return name == "conftest" or name.startswith("test_")


def test_test_code_imports_only_its_own_folder_and_tests_support():
    """bench/ imports no test code but tests/support (a support package, not tests); a test folder imports its own
    modules (conftest and test modules included) and tests/support: what several folders share lives there."""
    wrong = []
    for path in sorted([*(ROOT / "bench").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        folder = ".".join(path.relative_to(ROOT).parent.parts)
        for module in sorted(imported_modules(path)):
            if module.split(".")[0] != "tests" or module == "tests.support" or module.startswith("tests.support."):
                continue
            if folder.startswith("bench") or module.rpartition(".")[0] != folder:
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert wrong == [], "\n".join(wrong)


def test_the_folder_check_sees_a_conftest_imported_by_name(tmp_path):
    module = tmp_path / "bench_thing.py"
    module.write_text("from tests.sidecar import conftest\nfrom tests.support.sidecar import read_calls\n")
    assert {"tests.sidecar.conftest", "tests.support.sidecar"} <= imported_modules(module)


def module_graph(root: Path, part: str) -> dict[str, set[str]]:
    """Each module of a part and the modules of the same part it imports (function-level and TYPE_CHECKING imports
    too: a type-only import still ties two modules; ``from pkg import sub`` is the submodule ``pkg.sub``)."""
    paths = {}
    for path in (root / part).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names)
        graph[name] = {module for module in found if module in paths and module != name}
    return graph


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                found.append([*stack[stack.index(imported) :], imported])
            elif imported not in state:
                visit(imported)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


@pytest.mark.parametrize("part", [*PARTS, "forge"])
def test_no_module_imports_itself_through_others(part):
    """No import cycle inside a part: each module can be read (and tested) after the ones it needs."""
    assert cycles_in(module_graph(ROOT, part)) == []


def test_the_cycle_check_sees_a_type_only_cycle(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import B\n")
    (tmp_path / "pkg" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\nclass B: ...\n"
    )
    assert cycles_in(module_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.b", "pkg.a"]]
