"""The `lowbit` command: compose the Hydra config and hand it to the workflow.

lowbit                                   # the whole default workflow on the embedded default
lowbit experiment=smoke run_dir=/tmp/r   # tiny, ~2 minutes
lowbit --force stages=[quantize]         # rerun chosen stages
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeline import conf_dir
from pipeline.errors import LowbitError

log = logging.getLogger("lowbit")


def _under_launcher() -> bool:
    env = os.environ
    return "WORLD_SIZE" in env or int(env.get("SLURM_NTASKS", "1")) > 1


def _relaunch(nproc: int) -> None:
    """Several local ranks without a launcher: become `torchrun --nproc-per-node N` of ourselves."""
    args = [a for a in sys.argv[1:] if a != "--force"]
    if "--force" in sys.argv:
        args.append("force=true")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",
        "-m",
        "pipeline",
        *args,
    ]
    log.info("starting %d local ranks: %s", nproc, " ".join(cmd))
    sys.stdout.flush()
    os.execv(sys.executable, cmd)


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from pathlib import Path

    from pipeline import workflow

    trainer = cfg.get("trainer") or {}
    devices = trainer.get("devices", 1)
    try:
        # Validate once, here, before starting ranks or touching any model.
        workflow.plan(cfg, Path(cfg.run_dir).resolve())
        local_ranks = isinstance(devices, int) and devices > 1 and trainer.get("num_nodes", 1) == 1
        if local_ranks and not _under_launcher():
            _relaunch(devices)
        workflow.run(cfg)
    except LowbitError as e:
        log.error("%s", e)
        sys.exit(2)
    if cfg.get("print_config"):
        print(OmegaConf.to_yaml(cfg))


def main() -> None:
    # `--force` is friendlier than `force=true`; Hydra does not accept unknown flags.
    if "--force" in sys.argv:
        sys.argv = [a for a in sys.argv if a != "--force"] + ["force=true"]
    _main()


if __name__ == "__main__":
    main()
