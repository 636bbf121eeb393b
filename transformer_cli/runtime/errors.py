"""User-facing errors: the CLI prints them as one line and exits with status 2."""

from __future__ import annotations

import errno


class TfmError(Exception):
    """Bad input (config, files, arguments) that the user can fix; never a bug.

    Always one line: line breaks that come in with user input (a key, a file name) are escaped.
    """

    def __init__(self, message: str):
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"))


class Interrupted(Exception):
    """Training stopped by a signal after saving; the CLI exits with `exit_code` (130, 143, 129)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Diverged(Interrupted):
    """Too many consecutive non-finite steps: training stops (exit 3), the last checkpoint is good."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=3)


def describe_os_error(exc: OSError, unnamed: str | None = None) -> str:
    """`<path>: <reason> (<ERRNO>)`, e.g. `runs/x/checkpoints: No space left on device (ENOSPC)`;
    `unnamed` stands for the path where the error names none (e.g. "standard output")."""
    code = errno.errorcode.get(exc.errno, "") if exc.errno is not None else ""
    reason = exc.strerror or str(exc) or type(exc).__name__
    name = exc.filename or unnamed
    where = f"{name}: " if name else ""
    return f"{where}{reason}{f' ({code})' if code else ''}"
