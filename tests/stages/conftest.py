"""Stage tests share one set of smoke bootstrap models per session."""

from __future__ import annotations

import pytest

from pipeline import workflow
from tests.conftest import smoke_cfg


@pytest.fixture(scope="session")
def boot(tmp_path_factory):
    """Smoke bootstrap models: {"run_dir", "target", "draft", "tmp"}; reuse run_dir in stage tests
    (pass `run_dir=...` via `boot_cfg`) so the bootstrap stage is found done and skipped."""
    tmp = tmp_path_factory.mktemp("boot")
    cfg = smoke_cfg(tmp, "stages=[bootstrap]", "tracking=none")
    workflow.run(cfg)
    run_dir = tmp / "run"
    return {
        "tmp": tmp,
        "run_dir": run_dir,
        "target": run_dir / "bootstrap" / "target",
        "draft": run_dir / "bootstrap" / "draft",
    }


def boot_cfg(boot, tmp_path, *overrides: str):
    """A smoke config whose run_dir starts with a copy of the session's finished bootstrap."""
    import shutil

    run_dir = tmp_path / "run"
    if not (run_dir / "bootstrap").exists():
        shutil.copytree(boot["run_dir"] / "bootstrap", run_dir / "bootstrap")
    return smoke_cfg(tmp_path, "tracking=none", *overrides)


@pytest.fixture
def chat_target(boot, tmp_path):
    """A copy of the smoke bootstrap target whose tokenizer has a chat template."""
    import shutil

    from transformers import AutoTokenizer

    from tests.data.test_chat import TEMPLATE

    path = shutil.copytree(boot["target"], tmp_path / "chat_target")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path
