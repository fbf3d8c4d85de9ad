"""User-facing errors: printed as one line by the CLI, never as a traceback."""


class KVBenchError(Exception):
    """Bad input or a missing prerequisite; the message names the valid choices or the fix."""
