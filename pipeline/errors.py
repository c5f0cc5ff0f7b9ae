"""The one exception type a user sees: a message that names the problem and the fix."""


class LowbitError(Exception):
    """Bad input (config, files, environment). The CLI prints its message alone, no traceback."""


class ConfigError(LowbitError):
    """An invalid config value; the message names the key and what is allowed."""

    def __init__(self, key: str, problem: str, allowed: str | None = None):
        msg = f"config error: `{key}` {problem}"
        if allowed:
            msg += f"; allowed: {allowed}"
        super().__init__(msg)
        self.key = key
