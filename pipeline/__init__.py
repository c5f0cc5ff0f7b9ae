"""lowbit: compress LLMs to 2-4 bits, keep their quality and speculative-decoding speed-up,
pack them for Ascend NPUs."""

import os
from pathlib import Path

__version__ = "0.1.0"


def conf_dir() -> Path:
    """The Hydra config tree: LOWBIT_CONF, else an installed wheel's `pipeline/conf`, else the
    checkout's `conf/`."""
    env = os.environ.get("LOWBIT_CONF")
    if env:
        return Path(env)
    packaged = Path(__file__).resolve().parent / "conf"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[1] / "conf"
