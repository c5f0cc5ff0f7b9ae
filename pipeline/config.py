"""The config schema: every default, and the typed views the stages receive.

The dataclasses here and in the stage modules hold every default (conf/ adds only choices);
`parse` rejects a bad key, type or value before any compute, naming the key.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.errors import ConfigError, first_line

if TYPE_CHECKING:
    from pipeline.modelshape import SizeDefaults
    from pipeline.quant.formats import Format
    from pipeline.quant.plan import Recipe

T = TypeVar("T")
log = logging.getLogger(__name__)


def to_plain(node: Any) -> Any:
    if isinstance(node, DictConfig | ListConfig):
        return OmegaConf.to_container(node, resolve=True)
    return node


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(key, f"has invalid value {value!r}", " or ".join(_name(a) for a in args))
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"is {value!r}", ", ".join(map(repr, args)))
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"must be a list, got {value!r}")
        return [_coerce(v, args[0] if args else Any, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a mapping, got {value!r}")
        return value
    if dataclasses.is_dataclass(hint):
        return parse(value, hint, key)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, f"must be a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported schema type {hint!r} for {key}")


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def parse(node: Any, schema: type[T], prefix: str) -> T:
    """Validate `node` against `schema`, rejecting unknown keys, then run its `check(prefix)`."""
    data = to_plain(node)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping, got {data!r}")
    data = renamed(data, getattr(schema, "RENAMED", {}), prefix)
    data = removed(data, getattr(schema, "REMOVED", {}), prefix)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in data:
        if key not in fields:
            raise ConfigError(f"{prefix}.{key}", "is not a known key", ", ".join(fields))
    hints = typing.get_type_hints(schema)
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}"
        if name not in data or data[name] == "???":
            no_default = f.default is dataclasses.MISSING
            if no_default and f.default_factory is dataclasses.MISSING:
                raise ConfigError(key, f"is required (set it on the command line: {key}=...)")
            continue
        kwargs[name] = _coerce(_over_default(data[name], f), hints[name], key)
    obj = schema(**kwargs)
    check = getattr(obj, "check", None)
    if callable(check):  # `plan.check` is a setting, not a method
        check(prefix)
    return obj


def positive(prefix: str, **values: float) -> None:
    for name, v in values.items():
        if v is not None and v <= 0:
            raise ConfigError(f"{prefix}.{name}", f"must be > 0, got {v}")


@dataclass(frozen=True)
class ModelSpec:
    """One model: a local HF checkpoint or a hub id in the HF cache, or the size of the one
    bootstrap trains."""

    # A local HF checkpoint dir, or a hub id (org/name) found in the local HF cache (never
    # downloaded; a local dir of that name wins); either replaces the bootstrap model.
    path: str | None = None
    # A hub id's branch, tag or commit (null: its default branch); pinned to the commit the cache
    # holds, so a newer snapshot reruns the stages that read the model.
    revision: str | None = None
    # "auto" keeps the saved dtype; stages that train a model upcast what they train.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    layers: int = 4
    hidden: int = 128
    heads: int = 2
    intermediate: int = 384  # in_features stay multiples of 128, the largest group size

    def check(self, prefix: str) -> None:
        if self.path is None and self.revision is not None:
            raise ConfigError(f"{prefix}.revision", "is set but path is null", "a hub id in path")
        if self.path is not None and self.revision is not None and Path(self.path).is_dir():
            raise ConfigError(
                f"{prefix}.revision",
                f"is {self.revision!r} but path {self.path!r} is a local directory",
                f"null, or a hub id in {prefix}.path",
            )
        if self.path is not None:
            from pipeline.hub import is_hub_id

            if not Path(self.path).is_dir() and not is_hub_id(self.path):
                raise ConfigError(
                    f"{prefix}.path",
                    f"is {self.path!r}, which is not a directory",
                    "a local HF checkpoint directory (config.json + *.safetensors), a hub id "
                    "(org/name) in the local HF cache, or null for the bootstrap model",
                )
            self.local_dir(prefix)  # a hub id the cache lacks fails here, naming the download
        positive(prefix, layers=self.layers, hidden=self.hidden, heads=self.heads)
        if self.hidden % self.heads:
            raise ConfigError(f"{prefix}.hidden", f"({self.hidden}) must be divisible by heads")

    def local_dir(self, prefix: str) -> Path | None:
        """The checkpoint folder: `path` itself, or a hub id's cached snapshot (None: bootstrap's
        model). `prefix` (model.target) names the setting in the error."""
        if self.path is None:
            return None
        from pipeline.hub import local_dir

        return local_dir(self.path, self.revision, f"{prefix}.path")

    def pinned(self, prefix: str) -> ModelSpec:
        """This spec with a hub id's revision set to the commit of its cached snapshot."""
        from pipeline.hub import commit

        found = self.local_dir(prefix)
        if found is None or Path(self.path).is_dir():
            return self
        log.info("%s.path=%s: the cached snapshot %s", prefix, self.path, found)
        return dataclasses.replace(self, revision=commit(found))


