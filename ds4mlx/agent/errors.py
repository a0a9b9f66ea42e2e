"""The one exception the tools raise: its message goes back to the model."""


class ToolError(Exception):
    """A tool refused or failed."""
