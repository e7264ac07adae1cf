"""The one error type the CLI turns into a one-line message with exit code 2."""


class TQExportError(ValueError):
    """Bad user input or an unsupported model; the message names the problem and the fix."""


class ResolveError(TQExportError):
    """A skip pattern or dtype that does not fit the model."""
