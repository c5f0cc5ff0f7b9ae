"""The exceptions a user sees: one line that names the problem and the fix, no traceback."""

import errno
import os
import re
import resource
import shutil
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

    def __init__(self, msg: str, stage_dir: Path | None = None):
        super().__init__(msg)
        self.stage_dir = stage_dir  # the folder it was writing, for a refused write's line


class Interrupted(LowbitError):
    """SIGINT (Ctrl-C): the stage running was dropped, finished ones are kept; exit 130 as a
    shell reports a process ended by SIGINT."""

    exit_code = 130


# A write the disk or a limit refused: no space, over quota, past the file size limit.
FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# Rust writers (safetensors) carry the errno only in their message.
OS_ERROR = re.compile(r"\(os error (\d+)\)")


def disk_full(error: BaseException, where: Path) -> LowbitError | None:
    """The one line for `error` (or what caused it) when a write was refused for space, naming
    the file (or `where`, when the writer does not say) and the bytes free; else None."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = e.errno if isinstance(e, OSError) else None
        if code is None and (m := OS_ERROR.search(str(e))):
            code = int(m.group(1))
        if code in FULL:
            path, named = Path(where), getattr(e, "filename", None)
            # A file named on another file system is a writer's scratch copy (fsspec stages a
            # checkpoint in /tmp, then moves it): the full one is where the run writes.
            if named and _existing(Path(named)).stat().st_dev == _existing(path).stat().st_dev:
                path = Path(named)
            return LowbitError(f"writing {path} failed: {_space(code, path)}")
        e = e.__cause__ or e.__context__
    return None


def _existing(path: Path) -> Path:
    return next((p for p in (path, *path.parents) if p.exists()), Path("/"))


def _space(code: int, path: Path) -> str:
    rerun = "then rerun the same command: finished stages are kept"
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return f"a file may not exceed {limit} bytes here (ulimit -f); raise the limit, {rerun}"
    free = shutil.disk_usage(_existing(path)).free
    return (
        f"{os.strerror(code)}, {free} bytes free on its file system; free space or set run_dir "
        f"to a larger disk, {rerun}"
    )


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of `error`'s message, at most `limit` characters ("" when it has none)."""
    return (str(error).strip().splitlines() or [""])[0][:limit]


def record_failure(error: BaseException, log_path: Path) -> str:
    """Append `error`'s traceback to `log_path`; return the one line a user is shown."""
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as f:
            traceback.print_exception(error, file=f)
    except OSError as e:  # a full disk: the line still reaches the user
        return f"{type(error).__name__}: {first_line(error)} (no traceback: {e.strerror})"
    return f"{type(error).__name__}: {first_line(error)} (traceback in {log_path})"
