"""Downstream tasks through lm-evaluation-harness on models in memory: did the drift change answers?

Scores are lm-eval's own (``simple_evaluate`` on ``HFLM``), comparable with published ones. Nothing
is downloaded: task data comes from the local datasets cache or task YAMLs under ``include_path``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline.config import positive
from pipeline.data.chat import require_template
from pipeline.errors import ConfigError, LowbitError

KEY = "stage.evaluate.lm_eval"  # where the config lives, for messages raised at run time
INSTALL = "pip install 'lowbit[eval]' (lm-eval[hf]>=0.4.10)"
SAMPLES = "lm_eval_samples"  # <evaluate>/lm_eval_samples/<model>/<task>.jsonl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LmEvalConfig:
    """lm-eval tasks run on every target model; an empty ``tasks`` list turns them off."""

    tasks: list[str] = field(default_factory=list)  # task or group names
    num_fewshot: int | None = None  # None keeps each task's default
    limit: int | float | None = None  # documents per task: a count, or a fraction in (0, 1)
    include_path: str | None = None  # a directory of extra task YAMLs
    batch_size: int = 8
    # Prompts through the tokenizer's chat template, as chat models serve; null: data.chat_template
    apply_chat_template: bool | None = None
    # Few-shot examples as user/assistant turns, not one user turn; null: with the chat template.
    fewshot_as_multiturn: bool | None = None
    # Over each generate_until task's generation_kwargs (max_gen_toks, temperature...); null: none.
    gen_kwargs: dict | None = None
    # lm-eval's record per document (prompt, responses, scores) under the stage's folder (SAMPLES).
    log_samples: bool = False

    def check(self, prefix: str) -> None:
        positive(prefix, batch_size=self.batch_size, limit=self.limit)
        for key, value in (self.gen_kwargs or {}).items():
            scalar = isinstance(value, str | int | float | bool)
            if not (scalar or isinstance(value, list) and all(isinstance(v, str) for v in value)):
                allowed = "a number, string or list of strings"
                raise ConfigError(f"{prefix}.gen_kwargs.{key}", f"is {value!r}", allowed)
        self.resolved(chat_template=self.apply_chat_template is not False, prefix=prefix)
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"{prefix}.num_fewshot", f"must be >= 0, got {self.num_fewshot}")
        if isinstance(self.limit, float) and self.limit >= 1:
            raise ConfigError(
                f"{prefix}.limit", f"is {self.limit}", "an integer count or a fraction in (0, 1)"
            )
        for i, task in enumerate(self.tasks):
            if not task.strip() or task in self.tasks[:i]:
                raise ConfigError(f"{prefix}.tasks[{i}]", f"is {task!r}: empty or repeated")
        if self.include_path is not None and not Path(self.include_path).is_dir():
            raise ConfigError(
                f"{prefix}.include_path",
                f"is {self.include_path!r}, which is not a directory",
                "a directory of lm-eval task YAMLs, or null for the built-in tasks",
            )
        if self.tasks and importlib.util.find_spec("lm_eval") is None:
            raise ConfigError(
                f"{prefix}.tasks", f"needs lm-eval, which is not installed: {INSTALL}"
            )

    def resolved(self, chat_template: bool, prefix: str = KEY) -> LmEvalConfig:
        """The nulls decided: the chat template as ``data.chat_template`` (``chat_template``),
        few-shot examples as turns when it is applied."""
        chat = chat_template if self.apply_chat_template is None else self.apply_chat_template
        turns = chat if self.fewshot_as_multiturn is None else self.fewshot_as_multiturn
        if turns and not chat:
            raise ConfigError(
                f"{prefix}.fewshot_as_multiturn",
                "is true, but no chat template is applied (apply_chat_template is false, or null "
                "with data.chat_template=false)",
                f"false, or {prefix}.apply_chat_template=true",
            )
        return dataclasses.replace(self, apply_chat_template=chat, fewshot_as_multiturn=turns)


def run_lm_eval(
    models: dict[str, nn.Module],
    tokenizer: Any,
    cfg: LmEvalConfig,
    device: torch.device | str,
    out_dir: Path | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """``{model: {task: {metric: value}}}`` of ``cfg.tasks`` (empty without tasks).

    Each model moves to ``device`` for its run and back. A metric under a filter other than
    ``none`` is named ``<metric>_<filter>``. With ``cfg.log_samples`` each model's per-document
    records go to ``out_dir/SAMPLES/<model>/<task>.jsonl``. Raises LowbitError naming the task
    when lm-eval is missing, a task is unknown or its data is not available offline, or naming
    the key when the chat template is asked for and the tokenizer has none.
    """
    if not cfg.tasks:
        return {}
    if cfg.apply_chat_template:
        fix = f"set {KEY}.apply_chat_template=false (and data.chat_template=false)"
        require_template(tokenizer, f"{KEY}.apply_chat_template is on", fix)
    if cfg.log_samples and out_dir is None:
        raise ValueError("log_samples needs the folder to write them to (out_dir)")
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import get_task_dict
    except ImportError as err:
        raise LowbitError(
            f"{KEY}.tasks is set but lm-eval cannot be imported ({err}): {INSTALL}"
        ) from None

    out: dict[str, dict[str, dict[str, float]]] = {}
    with _isolated(torch.device(device)):
        manager = _task_manager(cfg.include_path)
        for task in cfg.tasks:  # a bad name or missing data fails here, before any model runs
            try:
                get_task_dict([task], manager)
            except Exception as err:  # lm-eval raises KeyError, ValueError, OSError, ...
                raise LowbitError(_task_error(task, cfg, err)) from None
        for name, model in models.items():
            home = next(model.parameters()).device
            lm = HFLM(
                pretrained=model.to(device).eval(), tokenizer=tokenizer, batch_size=cfg.batch_size
            )
            try:
                results = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=list(cfg.tasks),
                    num_fewshot=cfg.num_fewshot,
                    limit=cfg.limit,
                    task_manager=manager,
                    log_samples=cfg.log_samples,
                    apply_chat_template=bool(cfg.apply_chat_template),
                    fewshot_as_multiturn=bool(cfg.fewshot_as_multiturn),
                    gen_kwargs=dict(cfg.gen_kwargs) if cfg.gen_kwargs else None,
                    bootstrap_iters=1000,  # only non-mean metrics bootstrap; acc's is closed form
                )
            finally:
                model.to(home)
            if cfg.log_samples:
                _save_samples(results["samples"], out_dir / SAMPLES / name)
            out[name] = _numeric(results["results"])
            for task, metrics in out[name].items():
                log.info("evaluate: lm_eval %-18s %-24s %s", name, task, _fmt(metrics))
    return out


def lm_eval_metrics(results: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """Flat ``{lm_eval_<model>_<task>_<metric>: value}`` for the tracker."""
    return {
        f"lm_eval_{model}_{task}_{metric}": v
        for model, tasks in results.items()
        for task, metrics in tasks.items()
        for metric, v in metrics.items()
    }


@functools.cache
def _task_manager(include_path: str | None):
    """lm-eval's index of its own task YAMLs and include_path's: thousands of files scanned, so
    once per process (it holds names and paths; each run loads its tasks afresh)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def _save_samples(samples: dict[str, list[dict]], folder: Path) -> None:
    """One JSON line per document, lm-eval's record as it gives it (doc, arguments, resps...)."""
    from lm_eval.utils import handle_non_serializable

    folder.mkdir(parents=True, exist_ok=True)
    for task, rows in samples.items():
        file = folder / (re.sub(r"[^\w.-]", "_", task) + ".jsonl")  # a group's "a/b" stays a name
        with open(file, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n")
    log.info("evaluate: lm_eval samples in %s", folder)


def _numeric(task_results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Keep the finite numbers of lm-eval's ``{task: {"acc,none": 0.5, "alias": ...}}``."""
    out = {}
    for task, entries in task_results.items():
        metrics = {}
        for key, v in entries.items():
            metric, _, filt = key.partition(",")
            if not filt or isinstance(v, bool) or not isinstance(v, int | float):
                continue  # "alias", "samples", stderr "N/A"
            if math.isfinite(v):
                metrics[metric if filt == "none" else f"{metric}_{filt}"] = float(v)
        out[task] = metrics
    return out


def _task_error(task: str, cfg: LmEvalConfig, err: Exception) -> str:
    now = repr(cfg.include_path) if cfg.include_path else "unset"
    reason = " ".join(str(err).split())[:300] or type(err).__name__
    return (
        f"lm_eval task {task!r} cannot be loaded offline ({type(err).__name__}: {reason}). "
        f"Check the name, or write a task YAML whose data files are local into a directory "
        f"and point {KEY}.include_path at it (now {now})."
    )


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if not k.endswith("_stderr"))


@contextlib.contextmanager
def _isolated(device: torch.device) -> Iterator[None]:
    """Hub and datasets offline (their module flags too: read once, at import), and the RNG
    states simple_evaluate reseeds restored afterwards."""
    import datasets.config
    import huggingface_hub.constants as hub

    env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    flags = [
        (hub, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),
    ]
    saved = [(mod, name, getattr(mod, name)) for mod, name in flags if hasattr(mod, name)]
    py_rng, np_rng = random.getstate(), np.random.get_state()
    os.environ.update(dict.fromkeys(env, "1"))
    for mod, name, _ in saved:
        setattr(mod, name, True)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        random.setstate(py_rng)
        np.random.set_state(np_rng)
