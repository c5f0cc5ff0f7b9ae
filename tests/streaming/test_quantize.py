"""quantize_checkpoint: streaming equals the whole-model recipe, resume, ranks, errors."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.dist import Dist
from pipeline.errors import LowbitError
from pipeline.models import CheckpointError, StreamingCheckpoint
from pipeline.models.quantized import load_quantized, quantized_modules
from pipeline.models.synthetic import write_synthetic_checkpoint
from pipeline.quant.allocate import layer_bits
from pipeline.quant.feedback import Feedback
from pipeline.quant.formats import Format, parse_format
from pipeline.quant.gptq import HessianAccumulator, gptq_quantize
from pipeline.quant.qtensor import QTensor
from pipeline.quant.sequential import QuantOptions
from pipeline.streaming import StreamOptions, quantize_checkpoint

TINY = dict(hidden=32, layers=3, intermediate=48, heads=4, kv_heads=2, vocab=61)
OPTS = QuantOptions("gptq", block_size=16, damp=0.01, act_order=True)
BATCH = 4
INT4, INT3 = parse_format("int4g32"), parse_format("int3g32")
WALK = StreamOptions(segment_size=2, batch_size=BATCH, act_budget_gb=2.0, progress=False)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A 3-layer fp32 Llama in many small shards."""
    path = tmp_path_factory.mktemp("src")
    return write_synthetic_checkpoint(path, **TINY, shard_bytes=20_000, dtype=torch.float32)


@pytest.fixture(scope="module")
def calib() -> torch.Tensor:
    return torch.randint(0, TINY["vocab"], (6, 12), generator=torch.Generator().manual_seed(0))


def plan_for(layers: int = 3) -> dict[str, Format]:
    """Mixed formats; layer 1's o_proj stays float (not listed)."""
    plan = {}
    for i in range(layers):
        for lin in ("q_proj", "k_proj", "v_proj", "o_proj"):
            plan[f"model.layers.{i}.self_attn.{lin}"] = INT4 if lin != "o_proj" else INT3
        for lin in ("gate_proj", "up_proj", "down_proj"):
            plan[f"model.layers.{i}.mlp.{lin}"] = INT3
    del plan["model.layers.1.self_attn.o_proj"]
    return plan


def stored_codes(model_dir: Path) -> dict[str, torch.Tensor]:
    meta = json.loads((model_dir / "lowbit_quant.json").read_text())
    from safetensors.torch import load_file

    flat = {}
    for f in model_dir.glob("*.safetensors"):
        flat.update(load_file(str(f)))
    return {n: QTensor.from_state_dict(flat, n).codes for n in meta["layers"]}


def run(src, calib, tmp, name, method="gptq", dist=None, **walk) -> tuple[Path, dict]:
    """quantize_checkpoint with OPTS and WALK, ``walk`` changing StreamOptions fields."""
    out = tmp / name / "model"
    opts, walk = dataclasses.replace(OPTS, method=method), dataclasses.replace(WALK, **walk)
    report = quantize_checkpoint(StreamingCheckpoint(src), out, plan_for(), calib, opts, walk,
                                 work_dir=tmp / name / "work", dist=dist)  # fmt: skip
    return out, report