@dataclass(frozen=True)
class TokenizerSpec:
    vocab_size: int = 2048


@dataclass(frozen=True)
class ModelConfig:
    """Target and draft, sized to react to quantization as LLMs do (bench/default_model.py)."""

    target: ModelSpec = field(default_factory=ModelSpec)
    # A user target with a null draft path: no draft (the target drafts for itself).
    draft: ModelSpec = field(default_factory=lambda: ModelSpec(layers=1))
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    allow_bin: bool = False  # load .bin pickles (unsafe) instead of refusing them
    # transformers' device_map: null = the stage's device, "auto" = spread over all, "cuda:1".
    device_map: str | None = None

    def check(self, prefix: str) -> None:
        multi = ("auto", "balanced", "balanced_low_0", "sequential")
        # Checked by name, not with torch.device: "npu:0" is valid before torch_npu is imported.
        device = re.fullmatch(r"(cpu|cuda|npu|xpu|mps|hpu)(:\d+)?", self.device_map or "cpu")
        if self.device_map not in multi and device is None:
            raise ConfigError(
                f"{prefix}.device_map",
                f"is {self.device_map!r}",
                f"null, a device (cpu, cuda:0, npu:0) or one of {', '.join(multi)}",
            )

    def load_options(self, role: Literal["target", "draft"]) -> dict[str, Any]:
        """The ``dtype`` and ``device_map`` keyword arguments of the model loaders for ``role``."""
        spec = self.target if role == "target" else self.draft
        return {"dtype": spec.dtype, "device_map": self.device_map}

    def pinned(self) -> ModelConfig:
        """Hub ids pinned to their cached commits: what the fingerprints hash."""
        return dataclasses.replace(
            self, target=self.target.pinned("model.target"), draft=self.draft.pinned("model.draft")
        )


# Installed packages whose docstrings extend the built-in corpus, in reading order.
BUILTIN_PACKAGES = ("torch", "numpy", "scipy", "transformers", "pandas", "sklearn", "networkx")


