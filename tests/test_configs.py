"""Every config option composes and validates; bad values fail early with one clear message."""

from __future__ import annotations

import subprocess
import time

import pytest

from pipeline import conf_dir, stages
from pipeline.errors import ConfigError
from pipeline.workflow import plan
from tests.conftest import lowbit_cmd, make_cfg

GROUPS = ["model", "data", "quant", "trainer", "cluster", "tracking", "experiment"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "override",
    [f"{g}={o}" for g in GROUPS for o in options(g)],
)
def test_every_option_composes_and_validates(override, tmp_path):
    extra = []
    if override in ("model=hf",):
        extra.append(f"model.target.path={tmp_path}")
    if override in ("data=local",):
        (tmp_path / "c.txt").write_text("hello world\n")
        extra.append(f"data.path={tmp_path / 'c.txt'}")
    cfg = make_cfg(override, *extra, f"run_dir={tmp_path / 'run'}")
    assert list(cfg.stages)
    for name in cfg.stages:
        stages.load(name).validate(cfg)


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
        ("tracking.uri=mysql://x", "tracking.uri"),
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
    )
    assert proc.returncode == 2
    assert time.time() - t0 < 60
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "config error" in ln]
    assert len(errors) == 1 and "quant.candidates[0]" in errors[0] and "int5g128" in errors[0]
    assert "Traceback" not in proc.stderr
    # Nothing was computed: only Hydra's own log folder may exist.
    assert [p.name for p in (tmp_path / "r").glob("*")] in ([], [".hydra"])
