"""The workflow engine: fingerprints, skip/resume/invalidation, atomic stage folders.

The engine is exercised with small stand-in stage modules (the real stages are covered by the
smoke workflow test); they write files and count their runs.
"""

from __future__ import annotations

import json
import types

import pytest

from pipeline import stages, workflow
from tests.conftest import make_cfg

CALLS: list[str] = []


def toy(name, needs=(), keys=(), fail=None):
    def run(ctx):
        CALLS.append(name)
        (ctx.out_dir / "out.txt").write_text(f"{name} {sorted(ctx.inputs)}")
        if fail and fail(ctx):
            raise RuntimeError(f"{name} crashed")
        return {"value": len(CALLS)}

    return types.SimpleNamespace(
        NEEDS=needs, USES=(), KEYS=keys, DISTRIBUTED=False, validate=lambda cfg: None, run=run
    )


@pytest.fixture
def toy_stages(monkeypatch):
    CALLS.clear()
    mods = {
        "bootstrap": toy("bootstrap", keys=("model",)),
        "sensitivity": toy("sensitivity", needs=("bootstrap",), keys=("quant",)),
        "evaluate": toy("evaluate", needs=("sensitivity",), keys=("data",)),
    }
    monkeypatch.setattr(stages, "load", lambda n: mods[n])
    return mods


def cfg(tmp_path, *over):
    return make_cfg(
        "stages=[bootstrap,sensitivity,evaluate]", f"run_dir={tmp_path}", "tracking=none", *over
    )


def test_rerun_skips_finished_stages(toy_stages, tmp_path):
    workflow.run(cfg(tmp_path))
    assert CALLS == ["bootstrap", "sensitivity", "evaluate"]
    done = json.loads((tmp_path / "sensitivity" / "_done.json").read_text())
    assert set(done) >= {"fingerprint", "metrics", "outputs", "timings"}
    assert len(done["outputs"]["out.txt"]["sha256"]) == 64
    workflow.run(cfg(tmp_path))
    assert CALLS == ["bootstrap", "sensitivity", "evaluate"]


def test_config_change_reruns_the_stage_and_downstream(toy_stages, tmp_path):
    workflow.run(cfg(tmp_path))
    CALLS.clear()
    workflow.run(cfg(tmp_path, "quant.budget_bits=2.5"))
    assert CALLS == ["sensitivity", "evaluate"]
    CALLS.clear()
    workflow.run(cfg(tmp_path, "quant.budget_bits=2.5", "data.eval_windows=3"))
    assert CALLS == ["evaluate"]


def test_force_reruns_chosen_stages(toy_stages, tmp_path):
    workflow.run(cfg(tmp_path))
    CALLS.clear()
    workflow.run(
        make_cfg("stages=[evaluate]", f"run_dir={tmp_path}", "tracking=none", "force=true")
    )
    assert CALLS == ["evaluate"]


def test_crash_keeps_earlier_stages_and_leaves_no_partial_folder(toy_stages, tmp_path):
    toy_stages["sensitivity"].run = toy("sensitivity", fail=lambda ctx: True).run
    with pytest.raises(RuntimeError, match="sensitivity crashed"):
        workflow.run(cfg(tmp_path))
    assert (tmp_path / "bootstrap" / "_done.json").exists()
    assert not (tmp_path / "sensitivity").exists()
    assert not list(tmp_path.glob(".sensitivity.tmp*"))
    # The next run resumes at the crashed stage.
    toy_stages["sensitivity"].run = toy("sensitivity").run
    CALLS.clear()
    workflow.run(cfg(tmp_path))
    assert CALLS == ["sensitivity", "evaluate"]


def test_failed_rerun_keeps_the_previous_result(toy_stages, tmp_path):
    workflow.run(cfg(tmp_path))
    before = (tmp_path / "evaluate" / "_done.json").read_text()
    toy_stages["evaluate"].run = toy("evaluate", fail=lambda ctx: True).run
    with pytest.raises(RuntimeError):
        workflow.run(cfg(tmp_path, "data.eval_windows=5"))
    assert (tmp_path / "evaluate" / "_done.json").read_text() == before