@dataclass(frozen=True)
class DataConfig:
    """The corpus: local files, or a dataset in the local datasets cache; neither is the built-in
    one (pipeline/data/corpus.py)."""

    # How a run computes, not what: left out of fingerprints (tokens do not depend on it).
    UNHASHED: ClassVar[tuple[str, ...]] = ("num_proc",)

    path: str | None = None
    # A dataset in the local datasets cache (HF_DATASETS_CACHE, as `load_dataset` left it) or a
    # hub snapshot of it (`hf download --repo-type dataset`), with its config and split (null:
    # its only config; every split, kept as a DatasetDict's are).
    name: str | None = None
    config: str | None = None
    split: str | None = None
    text_field: str = "text"
    # Text files: a document per line | paragraph (blank-line separated) | document (file).
    sample_by: Literal["line", "paragraph", "document"] = "line"
    seq_len: int = 128  # training window in tokens
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    # Perplexity window; null: the model's context up to 2048 (user models), seq_len (bootstrap).
    eval_seq_len: int | None = None
    # null: the whole test split; N: N windows spread evenly over it.
    eval_windows: int | None = None
    builtin_packages: list[str] = field(default_factory=lambda: list(BUILTIN_PACKAGES))
    builtin_max_chars: int | None = 12_000_000
    num_proc: int = 1  # tokenizing processes (Dataset.map); a fast tokenizer batches on threads
    # Render every document through the target tokenizer's chat template (pipeline/data/chat.py):
    # a text_field of role/content message lists is one conversation, plain text one user turn.
    chat_template: bool = False

    @property
    def source(self) -> str:
        """The setting that chose the corpus, as messages name it."""
        if self.name is None:
            return "the built-in corpus" if self.path is None else f"data.path={self.path}"
        given = {"config": self.config, "split": self.split}
        parts = [f"data.{k}={v}" for k, v in given.items() if v is not None]
        return f"data.name={self.name}" + (f" ({', '.join(parts)})" if parts else "")

    def check(self, prefix: str) -> None:
        if self.path is not None and self.name is not None:
            raise ConfigError(
                f"{prefix}.name", "and data.path are both set", "one of them (the other null)"
            )
        for key in ("config", "split"):
            if getattr(self, key) is not None and self.name is None:
                raise ConfigError(f"{prefix}.{key}", "is set but data.name is null", "a name")
        if self.path is not None and not Path(self.path).exists():
            raise ConfigError(
                f"{prefix}.path",
                f"is {self.path!r}, which does not exist",
                "local text/JSON/parquet files, a directory of them, a `save_to_disk` dataset "
                "directory, or null (data.name for a cached dataset; both null: the built-in "
                "corpus)",
            )
        positive(
            prefix,
            seq_len=self.seq_len,
            eval_seq_len=self.eval_seq_len,
            eval_windows=self.eval_windows,
            builtin_max_chars=self.builtin_max_chars,
            num_proc=self.num_proc,
        )
        if not 0 < self.val_fraction + self.test_fraction < 0.5:
            raise ConfigError(f"{prefix}.val_fraction", "and test_fraction must sum to (0, 0.5)")


@dataclass(frozen=True)
class CalibConfig:
    """Calibration windows from the train split; null: by the target's size
    (`pipeline.modelshape.size_defaults`: 64 x 128 below 1 B parameters, 128 x 2048 above)."""

    samples: int | None = None
    seq_len: int | None = None


@dataclass(frozen=True)
class FeedbackConfig:
    """Error feedback (pipeline.quant.feedback): layers whose measured relative output error is
    above ``threshold`` move one candidate finer, paid from ``slack_bits`` the allocator holds back
    (it plans at budget_bits - slack_bits); 0 turns feedback off."""

    threshold: float = 0.005  # relative output error ||X(W-Q)|| / ||XW|| a layer may keep
    slack_bits: float = 0.0  # bits per weight held back from allocate for feedback; 0: off
    # greedy: a block may spend all the slack left; even: its share, plus what earlier ones left
    pace: Literal["greedy", "even"] = "greedy"

    def check(self, prefix: str) -> None:
        if not 0 < self.threshold < 1:
            raise ConfigError(f"{prefix}.threshold", f"is {self.threshold}", "0 < threshold < 1")
        if self.slack_bits < 0:
            raise ConfigError(f"{prefix}.slack_bits", f"is {self.slack_bits}", "slack_bits >= 0")


