"""The `lowbit` command: compose the Hydra config and hand it to the workflow.

lowbit                                   # the whole default workflow on the embedded default
lowbit experiment=smoke run_dir=/tmp/r   # tiny, ~2 minutes
lowbit --force stages=[quantize]         # rerun chosen stages
lowbit --verify                          # hash every recorded output, not only changed ones
lowbit --no-repair                       # stop at a damaged stage folder instead of rerunning it
lowbit --version                         # lowbit's version (Hydra's `--cfg job` prints the config)
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipeline import __version__, conf_dir
from pipeline.errors import LowbitError, record_failure

# Not __name__: that is "__main__" under `python -m pipeline`, outside the package's logger tree.
log = logging.getLogger("pipeline.__main__")


def _under_launcher() -> bool:
    env = os.environ
    return "WORLD_SIZE" in env or int(env.get("SLURM_NTASKS", "1")) > 1


# Flags friendlier than their config keys; Hydra does not accept unknown flags.
FLAGS = {"--force": "force=true", "--verify": "verify=true", "--no-repair": "repair=false"}


def _with_flags(argv: list[str]) -> list[str]:
    return [FLAGS.get(a, a) for a in argv]


def _relaunch(nproc: int) -> None:
    """Several local ranks without a launcher: become `torchrun --nproc-per-node N` of ourselves.

    `main` has already turned the flags into overrides, so the ranks parse what this one did."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",
        "-m",
        "pipeline",
        *sys.argv[1:],
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
        planned = workflow.plan(cfg, Path(cfg.run_dir).resolve())
        # A list (`trainer.devices=[4,5]`) names which devices: one rank each.
        count = len(devices) if OmegaConf.is_list(devices) else devices
        local_ranks = isinstance(count, int) and count > 1 and trainer.get("num_nodes", 1) == 1
        if local_ranks and not _under_launcher():
            _relaunch(count)
        if os.environ.get("RANK", "0") == "0":
            given = HydraConfig.get().overrides.task
            log.info("lowbit %s; overrides: %s", __version__, " ".join(given) or "none")
            if cfg.print_config:
                print(OmegaConf.to_yaml(cfg), flush=True)
        workflow.run(cfg, planned)
    except LowbitError as e:
        log.error("%s", e)
        sys.exit(e.exit_code)
    except Exception as e:  # outside any stage (tracking, report): the same one-line contract
        line = record_failure(e, Path(cfg.run_dir).resolve() / "logs" / "lowbit.log")
        log.error("lowbit failed: %s", line)
        sys.exit(1)


def main() -> None:
    if "--version" in sys.argv[1:]:  # Hydra's own flag would print Hydra's version
        print(f"lowbit {__version__}")
        return
    sys.argv = sys.argv[:1] + _with_flags(sys.argv[1:])
    from pipeline.stages import register_configs

    register_configs()  # the defaults Hydra composes on, from the dataclasses
    if not sys.stderr.isatty():
        # Read when huggingface_hub, datasets and mlflow are used (by the stages, later): their
        # bars, written to a log file or a pipe, are one line growing with every refresh.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # model logging
    _main()


if __name__ == "__main__":
    main()
