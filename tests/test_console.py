"""forge.console.libraries_to: what libraries print (fd 1 and 2: warnings, loggers, print(), C-level writes,
children) goes to the log file; the command's own lines (``echo``, ``terminal()``) and what follows the block do not."""

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, os, subprocess, sys, warnings
from pathlib import Path
from forge.console import echo, libraries_to, terminal

with libraries_to(Path(sys.argv[1])):
    warnings.warn("a library's warning")
    logging.getLogger("lib").warning("a library's log line")
    os.write(2, b"a C-level write\\n")
    subprocess.run(["sh", "-c", "echo a child process >&2"], check=True)
    print("a library's print")
    terminal().write("a progress bar\\n")
    echo("the command's own line")
print("after the block", file=sys.stderr)
print("stdout after the block")
"""


def test_libraries_go_to_the_log_and_the_commands_own_output_does_not(tmp_path: Path):
    log = tmp_path / "run" / "demo.log"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parent.parent, check=True)  # fmt: skip
    logged = log.read_text()
    for line in (
        "a library's warning",
        "a library's log line",
        "a C-level write",
        "a child process",
        "a library's print",
    ):
        assert line in logged and line not in done.stderr and line not in done.stdout
    assert done.stderr.splitlines() == ["a progress bar", "after the block"]
    assert done.stdout == "the command's own line\nstdout after the block\n"
