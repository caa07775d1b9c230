"""The wire-API contract is checked by mypy for every API module: a module that breaks it fails the type check."""

import subprocess
import sys
from pathlib import Path

from forge.paths import repo_root


def test_mypy_refuses_a_module_that_breaks_the_contract(tmp_path: Path):
    (tmp_path / "broken_api.py").write_text(
        "from typing import Any\n\n\ndef prepare_request(api: str) -> dict[str, Any]:\n    return {}\n"
    )
    (tmp_path / "use.py").write_text(
        "import broken_api\nfrom sidecar.apis.base import WireApi\n\nmodule: WireApi = broken_api\n"
    )
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", str(tmp_path / "use.py")],
        capture_output=True, text=True, cwd=tmp_path,
        env={"MYPYPATH": f"{tmp_path}:{repo_root()}", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert checked.returncode == 1 and "WireApi" in checked.stdout, checked.stdout + checked.stderr
