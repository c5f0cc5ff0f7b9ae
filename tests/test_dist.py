"""Leaving the process group: the CLI destroys it so gloo's threads do not abort the exit."""

from __future__ import annotations

import torch.distributed as tdist

from pipeline.dist import shutdown


def test_shutdown_destroys_the_group_and_is_a_no_op_without_one(tmp_path):
    shutdown()  # no group: nothing to do
    store = tdist.FileStore(str(tmp_path / "store"), 1)
    tdist.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert tdist.is_initialized()
    shutdown()
    assert not tdist.is_initialized()
