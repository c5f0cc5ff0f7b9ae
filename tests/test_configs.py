"""Every config option composes and validates; the defaults are the dataclasses' and nothing else;
bad values fail early with one clear message."""

from __future__ import annotations

import dataclasses
import subprocess
import time

import pytest
from omegaconf import OmegaConf

from pipeline import conf_dir, stages, workflow
from pipeline.config import SHARED, TrackingConfig, parse, run_config
from pipeline.errors import ConfigError
from pipeline.lit.trainer import trainer_kwargs
from pipeline.workflow import plan
from tests.conftest import CLI_TIMEOUT, REPO, lowbit_cmd, make_cfg

GROUPS = ["model", "data", "quant", "trainer", "cluster", "tracking", "experiment"]
# What the default options (model=bootstrap, data=builtin, quant=mixed, tracking=sqlite) change
# from the dataclass defaults: the mixed recipe; every other default is the schema's.
DEFAULT_CHOICES = {
    "quant.candidates": [
        "int2g64",
        "int3g128",
        "int4g128",
        "int8",
        "exp4g128",
        "int2g128",
        "int2g32",
        "int3g64",
    ],
    "quant.budget_bits": 3.0,
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def required_paths(override: str, tmp_path) -> list[str]:
    """The `???` values an option leaves to the command line, filled with real paths."""
    extra = []
    if override in (
        "model=hf",
        "experiment=ascend_k8s",
        "experiment=workflow_13b",
        "experiment=gpu_8b",
    ):
        extra += [f"model.target.path={tmp_path}", f"model.draft.path={tmp_path}"]
    elif override.startswith("experiment=") and override != "experiment=smoke":
        extra.append(f"model.target.path={tmp_path}")
    if override == "data=local" or (override.startswith("experiment=") and extra):
        (tmp_path / "c.txt").write_text("hello world\n")
        extra.append(f"data.path={tmp_path / 'c.txt'}")
    return extra


def flat(obj, prefix=""):
    """{dotted key: leaf value} of a (nested) dataclass or dict."""
    if dataclasses.is_dataclass(obj):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): obj}


ALL_OPTIONS = [f"{g}={o}" for g in GROUPS for o in options(g)]


@pytest.mark.parametrize("override", ALL_OPTIONS)
def test_every_option_composes_and_every_key_is_known(override, tmp_path):
    cfg = make_cfg(override, *required_paths(override, tmp_path), f"run_dir={tmp_path / 'run'}")
    assert list(cfg.stages)
    # Every section, whatever the stages selected: a key no schema knows fails here.
    run_config(cfg)
    for name, schema in SHARED.items():
        parse(cfg[name], schema, name)
    for name in stages.ORDER:
        parse(cfg.stage[name], stages.load(name).config, f"stage.{name}")
    trainer_kwargs(cfg.trainer)
    assert set(cfg.stage) == set(stages.ORDER)
    for name in cfg.stages:  # and the checks across sections of the stages it runs
        workflow.check_stage(cfg, name)


def test_the_default_config_is_the_dataclass_defaults(monkeypatch):
    for var in TrackingConfig.ENV.values():  # a shell set up for MLflow changes these defaults
        monkeypatch.delenv(var, raising=False)
    cfg = make_cfg()
    composed, defaults = {}, {}
    for name, schema in SHARED.items():
        composed.update(flat(parse(cfg[name], schema, name), f"{name}."))
        defaults.update(flat(schema(), f"{name}."))
    for name in stages.ORDER:
        schema = stages.load(name).config
        composed.update(flat(parse(cfg.stage[name], schema, f"stage.{name}"), f"stage.{name}."))
        defaults.update(flat(schema(), f"stage.{name}."))
    assert set(composed) == set(defaults)
    changed = {k: v for k, v in composed.items() if v != defaults[k]}
    assert changed == DEFAULT_CHOICES
    # The stage list is written once: stages.ORDER.
    assert list(cfg.stages) == list(stages.ORDER) == list(cfg.stage)


def test_stage_defaults_live_in_the_dataclasses_only():
    assert not (conf_dir() / "stage").exists()
    primary = OmegaConf.load(conf_dir() / "config.yaml")
    assert "stages" not in primary and "stage" not in primary
    groups = [next(iter(d)) for d in primary.defaults if not isinstance(d, str)]
    assert "stage" not in groups and primary.defaults[0] == stages.DEFAULTS_NODE


@pytest.mark.parametrize(
    ("overrides", "key", "value"),
    [
        (["stage.distill.train.steps=5"], "stage.distill.train.steps", 5),
        (["quant=w2g64"], "quant.candidates", ["int2g64"]),
        (["quant=w2g64"], "quant.budget_bits", None),
        (["experiment=smoke"], "model.draft.hidden", 64),
        (["experiment=smoke", "stage.bootstrap.precision=bf16-mixed"], "stage.bootstrap.precision",
         "bf16-mixed"),
        (["tracking=none"], "tracking.enabled", False),
        (["data.chat_template=true"], "data.chat_template", True),
        (["stage.evaluate.lm_eval.gen_kwargs={max_gen_toks:64,until:[x]}"],
         "stage.evaluate.lm_eval.gen_kwargs.until", ["x"]),
        (["stage.evaluate.lm_eval.log_samples=true"], "stage.evaluate.lm_eval.log_samples", True),
    ],
)  # fmt: skip
def test_overrides_reach_the_parsed_config(overrides, key, value):
    cfg = make_cfg(*overrides)
    section, rest = key.split(".", 1)
    if section == "stage":
        name, field = rest.split(".", 1)
        got = flat(parse(cfg.stage[name], stages.load(name).config, f"stage.{name}"))[field]
    else:
        got = flat(parse(cfg[section], SHARED[section], section))[rest]
    assert got == value