@dataclass(frozen=True)
class QuantConfig:
    """The recipe; the defaults are uniform (candidates[0]), conf/quant/mixed.yaml mixes formats."""

    method: Literal["gptq", "rtn"] = "gptq"
    candidates: list[str] = field(default_factory=lambda: ["int4g128"])
    budget_bits: float | None = None  # average bits per quantized weight, scales and zeros included
    float_fallback: int = 0  # keep the k most sensitive layers in float (msModelSlim-style)
    # Never quantized (allocation may still consider lm_head when removed).
    keep_float: list[str] = field(default_factory=lambda: ["lm_head", "embed_tokens"])
    segment_size: int = 1  # decoder blocks per streamed segment
    activation_budget_gb: float = 2.0
    act_order: bool = True
    damp: float = 0.01
    block_size: int = 128
    # Outlier columns carry most of the error (SpQR): keep_fp16 keeps up to outlier_cap in fp16.
    outliers: Literal["none", "keep_fp16"] = "none"
    outlier_cap: float = 0.01  # largest fraction of a layer's input columns kept
    calib: CalibConfig = field(default_factory=CalibConfig)
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)

    # Derived views a stage may read when its `sections` hold the fields they derive from.
    DERIVED: ClassVar[dict[str, tuple[str, ...]]] = {"formats": ("candidates",)}

    @functools.cached_property
    def formats(self) -> tuple[Format, ...]:
        """The candidates parsed, once: everything below the config gets these."""
        from pipeline.quant.formats import parse_format

        out = []
        for i, name in enumerate(self.candidates):
            try:
                out.append(parse_format(name))
            except ValueError as e:
                raise ConfigError(f"quant.candidates[{i}]", str(e)) from None
        return tuple(out)

    @functools.cached_property
    def recipe(self) -> Recipe:
        """What allocate plans for (pipeline.quant.plan.Recipe)."""
        from pipeline.quant.plan import Recipe

        return Recipe(
            self.formats,
            self.budget_bits,
            self.float_fallback,
            tuple(self.keep_float),
            self.outliers == "keep_fp16",
            self.feedback.slack_bits,
        )

    def check(self, prefix: str) -> None:
        if not self.candidates:
            raise ConfigError(f"{prefix}.candidates", "is empty", "a list of format names")
        self.formats  # noqa: B018  (parsed here, so a bad name fails before any stage runs)
        if len(self.candidates) > 1 and self.budget_bits is None:
            raise ConfigError(
                f"{prefix}.budget_bits", "is null but several candidates are given", "a number"
            )
        positive(
            prefix,
            segment_size=self.segment_size,
            activation_budget_gb=self.activation_budget_gb,
            block_size=self.block_size,
            budget_bits=self.budget_bits,
        )
        positive(f"{prefix}.calib", samples=self.calib.samples, seq_len=self.calib.seq_len)
        if not 0 <= self.damp < 1:
            raise ConfigError(f"{prefix}.damp", f"is {self.damp}", "0 <= damp < 1")
        if not 0 < self.outlier_cap <= 0.25:  # beyond a quarter, a wider format is cheaper
            raise ConfigError(f"{prefix}.outlier_cap", f"is {self.outlier_cap}", "0 < cap <= 0.25")
        self._check_feedback(f"{prefix}.feedback")
        if self.outliers == "keep_fp16" and self.budget_bits is None:
            raise ConfigError(
                f"{prefix}.budget_bits",
                "is null with quant.outliers=keep_fp16, which trades kept columns against bits",
                f"a number, or {prefix}.outliers=none",
            )

    def _check_feedback(self, prefix: str) -> None:
        slack = self.feedback.slack_bits
        if slack == 0:
            return
        if len(self.candidates) < 2 or self.budget_bits is None:
            raise ConfigError(
                f"{prefix}.slack_bits",
                f"is {slack}, but feedback moves layers to a finer candidate within "
                "quant.budget_bits, and this recipe has one candidate or no budget",
                f"{prefix}.slack_bits=0, or several quant.candidates and a quant.budget_bits",
            )
        if slack >= self.budget_bits:
            raise ConfigError(
                f"{prefix}.slack_bits",
                f"is {slack}, not below quant.budget_bits ({self.budget_bits})",
                f"0 <= slack_bits < {self.budget_bits}",
            )


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow: the command line > MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME > these defaults."""

    ENV: ClassVar[dict[str, str]] = {
        "uri": "MLFLOW_TRACKING_URI",
        "experiment": "MLFLOW_EXPERIMENT_NAME",
    }

    uri: str = "sqlite:///mlflow.db"
    artifact_location: str | None = "mlartifacts"
    experiment: str = "lowbit"
    enabled: bool = True
    # Seconds between CPU, memory (and GPU with pynvml) samples in each stage's run; 0 = off.
    system_metrics_s: float = 10.0
    # The MLflow run this workflow's run nests under; a sweep (`lowbit -m`) sets its own.
    parent_run_id: str | None = None

    def check(self, prefix: str) -> None:
        problem = tracking_uri_problem(self.uri)
        if problem:
            raise ConfigError(f"{prefix}.uri", f"is {self.uri!r}: {problem}")
        if self.system_metrics_s < 0:
            raise ConfigError(
                f"{prefix}.system_metrics_s", f"is {self.system_metrics_s}", "seconds >= 0"
            )


def tracking_uri_problem(uri: str) -> str | None:
    """Why MLflow would refuse `uri` as a tracking store, or None; decided as MLflow decides (its
    store registry, plugins included, and its database URI rules) without connecting."""
    from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    from mlflow.exceptions import MlflowException
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry as stores
    from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException as Unknown

    try:
        builder = stores.get_store_builder(uri)
    except Unknown:  # MLflow's own message speaks of the model registry
        shown = ", ".join(f"{s}://" for s in sorted(stores._registry) if s)
        return f"MLflow has no tracking store for it; use one of {shown} (e.g. sqlite:///PATH.db)"
    except MlflowException as e:  # a database URI MLflow cannot parse
        return f"{first_line(e).rstrip('.')}; e.g. postgresql+psycopg2://USER:PASSWORD@HOST:5432/DB"
    if builder is stores.get_store_builder("file:") and not MLFLOW_ALLOW_FILE_STORE.get():
        return (
            "MLflow 3 refuses the plain file store unless MLFLOW_ALLOW_FILE_STORE=true is set; "
            "or use sqlite:///PATH.db"
        )
    return None


@dataclass(frozen=True)
class PlanConfig:
    """`plan`: the memory plan checked before any compute (pipeline.memplan); `lowbit --plan`
    prints it and exits."""

    check: bool = True  # false: a run the plan says will not fit starts anyway
    show: bool = False  # print the plan and exit (`lowbit --plan`), writing nothing
    # Capacities: null reads them (host: SLURM_MEM_PER_NODE, cluster.mem_gb, else MemAvailable;
    # device: the free memory torch reports); set them to plan for another machine.
    host_mem_gib: float | None = None  # per node
    device_mem_gib: float | None = None  # per accelerator

    def __post_init__(self) -> None:  # not `check`: that name is the setting above
        positive("plan", host_mem_gib=self.host_mem_gib, device_mem_gib=self.device_mem_gib)


# `trainer` is checked by pipeline.lit.trainer; `cluster` is read by Hydra's launcher only.
SHARED: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "quant": QuantConfig,
    "tracking": TrackingConfig,
    "plan": PlanConfig,
}
# The sections a stage may list in its `sections`, whole (`quant`) or by field (`quant.calib`).
RUN_SECTIONS = ("name", "model", "data", "quant", "trainer")


def _plain(value: Any) -> Any:
    """A parsed section (dataclass or Fields) as plain values, less its UNHASHED fields; anything
    else as it is."""
    if isinstance(value, Fields):
        return value.asdict()
    if not dataclasses.is_dataclass(value):
        return value
    unhashed = getattr(value, "UNHASHED", ())
    return {k: v for k, v in dataclasses.asdict(value).items() if k not in unhashed}


class Fields:
    """The fields a stage names (`quant.calib`); others raise, so its fingerprint is whole."""

    def __init__(self, section: str, values: dict[str, Any], source: Any = None) -> None:
        self._section, self._values, self._source = section, values, source

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        needs = getattr(type(self._source), "DERIVED", {}).get(name)
        if needs is not None and set(needs) <= set(self._values):  # a view of fields it holds
            return getattr(self._source, name)
        if name not in self._values:
            raise AttributeError(
                f"{self._section}.{name} is not in the stage's sections (it lists "
                f"{', '.join(f'{self._section}.{k}' for k in self._values)}); add it there"
            )
        return self._values[name]

    def __repr__(self) -> str:
        return f"Fields({self._section}, {self._values!r})"

    def asdict(self) -> dict[str, Any]:
        return {k: _plain(v) for k, v in self._values.items()}


@dataclass(frozen=True)
class RunConfig:
    """What a stage gets beside `stage.<name>`: its `sections`, the others None."""

    seed: int
    name: str | None = None
    model: ModelConfig | None = None
    data: DataConfig | None = None
    quant: QuantConfig | Fields | None = None
    trainer: dict | None = (
        None  # lightning.Trainer kwargs plus lowbit's keys (pipeline.lit.trainer)
    )

    def view(self, sections: tuple[str, ...]) -> RunConfig:
        """This config with only `sections` (and the seed) set; `section.field` gives Fields."""
        whole = {s for s in sections if "." not in s}
        parts: dict[str, list[str]] = {}
        for s in sections:
            if "." in s:
                section, _, name = s.partition(".")
                parts.setdefault(section, []).append(name)
        unknown = (whole | set(parts)) - set(RUN_SECTIONS)
        if unknown:
            raise ValueError(f"unknown sections {sorted(unknown)}; known: {RUN_SECTIONS}")
        changes: dict[str, Any] = {s: None for s in RUN_SECTIONS if s not in whole}
        for section, names in parts.items():
            if section not in whole:
                obj = getattr(self, section)
                changes[section] = Fields(section, {n: getattr(obj, n) for n in names}, obj)
        return dataclasses.replace(self, **changes)

    def asdict(self) -> dict[str, Any]:
        """The plain values (a Fields section as its fields), for fingerprints and MLflow."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def run_config(cfg: DictConfig) -> RunConfig:
    """Every run-wide section of the composed config, parsed once."""
    if not isinstance(cfg.get("seed"), int) or isinstance(cfg.get("seed"), bool):
        raise ConfigError("seed", f"must be an integer, got {cfg.get('seed')!r}")
    trainer = to_plain(cfg.get("trainer"))
    if trainer is not None and not isinstance(trainer, dict):
        raise ConfigError("trainer", f"must be a mapping, got {trainer!r}")
    model = model_cfg(cfg)
    if trainer is not None and "precision" in trainer and trainer["precision"] is None:
        trainer["precision"] = by_size(model, "trainer.precision").precision
    return RunConfig(
        seed=cfg.seed,
        name=str(cfg.name),
        model=model,
        data=data_cfg(cfg),
        quant=quant_cfg(cfg, model),
        trainer=trainer,
    )


