"""Where a long command's own output goes while what the libraries print goes to its log file."""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

_terminal: dict[int, TextIO] = {}


def terminal() -> TextIO:
    """The stream for progress bars: the terminal's stderr, also while ``libraries_to`` is in effect."""
    return _terminal.get(2, sys.stderr)


def echo(message: str = "") -> None:
    """The command's own line, on the terminal's stdout, also while ``libraries_to`` is in effect."""
    out = _terminal.get(1, sys.stdout)
    out.write(f"{message}\n")
    out.flush()


@contextmanager
def libraries_to(log: Path) -> Iterator[Path]:
    """For the block, file descriptors 1 and 2 go to ``log`` (appended): what the libraries print — Python
    warnings, their loggers and print()s, C-level writes, progress bars of their own, child processes that inherit
    them — lands in the file, not between the command's lines. The command's own output goes through ``echo`` and
    ``terminal()``; an error raised out of the block is reported after both are back."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with log.open("ab") as file:
        for fd in saved:
            os.dup2(file.fileno(), fd)
    for fd, copy in saved.items():
        _terminal[fd] = os.fdopen(os.dup(copy), "w", buffering=1, encoding="utf-8", errors="replace")
    try:
        yield log
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
            _terminal.pop(fd).close()
