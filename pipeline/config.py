"""Typed views of the config, validated on entry.

Each stage parses the sections it reads into frozen dataclasses with `parse`, so a misspelt key,
a wrong type or a value outside its choices fails before any compute, with one message naming the
key and what is allowed. The shared sections (model, data, quant, tracking) are defined here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.errors import ConfigError

T = TypeVar("T")


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
    """Validate `node` against the dataclass `schema`; unknown keys are rejected.

    A schema may define `check(self, prefix)` for checks that involve several fields or the
    file system; it raises ConfigError.
    """
    data = to_plain(node)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping, got {data!r}")
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
        kwargs[name] = _coerce(data[name], hints[name], key)
    obj = schema(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        check(prefix)
    return obj


def positive(prefix: str, **values: float) -> None:
    for name, v in values.items():
        if v is not None and v <= 0:
            raise ConfigError(f"{prefix}.{name}", f"must be > 0, got {v}")


# ---------------------------------------------------------------- shared sections
@dataclass(frozen=True)
class ModelSpec:
    path: str | None = None
    layers: int = 4
    hidden: int = 128
    heads: int = 2
    intermediate: int = 384

    def check(self, prefix: str) -> None:
        if self.path is not None and not Path(self.path).is_dir():
            raise ConfigError(
                f"{prefix}.path",
                f"is {self.path!r}, which is not a directory",
                "a local HF checkpoint directory (config.json + *.safetensors), or null for the "
                "bootstrap model",
            )
        positive(prefix, layers=self.layers, hidden=self.hidden, heads=self.heads)
        if self.hidden % self.heads:
            raise ConfigError(f"{prefix}.hidden", f"({self.hidden}) must be divisible by heads")


@dataclass(frozen=True)
class TokenizerSpec:
    vocab_size: int = 2048


@dataclass(frozen=True)
class ModelConfig:
    target: ModelSpec = field(default_factory=ModelSpec)
    draft: ModelSpec = field(default_factory=ModelSpec)
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    allow_bin: bool = False


# Installed packages whose docstrings extend the built-in corpus, in reading order.
BUILTIN_PACKAGES = ("torch", "numpy", "scipy", "transformers", "pandas", "sklearn", "networkx")


@dataclass(frozen=True)
class DataConfig:
    path: str | None = None
    text_field: str = "text"
    sample_by: Literal["line", "paragraph", "document"] = "line"
    seq_len: int = 128
    val_fraction: float = 0.05
    test_fraction: float = 0.05
    eval_seq_len: int | None = None
    eval_windows: int | None = None
    builtin_packages: list[str] = field(default_factory=lambda: list(BUILTIN_PACKAGES))
    builtin_max_chars: int | None = 12_000_000

    def check(self, prefix: str) -> None:
        if self.path is not None and not Path(self.path).exists():
            raise ConfigError(
                f"{prefix}.path",
                f"is {self.path!r}, which does not exist",
                "local text/JSON/parquet files, a directory of them, a `save_to_disk` dataset "
                "directory, or null for the built-in corpus",
            )
        positive(
            prefix,
            seq_len=self.seq_len,
            eval_seq_len=self.eval_seq_len,
            eval_windows=self.eval_windows,
            builtin_max_chars=self.builtin_max_chars,
        )
        if not 0 < self.val_fraction + self.test_fraction < 0.5:
            raise ConfigError(f"{prefix}.val_fraction", "and test_fraction must sum to (0, 0.5)")


@dataclass(frozen=True)
class CalibConfig:
    samples: int = 64
    seq_len: int = 256


@dataclass(frozen=True)
class QuantConfig:
    method: Literal["gptq", "rtn"] = "gptq"
    candidates: list[str] = field(default_factory=lambda: ["int4g128"])
    budget_bits: float | None = None
    float_fallback: int = 0
    keep_float: list[str] = field(default_factory=lambda: ["lm_head", "embed_tokens"])
    segment_size: int = 1
    activation_budget_gb: float = 2.0
    act_order: bool = True
    damp: float = 0.01
    block_size: int = 128
    calib: CalibConfig = field(default_factory=CalibConfig)

    def check(self, prefix: str) -> None:
        from pipeline.quant.formats import parse_format

        if not self.candidates:
            raise ConfigError(f"{prefix}.candidates", "is empty", "a list of format names")
        for i, name in enumerate(self.candidates):
            try:
                parse_format(name)
            except ValueError as e:
                raise ConfigError(f"{prefix}.candidates[{i}]", str(e)) from None
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


@dataclass(frozen=True)
class TrackingConfig:
    uri: str = "sqlite:///mlflow.db"
    artifact_location: str | None = "mlartifacts"
    experiment: str = "lowbit"
    enabled: bool = True
    system_metrics_s: float = 10.0  # seconds between CPU/memory/GPU samples per stage; 0 = off

    def check(self, prefix: str) -> None:
        if not self.uri.startswith(("sqlite:///", "http://", "https://", "databricks", "file:")):
            raise ConfigError(
                f"{prefix}.uri", f"is {self.uri!r}", "sqlite:///PATH.db, http(s)://HOST:PORT"
            )
        if self.system_metrics_s < 0:
            raise ConfigError(
                f"{prefix}.system_metrics_s", f"is {self.system_metrics_s}", "seconds >= 0"
            )


def model_cfg(cfg: DictConfig) -> ModelConfig:
    return parse(cfg.model, ModelConfig, "model")


def data_cfg(cfg: DictConfig) -> DataConfig:
    return parse(cfg.data, DataConfig, "data")


def quant_cfg(cfg: DictConfig) -> QuantConfig:
    return parse(cfg.quant, QuantConfig, "quant")


def tracking_cfg(cfg: DictConfig) -> TrackingConfig:
    return parse(cfg.tracking, TrackingConfig, "tracking")
