"""Decode speed of runtime models: plain and speculative, theory beside measurement."""

from __future__ import annotations

import pytest
import torch

from pipeline.models.quantized import load_quantized
from pipeline.runtime.inmemory import to_runtime
from pipeline.runtime.kernels import int_kernel_name
from pipeline.runtime.speed import decode_speed, format_speed, paired_passes, slow_lowbit
from pipeline.speculative.stats import SpecStats


def test_plain_and_self_speculative_speed(qmodels):
    fp = qmodels.fp_model().eval()
    low = to_runtime(load_quantized(qmodels.get("int4g128")))
    prompts = [
        torch.randint(0, 200, (1, 10), generator=torch.Generator().manual_seed(i)) for i in range(2)
    ]
    speed = decode_speed(
        {"target_fp": fp, "target_int4": low},
        [("target_int4", "target_fp")],
        prompts,
        new_tokens=6,
        gamma=2,
    )
    plain = speed["plain"]
    assert plain["target_fp"]["kernels"] == "float (F.linear)"
    assert plain["target_int4"]["kernels"] == f"{int_kernel_name()} x7"
    assert all(r["tokens_per_s"] > 0 for r in plain.values())
    m = speed["speculative"]["target_int4@target_fp"]
    a, c = m["alpha"], m["cost_ratio"]
    assert 0 <= a <= 1 and c > 0
    assert abs(m["theoretical_speedup"] - (1 + a + a * a) / (2 * c + 1)) < 1e-6
    assert m["speedup"] > 0  # pass by pass against plain passes of its own (below)
    assert abs(m["of_theory"] - m["speedup"] / m["theoretical_speedup"]) < 1e-9
    table = "\n".join(format_speed(speed))
    assert "| target_int4 |" in table and "| target_int4@target_fp |" in table


def test_paired_passes_alternate_so_a_drifting_machine_touches_both_alike():
    calls = []

    def decoder(name: str, tokens_per_s: float):
        def fn(prompt, generator):
            calls.append(name)
            slower = 2.0 if len(calls) > 4 else 1.0  # the machine halves its speed mid-run
            return None, SpecStats(new_tokens=10, seconds=10 / tokens_per_s * slower)

        return fn

    prompts = [torch.zeros(1, 4, dtype=torch.long)]
    stats, rates, base = paired_passes(decoder("spec", 20.0), decoder("plain", 10.0), prompts, 0, 3)
    # the warm-ups, then the pairs, base first in every other one (no side always second)
    assert calls == ["plain", "spec"] * 2 + ["spec", "plain", "plain", "spec"]
    assert rates == [20.0, 10.0, 10.0] and base == [10.0, 5.0, 5.0] and stats.new_tokens == 30
    assert [r / b for r, b in zip(rates, base)] == [2.0] * 3  # the drift cancels pass by pass
    calls.clear()
    assert paired_passes(decoder("spec", 20.0), None, prompts, 0, 2)[2] == []
    assert calls == ["spec"] * 3


def test_the_overhead_caveat_appears_only_when_lowbit_is_slower():
    def speed(low_rate):
        return {
            "plain": {
                "target_fp": {"tokens_per_s": 100.0, "kernels": "float (F.linear)"},
                "target_quantized": {"tokens_per_s": low_rate, "kernels": "int4pack x7"},
                "draft_fp": {"tokens_per_s": 50.0, "kernels": "float (F.linear)"},
            },
            "speculative": {},
        }

    assert slow_lowbit(speed(80.0)) == ["target_quantized"]
    assert "crossover" in format_speed(speed(80.0))[-1]
    assert slow_lowbit(speed(120.0)) == []  # a float draft is slower by design: no caveat
    assert not any("crossover" in line for line in format_speed(speed(120.0)))


def test_adaptive_draft_length_is_priced_with_the_measured_costs(qmodels, monkeypatch):
    from pipeline.runtime import speed as module

    # Stand-in measurements (the timings themselves are cost.py's): a draft 100x cheaper than
    # the target, and verification as cheap as a step; the speed-up then favours long blocks.
    monkeypatch.setattr(module, "measure_cost_ratio", lambda *a, **k: 0.01)
    monkeypatch.setattr(
        module, "measure_verify_cost", lambda m, gammas, **k: dict.fromkeys(gammas, 1.0)
    )
    fp = qmodels.fp_model().eval()
    prompts = [torch.randint(0, 200, (1, 10), generator=torch.Generator().manual_seed(0))]
    kwargs = dict(new_tokens=24, temperature=0.0)
    fixed = decode_speed({"t": fp, "d": fp}, [("d", "t")], prompts, gamma=2, **kwargs)
    speed = decode_speed(  # untimed: the stand-in prices decide, not the clock
        {"t": fp, "d": fp}, [("d", "t")], prompts, adaptive=(2, 5, 64), timed=False, **kwargs
    )
    m, f = speed["speculative"]["d@t"], fixed["speculative"]["d@t"]
    # A self-draft accepts everything: the window drives gamma up, so each target call emits
    # more tokens than gamma 2's three; v is priced for every gamma the window may choose.
    assert f["gamma"] == 2 and f["tau"] == pytest.approx(3.0)
    assert m["gamma"] > 3 and m["tau"] > f["tau"]
    assert m["cost_ratio"] == 0.01
    assert "| d@t |" in "\n".join(format_speed(speed))


def test_a_draft_that_does_not_pay_is_replaced_by_plain_steps(monkeypatch):
    from pipeline.runtime import speed as module
    from tests.speculative.conftest import tiny_llama

    # A stranger's greedy proposals are rejected, and a draft half the target's cost (the
    # stand-in c) cannot pay; with allow_plain the adaptive length drops to plain steps.
    monkeypatch.setattr(module, "measure_cost_ratio", lambda *a, **k: 0.5)
    models, pairs = {"t": tiny_llama(0), "d": tiny_llama(1)}, [("d", "t")]
    prompts = [torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))]
    kwargs = dict(new_tokens=24, temperature=0.0, adaptive=(1, 4, 64), repeats=3)
    off = decode_speed(models, pairs, prompts, allow_plain=False, **kwargs)["speculative"]["d@t"]
    on = decode_speed(models, pairs, prompts, **kwargs)["speculative"]["d@t"]
    assert on["plain_share"] > 0.5 > off["plain_share"]
    assert on["alpha"] < 0.2  # the probes kept measuring the draft
