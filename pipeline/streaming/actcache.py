"""Calibration activations between segments: in memory, or spilled to a memory-mapped file.

A spilled cache keeps about one batch resident (pages dropped after each access) and writes a
segment's outputs to a new file, so the committed file stays intact until the next commit:
that is what makes a killed run resumable.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

# numpy has no bfloat16: such caches hold the raw 16-bit patterns and are viewed back in torch.
_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


def _np_dtype(dtype: torch.dtype):
    if dtype not in _NP:
        raise ValueError(f"activation dtype {dtype} not supported; use float32/float16/bfloat16")
    return _NP[dtype]


class ActivationCache:
    """(N, T, C) activations of this rank's windows, indexed like a tensor along dim 0."""

    def __init__(self, data: Tensor | np.ndarray, dtype: torch.dtype) -> None:
        self._data = data
        self.dtype = dtype

    @classmethod
    def create(
        cls, shape: tuple[int, ...], dtype: torch.dtype, budget_bytes: float, spill_path: str | Path
    ) -> ActivationCache:
        """An empty cache, in memory if it fits ``budget_bytes``, else a file at ``spill_path``."""
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes <= budget_bytes:
            return cls(torch.empty(shape, dtype=dtype), dtype)
        return cls.spilled(shape, dtype, spill_path)

    @classmethod
    def spilled(
        cls, shape: tuple[int, ...], dtype: torch.dtype, path: str | Path
    ) -> ActivationCache:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        arr = np.lib.format.open_memmap(
            str(path), mode="w+", dtype=_np_dtype(dtype), shape=tuple(shape)
        )
        return cls(arr, dtype)

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype, budget_bytes: float) -> ActivationCache:
        """A committed cache file: into memory if it fits the budget, else mapped read-only."""
        arr = np.load(str(path), mmap_mode="r")
        if arr.nbytes <= budget_bytes:
            return cls(torch.from_numpy(np.array(arr)).view(dtype), dtype)
        return cls(arr, dtype)

    def for_outputs(self, path: str | Path) -> ActivationCache:
        """Where a segment's outputs go: this cache in memory, a new file at ``path`` if spilled."""
        if self.in_memory:
            return self
        return ActivationCache.spilled(self.shape, self.dtype, path)

    @property
    def in_memory(self) -> bool:
        return isinstance(self._data, Tensor)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._data.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx: slice) -> Tensor:
        if self.in_memory:
            return self._data[idx].clone()
        out = torch.from_numpy(np.array(self._data[idx])).view(self.dtype)
        self._release()
        return out

    def __setitem__(self, idx: slice, value: Tensor) -> None:
        value = value.detach().to("cpu", self.dtype)
        if self.in_memory:
            self._data[idx] = value
            return
        if self.dtype == torch.bfloat16:
            value = value.view(torch.uint16)
        self._data[idx] = value.numpy()
        self._release()

    def _release(self) -> None:
        """Drop the mapped pages from this process (the file keeps the data)."""
        mm = getattr(self._data, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise"):
            if self._data.flags.writeable:
                mm.flush()  # write back before dropping, so nothing waits in dirty pages
            mm.madvise(mmap.MADV_DONTNEED)

    def commit(self, path: str | Path) -> Path:
        """Make the contents durable at ``path``, atomically (spilled: from :meth:`for_outputs`)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.in_memory:
            tmp = path.with_name(path.name + ".tmp")
            data = self._data.view(torch.uint16) if self.dtype == torch.bfloat16 else self._data
            with open(tmp, "wb") as f:
                np.save(f, data.numpy())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return path
        src = Path(self._data.filename)
        self._data.flush()
        with open(src, "rb") as f:
            os.fsync(f.fileno())
        if src != path:
            os.replace(src, path)
        return path
