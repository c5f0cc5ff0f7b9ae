"""The workflow engine: fingerprints, skip/resume/invalidation, atomic stage folders.

The engine is exercised with small stand-in stage modules (the real stages are covered by the
smoke workflow test); they write files and count their runs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeline import stages, workflow
from pipeline.errors import ConfigError, LowbitError, StageFailed
from tests.conftest import make_cfg

CALLS: list[str] = []


def toy(name, needs=(), sections=(), fail=None):
    """A stand-in for stage `name` with the real one's config schema."""

    def run(cfg, run, io):
        CALLS.append(name)
        (io.out_dir / "out.txt").write_text(f"{name} {sorted(io.inputs)}")
        if fail and fail(io):
            raise RuntimeError(f"{name} crashed")
        return {"value": len(CALLS)}

    return stages.Stage(config=REAL[name].config, run=run, sections=sections, needs=needs)


REAL = {name: stages.load(name) for name in ("bootstrap", "sensitivity", "evaluate")}


@pytest.fixture
def toy_stages(monkeypatch):
    CALLS.clear()
    mods = {
        "bootstrap": toy("bootstrap", sections=("model",)),
        "sensitivity": toy("sensitivity", needs=("bootstrap",), sections=("quant",)),
        "evaluate": toy("evaluate", needs=("sensitivity",), sections=("data",)),
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


def test_a_stage_gets_its_parsed_config_and_only_its_sections(toy_stages, tmp_path):
    seen = {}

    def run(cfg, run, io):
        seen.update(cfg=cfg, run=run, io=io)
        return {}

    toy_stages["sensitivity"] = dataclasses.replace(toy_stages["sensitivity"], run=run)
    workflow.run(cfg(tmp_path, "stage.sensitivity.batch_size=3"))
    assert isinstance(seen["cfg"], REAL["sensitivity"].config) and seen["cfg"].batch_size == 3
    got = seen["run"]
    assert got.seed == 0 and got.quant.budget_bits == 3.0
    assert got.model is None and got.data is None and got.trainer is None and got.name is None
    assert seen["io"].inputs == {"bootstrap": tmp_path / "bootstrap"}
    assert seen["io"].describe(tmp_path / "sensitivity" / "x") == "sensitivity/x"


def test_the_fingerprint_hashes_parsed_values_of_the_sections_read(toy_stages, tmp_path):
    workflow.run(cfg(tmp_path))
    CALLS.clear()
    # The same parsed values (3 is 3.0), and sections no stage here reads: nothing reruns.
    workflow.run(cfg(tmp_path, "quant.budget_bits=3", "trainer.devices=1", "name=other"))
    assert CALLS == []
    workflow.run(cfg(tmp_path, "stage.evaluate.gamma=2"))
    assert CALLS == ["evaluate"]


def test_data_chat_template_moves_the_fingerprint_of_every_stage_that_reads_the_corpus():
    from pipeline.config import run_config
    from pipeline.stageplan import fingerprint

    def fingerprints(*overrides: str) -> dict[str, str]:
        composed = make_cfg(*overrides)
        run = run_config(composed)
        return {n: fingerprint(workflow.make_stage(composed, n, run), {}) for n in composed.stages}

    off, on = fingerprints(), fingerprints("data.chat_template=true")
    moved = {name for name in off if on[name] != off[name]}
    assert moved >= {"sensitivity", "quantize", "distill", "reinforce", "evaluate"}
    assert not moved & {"allocate", "export"}  # they read no text


def test_a_stage_listing_fields_gets_only_those_and_reruns_only_for_them(toy_stages, tmp_path):
    seen = {}

    def run(cfg, run, io):
        seen["run"] = run
        return {}

    toy_stages["sensitivity"] = dataclasses.replace(
        toy_stages["sensitivity"], sections=("quant.candidates", "quant.calib"), run=run
    )
    workflow.run(cfg(tmp_path))
    q = seen["run"].quant
    assert q.calib.samples == 64 and len(q.candidates) > 1
    with pytest.raises(AttributeError, match="quant.budget_bits is not in the stage's sections"):
        q.budget_bits  # noqa: B018
    CALLS.clear()
    workflow.run(cfg(tmp_path, "quant.budget_bits=2.5"))
    assert CALLS == []
    workflow.run(cfg(tmp_path, "quant.calib.samples=8"))
    assert CALLS == ["evaluate"]


def test_check_and_skip_reason_get_the_parsed_config(toy_stages, tmp_path):
    def check(cfg, run):
        if run.quant.budget_bits < 2:
            raise ConfigError("quant.budget_bits", "is too low for this toy")

    toy_stages["sensitivity"] = dataclasses.replace(toy_stages["sensitivity"], check=check)
    toy_stages["evaluate"] = dataclasses.replace(
        toy_stages["evaluate"], skip_reason=lambda cfg, run: f"gamma is {cfg.gamma}"
    )
    with pytest.raises(ConfigError, match="too low"):
        workflow.run(cfg(tmp_path, "quant.budget_bits=1.5"))
    assert CALLS == []
    done = workflow.run(cfg(tmp_path, "stage.evaluate.gamma=3"))
    assert CALLS == ["bootstrap", "sensitivity"] and "evaluate" not in done


def test_force_reruns_chosen_stages(toy_stages, tmp_path):
    workflow.run(cfg(tmp_path))
    CALLS.clear()
    workflow.run(
        make_cfg("stages=[evaluate]", f"run_dir={tmp_path}", "tracking=none", "force=true")
    )
    assert CALLS == ["evaluate"]


def test_crash_keeps_earlier_stages_and_leaves_no_partial_folder(toy_stages, tmp_path):
    toy_stages["sensitivity"] = dataclasses.replace(
        toy_stages["sensitivity"], run=toy("sensitivity", fail=lambda io: True).run
    )
    with pytest.raises(StageFailed, match="sensitivity failed: RuntimeError: sensitivity crashed"):
        workflow.run(cfg(tmp_path))
    assert (tmp_path / "bootstrap" / "_done.json").exists()
    assert not (tmp_path / "sensitivity").exists()
    assert not list(tmp_path.glob(".sensitivity.tmp*"))
    # The next run resumes at the crashed stage.
    toy_stages["sensitivity"] = dataclasses.replace(
        toy_stages["sensitivity"], run=toy("sensitivity").run
    )
    CALLS.clear()
    workflow.run(cfg(tmp_path))
    assert CALLS == ["sensitivity", "evaluate"]


def test_failed_rerun_keeps_the_previous_result(toy_stages, tmp_path):
    workflow.run(cfg(tmp_path))
    before = (tmp_path / "evaluate" / "_done.json").read_text()
    toy_stages["evaluate"] = dataclasses.replace(
        toy_stages["evaluate"], run=toy("evaluate", fail=lambda io: True).run
    )
    with pytest.raises(StageFailed):
        workflow.run(cfg(tmp_path, "data.eval_windows=5"))
    assert (tmp_path / "evaluate" / "_done.json").read_text() == before


def test_a_crash_is_one_line_and_its_traceback_is_in_the_stage_log(toy_stages, tmp_path, caplog):
    caplog.set_level("INFO")  # as the CLI's logging config does
    toy_stages["sensitivity"] = dataclasses.replace(
        toy_stages["sensitivity"], run=toy("sensitivity", fail=lambda io: True).run
    )
    with pytest.raises(StageFailed) as err:
        workflow.run(cfg(tmp_path))
    line = str(err.value)
    log_file = tmp_path / "logs" / "sensitivity.log"
    assert "\n" not in line and str(log_file) in line
    text = log_file.read_text()
    assert "Traceback (most recent call last)" in text and "sensitivity crashed" in text
    assert "sensitivity  running" in text  # the stage's own log records are there too


def _damage(path):
    """Flip one byte in place, keeping the size (and, below, the mtime) of the file."""
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    stat = path.stat()
    path.write_bytes(bytes(data))
    return stat


def test_a_damaged_stage_is_named_and_rerun_and_readers_are_not(toy_stages, tmp_path, caplog):
    workflow.run(cfg(tmp_path))
    _damage(tmp_path / "sensitivity" / "out.txt")
    CALLS.clear()
    workflow.run(cfg(tmp_path))
    # Deterministic stage: the same bytes again, so evaluate's fingerprint did not move.
    assert CALLS == ["sensitivity"]
    assert "sensitivity/out.txt changed since it was written" in caplog.text
    assert (tmp_path / "sensitivity" / "out.txt").read_text().startswith("sensitivity")


def test_a_damaged_upstream_outside_the_run_is_repaired(toy_stages, tmp_path):
    workflow.run(cfg(tmp_path))
    only_evaluate = make_cfg("stages=[evaluate]", f"run_dir={tmp_path}", "tracking=none")
    (tmp_path / "bootstrap" / "out.txt").unlink()
    CALLS.clear()
    workflow.run(only_evaluate)
    assert CALLS == []  # evaluate reads sensitivity only: bootstrap is not its concern
    (tmp_path / "sensitivity" / "out.txt").unlink()
    workflow.run(only_evaluate)
    # sensitivity is repaired, and first what it reads; evaluate's inputs came back the same.
    assert CALLS == ["bootstrap", "sensitivity"]


def test_no_repair_stops_with_one_line_naming_the_file(toy_stages, tmp_path):
    workflow.run(cfg(tmp_path))
    (tmp_path / "bootstrap" / "out.txt").write_text("x")
    CALLS.clear()
    with pytest.raises(LowbitError, match="bootstrap/out.txt has 1 bytes") as err:
        workflow.run(cfg(tmp_path, "repair=false"))
    assert "\n" not in str(err.value) and CALLS == []


def test_verify_hashes_files_whose_size_and_mtime_look_unchanged(toy_stages, tmp_path):
    import os

    workflow.run(cfg(tmp_path))
    out = tmp_path / "evaluate" / "out.txt"
    st = _damage(out)
    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
    CALLS.clear()
    workflow.run(cfg(tmp_path))
    assert CALLS == []  # the cheap check trusts size + mtime
    workflow.run(cfg(tmp_path, "verify=true"))
    assert CALLS == ["evaluate"]


def test_a_second_process_on_the_run_dir_is_refused(toy_stages, tmp_path):
    from pipeline.rundir import RunLock

    holder = RunLock(tmp_path)
    holder.acquire()
    try:
        with pytest.raises(LowbitError, match=r"is in use by pid \d+ on "):
            workflow.run(cfg(tmp_path))
        assert CALLS == []
    finally:
        holder.release()
    workflow.run(cfg(tmp_path))  # released: the next run owns it
    assert CALLS == ["bootstrap", "sensitivity", "evaluate"]


def test_a_mixed_recipe_without_a_bit_plan_is_refused(tmp_path):
    c = make_cfg("stages=[bootstrap,quantize,evaluate]", f"run_dir={tmp_path}", "tracking=none")
    with pytest.raises(ConfigError, match="no bit plan exists") as err:
        workflow.plan(c, tmp_path)
    assert "add sensitivity and allocate" in str(err.value)
    workflow.plan(make_cfg("stages=[bootstrap,quantize]", "quant=w3g128"), tmp_path)


def _tree(root):
    """Every file and folder under `root` with its size and mtime: what a dry run must not move."""
    return {
        p.relative_to(root): (p.is_dir() or p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
    }


def _verdicts(c):
    """{stage: (action, why)} of a dry run of the composed config `c`."""
    steps = workflow.preview(c, workflow.plan(c, Path(c.run_dir)))
    return {s.stage.name: (s.action, s.why) for s in steps}


def test_a_dry_run_names_each_stage_and_why_and_touches_nothing(toy_stages, tmp_path):
    workflow.run(cfg(tmp_path))
    CALLS.clear()
    before = _tree(tmp_path)
    got = _verdicts(cfg(tmp_path))
    assert {a for a, _ in got.values()} == {"up to date"}
    # One stage's key changed: that stage, then the stages reading it (it would rerun first).
    got = _verdicts(cfg(tmp_path, "quant.budget_bits=2.5"))
    assert got["bootstrap"][0] == "up to date"
    assert got["sensitivity"] == ("will run", "config changed: quant.budget_bits 3.0 -> 2.5")
    assert got["evaluate"] == ("will run", "(after sensitivity reruns)")
    # The stage's own key; then an unfinished stage.
    got = _verdicts(cfg(tmp_path, "stage.evaluate.gamma=2"))
    assert CALLS == [] and _tree(tmp_path) == before
    (tmp_path / "sensitivity" / "_done.json").unlink()
    got = _verdicts(cfg(tmp_path))
    assert got["sensitivity"] == ("will run", "no finished outputs")
    # Its fingerprint is the one evaluate read: the same bytes again would leave evaluate alone.
    assert got["evaluate"] == ("may run", "if sensitivity reruns with different outputs")


def test_a_dry_run_says_a_reader_of_a_repaired_stage_may_run(toy_stages, tmp_path):
    workflow.run(cfg(tmp_path))
    (tmp_path / "sensitivity" / "out.txt").unlink()
    got = _verdicts(cfg(tmp_path))
    assert got["sensitivity"][0] == "will run" and "outputs damaged" in got["sensitivity"][1]
    # Same fingerprint again: evaluate reruns only if sensitivity writes different bytes.
    assert got["evaluate"] == ("may run", "if sensitivity reruns with different outputs")
    got = _verdicts(cfg(tmp_path, "force=true"))
    assert {a for a, _ in got.values()} == {"will run"}
    assert not (tmp_path / "sensitivity" / "out.txt").exists()  # not repaired by a dry run


def test_a_rerun_logs_why_the_stage_runs(toy_stages, tmp_path, caplog):
    caplog.set_level("INFO")
    workflow.run(cfg(tmp_path))
    done = json.loads((tmp_path / "sensitivity" / "_done.json").read_text())
    assert done["config"]["run"]["quant"]["budget_bits"] == 3.0
    workflow.run(cfg(tmp_path, "quant.budget_bits=2.5"))
    assert "config changed: quant.budget_bits 3.0 -> 2.5" in caplog.text
    assert "evaluate     running" in caplog.text and "input sensitivity changed" in caplog.text


def test_switches_must_be_booleans(tmp_path):
    with pytest.raises(ConfigError, match=r"`dry_run` must be a boolean, got 'no'"):
        workflow.plan(cfg(tmp_path, "dry_run=no"), tmp_path)


def test_each_stage_reports_its_own_peak_memory_and_device(toy_stages, tmp_path, caplog):
    import torch

    def hungry(cfg, run, io):
        block = torch.ones(64 * 2**20)  # 256 MiB, touched
        (io.out_dir / "out.txt").write_text(str(float(block.sum())))
        return {}

    toy_stages["bootstrap"] = dataclasses.replace(toy_stages["bootstrap"], run=hungry)
    caplog.set_level("INFO")
    done = workflow.run(cfg(tmp_path))
    peaks = {s: done[s]["metrics"]["peak_rss_mib"] for s in ("bootstrap", "sensitivity")}
    # The high-water mark is reset per stage: the stage after the hungry one does not inherit it.
    assert peaks["bootstrap"] - peaks["sensitivity"] > 200, peaks
    assert "bootstrap    running (fingerprint " in caplog.text and ") on cpu (" in caplog.text
    assert "| peak_rss 0." in caplog.text or "| peak_rss 1." in caplog.text


KEPT: list = []  # small tensors that outlive their stage, as caches and module state do


def test_heap_a_stage_freed_is_not_in_the_next_stages_peak(toy_stages, tmp_path):
    import torch

    def fragmenting(cfg, run, io):
        torch.ones(4 * 2**20)  # freeing 16 MiB raises glibc's mmap threshold past 1 MiB
        blocks = []
        for _ in range(400):  # 400 MiB on the heap, each block pinned below a small survivor
            blocks.append(torch.ones(2**18))
            KEPT.append(torch.ones(16))
        (io.out_dir / "out.txt").write_text(str(sum(float(b[0]) for b in blocks)))
        return {}

    toy_stages["bootstrap"] = dataclasses.replace(toy_stages["bootstrap"], run=fragmenting)
    done = workflow.run(cfg(tmp_path))
    peaks = {s: done[s]["metrics"]["peak_rss_mib"] for s in ("bootstrap", "sensitivity")}
    # The freed blocks stay resident in glibc's arenas until they are trimmed at the next start.
    assert peaks["bootstrap"] - peaks["sensitivity"] > 300, peaks
