"""The pipeline's one user-facing error kind."""


class UsageError(Exception):
    """A bad flag, path or input: reported as one line on stderr, exit status 2."""