_chosen: set[str] = set()


def by_size(model: ModelConfig, key: str) -> SizeDefaults:
    """The size-dependent defaults of `model`'s target, logged once per setting they fill."""
    from pipeline.modelshape import model_shapes, size_defaults

    chosen = size_defaults(model_shapes(model)["target"])
    if key not in _chosen:
        _chosen.add(key)
        log.info("%s=null: chosen for the target's size (%s)", key, chosen.why)
    return chosen


def _defaults(schema: type) -> dict[str, Any]:
    """A schema's defaults; a field in its ``ENV`` becomes ``${oc.env:VAR,'default'}``."""
    node = dataclasses.asdict(schema())
    for key, var in getattr(schema, "ENV", {}).items():
        node[key] = f"${{oc.env:{var},'{node[key]}'}}"
    return node


def defaults_node(stage_schemas: dict[str, type]) -> dict[str, Any]:
    """Every section's defaults as a plain dict (not structured, so `parse` gives the errors)."""
    node: dict[str, Any] = {k: _defaults(schema) for k, schema in SHARED.items()}
    node["stage"] = {name: stage_defaults(schema) for name, schema in stage_schemas.items()}
    node["stages"] = list(stage_schemas)
    return node


def model_cfg(cfg: DictConfig) -> ModelConfig:
    return parse(cfg.model, ModelConfig, "model").pinned()


