"""The sidecar's planned hook dispatch reaches the same callables, in the same order, as mitmproxy's own, and logs
the same addon errors; every built-in hook it leaves out (``INERT``) does nothing under the options its rule names,
and an option set later brings its addon back (dispatch_check.py, run in the sidecar's environment on a real
mitmproxy Master with mitmdump's default addons)."""

import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SIDECAR_PYTHON = HERE.parent.parent / ".venv-sidecar" / "bin" / "python"


def test_planned_dispatch_reaches_what_mitmproxys_own_does_as_the_chain_changes():
    """Every hook, halts, an addon failing, children, addons added and removed after the first events. Checked to
    fail when the plan is not dropped on ``add``/``remove`` and when a top-level addon's children are skipped; and,
    one rule at a time, with each of the 13 ``INERT`` rules made to hold whatever the options."""
    if not SIDECAR_PYTHON.exists():
        pytest.fail("the sidecar environment is missing: run `make env`")
    done = subprocess.run([str(SIDECAR_PYTHON), str(HERE / "dispatch_check.py")], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr[-6000:]
