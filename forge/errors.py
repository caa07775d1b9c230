"""The error a user can cause: one line that says what was wrong and what to do, and an exit code."""


class ForgeError(Exception):
    """An expected failure. The CLI prints ``forge: <message>`` and exits with ``exit_code``, no traceback."""

    exit_code = 2

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
