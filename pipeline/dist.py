"""Rank discovery and the few collectives the workflow needs.

The process group is created here once, from the launcher's environment; Lightning reuses it.
"""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as tdist

# Rank 0 may spend hours in a stage that runs on it alone while the others wait at a barrier.
BARRIER_TIMEOUT = timedelta(hours=48)


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            tdist.barrier()

    def broadcast(self, obj):
        """Rank 0's Python object on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place over ranks (a no-op on one rank)."""
        if self.world_size > 1:
            tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
        return tensor

    def shard(self, n: int) -> range:
        """This rank's share of n items (strided, so shares differ by at most one item)."""
        return range(self.rank, n, self.world_size)


def _slurm_env() -> None:
    """Translate srun's variables into torch.distributed's when no launcher set them."""
    env = os.environ
    if "RANK" in env or int(env.get("SLURM_NTASKS", "1")) <= 1 or "SLURM_PROCID" not in env:
        return
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in env:
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or socket.gethostname()
        try:
            first = subprocess.run(
                ["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, check=True
            ).stdout.split()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            first = nodes.split(",")[0]
        env["MASTER_ADDR"] = first
    # A port derived from the job id, so concurrent jobs on a node do not collide.
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))


def init_from_env(backend: str | None = None) -> Dist:
    """Join the process group described by the environment (or return a single-rank Dist)."""
    _slurm_env()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not tdist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "hccl":
            # torch_npu registers the hccl backend on import; each rank owns its local NPU, so
            # lowbit's own collectives do not all land on npu:0.
            import torch_npu  # noqa: F401

            torch.npu.set_device(local_rank)
        tdist.init_process_group(backend=backend, timeout=BARRIER_TIMEOUT)
    return Dist(rank=tdist.get_rank(), world_size=tdist.get_world_size(), local_rank=local_rank)


def shutdown() -> None:
    """Leave the process group, if any: an undestroyed gloo group can abort the exit."""
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()