def data_cfg(cfg: DictConfig) -> DataConfig:
    return parse(cfg.data, DataConfig, "data")


def quant_cfg(cfg: DictConfig, model: ModelConfig | None = None) -> QuantConfig:
    """`quant`, a null calibration shape filled by the target's size (`model`: parsed already)."""
    quant = parse(cfg.quant, QuantConfig, "quant")
    calib = quant.calib
    if calib.samples is None or calib.seq_len is None:
        scaled = by_size(model or model_cfg(cfg), "quant.calib")
        calib = CalibConfig(
            calib.samples or scaled.calib_samples, calib.seq_len or scaled.calib_seq_len
        )
        quant = dataclasses.replace(quant, calib=calib)
    return quant


def plan_cfg(cfg: DictConfig) -> PlanConfig:
    return parse(cfg.get("plan"), PlanConfig, "plan")


def tracking_cfg(cfg: DictConfig) -> TrackingConfig:
    return parse(cfg.tracking, TrackingConfig, "tracking")


# A schema's RENAMED ({old key: new dotted key}) keeps old names for one release; Hydra refuses a
# command-line key missing from the defaults, so each old key is there with a marker.
def renamed_marker(new: str) -> str:
    return f"(renamed: {new})"


REMOVED_MARKER = "(removed)"


