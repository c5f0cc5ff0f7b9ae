"""A sweep's summary: `lowbit -m` gives the sweep a parent MLflow run holding each point's run, and
after its last point a table (sweep.md, sweep.csv) and a Pareto plot (sweep.png) over the points,
a failed point in it with its status; `lowbit-sweep-summary DIR` rebuilds them."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline import sweep
from pipeline.tracking import MARKER
from tests.conftest import CLI_TIMEOUT, REPO, lowbit_cmd

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

WORDS = ["river", "stone", "cloud", "maple", "ember", "quartz", "violet", "harbor", "lantern",
         "meadow", "cobalt", "willow"]  # fmt: skip
LINES = [
    f"line {i} tells of the {WORDS[i % 12]} and the {WORDS[i * 5 % 12]}, then {WORDS[i * 7 % 12]}"
    for i in range(240)
]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """`lowbit -m ... quant.budget_bits=3,4,2` on a tiny HF target and draft: two points run
    sensitivity to evaluate (untimed: `measure` is tested on tokens/s below), the third asks
    for fewer bits than any candidate has and fails."""
    from pipeline.models.hf import train_tokenizer
    from tests.models.conftest import save_hf_checkpoint

    root = tmp_path_factory.mktemp("sweep")
    tok = train_tokenizer(LINES, 300)
    target = save_hf_checkpoint(root / "target", "llama", vocab=len(tok))
    draft = save_hf_checkpoint(root / "draft", "llama", seed=1, vocab=len(tok), layers=1)
    for ckpt in (target, draft):
        tok.save_pretrained(ckpt)
    data = root / "data"
    data.mkdir()
    (data / "train.txt").write_text("\n".join(LINES[:200]) + "\n")
    (data / "test.txt").write_text("\n".join(LINES[200:]) + "\n")
    args = [
        "-m", "experiment=smoke", "model=hf", f"model.target.path={target}",
        f"model.draft.path={draft}", "data=local", f"data.path={data}", "data.eval_seq_len=64",
        "stages=[sensitivity,allocate,quantize,evaluate]", "quant.candidates=[int2g32,int4g32]",
        "stage.evaluate.scenarios=[mix]", "stage.evaluate.timing=false",
        "stage.evaluate.adaptive=false", f"tracking.uri=sqlite:///{root / 'mlflow.db'}",
        f"tracking.artifact_location={root / 'artifacts'}", f"hydra.sweep.dir={root / 'sweep'}",
        "quant.budget_bits=3,4,2",
    ]  # fmt: skip
    proc = subprocess.run(
        lowbit_cmd(*args), cwd=root, env=ENV, capture_output=True, text=True, timeout=CLI_TIMEOUT
    )
    return {"root": root, "dir": root / "sweep", "proc": proc, "uri": f"sqlite:///{root}/mlflow.db"}


def read_csv(sweep_dir):
    with open(sweep_dir / "sweep.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_a_sweep_writes_a_row_per_point_and_nests_their_runs_under_its_own(swept):
    proc, sweep_dir = swept["proc"], swept["dir"]
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "[ERROR]" in line]
    # The failed point is its own line; the sweep went on and ends with the config error's code.
    assert proc.returncode == 2, out[-4000:]
    assert len(errors) == 2 and "quant.budget_bits" in errors[0], errors
    assert "1 of 3 sweep points did not finish (budget_bits=2: failed (exit 2))" in errors[1]
    rows = read_csv(sweep_dir)
    assert [(r["point"], r["quant.budget_bits"], r["status"]) for r in rows] == [
        ("0", "3", "finished"), ("1", "4", "finished"), ("2", "2", "failed (exit 2)"),
    ]  # fmt: skip
    low, high, failed = rows
    for row, budget in ((low, 3), (high, 4)):
        numbers = {k: float(row[k]) for k in ("bits", "ppl", "alpha")}
        assert 2.5 < numbers["bits"] <= budget and numbers["ppl"] > 1, row
        assert 0 <= numbers["alpha"] <= 1, row
        # A missing measurement is said, with why.
        assert row["tokens_per_s"] == ""
        assert row["note"] == "no tokens/s (stage.evaluate.timing=false)"
    assert float(low["bits"]) < float(high["bits"])
    # Fewer bits is never dominated; the other point is optimal where it does better.
    assert low["pareto"] == "ppl alpha"
    assert failed["bits"] == failed["ppl"] == failed["pareto"] == ""
    assert "achievable" in failed["note"]
    table = (sweep_dir / "sweep.md").read_text()
    assert table.count("\n| ") == 4 and "| 2 | 2 | - | - | - | - |  | failed (exit 2): " in table
    assert (sweep_dir / "sweep.png").stat().st_size > 10_000

    client = MlflowClient(swept["uri"])
    parent = json.loads((sweep_dir / MARKER).read_text())["run_id"]
    sweep_run = client.get_run(parent)
    assert sweep_run.info.status == "FAILED" and "mlflow.parentRunId" not in sweep_run.data.tags
    assert sweep_run.data.params["sweep.quant.budget_bits"] == "3,4,2"
    logged = {a.path for a in client.list_artifacts(parent)}
    assert {"sweep.md", "sweep.csv", "sweep.png"} <= logged
    exp = sweep_run.info.experiment_id
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent}'")
    points = {json.loads(Path(r["run_dir"], MARKER).read_text())["run_id"] for r in rows[:2]}
    assert {c.info.run_id for c in children} == points
    for child in children:  # each point's stages nest under its own run, as in a single run
        stages = client.search_runs([exp], f"tags.mlflow.parentRunId = '{child.info.run_id}'")
        assert sorted(s.info.run_name for s in stages) == [
            "allocate", "evaluate", "quantize", "sensitivity",
        ]  # fmt: skip


def test_a_point_is_measured_through_its_stages_types(tmp_path):
    """bits as quantized, the final target's ppl, the final draft's mean α, the pair's tokens/s;
    without a draft: no α, and tokens/s of the target decoding alone."""
    from pipeline.evaluation.result import EvalResult
    from pipeline.streaming.quant_report import QuantReport

    for stage in ("quantize", "evaluate"):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "_done.json").write_text("{}")
    QuantReport("gptq", 1, 1, 8, 64, 3, 3.25, 0.1, 0.2, {}).save(tmp_path / "quantize")
    ppl = {"target_fp": 10.0, "target_quantized": 12.0, "draft_fp": 20.0}
    acceptance = {
        "draft_fp@target_quantized": {"mix": 0.5, "rare": 0.3, "mean": 0.4},
        "draft_reinforced@target_quantized": {"mix": 0.7, "rare": 0.5, "mean": 0.6},
        "draft_reinforced@target_fp": {"mix": 0.9, "mean": 0.9},
    }
    speed = {
        "plain": {"target_quantized": {"tokens_per_s": 50.0}},
        "speculative": {"draft_reinforced@target_quantized": {"tokens_per_s": 80.0}},
    }
    EvalResult(ppl, acceptance=acceptance, speed=speed).save(tmp_path / "evaluate")
    values, missing = sweep.measure(tmp_path)
    assert values == {"bits": 3.25, "ppl": 12.0, "alpha": 0.6, "tokens_per_s": 80.0}
    assert missing == []
    EvalResult(ppl, speed=speed).save(tmp_path / "evaluate")
    values, missing = sweep.measure(tmp_path)
    assert (values["alpha"], values["tokens_per_s"], missing) == (None, 50.0, ["α (no draft)"])


def test_the_summary_is_rebuilt_from_the_sweep_dir(swept):
    sweep_dir = swept["dir"]
    before = read_csv(sweep_dir)
    for name in sweep.OUTPUTS:
        (sweep_dir / name).unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.sweep", str(sweep_dir)],
        env=ENV, capture_output=True, text=True, timeout=CLI_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_csv(sweep_dir) == before
    assert proc.stdout == (sweep_dir / "sweep.md").read_text()
    assert (sweep_dir / "sweep.png").is_file()


def test_a_dir_that_is_no_sweep_is_one_line(tmp_path, caplog):
    assert sweep.main([str(tmp_path)]) == 2
    assert f"{tmp_path} holds no sweep points" in caplog.text


@pytest.mark.parametrize(
    "points, lower, optimal",
    [
        ([(2.5, 30.0), (3.0, 20.0), (4.0, 25.0)], True, [True, True, False]),
        ([(2.5, 0.5), (3.0, 0.4), (4.0, 0.7)], False, [True, False, True]),
        ([(3.0, 1.0), (3.0, 1.0)], True, [True, True]),  # equal points dominate neither
    ],
)
def test_pareto_keeps_the_points_no_other_dominates(points, lower, optimal):
    assert sweep.pareto(points, lower) == optimal
