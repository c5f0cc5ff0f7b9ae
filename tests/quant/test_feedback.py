"""Error feedback: the next finer candidate, the largest errors paid first within the slack, and a
block re-quantized from the first moved group exactly as a fresh pass with the final formats."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline.quant.allocate import layer_bits
from pipeline.quant.feedback import (
    Feedback,
    allowance,
    choose,
    finer,
    quantize_block_feedback,
    spent_bits,
)
from pipeline.quant.formats import parse_format
from pipeline.quant.sequential import QuantOptions, quantize_block

pytestmark = pytest.mark.usefixtures("one_thread")

INT2, INT2G32, INT3, INT4 = (parse_format(f) for f in ("int2g64", "int2g32", "int3g64", "int4g64"))
CANDS = (INT4, INT2, parse_format("float"), INT3, INT2G32)
OPTS = QuantOptions("gptq", block_size=32, damp=0.01, act_order=True)


def test_finer_is_the_cheapest_candidate_costing_more():
    shape = (32, 64)
    assert finer(INT2, CANDS, shape) == INT2G32
    assert finer(INT2G32, CANDS, shape) == INT3
    assert finer(INT3, CANDS, shape) == INT4
    assert finer(INT4, CANDS, shape) is None  # float is never a move: it is outside the budget


def _entry(err: float, fmt=INT2, shape=(32, 64)) -> dict:
    return {"rel_output_error": err, "shape": list(shape), "format": fmt.name}


def test_largest_error_first_within_the_slack_and_groups_move_together():
    report = {"a": _entry(0.30), "b": _entry(0.10), "c": _entry(0.50), "d": _entry(0.02)}
    formats = dict.fromkeys(report, INT2)
    groups = [("a", "b"), ("c",), ("d",)]  # a and b share an input, hence a format
    one = layer_bits(INT2G32, (32, 64)) - layer_bits(INT2, (32, 64))
    fb = Feedback(threshold=0.05, candidates=CANDS, slack_bits=0)

    ups, spent = choose(report, formats, groups, fb, slack=one)
    assert ups == {"c": INT2G32} and spent == one  # the worst error, alone within the slack
    ups, spent = choose(report, formats, groups, fb, slack=2 * one)
    assert ups == {"c": INT2G32} and spent == one  # the pair (a, b) costs two moves: not both
    ups, spent = choose(report, formats, groups, fb, slack=3 * one)
    assert ups == {"a": INT2G32, "b": INT2G32, "c": INT2G32} and spent == 3 * one
    ups, _ = choose(report, formats, groups, fb, slack=10**9)
    assert "d" not in ups  # below the threshold: never moved, whatever the slack
    assert choose(report, formats, groups, fb, slack=one - 1) == ({}, 0)


def test_even_pace_carries_unspent_shares_forward():
    fb = Feedback(0.01, CANDS, slack_bits=100, pace="even")
    assert allowance(fb, left=100, block=0, n_blocks=4) == 25
    assert allowance(fb, left=100, block=1, n_blocks=4) == 50  # block 0 spent nothing
    assert allowance(fb, left=60, block=1, n_blocks=4) == 10
    assert allowance(fb, left=10, block=2, n_blocks=4) == 0  # ahead of the pace: wait
    assert allowance(fb, left=7, block=3, n_blocks=4) == 7  # the last block: all that is left
    greedy = Feedback(0.01, CANDS, slack_bits=100)
    assert allowance(greedy, left=60, block=0, n_blocks=4) == 60


class Toy(nn.Module):
    """Two linears read the input (fused), a third reads their product."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate, self.up = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)
        for lin in (self.gate, self.up, self.down):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) / 8

    def forward(self, x):
        return self.down(torch.relu(self.gate(x)) * self.up(x))


def _batches():
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 16, 64, generator=g) for _ in range(2)]
    xs[0][..., 3] *= 20  # an outlier column: what makes rounding errors uneven
    return lambda: iter(xs)


def test_block_moves_within_the_slack_and_matches_a_fresh_pass_with_the_final_formats():
    groups = [("gate", "up"), ("down",)]
    formats = dict.fromkeys(("gate", "up", "down"), INT2)
    block = Toy()
    pair = 2 * (layer_bits(INT2G32, (64, 64)) - layer_bits(INT2, (64, 64)))
    fb = Feedback(threshold=1e-4, candidates=CANDS, slack_bits=pair)
    qts, rep, spent = quantize_block_feedback(
        copy.deepcopy(block), formats, _batches(), {}, groups, OPTS, fb, slack=pair
    )
    moved = {n for n, r in rep.items() if r["format"] != r["format_before"]}
    assert spent == spent_bits(rep.values()) <= pair and moved  # some group moved, within slack
    assert all(rep[n]["rel_output_error"] < rep[n]["rel_output_error_before"] for n in moved)

    final = {n: parse_format(rep[n]["format"]) for n in formats}
    fresh_qts, fresh_rep = quantize_block(copy.deepcopy(block), final, _batches(), {}, groups, OPTS)
    for n in formats:
        assert torch.equal(qts[n].codes, fresh_qts[n].codes), n
        assert rep[n]["rel_output_error"] == pytest.approx(fresh_rep[n]["rel_output_error"])


def test_nothing_moves_without_slack_or_above_a_high_threshold():
    groups = [("gate", "up"), ("down",)]
    formats = dict.fromkeys(("gate", "up", "down"), INT2)
    plain, _ = quantize_block(Toy(), formats, _batches(), {}, groups, OPTS)
    for fb, slack in [(Feedback(1e-4, CANDS, 0), 0), (Feedback(0.99, CANDS, 10**9), 10**9)]:
        qts, rep, spent = quantize_block_feedback(
            Toy(), formats, _batches(), {}, groups, OPTS, fb, slack
        )
        assert spent == 0 and all(r["format"] == r["format_before"] for r in rep.values())
        assert all(torch.equal(qts[n].codes, plain[n].codes) for n in formats)
