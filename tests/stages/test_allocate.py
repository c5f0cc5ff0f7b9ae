"""allocate: config-time budget checks and the stage in a workflow (plans: tests/quant)."""

from __future__ import annotations

import json
import math

import pytest

from pipeline import workflow
from pipeline.config import quant_cfg
from pipeline.errors import ConfigError
from pipeline.quant.plan import BitPlan
from tests.conftest import make_cfg
from tests.stages.conftest import boot_cfg


@pytest.mark.parametrize(("budget", "fails"), [("2.1", True), ("2.2", False)])
def test_check_refuses_the_budget_from_config_alone(budget, fails):
    # the default candidates' cheapest, int2g128, costs 2 + 18/128 = 2.140625 bits per weight,
    # printed rounded up
    cfg = make_cfg(f"quant.budget_bits={budget}")
    if fails:
        with pytest.raises(ConfigError, match=r"quant\.budget_bits.*2\.1407"):
            workflow.check_stage(cfg, "allocate")
    else:
        workflow.check_stage(cfg, "allocate")


def test_check_reads_shapes_of_a_user_checkpoint(tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 50,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = make_cfg(
        "model=hf",
        f"model.target.path={tmp_path}",
        "quant.candidates=[int4g64]",
        "quant.budget_bits=4.2",
    )
    # in=96: two groups of 64 -> (4*96 + 20*2)/96 bits on q,k,v,o,gate,up (67584 weights);
    # in=160: (4*160 + 20*3)/160 on down (15360); lm_head and embeddings stay float
    minimum = (67584 * (4 * 96 + 40) / 96 + 15360 * (4 * 160 + 60) / 160) / (67584 + 15360)
    with pytest.raises(ConfigError, match=f"minimum achievable: {math.ceil(minimum * 1e4) / 1e4}"):
        workflow.check_stage(cfg, "allocate")


def test_uniform_workflow_skips_sensitivity(boot, tmp_path):
    cfg = boot_cfg(boot, tmp_path, "stages=[bootstrap,sensitivity,allocate]", "quant=w4g128")
    done = workflow.run(cfg)
    assert "sensitivity" not in done
    plan = BitPlan.load(tmp_path / "run" / "allocate")
    formats = {
        f.name for n, f in plan.layers.items() if not n.endswith(("lm_head", "embed_tokens"))
    }
    assert formats == {"int4g128"}
    assert (tmp_path / "run" / "allocate" / "bits_per_layer.png").stat().st_size > 0


def test_feedback_slack_is_checked_against_the_cheapest_plan():
    # planned at 2.5 - 0.4 = 2.1 bits, below int2g128's 2.140625: the slack is the key to fix
    with pytest.raises(ConfigError, match=r"quant\.feedback\.slack_bits.*<= 0\.359"):
        workflow.check_stage(make_cfg("quant.budget_bits=2.5", "quant.feedback.slack_bits=0.4"),
                             "allocate")  # fmt: skip
    with pytest.raises(ConfigError, match=r"quant\.feedback\.slack_bits.*one candidate"):
        quant_cfg(make_cfg("quant=w4g128", "quant.feedback.slack_bits=0.1"))
