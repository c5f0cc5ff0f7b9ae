"""MLflow bookkeeping: one parent run per workflow (id in `<run_dir>/_mlflow.json`, so a resumed
run logs into it), one nested child run per stage, and the workflow's run itself nested under
`tracking.parent_run_id` when given (a sweep's run); only rank 0 talks to MLflow, through the
client API so stages can log from any thread."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import socket
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.config import DataConfig, TrackingConfig
from pipeline.errors import LowbitError

log = logging.getLogger(__name__)

_METRIC_CHARS = re.compile(r"[^\w\-. :/]")  # what MLflow accepts in a metric name
# MLflow rejects long param values on some backends; the full config is an artifact.
_MAX_PARAM = 500
MARKER = "_mlflow.json"  # in a run dir (or a sweep dir): {"uri", "run_id"} of its parent run
PARENT_TAG = "mlflow.parentRunId"  # what MLflow's UI nests runs by


def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"} (lists kept whole, as their repr)."""
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = str(d)[:_MAX_PARAM]
    return out


# MLflow 3 opens an experiment without this tag in its GenAI view (traces, prompts).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _without_password(uri: str) -> str:
    """A database URI as it may appear in a log: its password masked."""
    password = urllib.parse.urlsplit(uri).password
    return uri.replace(f":{password}@", ":***@", 1) if password else uri


def _resolve_uri(uri: str) -> str:
    # A relative sqlite path is relative to the working directory; make it absolute so every
    # rank and every later `mlflow ui` command points at the same file.
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///") :]).resolve())
    return uri


@contextlib.contextmanager
def _opening(uri: str) -> Iterator[None]:
    """Hold `<database>.lock` while a sqlite store is first opened: MLflow creates a new
    database's tables without a lock, and runs starting together on one new file (a sweep's
    jobs, workflows side by side) would each migrate it, all but one failing."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri.removeprefix("sqlite:///"))
    with contextlib.ExitStack() as held:
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
            lock = held.enter_context(open(db.with_name(f"{db.name}.lock"), "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        except OSError:  # a read-only folder, or no flock there: unguarded, as MLflow is
            pass
        yield


def _fluent_globals() -> tuple[str | None, str | None]:
    """The environment variables behind MLflow's global tracking URI and sampling interval."""
    from mlflow.environment_variables import (
        MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL,
        MLFLOW_TRACKING_URI,
    )

    names = (MLFLOW_TRACKING_URI.name, MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.name)
    return tuple(os.environ.get(name) for name in names)


