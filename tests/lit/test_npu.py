"""The trainer start check without torch_npu, and the accelerator cases in a child process.

See npu_cases.py for why the cases with a stand-in `npu` device run in a pytest of their own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.lit.trainer import check_trainer
from tests.conftest import cases_in_child, make_cfg
from tests.lit.npu_cases import refusal


def test_accelerator_cases_against_a_stand_in_npu():
    cases_in_child(Path(__file__).with_name("npu_cases.py"))


def test_check_refuses_npu_without_torch_npu(no_torch_npu):
    msg = refusal(make_cfg("trainer=npu").trainer)
    assert "`trainer.accelerator`" in msg and "torch_npu" in msg and "not installed" in msg
    assert "trainer=cpu" in msg


def test_check_refuses_hccl_without_torch_npu(no_torch_npu):
    msg = refusal({"accelerator": "cpu", "devices": 1, "dist_backend": "hccl"})
    assert "`trainer.dist_backend`" in msg and "torch_npu" in msg


def test_check_refuses_gpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    msg = refusal(make_cfg("trainer=gpu").trainer)
    assert "`trainer.accelerator`" in msg and "CUDA" in msg and "trainer=cpu" in msg


def test_check_passes_the_default_cpu_trainer():
    assert check_trainer(make_cfg().trainer) is None
    assert check_trainer(make_cfg("trainer=cpu").trainer) is None
    assert check_trainer(None) is None
    assert check_trainer({}) is None
