"""What the machine runs natively, and the float precision chosen from it.

``auto`` means bf16 where the hardware computes it natively and float32 elsewhere (emulated bf16
is several times slower), logged once with the reason; a precision the user chose is kept, with
one warning where it will be emulated. The rules: docs/portability.md.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ISA_ENV = "LOWBIT_CPU_ISA"  # auto | avx512gfni | avx512 | avx2 | none: the CPU code to use

# The CPU flags that decide a default (precision, kernels): reported with every speed figure.
CPU_FLAGS = (
    "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "gfni", "amx_bf16", "amx_fp16", "bf16", "fphp", "asimddp",
)  # fmt: skip
# CPU flags under which a half type is native: x86 (avx512_*, amx_*) and Arm (bf16, fphp).
_NATIVE_CPU = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16", "fphp"),
}
_HALF = {"bf16": torch.bfloat16, "16": torch.float16}


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (Linux); empty elsewhere."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty where unknown.
    ``LOWBIT_CPU_ISA=avx2`` hides the AVX-512 and AMX ones."""
    info = _cpuinfo()
    flags = frozenset((info.get("flags") or info.get("Features") or "").split())
    if os.environ.get(ISA_ENV, "").lower() == "avx2":
        flags = frozenset(f for f in flags if not f.startswith(("avx512", "amx")))
    return flags


def cpu_name() -> str:
    """Model name, then x86 family/model ("AMD EPYC 26/2": a VM's name hides the generation)."""
    info = _cpuinfo()
    name = info.get("model name") or info.get("Model") or platform.processor() or platform.machine()
    family, model = info.get("cpu family"), info.get("model")
    return f"{name} {family}/{model}" if family and model else name


def cpu_summary() -> dict:
    """The CPU as speed figures cite it: model, cores, and which of ``CPU_FLAGS`` it has."""
    have = cpu_flags()
    return {
        "cpu": cpu_name(),
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu_flags": [f for f in CPU_FLAGS if f in have],
    }


def source_commit() -> str | None:
    """The git commit lowbit runs from (``+dirty`` with local changes), None outside a checkout."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(here), "diff", "--quiet", "HEAD", "--", "."], timeout=10
        ).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head


def where() -> dict:
    """The machine and code a measurement comes from: ``cpu_summary`` plus commit and torch."""
    return cpu_summary() | {"commit": source_commit(), "torch": torch.__version__}


def describe(machine: dict) -> str:
    """``where()`` as one line, e.g. "AMD EPYC (2 cores; avx2 fma avx512_vnni), commit ..."."""
    flags = " ".join(machine.get("cpu_flags", [])) or "no listed flags"
    return (
        f"{machine.get('cpu', '?')} ({machine.get('cores', '?')} cores; {flags}), "
        f"lowbit {machine.get('commit') or 'outside git'}, torch {machine.get('torch', '?')}"
    )


def device_type(accelerator: str | None) -> str:
    """Lightning's accelerator name (cpu, gpu, cuda, npu, auto) as a torch device type."""
    acc = str(accelerator or "auto").lower()
    if acc in ("gpu", "cuda"):
        return "cuda"
    if acc == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return acc


def release(device: torch.device) -> None:
    """Hand the memory of deleted models back: gc first (a model in a reference cycle outlives
    its last name), then the caching allocator of ``device`` (a CPU has none)."""
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif device.type == "npu" and getattr(torch, "npu", None) is not None:
        torch.npu.empty_cache()


def native(dtype: torch.dtype, device: str) -> tuple[bool, str]:
    """Whether ``device`` (a torch device type) computes in ``dtype`` natively, and why."""
    if dtype not in _NATIVE_CPU:
        return True, f"{dtype} is not emulated"
    name = str(dtype).removeprefix("torch.")
    if device == "cpu":
        flags = [f for f in _NATIVE_CPU[dtype] if f in cpu_flags()]
        if flags:
            return True, f"the CPU has {'/'.join(flags)}"
        return False, f"the CPU ({cpu_name()}) has no {'/'.join(_NATIVE_CPU[dtype])}"
    if dtype is torch.float16 or device not in ("cuda", "npu"):
        return True, f"{device} computes {name}"
    if device == "cuda":
        if not torch.cuda.is_available():
            return True, "no CUDA device here to ask"
        ok = torch.cuda.is_bf16_supported(including_emulation=False)
        return ok, f"torch.cuda.is_bf16_supported() is {ok}"
    try:
        import torch_npu  # noqa: F401  (adds torch.npu)

        ok = bool(torch.npu.is_bf16_supported())
    except (ImportError, AttributeError, RuntimeError):
        return True, "torch_npu is not here to ask"
    return ok, f"torch.npu.is_bf16_supported() is {ok}"


_said: set[tuple] = set()


def _say_once(key: tuple, level: int, message: str) -> None:
    """Log ``message`` the first time ``key`` (what was decided, not who asked) comes up."""
    if key not in _said:
        _said.add(key)
        log.log(level, "%s", message)


def resolve_precision(precision: str | int, accelerator: str | None, who: str) -> str | int:
    """A Lightning precision for ``accelerator``: ``auto`` becomes ``bf16-mixed`` where bf16 is
    native, else ``32-true``; ``who`` names the setting in the lines."""
    device = device_type(accelerator)
    if str(precision) == "auto":
        ok, why = native(torch.bfloat16, device)
        chosen = "bf16-mixed" if ok else "32-true"
        _say_once(("auto", device), logging.INFO, f"{who}=auto: {chosen} on {device} ({why})")
        return chosen
    half = _HALF.get(str(precision).split("-")[0])
    if half is not None:
        warn_if_emulated(half, device, who, value=str(precision), instead=("auto", "32-true"))
    return precision


def compute_dtype(dtype: torch.dtype, device: str, who: str) -> torch.dtype:
    """``dtype`` where ``device`` computes it natively, else float32 (logged once)."""
    ok, why = native(dtype, device)
    if ok:
        return dtype
    _say_once(
        ("float32", dtype, device),
        logging.INFO,
        f"{who}: float32 rather than {dtype} on {device} ({why})",
    )
    return torch.float32


def warn_if_emulated(
    dtype: torch.dtype,
    device: str,
    who: str,
    *,
    value: str | None = None,
    instead: tuple[str, ...] = ("float32",),
) -> None:
    """One warning when a dtype the user chose will be emulated on ``device``; ``instead``:
    the settings that avoid it, the float32 one last."""
    ok, why = native(dtype, device)
    if not ok:
        _say_once(
            ("emulated", dtype, device),
            logging.WARNING,
            f"{who}={value or str(dtype).removeprefix('torch.')} will be emulated on {device}, "
            f"several times slower than {instead[-1]} ({why}); set {who}={' or '.join(instead)}",
        )


def meminfo(key: str) -> int | None:
    """A /proc/meminfo field in bytes (``MemTotal``, ``MemAvailable``); None where unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
