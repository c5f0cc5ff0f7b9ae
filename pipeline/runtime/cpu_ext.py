"""lowbit's CPU kernels as one compiled extension: W4A8 (``cpu_w4a8``) and few-row float32
(``float_rows``), both AVX-512 code for decoding's and speculative verification's few rows.

The extension is compiled at first use (``torch.utils.cpp_extension``, cached under
``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``; ``.ci/setup`` builds it ahead).
It is built with AVX-512 VNNI enabled, so it is loaded only where the CPU executes VNNI:
elsewhere :func:`extension` returns None, and where the build fails (no compiler) too, after
one warning. The callers then keep torch's own kernels.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "w4a8.cpp", "f32_rows.cpp")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]


def cpu_has_vnni() -> bool:
    """Whether this CPU executes AVX-512 VNNI (Linux: its /proc/cpuinfo flags)."""
    try:
        return "avx512_vnni" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@functools.cache
def extension() -> ModuleType | None:
    """The compiled kernels, or None (with one warning) where they cannot run or build."""
    if not cpu_has_vnni():
        return None
    try:
        from torch.utils.cpp_extension import load

        # -fopenmp: at::parallel_for is an OpenMP region compiled into this extension
        return load(
            name="lowbit_cpu",
            sources=[str(_CSRC / s) for s in SOURCES],
            extra_cflags=[*_FLAGS, "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # a missing compiler, ninja or source: any is a reason to fall back
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        log.warning("runtime: lowbit's CPU kernels did not build (%s: %s)", type(e).__name__, first)
        return None
