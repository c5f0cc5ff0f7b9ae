"""Int8 activations per 32 columns: the grid, the rounding, the split into int8 and float parts."""

from __future__ import annotations

import pytest
import torch

from pipeline.quant import act8


def test_each_block_is_its_own_int8_grid():
    torch.manual_seed(0)
    x = torch.randn(3, 96)
    x[1, 40] = 50.0  # an outlier in the second block of row 1 only
    got = act8.fake_act8(x)
    for r in range(3):
        for b in range(3):
            block, q = x[r, 32 * b : 32 * b + 32], got[r, 32 * b : 32 * b + 32]
            step = block.abs().max() / 127
            codes = q / step
            torch.testing.assert_close(codes, codes.round(), atol=1e-4, rtol=0)  # on the grid
            assert (q - block).abs().max() <= step / 2 + 1e-6  # nearest point
            assert q.abs().max() == pytest.approx(float(block.abs().max()), rel=1e-6)
    # the outlier coarsens its own block only: its neighbours lose, the other blocks do not
    err = (got - x).abs()
    assert err[1, 32:64].max() > 5 * err[1, :32].max()
    assert err[1, 64:].max() < 0.05


def test_halves_round_to_even_and_zero_blocks_stay_zero():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 2.5, 3.5  # step 1: 2.5 -> 2, 3.5 -> 4 (cvtps2dq)
    got = act8.fake_act8(x)
    assert got[0, :3].tolist() == [127.0, 2.0, 4.0]
    assert torch.equal(got[0, 32:], torch.zeros(32))


def test_columns_not_in_blocks_are_refused():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        act8.fake_act8(torch.randn(2, 48))


def test_split_parts_add_up_to_x():
    torch.manual_seed(1)
    x = torch.randn(4, 64)
    idx = torch.tensor([3, 40])
    rest, kept = act8.split(x, idx)
    assert torch.equal(rest[:, idx], torch.zeros(4, 2)) and torch.equal(kept, x[:, idx])
    assert torch.equal(rest.index_add(1, idx, kept), x)


def test_error_sums_give_the_relative_error():
    torch.manual_seed(2)
    x = torch.randn(2, 5, 64)
    err, ref = act8.error_sums(x).tolist()
    want = (act8.fake_act8(x) - x).norm() / x.norm()
    assert (err / ref) ** 0.5 == pytest.approx(float(want), rel=1e-5)
    assert 1e-3 < (err / ref) ** 0.5 < 2e-2  # Gaussian blocks: about half a percent