def stage_defaults(schema: type) -> dict[str, Any]:
    """A stage's defaults, plus a marker under each old key name (never a field's own name);
    a key in the schema's LINKED ({key: dotted key}) defaults to that key's value."""
    node = dataclasses.asdict(schema())
    node |= {k: f"${{{src}}}" for k, src in getattr(schema, "LINKED", {}).items()}
    old = getattr(schema, "RENAMED", {})
    node |= {k: renamed_marker(new) for k, new in old.items() if k not in node}
    gone = getattr(schema, "REMOVED", {})
    return node | {k: REMOVED_MARKER for k in gone if k not in node}


def _over_default(value: Any, f: dataclasses.Field) -> Any:
    """A nested section's keys over this field's own default (`train`: the stage's schedule)."""
    if isinstance(value, dict) and f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
        if dataclasses.is_dataclass(default):
            return dataclasses.asdict(default) | value
    return value


def renamed(data: dict, old_names: dict[str, str], prefix: str) -> dict:
    """`data` with each old key's value moved to its new key, with a one-line notice."""
    data = dict(data)
    for old, new in old_names.items():
        if old not in data or data[old] == renamed_marker(new):
            data.pop(old, None)
            continue
        log.warning("%s.%s is deprecated: use %s.%s", prefix, old, prefix, new)
        *path, last = new.split(".")
        node = data
        for part in path:  # copy each level: `data` may share nodes with its caller
            node[part] = node = dict(node.get(part) or {})
        node[last] = data.pop(old)
    return data


# A schema's REMOVED ({old key: the setting that replaced it}): a value given there is refused,
# naming that setting, rather than Hydra's "not in struct" or a list of the known keys.
REMOVED_DEVICE = {
    "device": "every stage computes on the trainer's device: set trainer.accelerator (cpu, gpu, "
    "npu, auto; or trainer=cpu|gpu|npu) and trainer.devices"
}


def removed(data: dict, gone: dict[str, str], prefix: str) -> dict:
    """`data` without the markers of removed keys; a value set there fails, naming the fix."""
    data = dict(data)
    for key, instead in gone.items():
        value = data.pop(key, REMOVED_MARKER)
        if value != REMOVED_MARKER:
            raise ConfigError(f"{prefix}.{key}", f"is {value!r}, but it was removed: {instead}")
    return data