def test_default_stage_order_is_the_canonical_one():
    cfg = make_cfg()
    assert list(cfg.stages) == [s for s in stages.ORDER if s in cfg.stages]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("quant.candidates=[int5g128]", "quant.candidates[0]"),
        ("quant.candidates=[int4g100]", "quant.candidates[0]"),
        ("quant.method=awq", "quant.method"),
        ("+quant.bogus=1", "quant.bogus"),
        ("model.target.path=/nonexistent/ckpt", "model.target.path"),
        ("data.path=/nonexistent/data.txt", "data.path"),
        ("stage.bootstrap.max_steps=-3", "stage.bootstrap.max_steps"),
        ("+stage.evaluate.gama=3", "stage.evaluate.gama"),
        ("stages=[evaluate,bootstrap]", "stages"),
        ("stages=[bootstrap,frobnicate]", "stages"),
        ("tracking.uri=mongodb://x", "tracking.uri"),
        ("seed=x", "seed"),
    ],
)
def test_invalid_values_name_the_key(override, key, tmp_path):
    cfg = make_cfg(override, f"run_dir={tmp_path}")
    with pytest.raises(ConfigError) as e:
        plan(cfg, tmp_path)
    assert f"`{key}`" in str(e.value)


def test_missing_upstream_stage_is_reported(tmp_path):
    cfg = make_cfg("stages=[evaluate]", f"run_dir={tmp_path}")
    with pytest.raises(ConfigError, match="add 'bootstrap' to stages"):
        plan(cfg, tmp_path)


def test_cli_rejects_bad_value_in_seconds_with_one_line(tmp_path):
    t0 = time.time()
    proc = subprocess.run(
        lowbit_cmd("quant.candidates=[int5g128]", f"run_dir={tmp_path / 'r'}"),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=CLI_TIMEOUT,
    )
    assert proc.returncode == 2
    assert time.time() - t0 < 60
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "config error" in ln]
    assert len(errors) == 1 and "quant.candidates[0]" in errors[0] and "int5g128" in errors[0]
    assert "Traceback" not in proc.stderr
    # Nothing was computed: only Hydra's own log folder may exist.
    assert [p.name for p in (tmp_path / "r").glob("*")] in ([], [".hydra"])


def test_cli_prints_the_composed_config_without_running(tmp_path):
    proc = subprocess.run(
        lowbit_cmd("--cfg", "job", "quant=w2g64", "stage.distill.train.steps=5"),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=CLI_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "steps: 5" in proc.stdout and "- int2g64" in proc.stdout
    assert "running" not in proc.stdout + proc.stderr
    # The schemas, as `--cfg job` shows them: every field of every section, each default printed
    # with its field's type (3.0, not 3, for a float).
    shown = OmegaConf.create(proc.stdout)
    schemas = {**SHARED, **{f"stage.{n}": stages.load(n).config for n in stages.ORDER}}
    for section, schema in schemas.items():
        printed = OmegaConf.select(shown, section)
        for field in dataclasses.fields(schema):
            value = OmegaConf.to_container(printed)[field.name]  # unresolved: ${oc.env:...}
            default = getattr(schema(), field.name)
            # an interpolated default (stage.reinforce.serve_temperature) is shown unresolved
            interpolated = isinstance(value, str) and value.startswith("${")
            key = f"{section}.{field.name}"
            if default is not None and key not in DEFAULT_CHOICES and not interpolated:
                want = dict if dataclasses.is_dataclass(default) else type(default)
                assert type(value) is want, (section, field.name, value)


@pytest.mark.parametrize(
    ("experiment", "target", "expect"),
    [
        ("gpu_8b", "llama3_8b", {"trainer.devices": 8, "trainer.accelerator": "gpu"}),
        ("npu_70b", "llama3_70b", {"trainer.num_nodes": 4, "stage.sensitivity.stream": True}),
    ],
)
def test_the_big_model_experiments_get_the_scaled_defaults(experiment, target, expect, tmp_path):
    assets = REPO / "tests" / "assets"
    (tmp_path / "c.txt").write_text("hello world\n")
    cfg = make_cfg(
        f"experiment={experiment}",
        f"model.target.path={assets / target}",
        f"model.draft.path={assets / 'llama3_1b'}",
        f"data.path={tmp_path / 'c.txt'}",
    )
    run = run_config(cfg)
    assert (run.quant.calib.samples, run.quant.calib.seq_len) == (128, 2048)
    assert run.trainer["precision"] == "auto"
    assert workflow.stage_config(cfg, "sensitivity")[0].stream is True
    for key, value in expect.items():
        assert OmegaConf.select(cfg, key) == value
