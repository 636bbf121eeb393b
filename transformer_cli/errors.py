"""User-facing errors: the CLI prints them as one line and exits with status 2."""


class TfmError(Exception):
    """Bad input (config, files, arguments) that the user can fix; never a bug."""
