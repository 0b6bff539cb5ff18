"""The one exception type users see as a single clear line instead of a traceback."""


class RelposError(Exception):
    """A problem with the user's input or environment, reported as `error: <message>`, exit 2."""