class StageRun:
    """Logging handle for one stage (a nested MLflow run), or a no-op."""

    def __init__(self, client=None, run_id: str | None = None, uri: str | None = None):
        self.client, self.run_id, self.uri = client, run_id, uri
        self.sampling = False  # the run is this thread's active MLflow run, sampling system/*
        self._globals: tuple[str | None, str | None] = (None, None)

    def monitor_system(self, interval_s: float) -> None:
        """Sample CPU, memory, disk (GPU with the `gpu` extra) into ``system/*`` every
        ``interval_s`` until ``end``, through MLflow's public API: the run becomes this thread's
        active run, as `mlflow.start_run(log_system_metrics=True)` makes it."""
        if not self.active or interval_s <= 0:
            return
        import logging

        import mlflow

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # start/stop lines
        self._globals = _fluent_globals()  # both setters below export environment variables
        mlflow.set_tracking_uri(self.uri)  # the fluent API's store, and its monitor's
        mlflow.set_system_metrics_sampling_interval(interval_s)
        # nested: another active run in this thread (a caller's own) stays active beneath it
        mlflow.start_run(run_id=self.run_id, nested=True, log_system_metrics=True)
        self.sampling = True

    @property
    def active(self) -> bool:
        return self.client is not None

    def log_params(self, params: dict[str, Any]) -> None:
        if not self.active:
            return
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not self.active:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [
            Metric(_METRIC_CHARS.sub("_", k), float(v), now, step or 0)
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        ]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        if self.active:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_figure(self, fig, name: str) -> None:
        if self.active:
            self.client.log_figure(self.run_id, fig, name)

    def log_dict(self, data: dict, name: str) -> None:
        if self.active:
            self.client.log_dict(self.run_id, data, name)

    def log_input(self, tokens, context: str, data: DataConfig, split: str) -> None:
        """Record the tokens the stage read from ``split`` of the corpus as an MLflow dataset
        input (`mlflow.data.context` = ``context``: training, validation, calibration, test):
        its source (the path, or the built-in corpus's recipe), a digest of every token, and its
        shape as the profile (windows x tokens, or one token stream)."""
        if not self.active:
            return
        import hashlib

        import mlflow.data
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        array = tokens.detach().cpu().numpy()
        if data.path is None:  # made from installed packages' docstrings: the recipe names it
            source = CodeDatasetSource(
                {
                    "lowbit.corpus": "builtin",
                    "packages": ",".join(data.builtin_packages),
                    "max_chars": str(data.builtin_max_chars),
                }
            )
        else:
            source = str(Path(data.path).resolve())
        label = "builtin" if data.path is None else Path(data.path).name
        dataset = mlflow.data.from_numpy(
            array,
            source=source,
            name=f"{label}:{split}",
            # MLflow's own digest hashes a sample of rows; this one every token.
            digest=hashlib.sha256(array.tobytes()).hexdigest()[:12],
        )
        tags = [InputTag(MLFLOW_DATASET_CONTEXT, context), InputTag("lowbit.split", split)]
        self.client.log_inputs(self.run_id, [DatasetInput(Dataset(**dataset.to_dict()), tags)])

    def lightning_logger(self, prefix: str = ""):
        """A Lightning MLFlowLogger writing into this run (None when tracking is off); ``prefix``
        keeps several trainings of one stage apart ("target" -> target-train_loss)."""
        if not self.active:
            return None
        from lightning.pytorch.loggers import MLFlowLogger

        return MLFlowLogger(tracking_uri=self.uri, run_id=self.run_id, prefix=prefix)

    def end(self, status: str = "FINISHED") -> None:
        if self.sampling:
            import mlflow

            mlflow.set_tracking_uri(self.uri)
            mlflow.end_run(status)  # stops the monitor after its last samples
            self.sampling = False
            uri, interval = self._globals  # as before the stage (None: unset)
            mlflow.set_tracking_uri(uri)
            mlflow.set_system_metrics_sampling_interval(interval)
        elif self.active:
            self.client.set_terminated(self.run_id, status)


def reopen(run_dir: Path) -> StageRun:
    """The parent run `run_dir`'s marker names, to log more into it; a no-op handle (and a
    warning when a marker exists) when there is none or its store no longer has it."""
    try:
        saved = json.loads((run_dir / MARKER).read_text())
    except (OSError, ValueError):
        return StageRun()
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(saved["uri"])
    try:
        client.get_run(saved["run_id"])
    except Exception as e:  # a wiped store, a server that is down
        where = _without_password(saved["uri"])
        log.warning("MLflow run %s in %s not reachable (%s)", saved["run_id"], where, e)
        return StageRun()
    return StageRun(client, saved["run_id"], saved["uri"])