@torch.no_grad()
def reference_codes(src: Path, calib: torch.Tensor, plan: dict[str, str]) -> dict:
    """The recipe written out on the fully loaded HF model, layer by layer: GPTQ's sequential
    order (q/k/v, o, gate/up, down), Hessians from forward hooks on the whole batch stream."""
    ck = StreamingCheckpoint(src)
    model = ck.full_model(torch.float32)
    groups = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)]  # fmt: skip
    h = model.model.embed_tokens(calib)  # (N, T, C)
    batches = [slice(i, i + BATCH) for i in range(0, calib.shape[0], BATCH)]
    codes = {}
    for i, layer in enumerate(model.model.layers):
        kw = ck.block_forward_inputs(calib.shape[1], layer_idx=i)
        for group in groups:
            names = [n for n in group if f"model.layers.{i}.{n}" in plan]
            if not names:
                continue
            lin = layer.get_submodule(names[0])
            acc = HessianAccumulator(lin.in_features)
            handle = lin.register_forward_hook(lambda m, args, out, acc=acc: acc.add_batch(args[0]))
            for b in batches:
                layer(h[b], **kw)
            handle.remove()
            for n in names:
                mod = layer.get_submodule(n)
                qt, _ = gptq_quantize(
                    mod.weight,
                    acc.H,
                    plan[f"model.layers.{i}.{n}"],
                    OPTS.block_size,
                    OPTS.damp,
                    OPTS.act_order,
                )
                codes[f"model.layers.{i}.{n}"] = qt.codes
                mod.weight.copy_(qt.dequantize())
        h = torch.cat([layer(h[b], **kw) for b in batches])
    return codes


@pytest.fixture(scope="module")
def ref(src, calib) -> dict[str, torch.Tensor]:
    return reference_codes(src, calib, plan_for())


@pytest.mark.parametrize("budget_gb", [1.0, 1e-9], ids=["in-memory", "spilled"])
def test_streaming_equals_whole_model_recipe(src, calib, ref, tmp_path, budget_gb):
    out, report = run(src, calib, tmp_path, "s", act_budget_gb=budget_gb)
    got = stored_codes(out)
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    assert report["segments"] == 2 and len(report["layers"]) == len(plan_for())
    entry = report["layers"]["model.layers.2.mlp.down_proj"]
    assert entry["format"] == "int3g32" and 0 < entry["rel_output_error"] < 1
    # The float linear, norms, embeddings and head are stored exactly, under their HF names.
    model = load_quantized(out)
    full = StreamingCheckpoint(src).full_model(torch.float32)
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.norm.weight", "lm_head.weight",
                 "model.embed_tokens.weight", "model.layers.2.input_layernorm.weight"):  # fmt: skip
        assert torch.equal(model.get_parameter(name), full.get_parameter(name)), name
    assert len(quantized_modules(model)) == len(plan_for())


def test_whole_model_mode_gives_the_same_codes(src, calib, ref, tmp_path):
    """stream=False (the memory benchmark's baseline) runs the same loop on a loaded model."""
    out, _ = run(src, calib, tmp_path, "full", stream=False, segment_size=3)
    got = stored_codes(out)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize("budget_gb", [1.0, 1e-9], ids=["in-memory", "spilled"])
def test_resume_after_crash_gives_identical_codes(src, calib, ref, tmp_path, budget_gb):
    kw = {"segment_size": 1, "act_budget_gb": budget_gb}

    def crash_after_second(k: int) -> None:
        if k == 1:
            raise Crash("killed")

    with pytest.raises(Crash):
        run(src, calib, tmp_path, "r", on_segment=crash_after_second, **kw)
    assert not (tmp_path / "r" / "model").exists()  # nothing half-written in the output
    with pytest.raises(Crash):  # other inputs (here the method) never reuse those segments
        run(src, calib, tmp_path, "r", on_segment=crash_after_second, method="rtn", **kw)
    with pytest.raises(Crash):
        run(src, calib, tmp_path, "r", on_segment=crash_after_second, **kw)
    out, report = run(src, calib, tmp_path, "r", **kw)
    assert report["resumed_segments"] == 2
    # `ref` is what the uninterrupted run gives (test_streaming_equals_whole_model_recipe).
    got = stored_codes(out)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    names = {n: f.name for n, f in plan_for().items()}
    assert json.loads((out / "lowbit_quant.json").read_text())["layers"] == names


