"""The exception types users see as a single clear line instead of a traceback."""


class RelposError(Exception):
    """A problem with the user's input or environment, reported as `error: <message>`, exit 2."""

    exit_code = 2


class Interrupted(RelposError):
    """Training stopped by SIGINT/SIGTERM after saving a checkpoint; exits 128 + signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class RunDirTaken(RelposError):
    """A fresh run aimed at a dir that holds another run: that run is left untouched (not marked failed)."""
