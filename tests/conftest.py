"""Shared fixtures: composed configs, a real MLflow server, one smoke workflow per session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipeline import conf_dir
from pipeline.stages import register_configs
from tests import _require

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    _require.required()  # a misspelt LOWBIT_REQUIRE stops the run at its start


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Tests marked with tests._require.needs skip, or fail under LOWBIT_REQUIRE, before any of
    their fixtures start."""
    for mark in item.iter_markers("requires"):
        try:
            _require.check(*mark.args)
        except pytest.skip.Exception as e:
            e._use_item_location = True  # report the test's line, as pytest does for skipif
            raise


def make_cfg(*overrides: str):
    """The config `lowbit <overrides>` would run with."""
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def smoke_cfg(tmp: Path, *overrides: str):
    return make_cfg(
        "experiment=smoke",
        f"run_dir={tmp / 'run'}",
        f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
        f"tracking.artifact_location={tmp / 'artifacts'}",
        *overrides,
    )


# Limits for the lowbit commands the tests start, in seconds on a busy 2-core machine: one that
# stops at its start or runs a stage or two, and the whole smoke workflow (about 2 min alone).
CLI_TIMEOUT = 300
WORKFLOW_TIMEOUT = 600


def lowbit_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", *args]


def cases_in_child(cases: Path, timeout: int = 300) -> None:
    """Run the pytest file ``cases`` in a process of its own (for process-wide, final changes
    such as torch's privateuse1 rename); every case must pass, none be skipped."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(cases), "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads and lose a lot on a busy machine."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1, stopped at the end of the session."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    proc = subprocess.Popen(
        [
            str(mlflow_bin),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{root / 'db.sqlite'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            urllib.request.urlopen(uri + "/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                os.killpg(proc.pid, 9)  # the server and its workers
                proc.wait(timeout=30)
                pytest.fail("mlflow server did not become healthy")
            time.sleep(0.5)
    yield uri
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The whole `experiment=smoke` workflow, run once per test session through the CLI."""
    tmp = tmp_path_factory.mktemp("smoke")
    args = [
        "experiment=smoke",
        f"run_dir={tmp / 'run'}",
        f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
        f"tracking.artifact_location={tmp / 'artifacts'}",
    ]
    t0 = time.time()
    proc = subprocess.run(
        lowbit_cmd(*args), cwd=tmp, capture_output=True, text=True, timeout=WORKFLOW_TIMEOUT
    )
    seconds = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {
        "dir": tmp,
        "run_dir": tmp / "run",
        "args": args,
        "seconds": seconds,
        "uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "log": proc.stdout + proc.stderr,
    }


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty HF_HOME for one test. huggingface_hub and datasets read it once, at import, so
    their cache locations are moved with it here, as a `lowbit` started with it set sees them."""
    import datasets.config
    import huggingface_hub.constants as hub

    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    return home


def put_in_hub_cache(src: Path, cache: Path, repo_id: str, commit: str, repo_type="model") -> Path:
    """Lay `src`'s files into the hub cache `cache` as `hf download` leaves them (blobs named by
    their hash, a snapshot folder of links per commit, refs/main naming the newest commit);
    returns the snapshot folder."""
    import hashlib

    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in src.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(file.read_bytes())
        link = snapshot / file.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> Path:
    """The short workflow of tests/test_resume.py (every stage but evaluate), run once per session
    without a stop and without tracking: the bytes each resumed, interrupted or concurrent run of
    it must write (tests/test_resume.py, tests/test_load.py, the cluster sweep)."""
    from tests.test_resume import ENV, STAGES, lowbit  # it imports this module: not at the top

    run = tmp_path_factory.mktemp("resume") / "run"
    proc = subprocess.run(
        lowbit(run, STAGES), env=ENV, capture_output=True, text=True, timeout=WORKFLOW_TIMEOUT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run