def _rank_worker(rank: int, src: str, calib: torch.Tensor, tmp: str) -> None:
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
    try:
        run(Path(src), calib, Path(tmp), "two", dist=Dist(rank=rank, world_size=2))
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_match_one_rank(src, calib, ref, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_worker, args=(str(src), calib, str(tmp_path)), nprocs=2, join=True)
    a, b = stored_codes(tmp_path / "two" / "model"), ref  # ref: the one-rank codes
    differ = sum(int((a[n] != b[n]).sum()) for n in b)
    total = sum(b[n].numel() for n in b)
    # Hessians summed over ranks in another order may flip a code sitting on a rounding edge.
    assert differ / total <= 1e-3, f"{differ} of {total} codes differ"
    print(f"two ranks vs one: {differ} of {total} codes differ")


def test_corrupt_shard_names_the_file(src, calib, tmp_path):
    bad = Path(shutil.copytree(src, tmp_path / "bad"))
    shard = sorted(bad.glob("model-*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match=shard.name):
        quantize_checkpoint(StreamingCheckpoint(bad), tmp_path / "o", plan_for(), calib, OPTS,
                            WALK, work_dir=tmp_path / "w")  # fmt: skip


def test_plan_naming_unknown_layers_is_refused(src, calib, tmp_path):
    with pytest.raises(LowbitError, match="model.layers.9.mlp.up_proj"):
        quantize_checkpoint(StreamingCheckpoint(src), tmp_path / "o",
                            {"model.layers.9.mlp.up_proj": "int4"}, calib, OPTS, WALK,
                            work_dir=tmp_path / "w")  # fmt: skip


def test_quantized_lm_head(src, calib, tmp_path):
    plan = {"lm_head": "int8", "model.layers.0.mlp.down_proj": "int4g32"}
    out = tmp_path / "m"
    ckpt = StreamingCheckpoint(src)
    report = quantize_checkpoint(ckpt, out, plan, calib, OPTS, WALK, work_dir=tmp_path / "w")
    assert set(report["layers"]) == set(plan)
    model = load_quantized(out)
    assert set(quantized_modules(model)) == set(plan)
    assert report["layers"]["lm_head"]["rel_output_error"] < 0.05  # 8 bits per channel


def test_error_feedback_resumes_with_what_is_left_of_the_slack(src, calib, tmp_path):
    """A resumed run spends only what the finished segments left: the same moves and codes."""
    # Enough for a few int3 -> int4 moves (the down_proj is 32 x 48), not for all of them.
    slack = 3 * (layer_bits(INT4, (32, 48)) - layer_bits(INT3, (32, 48)))
    fb = Feedback(threshold=1e-3, candidates=(INT3, INT4), slack_bits=slack)
    kw = {"segment_size": 1}

    def go(name, **walk):
        walk = dataclasses.replace(WALK, **walk)
        return quantize_checkpoint(StreamingCheckpoint(src), tmp_path / name / "model", plan_for(),
                                   calib, OPTS, walk, work_dir=tmp_path / name / "work",
                                   feedback=fb)  # fmt: skip

    whole = go("whole", **kw)
    moved = {
        n: r["format"] for n, r in whole["layers"].items() if r["format"] != r["format_before"]
    }
    assert moved and set(moved.values()) == {"int4g32"}
    assert 0 < whole["feedback_bits"] <= slack

    def crash_after_first(k: int) -> None:
        if k == 0:
            raise Crash("killed")

    with pytest.raises(Crash):
        go("r", on_segment=crash_after_first, **kw)
    resumed = go("r", **kw)
    assert resumed["resumed_segments"] == 1
    assert resumed["feedback_bits"] == whole["feedback_bits"]
    a, b = stored_codes(tmp_path / "r" / "model"), stored_codes(tmp_path / "whole" / "model")
    assert all(torch.equal(a[n], b[n]) for n in b)
    meta = json.loads((tmp_path / "r" / "model" / "lowbit_quant.json").read_text())
    assert {n: f for n, f in meta["layers"].items() if f != plan_for()[n].name} == moved
