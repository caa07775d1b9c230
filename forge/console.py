"""Where a long command's own output goes while what the libraries print goes to its log file."""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

_terminal: TextIO | None = None


def terminal() -> TextIO:
    """The stream for progress bars: the terminal's stderr, also while ``libraries_to`` is in effect."""
    return _terminal or sys.stderr


@contextmanager
def libraries_to(log: Path) -> Iterator[Path]:
    """For the block, file descriptor 2 goes to ``log`` (appended): what the libraries print there — Python
    warnings, their loggers, C++ warnings, progress bars of their own, child processes that inherit it — lands in
    the file, not between the command's lines. The command's own output (stdout, ``terminal()``) is unchanged; an
    error raised out of the block is reported after fd 2 is back."""
    global _terminal
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with log.open("ab") as file:
        os.dup2(file.fileno(), 2)
    _terminal = os.fdopen(os.dup(saved), "w", buffering=1, encoding="utf-8", errors="replace")
    try:
        yield log
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        _terminal.close()
        _terminal = None
