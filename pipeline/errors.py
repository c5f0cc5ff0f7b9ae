"""The exceptions a user sees: one line that names the problem and the fix, no traceback."""

import traceback
from pathlib import Path


class LowbitError(Exception):
    """Bad input (config, files, environment). The CLI prints its message alone and exits 2."""

    exit_code = 2


class ConfigError(LowbitError):
    """An invalid config value; the message names the key and what is allowed."""

    def __init__(self, key: str, problem: str, allowed: str | None = None):
        msg = f"config error: `{key}` {problem}"
        if allowed:
            msg += f"; allowed: {allowed}"
        super().__init__(msg)
        self.key = key


class StageFailed(LowbitError):
    """A stage raised something unexpected; the message says where its traceback was written."""

    exit_code = 1


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of `error`'s message, at most `limit` characters ("" when it has none)."""
    return (str(error).strip().splitlines() or [""])[0][:limit]


def record_failure(error: BaseException, log_path: Path) -> str:
    """Append `error`'s traceback to `log_path`; return the one line a user is shown."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as f:
        traceback.print_exception(error, file=f)
    return f"{type(error).__name__}: {first_line(error)} (traceback in {log_path})"
