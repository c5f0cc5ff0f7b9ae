"""lowbit's CPU kernels as one compiled extension: the runtime's W2-W8 x A8
(``runtime.cpu_w4a8``), 4-bit LUT codes (``runtime.cpu_lut16``) and few-row float32
(``runtime.float_rows``), and the decode forward's ops between the matmuls (``models.lean``).

Each kernel is compiled for AVX-512 VNNI (W2-W8 also with GFNI) and AVX2 under per-ISA target
pragmas, so one build serves any x86-64 CPU; :func:`isa` picks the ISA (``LOWBIT_CPU_ISA``). The
extension builds at first use; a failed build costs one warning and callers keep torch's kernels.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType

from pipeline.hardware import cpu_flags

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
NAME = "lowbit_cpu"
SOURCES = (
    "bindings.cpp",
    "w4a8.cpp",
    "w4a8_avx512.cpp",
    "w4a8_avx512_gfni.cpp",
    "w4a8_avx2.cpp",
    "lut16.cpp",
    "f32_rows.cpp",
    "decode_ops.cpp",
)
ENV = "LOWBIT_CPU_ISA"
ISAS = ("avx512gfni", "avx512", "avx2")  # best first
CHOICES = ("auto", *ISAS, "none")
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
FLAGS = {  # the /proc/cpuinfo flags each ISA's kernels execute
    "avx512gfni": (*_AVX512, "gfni"),  # avx512's kernels, sub-byte codes unpacked by GFNI
    "avx512": _AVX512,
    "avx2": ("avx2", "fma", "f16c"),
}
FIX = "install a C++ compiler (g++) and ninja, or set LOWBIT_CPU_ISA=none to run on torch's kernels"
_forced: list[str | None] = []  # forced_isa's stack


def supported(flags: Iterable[str] | None = None) -> tuple[str, ...]:
    """The ISAs whose kernels a CPU with ``flags`` (default: this one) executes, best first."""
    have = cpu_flags() if flags is None else set(flags)
    return tuple(i for i in ISAS if set(FLAGS[i]) <= have)


def choose_isa(wanted: str, flags: Iterable[str]) -> str | None:
    """The ISA for a ``LOWBIT_CPU_ISA`` value on a CPU with ``flags``; None: torch's kernels.

    Raises:
        ValueError: An unknown value, or an ISA this CPU lacks (naming the missing flags).
    """
    flags = set(flags)
    wanted = wanted.strip().lower() or "auto"
    if wanted not in CHOICES:
        raise ValueError(f"{ENV}={wanted!r}: choose one of {', '.join(CHOICES)}")
    runs = supported(flags)
    if wanted == "auto":
        return runs[0] if runs else None
    if wanted == "none" or wanted in runs:
        return None if wanted == "none" else wanted
    missing = ", ".join(f for f in FLAGS[wanted] if f not in flags)
    raise ValueError(
        f"{ENV}={wanted}: this CPU lacks {missing}; unset {ENV} or set it to "
        f"{' or '.join((*runs, 'none'))}"
    )


@functools.cache
def _env_isa() -> str | None:
    return choose_isa(os.environ.get(ENV, "auto"), cpu_flags())


def isa() -> str | None:
    """The ISA lowbit's CPU kernels run in this process, or None (torch's kernels)."""
    return _forced[-1] if _forced else _env_isa()


@contextlib.contextmanager
def forced_isa(name: str | None) -> Iterator[None]:
    """Layers built inside take ``name``'s kernels (None: torch's), whatever the env says."""
    if name is not None and name not in supported():
        raise ValueError(f"this CPU does not run lowbit's {name} kernels (it runs: {supported()})")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def _load() -> ModuleType:
    from torch.utils.cpp_extension import _get_build_directory, load

    build = Path(_get_build_directory(NAME, verbose=False))
    # torch guards every load with a lock file it deletes when done, so a build killed midway
    # leaves one that every later load waits on forever. An flock dies with its holder: while
    # this process holds it no other lowbit load runs, and a lock file left there is stale.
    with open(build.parent / f"{NAME}.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if (build / "lock").exists():
            log.warning("runtime: removing a stale build lock left by a killed build: %s", build)
            (build / "lock").unlink()
        # -fopenmp: at::parallel_for is an OpenMP region compiled into this extension
        return load(
            name=NAME,
            sources=[str(_CSRC / s) for s in SOURCES],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )


@functools.cache
def loaded() -> ModuleType | None:
    """The compiled kernels (built on the first call), or None after one warning."""
    try:
        return _load()
    except Exception as e:  # a missing compiler, ninja or source: any is a reason to fall back
        log.warning("runtime: lowbit's CPU kernels did not build (%s); %s", _first_line(e), FIX)
        return None


def extension() -> ModuleType | None:
    """The compiled kernels where this process runs them (:func:`isa` is not None), else None."""
    return loaded() if isa() is not None else None


def runnable(name: str | None = None) -> tuple[ModuleType, str]:
    """The compiled kernels and the ISA to call them with (``name``, default :func:`isa`).

    Raises:
        RuntimeError: This process runs torch's kernels, or the extension did not build.
    """
    name = name or isa()
    if name is None:
        raise RuntimeError("lowbit's CPU kernels do not run here (no AVX2 or LOWBIT_CPU_ISA=none)")
    ext = loaded()
    if ext is None:
        raise RuntimeError(f"lowbit's CPU kernels did not build; {FIX}")
    return ext, name


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def main() -> int:
    """Set-up's step: build the kernels where the CPU runs an ISA; 1 with the fix if not."""
    try:
        chosen = isa()
    except ValueError as e:
        print(f"lowbit: {e}", file=sys.stderr)
        return 1
    if chosen is None:
        why = f"{ENV}=none" if supported() else "this CPU has neither AVX-512 VNNI nor AVX2"
        print(f"lowbit: CPU kernels not built ({why}); torch's kernels serve")
        return 0
    try:
        _load()
    except Exception as e:
        print(f"lowbit: the CPU kernels ({chosen}) did not build ({_first_line(e)}); {FIX}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"lowbit: CPU kernels built; this CPU runs {chosen}")
    return 0
