"""Where a stage runs and the most memory it held: one line at its start, two numbers at its end.

Each stage resets the RSS high-water mark (``/proc/self/clear_refs``) and CUDA's peak, so it
reports its own; where that cannot be written the peak is the process's, and the metric says so.
Before the reset the heap the earlier stages freed goes back to the system: else it stays
resident in the allocator's arenas and counts in the next stage's peak (and against its room).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from pathlib import Path

import torch

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def device_line() -> str:
    """What the stage's work can run on: the accelerators visible, else the CPU threads."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"cuda ({n} x {torch.cuda.get_device_name(0)})"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return f"npu ({npu.device_count()} devices)"
    return f"cpu ({torch.get_num_threads()} threads of {os.cpu_count()} cores)"


def release_free_heap() -> None:
    """glibc ``malloc_trim``: freed tensors otherwise stay in its arenas and RSS creeps up."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _hwm_mib() -> float | None:
    try:
        text = STATUS.read_text()
    except OSError:
        return None
    kib = next(
        (int(line.split()[1]) for line in text.splitlines() if line.startswith("VmHWM:")), None
    )
    return None if kib is None else kib / 1024


class StagePeak:
    """``start()`` before the stage, ``metrics()`` after: its peak RSS (and CUDA) in MiB."""

    def __init__(self) -> None:
        self.reset = False

    def start(self) -> None:
        gc.collect()
        release_free_heap()
        try:
            CLEAR_REFS.write_text("5")
            self.reset = True
        except OSError:
            self.reset = False
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        hwm = _hwm_mib()
        if hwm is not None:
            out["peak_rss_mib" if self.reset else "process_peak_rss_mib"] = round(hwm, 1)
        if torch.cuda.is_available():
            out["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        return out
