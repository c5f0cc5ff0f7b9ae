"""lowbit: compress LLMs to 2-4 bits, keep their quality and speculative-decoding speed-up,
pack them for Ascend NPUs."""

import os
from pathlib import Path

__version__ = "0.1.0"


def conf_dir() -> Path:
    """The Hydra config tree: the checkout's `conf/`, or LOWBIT_CONF for installed copies."""
    env = os.environ.get("LOWBIT_CONF")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "conf"
