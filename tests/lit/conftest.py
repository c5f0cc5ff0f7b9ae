"""Fixtures of the trainer and accelerator tests."""

from __future__ import annotations

import sys

import pytest
import torch

from pipeline.lit.devices import ASCEND_VISIBLE_DEVICES


@pytest.fixture
def no_mask(monkeypatch):
    # setenv first so that monkeypatch restores the variable's absence afterwards.
    monkeypatch.setenv(ASCEND_VISIBLE_DEVICES, "")
    monkeypatch.delenv(ASCEND_VISIBLE_DEVICES)


@pytest.fixture
def no_torch_npu(monkeypatch, no_mask):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import raises ModuleNotFoundError
    monkeypatch.delattr(torch, "npu", raising=False)
