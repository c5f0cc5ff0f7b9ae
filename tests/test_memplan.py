"""The memory planner: shapes from config.json, defaults by size, per-stage plans, the refusal."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
import torch

from pipeline import hardware, workflow
from pipeline.config import PlanConfig, run_config
from pipeline.errors import ConfigError, LowbitError
from pipeline.memplan import GIB, Capacity, StageMemory, capacity, plan_run
from pipeline.modelshape import ModelShape, size_defaults
from tests.conftest import CLI_TIMEOUT, REPO, lowbit_cmd, make_cfg

ASSETS = REPO / "tests" / "assets"
LLAMA_8B, LLAMA_1B, LLAMA_70B = (ASSETS / n for n in ("llama3_8b", "llama3_1b", "llama3_70b"))


def corpus(tmp_path):
    (tmp_path / "c.txt").write_text("hello world\n")
    return f"data.path={tmp_path / 'c.txt'}"


def test_shapes_count_the_published_parameters():
    # Meta's model cards: Llama-3-8B 8.03 B, Llama-3.2-1B 1.24 B (tied), Llama-3-70B 70.6 B.
    assert ModelShape.from_dir(LLAMA_8B).params == 8_030_261_248
    assert ModelShape.from_dir(LLAMA_1B).params == 1_235_814_400
    assert ModelShape.from_dir(LLAMA_70B).params == 70_553_706_496
    assert ModelShape.from_dir(LLAMA_8B).dtype_bytes == 2


def test_a_config_without_llama_fields_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "t5", "d_model": 512}')
    with pytest.raises(LowbitError, match="num_hidden_layers"):
        ModelShape.from_dir(tmp_path)


def test_defaults_scale_with_the_model():
    small = size_defaults(ModelShape(4, 128, 384, 2, 2, 2048))
    one = size_defaults(ModelShape.from_dir(LLAMA_1B))
    eight = size_defaults(ModelShape.from_dir(LLAMA_8B))
    assert (small.calib_samples, small.calib_seq_len, small.stream_sensitivity) == (64, 128, False)
    assert small.precision == "32-true"
    assert (one.calib_samples, one.calib_seq_len, one.stream_sensitivity) == (128, 2048, False)
    assert (eight.calib_samples, eight.calib_seq_len, eight.stream_sensitivity) == (128, 2048, True)
    assert eight.precision == one.precision == "auto"


def test_null_settings_follow_the_target_and_set_ones_win(tmp_path):
    default = run_config(make_cfg())
    assert (default.quant.calib.samples, default.quant.calib.seq_len) == (64, 128)
    assert default.trainer["precision"] == "32-true"
    big = make_cfg("model=hf", f"model.target.path={LLAMA_8B}", corpus(tmp_path))
    run = run_config(big)
    assert (run.quant.calib.samples, run.quant.calib.seq_len) == (128, 2048)
    assert run.trainer["precision"] == "auto"
    assert workflow.stage_config(big, "sensitivity")[0].stream is True
    chosen = make_cfg("model=hf", f"model.target.path={LLAMA_8B}", corpus(tmp_path),
                      "quant.calib.samples=16", "stage.sensitivity.stream=false",
                      "trainer.precision=32-true")  # fmt: skip
    run = run_config(chosen)
    assert (run.quant.calib.samples, run.quant.calib.seq_len) == (16, 2048)
    assert run.trainer["precision"] == "32-true"
    assert workflow.stage_config(chosen, "sensitivity")[0].stream is False


def test_the_default_plan_has_every_stage_and_adds_up():
    plan = plan_run(run_config(make_cfg()))
    assert [s.stage for s in plan.stages] == [
        "bootstrap", "sensitivity", "allocate", "quantize", "distill", "reinforce", "evaluate",
        "export",
    ]  # fmt: skip
    for s in plan.stages:
        assert isinstance(s, StageMemory) and s.device_bytes == 0  # a CPU run: host only
        assert s.host_bytes == sum(s.terms.values()) > 0.5 * GIB
    assert plan.stage("distill").host_bytes > plan.stage("allocate").host_bytes  # Lightning
    assert "sensitivity" in plan.table()


def test_allocate_and_export_keep_what_an_earlier_stage_reading_the_corpus_left():
    def terms(*names):
        plan = plan_run(run_config(make_cfg()), dict.fromkeys(names))
        return {n: plan.stage(n).terms for n in names}

    after = terms("sensitivity", "allocate", "export")
    assert after["allocate"]["corpus read before"] == after["export"]["corpus read before"] > 0
    assert after["sensitivity"]["corpus"] > after["allocate"]["corpus read before"]
    alone = terms("allocate", "export")  # nothing before them reads it
    assert not [t for n in alone for t in alone[n] if t.startswith("corpus")]
    assert "corpus" in terms("bootstrap", "allocate")["allocate"]  # bootstrap's whole term


def stage_terms(stage, *overrides):
    """{term: bytes} of `stage` alone in the plan of a run with `overrides`."""
    cfg = make_cfg(*overrides)
    plan = plan_run(run_config(cfg), {stage: workflow.stage_config(cfg, stage)[0]})
    return plan.stage(stage).terms


def test_bootstrap_plans_its_tokenizer_and_its_training_as_phases_not_a_sum():
    def bootstrap(*overrides):
        return stage_terms("bootstrap", *overrides)

    tokenizer = bootstrap()  # the built-in corpus's BPE training outweighs a 1.4 M model
    assert "tokenizer training" in tokenizer and "activations" not in tokenizer
    wide = bootstrap("model.target.hidden=512", "stage.bootstrap.batch_size=64")
    assert "activations" in wide and "tokenizer training" not in wide


def test_evaluate_plans_acceptance_on_its_longest_prompts_and_none_without_scenarios():
    def evaluate(*overrides):
        return stage_terms("evaluate", *overrides)["logits"]

    mix, none = evaluate("stage.evaluate.scenarios=[mix]"), evaluate("stage.evaluate.scenarios=[]")
    assert evaluate() > mix > none  # the long scenario's 576-token prompts, then 128 tokens


def test_sensitivity_plans_the_hessians_a_gptq_delta_holds():
    gptq, rtn = stage_terms("sensitivity"), stage_terms("sensitivity", "quant.method=rtn")
    assert "input Hessians" not in rtn and "GPTQ factors and copies" not in rtn
    hidden, inter, layers = 128, 384, 4  # the default target: q/k/v, o, gate/up in 128, down 384
    assert gptq["input Hessians"] == layers * (3 * hidden**2 + inter**2) * 4 + hidden**2 * 4
    assert gptq["GPTQ factors and copies"] > 5 * inter**2 * 4


def _plan(tmp_path, *overrides):
    cfg = make_cfg("model=hf", f"model.target.path={LLAMA_70B}", corpus(tmp_path), *overrides)
    return plan_run(run_config(cfg), {
        "sensitivity": workflow.stage_config(cfg, "sensitivity")[0],
        "quantize": workflow.stage_config(cfg, "quantize")[0],
        "distill": workflow.stage_config(cfg, "distill")[0],
    })  # fmt: skip


def test_streaming_and_zero3_shrink_what_a_70b_needs(tmp_path):
    loaded = _plan(tmp_path, "stage.sensitivity.stream=false").stage("sensitivity")
    streamed = _plan(tmp_path).stage("sensitivity")
    # fp32 weights + gradients + Fisher sums: 12 bytes a parameter, 70.6 B parameters.
    assert loaded.terms["weights fp32"] == 70_553_706_496 * 4
    assert loaded.host_bytes > 800 * GIB > 40 * GIB > streamed.host_bytes
    # Segment by segment: the depth costs quantize nothing.
    deeper = ModelShape.from_dir(LLAMA_70B)
    deeper = dataclasses.replace(deeper, layers=2 * deeper.layers)
    run = run_config(make_cfg("model=hf", f"model.target.path={LLAMA_70B}", corpus(tmp_path)))
    quantize = [
        plan_run(run, {"quantize": None}, shapes={"target": shape}).stage("quantize").host_bytes
        for shape in (ModelShape.from_dir(LLAMA_70B), deeper)
    ]
    assert quantize[0] == quantize[1] < 0.3 * 70_553_706_496 * 2
    ddp = _plan(tmp_path, "trainer=gpu", "trainer.devices=8").stage("distill")
    zero3 = _plan(tmp_path, "trainer=deepspeed_zero3", "trainer.accelerator=gpu",
                  "trainer.devices=8").stage("distill")  # fmt: skip
    assert zero3.terms["teacher"] * 8 == ddp.terms["teacher"]
    assert zero3.device_bytes < ddp.device_bytes


def test_a_streamed_head_left_unscored_holds_its_weight_alone(tmp_path):
    # A vocabulary so wide that the head's pass is the stage's peak either way.
    shape = ModelShape(layers=1, hidden=512, intermediate=1024, heads=8, kv_heads=8, vocab=2**20)
    head = 2**20 * 512 * 4  # the untied lm_head in float32

    def terms(*overrides):
        cfg = make_cfg("model=hf", f"model.target.path={LLAMA_70B}", corpus(tmp_path), *overrides)
        sens = workflow.stage_config(cfg, "sensitivity")[0]
        plan = plan_run(run_config(cfg), {"sensitivity": sens}, shapes={"target": shape})
        return plan.stage("sensitivity").terms

    scored = terms("stage.sensitivity.stream=true")
    unscored = terms("stage.sensitivity.stream=true", "stage.sensitivity.include_lm_head=false",
                     "stage.sensitivity.include_embeddings=false")  # fmt: skip
    assert scored["lm_head fp32"] == 3 * head  # weight, gradient, Fisher sums
    assert unscored["lm_head fp32"] == head and "embeddings fp32" not in unscored


def test_models_are_planned_in_the_dtype_they_compute_in(tmp_path):
    """A bf16 checkpoint on a CPU without native bf16 is cast to float32 as it loads (pipeline.
    hardware.compute_dtype): evaluate holds it in both dtypes for a moment, export in float32."""
    params = ModelShape.from_dir(LLAMA_8B).params
    native = hardware.native(torch.bfloat16, "cpu")[0]

    def terms(stage, *overrides):
        cfg = make_cfg("model=hf", f"model.target.path={LLAMA_8B}", corpus(tmp_path), *overrides)
        plan = plan_run(run_config(cfg), {stage: workflow.stage_config(cfg, stage)[0]})
        return plan.stage(stage).terms

    auto = terms("evaluate", "stage.evaluate.batch_size=1")
    assert auto["target"] == params * (2 if native else 4)
    assert auto.get("as stored (cast)") == (None if native else params * 2)
    forced = terms("evaluate", "stage.evaluate.batch_size=1", "model.target.dtype=float32")
    assert forced["target"] == params * 4 and forced["as stored (cast)"] == params * 2
    floats = terms("export", "model.target.dtype=float32")["quantized model"]
    assert floats - terms("export", "model.target.dtype=bfloat16")["quantized model"] > params // 8


def test_a_plan_that_does_not_fit_names_the_stage_and_the_fix(tmp_path):
    plan = _plan(tmp_path, "stage.sensitivity.stream=false")
    problems = plan.fits(Capacity(256 * GIB, None, "a 256 GiB node"))
    sens = next(p for p in problems if p.startswith("stage sensitivity"))
    assert "a 256 GiB node has 256.0 GiB" in sens and "set stage.sensitivity.stream=true" in sens
    assert plan_run(run_config(make_cfg())).fits(Capacity(64 * GIB, None)) == []


def test_the_start_checks_refuse_before_any_compute(tmp_path):
    cfg = make_cfg(f"run_dir={tmp_path}", "plan.host_mem_gib=0.1")
    with pytest.raises(LowbitError, match=r"the run will not fit: stage .* plan.check=false"):
        workflow.plan(cfg, tmp_path)
    workflow.plan(make_cfg(f"run_dir={tmp_path}", "plan.host_mem_gib=0.1", "plan.check=false"),
                  tmp_path)  # fmt: skip


@pytest.mark.parametrize(("experiment", "target"), [("gpu_8b", LLAMA_8B), ("npu_70b", LLAMA_70B)])
def test_cli_plan_prints_the_table_of_an_experiment(experiment, target, tmp_path):
    draft = [f"model.draft.path={LLAMA_1B}"] if experiment == "gpu_8b" else []
    out = subprocess.run(
        lowbit_cmd("--plan", f"experiment={experiment}", f"model.target.path={target}", *draft,
                   corpus(tmp_path), f"run_dir={tmp_path / 'run'}"),
        capture_output=True, text=True, timeout=CLI_TIMEOUT, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "memory plan: target" in out.stdout and "quantize" in out.stdout
    assert not (tmp_path / "run").exists()  # writes nothing


def test_capacity_reads_the_override_the_allocation_then_the_machine(monkeypatch):
    monkeypatch.delenv("SLURM_MEM_PER_NODE", raising=False)
    machine = capacity(PlanConfig(), "cpu")
    assert machine.host_source.startswith("MemAvailable") and machine.host_bytes > 0
    assert machine.device_bytes is None  # a CPU run has no device to fill
    assert capacity(PlanConfig(), "cpu", {"mem_gb": 512}).host_bytes == 512 * GIB
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "2048")  # MiB, as Slurm sets it
    assert capacity(PlanConfig(), "cpu", {"mem_gb": 512}).host_bytes == 2 * GIB
    given = capacity(PlanConfig(host_mem_gib=3, device_mem_gib=64), "npu")
    assert (given.host_bytes, given.device_bytes) == (3 * GIB, 64 * GIB)
    assert capacity(PlanConfig(), "npu").device_bytes is None  # no NPU here to ask
    with pytest.raises(ConfigError, match="plan.host_mem_gib"):
        PlanConfig(host_mem_gib=0)
