"""The quantized model directory: what `quantize` and `distill` write and later stages load.

Layout (``<stage>/model/``): the FP checkpoint's config.json (plus ``quantization_config``, so
``from_pretrained`` loads it via ``hf_quantizer``) and tokenizer files; ``lowbit_quant.json`` =
``{"format_version": 1, "method", "layers": {name: format}, "kept_columns": {name: k}}``
(unlisted linears are float; ``kept_columns`` only when some are kept); safetensors (HF naming
and index) holding ``QTensor.to_state_dict(P)`` and ``P.bias`` per quantized linear ``P``, other
tensors under their HF names. Parts (one output shard each) are committed atomically into a
staging folder, so a streamed writer holds one segment and a resumed run keeps its parts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from pipeline.errors import LowbitError
from pipeline.models.hf import MULTI_DEVICE_MAPS, load_causal_lm, resolve_dtype
from pipeline.models.qtensor_io import FORMAT_VERSION, QUANT_METHOD
from pipeline.models.shards import CheckpointError, read_safetensors_header
from pipeline.quant.fakequant import FakeQuantLinear
from pipeline.quant.qtensor import QTensor

QUANT_JSON = "lowbit_quant.json"
INDEX = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _is_weight_file(p: Path) -> bool:
    return p.name.endswith(_WEIGHT_SUFFIXES) or p.name in {INDEX, "pytorch_model.bin.index.json"}


class QuantizedWriter:
    """Writes a quantized model directory part by part; ``parts_dir`` (default
    ``out_dir/.parts``) must survive a crash for a resume to keep them."""

    def __init__(self, out_dir: str | Path, parts_dir: str | Path | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.parts_dir = Path(parts_dir) if parts_dir is not None else self.out_dir / ".parts"
        self.parts_dir.mkdir(parents=True, exist_ok=True)

    def part_path(self, k: int) -> Path:
        return self.parts_dir / f"part-{k:05d}.safetensors"

    def has_part(self, k: int) -> bool:
        """Whether part ``k`` was committed (written completely; checked from its header)."""
        path = self.part_path(k)
        if not path.is_file():
            return False
        try:
            read_safetensors_header(path)
        except CheckpointError:
            return False
        return True

    def write_part(
        self,
        k: int,
        tensors: dict[str, Tensor] | None = None,
        qtensors: dict[str, QTensor] | None = None,
    ) -> Path:
        """Commit part ``k`` (float ``tensors``, ``qtensors`` as fields): write, fsync, rename."""
        flat: dict[str, Tensor] = {}
        for name, t in (tensors or {}).items():
            flat[name] = t.detach().to("cpu").contiguous()
        for name, qt in (qtensors or {}).items():
            for key, t in qt.to_state_dict(name).items():
                if key in flat:
                    raise ValueError(f"tensor {key} is written twice in part {k}")
                flat[key] = t.detach().to("cpu").contiguous()
        for key, t in flat.items():  # views of one storage (tied weights) are refused on save
            if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                flat[key] = t.clone()
        final = self.part_path(k)
        tmp = final.with_suffix(".tmp")
        save_file(flat, str(tmp), metadata={"format": "pt"})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return final

    def close(
        self,
        n_parts: int,
        *,
        src_dir: str | Path,
        method: str,
        layers: dict[str, str],
        config_overrides: dict[str, Any] | None = None,
        kept: dict[str, int] | None = None,
    ) -> Path:
        """Assemble parts ``0..n_parts-1`` with ``src_dir``'s config (plus ``config_overrides``)
        and tokenizer into ``out_dir``, and return it."""
        missing = [k for k in range(n_parts) if not self.has_part(k)]
        if missing:
            raise LowbitError(f"quantized parts {missing} are missing in {self.parts_dir}")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        names = [f"model-{k + 1:05d}-of-{n_parts:05d}.safetensors" for k in range(n_parts)]
        if n_parts == 1:
            names = ["model.safetensors"]
        weight_map, total = {}, 0
        for k, name in enumerate(names):
            for key, (_, _, start, stop) in read_safetensors_header(self.part_path(k)).items():
                weight_map[key] = name
                total += stop - start
            _place(self.part_path(k), self.out_dir / name)
        if n_parts > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.out_dir / INDEX).write_text(json.dumps(index, indent=2))
        meta = {"format_version": FORMAT_VERSION, "method": method, "layers": dict(layers)}
        if kept:
            meta["kept_columns"] = dict(kept)
        hf_meta = {"quantization_config": {"quant_method": QUANT_METHOD, **meta}}
        _copy_non_weights(Path(src_dir), self.out_dir, {**(config_overrides or {}), **hf_meta})
        (self.out_dir / QUANT_JSON).write_text(json.dumps(meta, indent=1))
        if self.parts_dir.is_relative_to(self.out_dir):
            shutil.rmtree(self.parts_dir, ignore_errors=True)
        return self.out_dir


def _place(src: Path, dst: Path) -> None:
    """Hard-link (the part stays valid for a resume) or copy across file systems."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _copy_non_weights(src: Path, dst: Path, config_overrides: dict[str, Any]) -> None:
    if not (src / "config.json").is_file():
        raise LowbitError(f"{src} has no config.json: pass the FP checkpoint directory as src_dir")
    for p in src.iterdir():
        if p.is_file() and not _is_weight_file(p):
            shutil.copy2(p, dst / p.name)
    if config_overrides:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_overrides)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def read_quant_meta(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``lowbit_quant.json`` of a quantized model directory (validated)."""
    path = Path(model_dir) / QUANT_JSON
    if not path.is_file():
        raise LowbitError(f"{path} is missing: {model_dir} is not a lowbit quantized model")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise LowbitError(
            f"{path} is not valid JSON ({err}); re-run the stage that wrote it"
        ) from err
    if meta.get("format_version") != FORMAT_VERSION or not isinstance(meta.get("layers"), dict):
        raise LowbitError(
            f"{path} has format_version {meta.get('format_version')!r} or no 'layers'; this "
            f"lowbit reads version {FORMAT_VERSION}: re-run the stage that wrote it"
        )
    return meta


def _read_weights(model_dir: Path, device: torch.device | str = "cpu") -> dict[str, Tensor]:
    if (model_dir / INDEX).is_file():
        weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise LowbitError(f"{model_dir} has no *.safetensors weights")
    state: dict[str, Tensor] = {}
    for f in files:
        if not f.is_file():
            raise LowbitError(f"shard {f} named in {model_dir / INDEX} is missing")
        read_safetensors_header(f)  # a truncated or corrupt shard fails naming the file
        state.update(load_file(str(f), device=str(device)))
    return state


def load_quantized(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    **fake_quant_kwargs: Any,
) -> nn.Module:
    """A quantized model directory as a transformers model in eval mode, each quantized
    linear a ``FakeQuantLinear`` (``fake_quant_kwargs``) on exactly the stored weights.

    ``dtype`` is the float tensors' ("auto": the FP checkpoint's); ``from_pretrained`` gives
    the same model but takes no ``fake_quant_kwargs``, which the training stages need.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.models import hf_quantizer

    hf_quantizer.register()  # config.json names the lowbit quant_method
    model_dir = Path(model_dir)
    meta = read_quant_meta(model_dir)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    dtype = resolve_dtype(dtype)
    if dtype == "auto":
        dtype = _stored_dtype(config)
    state = _read_weights(model_dir, device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, fmt in meta["layers"].items():
        try:
            qt = QTensor.from_state_dict(state, name)
        except KeyError as err:
            raise LowbitError(f"{model_dir}: {QUANT_JSON} lists {name}, but {err}") from None
        if qt.fmt.name != fmt:
            raise LowbitError(f"{model_dir}: {name} is stored as {qt.fmt.name}, listed as {fmt}")
        for key in qt.to_state_dict(name):
            state.pop(key)
        bias = state.pop(f"{name}.bias", None)
        module = FakeQuantLinear.from_qtensor(qt, bias, **fake_quant_kwargs)
        model.set_submodule(name, module)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise LowbitError(
            f"{model_dir} holds tensors the model does not have: {result.unexpected_keys[:5]}"
        )
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    _rebuild_meta_buffers(model, device)
    left = [n for n, t in model.named_parameters() if t.is_meta]
    if left:
        raise LowbitError(f"{model_dir} lacks tensors {left[:5]}: the directory is incomplete")
    return model.eval()


def _stored_dtype(config) -> torch.dtype:
    """The dtype config.json records for the FP checkpoint (float32 when it records none)."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) else torch.float32


def _rebuild_meta_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Recreate computed (non-persistent) buffers, e.g. rotary ``inv_freq``, left on meta."""
    for name, module in list(model.named_modules()):
        own = [b for b in module.buffers(recurse=False) if b is not None and b.is_meta]
        if own and not any(p.is_meta for p in module.parameters(recurse=False)):
            with torch.device(device):
                fresh = type(module)(config=model.config)
            model.set_submodule(name, fresh)


def quantized_modules(model: nn.Module) -> dict[str, FakeQuantLinear]:
    """``{name: module}`` of every FakeQuantLinear in ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}


def save_quantized_model(
    model: nn.Module,
    out_dir: str | Path,
    src_dir: str | Path,
    method: str,
    shard_bytes: int = 2 << 30,
) -> Path:
    """Write a model with FakeQuantLinear layers (``to_qtensor()``) as a quantized directory."""
    qmods = quantized_modules(model)
    layers = {name: m.fmt.name for name, m in qmods.items()}
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    overrides = {}
    if tied and "lm_head" in qmods:
        overrides["tie_word_embeddings"] = False  # a quantized head is its own tensor now
    skip = tuple(f"{n}." for n in qmods)
    items: list[tuple[str, Tensor | QTensor]] = []
    for key, t in model.state_dict().items():
        if key.startswith(skip) or (tied and "lm_head" not in qmods and key == "lm_head.weight"):
            continue
        items.append((key, t))
    for name, m in qmods.items():
        items.append((name, m.to_qtensor()))
        if m.bias is not None:
            items.append((f"{name}.bias", m.bias.detach()))
    writer = QuantizedWriter(out_dir)
    k, size, floats, quants = 0, 0, {}, {}
    for key, t in items:
        nbytes = sum(v.numel() * v.element_size() for v in _tensors_of(key, t))
        if size and size + nbytes > shard_bytes:
            writer.write_part(k, floats, quants)
            k, size, floats, quants = k + 1, 0, {}, {}
        (quants if isinstance(t, QTensor) else floats)[key] = t
        size += nbytes
    writer.write_part(k, floats, quants)
    kept = {n: m.keep_idx.numel() for n, m in qmods.items() if m.keep_idx is not None}
    return writer.close(
        k + 1, src_dir=src_dir, method=method, layers=layers, config_overrides=overrides, kept=kept
    )


def _tensors_of(key: str, t: Tensor | QTensor) -> list[Tensor]:
    return list(t.to_state_dict(key).values()) if isinstance(t, QTensor) else [t]


def is_quantized_dir(path: Path | str) -> bool:
    """Whether `path` is a lowbit quantized model directory (else an HF one)."""
    return (Path(path) / QUANT_JSON).is_file()


def load_model(
    path: Path | str,
    allow_bin: bool,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str | None = None,
    device_map: str | dict | None = None,
):
    """A causal LM from an HF dir or a lowbit quantized dir (read onto ``device``, no map);
    arguments as in :func:`pipeline.models.hf.load_causal_lm`."""
    if is_quantized_dir(path):
        if isinstance(device_map, dict) or device_map in MULTI_DEVICE_MAPS:
            raise LowbitError(
                f"model.device_map={device_map!r} splits a model across devices; {path} is a "
                "lowbit quantized directory, loaded whole on one device: set model.device_map "
                "to a device (cuda:0) or null"
            )
        return load_quantized(path, dtype, device_map or device or "cpu")
    return load_causal_lm(path, dtype, allow_bin, device, device_map)
