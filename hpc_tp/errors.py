"""The project's own error: a clear one-line message about a value the user gave."""


class ConfigError(ValueError):
    """Bad user input (config, CLI value, file). The message names the value and what was expected."""
