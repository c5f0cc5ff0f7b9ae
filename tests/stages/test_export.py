"""The export stage through the workflow, and its config validation."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline import workflow
from pipeline.errors import ConfigError
from tests.conftest import smoke_cfg
from tests.stages.conftest import boot_cfg

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow  # the workflow with MLflow tracking, quantize and export: ~20-30 s on 2 cores
def test_export_stage_end_to_end(boot, tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline.models.quantized import load_quantized
    from pipeline.runtime import load

    cfg = boot_cfg(
        boot,
        tmp_path,
        "stages=[bootstrap,quantize,export]",
        "quant=w4g128",
        "quant.method=rtn",
        "tracking.enabled=true",
        "stage.export.float_dtype=keep",
        "stage.export.shard_bytes=20000",
    )
    done = workflow.run(cfg)["export"]
    run_dir = tmp_path / "run"
    art = run_dir / "export" / "artifact"
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["format"] == "lowbit" and manifest["draft"]["path"] == "draft"
    assert len(manifest["layers"]) == 14  # 2 blocks x 7 linears, all int4 (per channel here)
    assert {d["type"] for d in manifest["layers"].values()} == {"W4A16"}
    assert (art / "quant_model_weights.safetensors.index.json").is_file()  # sharded
    assert done["metrics"]["weights_bytes"] < done["metrics"]["fp16_bytes"]
    summary = json.loads((run_dir / "export" / "export.json").read_text())
    assert summary["source"].endswith("quantize/model")
    assert summary["draft"].endswith("bootstrap/draft")

    rt = load(art, "torch", kernel="reference")  # bit-exact with the fake-quant model
    x = torch.randint(0, 400, (2, 16))
    with torch.no_grad():
        got = rt.model(input_ids=x).logits
        ref = load_quantized(run_dir / "quantize" / "model")(input_ids=x).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    spec = rt.generate("Once upon a time", 16)
    assert spec.stats.drafted > 0
    assert spec.tokens == rt.generate("Once upon a time", 16, speculative=False).tokens

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    versions = client.search_model_versions("name='smoke-lowbit'")
    assert len(versions) == 1
    run_id = versions[0].run_id
    logged = {f.path for f in client.list_artifacts(run_id, "artifact")}
    assert "artifact/manifest.json" in logged
    assert client.get_run(run_id).data.tags["lowbit.stage"] == "export"


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        (["stage.export.format=ascend", "quant=w2g64"], "stage.export.widen=true"),
        (["stage.export.format=ascend", "stage.export.widen=true", "quant=e4g128"], "quant=w4g128"),
        (["stage.export.format=compressed-tensors", "quant=w3g128"], "int4 and int8"),
        (["stage.export.format=ascend", "quant.candidates=[int4g32]"], "group sizes"),
        (
            [
                "stage.export.format=ascend",
                "quant.candidates=[int4g64,int4g128,int8]",
                "quant.budget_bits=4.5",
            ],
            "one int4 group size",
        ),
        (["stage.export.format=onnx"], "compressed-tensors"),
        (["stage.export.shard_bytes=0"], "> 0"),
    ],
)
def test_check_refuses_what_the_format_cannot_hold(tmp_path, overrides, fix):
    cfg = smoke_cfg(tmp_path, "tracking=none", *overrides)
    with pytest.raises(ConfigError, match="stage.export"):
        workflow.check_stage(cfg, "export")
    with pytest.raises(ConfigError) as err:
        workflow.check_stage(cfg, "export")
    assert fix in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["stage.export.format=ascend", "quant=w4g128"],
        ["stage.export.format=ascend", "quant.candidates=[int4g128,int8]", "quant.budget_bits=5"],
        ["stage.export.format=ascend", "stage.export.widen=true", "quant=w3g128"],
        ["stage.export.format=compressed-tensors", "quant=w8"],
        ["quant=e4g128"],  # the default lowbit format holds everything
    ],
)
def test_check_accepts(tmp_path, overrides):
    workflow.check_stage(smoke_cfg(tmp_path, "tracking=none", *overrides), "export")
