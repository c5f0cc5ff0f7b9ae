"""QTensor files: many quantized weights in one safetensors file."""

import pytest
import torch

from pipeline.models.qtensor_io import load_qtensors, save_qtensors
from pipeline.quant.qtensor import QTensor
from pipeline.quant.rtn import quantize_rtn


def _qt(name: str, seed: int = 0) -> QTensor:
    w = torch.randn(6, 100, generator=torch.Generator().manual_seed(seed))
    return quantize_rtn(w, name)


def test_save_and_load_many(tmp_path):
    qts = {"a.q_proj": _qt("int4g128"), "a.k_proj": _qt("exp4g64", seed=1), "b": _qt("float")}
    path = tmp_path / "q.safetensors"
    save_qtensors(path, qts)
    back = load_qtensors(path)
    assert set(back) == set(qts)
    for name, qt in qts.items():
        assert back[name].fmt == qt.fmt
        assert torch.equal(back[name].dequantize(), qt.dequantize())


def test_load_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_qtensors(tmp_path / "nope.safetensors")
