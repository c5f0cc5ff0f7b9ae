"""Where the engine keeps activations between segments: a scratch folder, or a resumable work dir.

Resume is exact: after segment ``k`` every rank commits its output activations and the step its
files, then rank 0 writes the marker ``segments/NNNNN.json``; a rerun continues after the last
marker from those same activations if ``run.json`` (ranks, windows, segments, a hash of the
inputs) is unchanged, and starts over otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeline.dist import Dist
from pipeline.io import write_json
from pipeline.streaming.actcache import ActivationCache

log = logging.getLogger(__name__)


class Scratch:
    """Spill files in ``folder`` named after ``tag``; nothing is committed or resumed."""

    def __init__(self, folder: str | Path, tag: str) -> None:
        self.folder, self.tag = Path(folder), tag
        self._reports: dict[int, dict] = {}

    def open(self, calib: Tensor, segments: list[tuple[int, int]], dist: Dist, device) -> int:
        return 0

    def embed_file(self, rank: int) -> Path:
        return self.folder / f"{self.tag}-rank{rank}.npy"

    def outputs_file(self, k: int, rank: int) -> Path:
        # Two names in turn: segment k reads the file segment k - 1 wrote.
        return self.folder / f"{self.tag}-rank{rank}-{k % 2}.npy"

    def resume(self, k: int, rank: int, dtype: torch.dtype, budget_bytes: float):
        raise AssertionError("a scratch folder never resumes")

    def save_acts(self, k: int, cache: ActivationCache, rank: int) -> None:
        pass

    def mark(self, k: int, report: dict, dist: Dist) -> None:
        self._reports[k] = report

    def reports(self, n_seg: int) -> list[dict]:
        return [self._reports[k] for k in range(n_seg)]


class WorkDir:
    """Durable segments in ``path``; a changed ``key`` (what else decides results) wipes it."""

    def __init__(self, path: str | Path, key: Any) -> None:
        self.path, self.key = Path(path), key
        self._committed: Path | None = None

    def acts_file(self, k: int, rank: int) -> Path:
        return self.path / "acts" / f"{k:05d}-rank{rank}.npy"

    def embed_file(self, rank: int) -> Path:
        return self.path / "acts" / f"embed-rank{rank}.npy"

    def outputs_file(self, k: int, rank: int) -> Path:
        return self.acts_file(k, rank).with_suffix(".partial.npy")

    def _marker(self, k: int) -> Path:
        return self.path / "segments" / f"{k:05d}.json"

    def open(self, calib: Tensor, segments: list[tuple[int, int]], dist: Dist, device) -> int:
        """Agree on the segments every rank can skip, wipe a stale work dir; a collective."""
        state = {
            "world_size": dist.world_size,
            "samples": list(calib.shape),
            "segments": [list(s) for s in segments],
            "inputs": hashlib.sha256(
                json.dumps(self.key, sort_keys=True).encode() + calib.cpu().numpy().tobytes()
            ).hexdigest(),
        }
        start = dist.broadcast(self._finished(state, len(segments)) if dist.is_main else None)
        # Resume only if every rank still has its activations of the last finished segment.
        ok = start <= 0 or self.acts_file(start - 1, dist.rank).is_file()
        if dist.all_reduce_(torch.tensor([int(ok)], device=device)).item() < dist.world_size:
            start = -1
        dist.barrier()
        if dist.is_main:
            if start < 0:
                shutil.rmtree(self.path, ignore_errors=True)
            for sub in ("segments", "acts"):
                (self.path / sub).mkdir(parents=True, exist_ok=True)
            write_json(self.path / "run.json", state)
        dist.barrier()
        return max(start, 0)

    def _finished(self, state: dict, n_seg: int) -> int:
        """Segments with a marker, or -1 when the work dir is from another setup."""
        run_file = self.path / "run.json"
        if run_file.is_file() and json.loads(run_file.read_text()) != state:
            log.warning("%s is from another setup (inputs or ranks); starting over", self.path)
            return -1
        k = 0
        while k < n_seg and self._marker(k).is_file():
            k += 1
        return k

    def resume(self, k: int, rank: int, dtype: torch.dtype, budget_bytes: float):
        return ActivationCache.load(self.acts_file(k, rank), dtype, budget_bytes)

    def save_acts(self, k: int, cache: ActivationCache, rank: int) -> None:
        """Make segment ``k``'s output activations durable (atomic)."""
        self._committed = cache.commit(self.acts_file(k, rank))

    def mark(self, k: int, report: dict, dist: Dist) -> None:
        """Mark segment ``k`` finished once every rank's files are on disk; a collective."""
        dist.barrier()
        if dist.is_main:
            write_json(self._marker(k), {"segment": k, "report": report}, indent=1)
        dist.barrier()
        for old in (self.path / "acts").glob(f"*-rank{dist.rank}.npy"):
            if old != self._committed:
                old.unlink(missing_ok=True)  # the committed newer state supersedes it

    def reports(self, n_seg: int) -> list[dict]:
        """Every segment's report, this run's and the resumed ones', from the markers."""
        return [json.loads(self._marker(k).read_text())["report"] for k in range(n_seg)]
