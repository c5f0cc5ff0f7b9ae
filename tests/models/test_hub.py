"""Hub ids as model paths: read from the local HF cache that HF_HOME names, never downloaded, and
pinned to the cached commit so that a stage's fingerprint follows the snapshot."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline import runmodels
from pipeline.config import DataConfig, model_cfg, run_config
from pipeline.errors import LowbitError
from pipeline.inputs import check_inputs
from pipeline.models.hf import load_causal_lm
from pipeline.stageplan import fingerprint
from pipeline.workflow import make_stage
from tests.conftest import CLI_TIMEOUT, lowbit_cmd, make_cfg, put_in_hub_cache

SHA1, SHA2 = "a1" * 20, "b2" * 20  # commit hashes as the hub writes them: 40 hex digits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny HF llama and its tokenizer, as save_pretrained writes them."""
    from pipeline.models.hf import train_tokenizer
    from tests.models.conftest import save_hf_checkpoint

    lines = [f"line {i} of the tiny corpus, river stone cloud {i % 7}" for i in range(60)]
    tok = train_tokenizer(lines, 300)
    ckpt = save_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", "llama", vocab=len(tok))
    tok.save_pretrained(ckpt)
    return ckpt


def models(*overrides: str):
    return model_cfg(make_cfg("model=hf", *overrides))


def test_a_hub_id_is_read_from_the_cache_hf_home_names(tiny, hf_home):
    from huggingface_hub import scan_cache_dir

    snapshot = put_in_hub_cache(tiny, hf_home / "hub", "org/tiny", SHA1)
    (repo,) = scan_cache_dir(hf_home / "hub").repos  # huggingface_hub reads the layout as its own
    assert repo.repo_id == "org/tiny" and [r.commit_hash for r in repo.revisions] == [SHA1]

    model = models("model.target.path=org/tiny", "model.draft.path=org/tiny")
    assert model.target.revision == model.draft.revision == SHA1
    assert runmodels.fp_target(model, {}) == runmodels.fp_draft(model, {}) == snapshot
    check_inputs(model, DataConfig())  # headers and tokenizer, read through the cache's links
    loaded = load_causal_lm(runmodels.fp_target(model, {})).state_dict()
    assert all(torch.equal(t, loaded[k]) for k, t in load_causal_lm(tiny).state_dict().items())


def test_a_local_directory_of_the_same_name_wins(tiny, hf_home, tmp_path, monkeypatch):
    put_in_hub_cache(tiny, hf_home / "hub", "org/tiny", SHA1)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny, tmp_path / "org" / "tiny")
    model = models("model.target.path=org/tiny")
    assert model.target.revision is None
    assert runmodels.fp_target(model, {}) == Path("org/tiny")


def test_fingerprints_follow_the_snapshot_not_where_the_cache_is(tiny, hf_home, tmp_path):
    import huggingface_hub.constants as hub

    put_in_hub_cache(tiny, hf_home / "hub", "org/tiny", SHA1)

    def quantize_fingerprint(*overrides: str) -> str:
        cfg = make_cfg("model=hf", "model.target.path=org/tiny", *overrides)
        stage = make_stage(cfg, "quantize", run_config(cfg))
        recorded = stage.config_record()["run"]["model"]["target"]  # what a dry run compares
        assert recorded["path"] == "org/tiny" and recorded["revision"] in (SHA1, SHA2)
        return fingerprint(stage, {})

    first = quantize_fingerprint()
    assert quantize_fingerprint() == first
    moved = tmp_path / "elsewhere"
    shutil.copytree(hf_home / "hub", moved, symlinks=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hub, "HF_HUB_CACHE", str(moved))
        assert quantize_fingerprint() == first  # the same snapshot from another cache
    put_in_hub_cache(tiny, hf_home / "hub", "org/tiny", SHA2)  # a newer download moves main
    assert quantize_fingerprint() != first
    assert quantize_fingerprint(f"model.target.revision={SHA1}") == first


def one_line(*overrides: str) -> str:
    with pytest.raises(LowbitError) as info:
        models(*overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_an_id_not_in_the_cache_is_one_line_naming_the_download(tiny, hf_home):
    put_in_hub_cache(tiny, hf_home / "hub", "org/tiny", SHA1)
    message = one_line("model.target.path=org/absent")
    assert message.startswith("model.target.path=org/absent is not a local directory")
    assert str(hf_home / "hub") in message and "`hf download org/absent`" in message
    assert "`hf download org/absent --local-dir DIR` and set model.target.path=DIR" in message
    message = one_line("model.target.path=org/tiny", "model.target.revision=v2")
    assert "at revision v2" in message and "`hf download org/tiny --revision v2`" in message


def test_a_revision_needs_a_hub_id(tiny, tmp_path):
    message = one_line(f"model.target.path={tiny}", "model.target.revision=v2")
    assert "model.target.revision" in message and "local directory" in message


def test_lowbit_reads_the_cache_of_the_hf_home_it_starts_with(tiny, tmp_path):
    home = tmp_path / "hf"
    put_in_hub_cache(tiny, home / "hub", "org/tiny", SHA1)
    unset = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
    env = {k: v for k, v in os.environ.items() if k not in unset} | {"HF_HOME": str(home)}
    args = ("--dry-run", "model=hf", "model.target.path=org/tiny", "tracking=none")
    proc = subprocess.run(
        lowbit_cmd(*args, f"run_dir={tmp_path / 'run'}"), cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=CLI_TIMEOUT,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"model.target.path=org/tiny: the cached snapshot {home / 'hub'}" in out
    assert "quantize" in out and "will run" in out
