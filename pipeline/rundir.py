"""The run directory: stage folders described by `_done.json`, checked before use, one owner.

A folder is trusted while its files are the ones `_done.json` recorded: a `stat` per file when
size and mtime are unchanged, a sha256 otherwise or with `--verify`. The outputs digest hashes
paths, sizes and contents only, so a deterministic rerun leaves readers' fingerprints unchanged.
One process owns a run dir: a `flock` on `<run_dir>/.lock`, dropped by the kernel if it dies.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

from pipeline.errors import LowbitError
from pipeline.io import sha256

DONE = "_done.json"


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


class RunLock:
    """Exclusive ownership of a run dir for this process's lifetime (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise LowbitError(
                f"run_dir {self.path.parent} is in use by {holder}; wait for it to finish, or "
                "choose another run_dir"
            ) from None
        os.ftruncate(fd, 0)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays, harmless
            self.fd = None
