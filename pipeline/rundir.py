"""The run directory: stage folders described by `_done.json`, checked before use, one owner.

A folder is trusted while its files are the ones `_done.json` recorded: a `stat` per file when
size and mtime are unchanged, a sha256 otherwise or with `--verify`. The outputs digest hashes
paths, sizes and contents only, so a deterministic rerun leaves readers' fingerprints unchanged.
One process owns a run dir: a `flock` on `<run_dir>/.lock`, dropped by the kernel if it dies.
Where the file system refuses `flock` (some NFS and FUSE mounts), `<run_dir>/.lock.held` holds
the owner's pid, host and a heartbeat a thread refreshes; it is taken over, with a warning, once
its pid is gone from this host or its heartbeat is older than `STALE_S`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

from pipeline.errors import LowbitError
from pipeline.io import sha256

DONE = "_done.json"
# The fallback lock's heartbeat: refreshed every HEARTBEAT_S, presumed dead after STALE_S (wide,
# so that a clock skew between hosts or a stalled NFS write never takes a live run's lock).
HEARTBEAT_S = 10.0
STALE_S = 120.0
# What flock raises where the file system does not support it.
NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}

log = logging.getLogger(__name__)


def check_writable(run_dir: Path) -> None:
    """Raise one line naming `run_dir` and the fix when no file can be created in it."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as e:
        raise LowbitError(
            f"run_dir {run_dir} cannot be written ({e.strerror}); make it "
            "writable (chmod u+w, or mount it read-write) or set run_dir= to a writable directory"
        ) from None


def read_done(stage_dir: Path) -> dict | None:
    try:
        return json.loads((stage_dir / DONE).read_text())
    except (OSError, ValueError):
        return None


def set_aside(final: Path) -> Path:
    """Where `commit` keeps the previous `final` while the new one moves in."""
    return final.with_name(f".{final.name}.old")


def commit(tmp: Path, final: Path) -> None:
    """Replace `final` by `tmp` with renames only; an old directory is set aside until the new
    one is in place, so a crash between the renames leaves it there under `set_aside`."""
    if tmp.is_file():
        os.replace(tmp, final)
        return
    old = set_aside(final)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def record_outputs(stage_dir: Path) -> dict[str, dict]:
    """{relative path: bytes, sha256, mtime_ns} of every file a stage wrote."""
    out = {}
    for p in sorted(stage_dir.rglob("*")):
        if p.is_file() and p.name != DONE:
            st = p.stat()
            out[str(p.relative_to(stage_dir))] = {
                "bytes": st.st_size,
                "sha256": sha256(p),
                "mtime_ns": st.st_mtime_ns,
            }
    return out


def outputs_digest(outputs: dict[str, dict]) -> str:
    """What readers' fingerprints see: paths, sizes and contents, never times."""
    content = {k: [v["bytes"], v["sha256"]] for k, v in outputs.items()}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def find_damage(stage_dir: Path, done: dict, full: bool = False) -> str | None:
    """The first recorded output that is missing or changed, as a phrase; None when intact."""
    for rel, rec in done.get("outputs", {}).items():
        path = stage_dir / rel
        try:
            st = path.stat()
        except OSError:
            return f"{path} is missing"
        if st.st_size != rec["bytes"]:
            return f"{path} has {st.st_size} bytes, {rec['bytes']} were written"
        unchanged = not full and st.st_mtime_ns == rec.get("mtime_ns")
        if not unchanged and sha256(path) != rec["sha256"]:
            return f"{path} changed since it was written (sha256 differs)"
    return None


def _in_use(run_dir: Path, holder: str) -> LowbitError:
    return LowbitError(
        f"run_dir {run_dir} is in use by {holder}; wait for it to finish, or choose another run_dir"
    )


class RunLock:
    """Exclusive ownership of a run dir for this process's lifetime (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self.fd: int | None = None
        self.held: HeldFile | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise _in_use(self.path.parent, holder) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in NO_FLOCK:
                raise
            self.held = HeldFile(self.path.with_name(".lock.held"))
            self.held.acquire()
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {_now()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays, harmless
            self.fd = None
        if self.held is not None:
            self.held.release()
            self.held = None


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _describe(holder: dict | None) -> str:
    if not holder:
        return "another process"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"


class HeldFile:
    """The lock where `flock` is unsupported: a file holding {pid, host, since, heartbeat}, linked
    into place (atomic on NFS too) and kept fresh by a daemon thread."""

    def __init__(self, path: Path):
        self.path = path
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "since": _now()}
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> None:
        for _ in range(2):  # a stale holder's file is removed once, then created anew
            # Written aside, then linked: link() fails if the name exists (atomic on NFS too),
            # and a reader never sees the file half-written.
            tmp = self._write_aside()
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            finally:
                tmp.unlink()
            self._beat = threading.Thread(target=self._refresh, name="lowbit-lock", daemon=True)
            self._beat.start()
            return
        raise _in_use(self.path.parent, _describe(self._read()))

    def _take_over_if_stale(self) -> None:
        holder = self._read()
        if holder is None:  # not lowbit's format: never guess that its owner is gone
            raise _in_use(self.path.parent, f"the owner of {self.path} (remove it if none)")
        age = time.time() - holder.get("heartbeat", 0)
        here = holder.get("host") == self.me["host"]
        if here and not _pid_alive(int(holder.get("pid", 0))):
            why = "its process is gone"
        elif age > STALE_S:
            why = f"its heartbeat is {age:.0f} s old"
        else:
            raise _in_use(self.path.parent, _describe(holder))
        log.warning("taking over the stale lock %s of %s: %s", self.path, _describe(holder), why)
        self.path.unlink(missing_ok=True)

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _write_aside(self) -> Path:
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.me | {"heartbeat": time.time()}))
        return tmp

    def _write(self) -> None:
        os.replace(self._write_aside(), self.path)

    def _refresh(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write()
            except OSError as e:  # a full or flaky disk: the next beat tries again
                log.warning("could not refresh the lock %s: %s", self.path, e)

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        holder = self._read()
        if holder and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
            self.path.unlink(missing_ok=True)