class Tracker:
    """The workflow's MLflow parent run and its children."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, active: bool):
        self.cfg = cfg
        self.run_dir = run_dir
        self.active = active and cfg.enabled
        self.uri = _resolve_uri(cfg.uri)
        self.client = None
        self.parent: StageRun = StageRun()

    def connect(self) -> None:
        """Fail now, with the fix, when MLflow cannot be reached (not after hours of compute)."""
        if not self.active:
            return
        if self.uri.startswith("http"):
            try:
                urllib.request.urlopen(self.uri.rstrip("/") + "/health", timeout=10)
            except (urllib.error.URLError, OSError) as e:
                raise LowbitError(
                    f"MLflow server at tracking.uri={self.cfg.uri} is not reachable ({e}). "
                    "Start it (mlflow server --host 127.0.0.1 --port 5000), fix tracking.uri, "
                    "or run with tracking=none."
                ) from None
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow
        from mlflow.tracking import MlflowClient

        try:
            with _opening(self.uri):
                self.client = MlflowClient(self.uri)
                if self.client.get_experiment_by_name(self.cfg.experiment) is None:
                    self._create_experiment()
        except mlflow.exceptions.MlflowException as e:
            raise LowbitError(
                f"MLflow store tracking.uri={self.cfg.uri} is not usable: {e}. "
                "Fix tracking.uri or run with tracking=none."
            ) from None

    def _create_experiment(self) -> None:
        """Create the experiment, unless a run started at the same time on the same store (a
        sweep's other point, a second workflow) created it since this one looked."""
        from mlflow.exceptions import MlflowException

        location = None
        if self.cfg.artifact_location and not self.uri.startswith("http"):
            location = Path(self.cfg.artifact_location).resolve().as_uri()
        try:
            self.client.create_experiment(
                self.cfg.experiment, artifact_location=location, tags=EXPERIMENT_TAGS
            )
        except MlflowException:
            if self.client.get_experiment_by_name(self.cfg.experiment) is None:
                raise

    def start_parent(self, name: str, params: dict[str, Any]) -> StageRun:
        if not self.active:
            return self.parent
        marker = self.run_dir / MARKER
        run_id = None
        if marker.exists():
            saved = json.loads(marker.read_text())
            if saved.get("uri") == self.uri:
                run_id = saved["run_id"]
                try:
                    self.client.get_run(run_id)
                    self.client.update_run(run_id, status="RUNNING")
                except Exception:  # the store was wiped: start a new parent
                    run_id = None
        if run_id is None:
            exp = self.client.get_experiment_by_name(self.cfg.experiment)
            run = self.client.create_run(exp.experiment_id, run_name=name, tags=self._tags())
            run_id = run.info.run_id
            marker.write_text(json.dumps({"uri": self.uri, "run_id": run_id}))
            self.parent = StageRun(self.client, run_id, self.uri)
            self.parent.log_params(params)
            with tempfile.TemporaryDirectory() as tmp:
                p = Path(tmp) / "config.json"
                p.write_text(json.dumps(params, indent=1, default=str))
                self.parent.log_artifact(p)
        self.parent = StageRun(self.client, run_id, self.uri)
        self._nest(run_id)
        return self.parent

    def _nest(self, run_id: str) -> None:
        """Under `tracking.parent_run_id`, a resumed run too (it may be a new sweep's point)."""
        parent = self.cfg.parent_run_id
        if not parent:
            return
        try:
            self.client.get_run(parent)
        except Exception as e:  # another store (a swept tracking.uri) or a deleted run
            where = _without_password(self.uri)
            log.warning("MLflow run %s not found in %s (%s); not nested", parent, where, e)
            return
        self.client.set_tag(run_id, PARENT_TAG, parent)

    def start_stage(self, stage: str, params: dict[str, Any], tags: dict[str, Any]) -> StageRun:
        if not self.active:
            return StageRun()
        exp = self.client.get_experiment_by_name(self.cfg.experiment)
        all_tags = {**self._tags(), **{k: str(v) for k, v in tags.items()}}
        all_tags[PARENT_TAG] = self.parent.run_id
        all_tags["lowbit.stage"] = stage
        run = self.client.create_run(exp.experiment_id, run_name=stage, tags=all_tags)
        child = StageRun(self.client, run.info.run_id, self.uri)
        child.log_params(params)
        child.monitor_system(self.cfg.system_metrics_s)
        return child

    def ui_command(self) -> str:
        if not self.uri.startswith(("http://", "https://", "databricks")):  # a database or files
            art = ""
            if self.cfg.artifact_location:
                art = f" --artifacts-destination {Path(self.cfg.artifact_location).resolve()}"
            return f"mlflow ui --backend-store-uri {_without_password(self.uri)}{art}"
        return f"open {self.uri}"

    @staticmethod
    def _tags() -> dict[str, str]:
        """MLflow's standard context tags (user, source), lowbit's commit, and lowbit's own."""
        from mlflow.tracking.context.registry import resolve_tags
        from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_SOURCE_NAME

        from pipeline import __version__

        tags = resolve_tags(
            {
                MLFLOW_SOURCE_NAME: "lowbit",  # not sys.argv[0], a venv's script path
                "lowbit.version": __version__,
                "lowbit.host": socket.gethostname(),
                "world_size": os.environ.get("WORLD_SIZE", "1"),
            }
        )
        commit = git_commit()
        if commit != "unknown":  # lowbit's own checkout, wherever the command was started
            tags[MLFLOW_GIT_COMMIT] = commit
        return tags
