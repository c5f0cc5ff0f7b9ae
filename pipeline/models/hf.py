"""Whole-model HF helpers: load/save checkpoints and tokenizers, build the bootstrap models.

For models that fit (streaming is ``checkpoint.py``). Every load passes
``local_files_only=True``: nothing is downloaded, and lowbit sets no HF_* variable.
``load_causal_lm`` defaults to float32 because its training callers need fp32 master weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pipeline.config import ModelSpec
from pipeline.errors import LowbitError, first_line
from pipeline.hardware import compute_dtype, warn_if_emulated
from pipeline.models.adapters import UnsupportedArchitectureError, get_adapter, supported
from pipeline.models.shards import (
    CheckpointError,
    CheckpointNotFoundError,
    check_finite,
    read_json,
    tensor_locations,
    weight_files,
    weight_map,
)
from pipeline.progress import progress

log = logging.getLogger(__name__)


def check_checkpoint(path: Path, allow_bin: bool = False, key: str | None = None) -> None:
    """One clear line for a directory that is not a checkpoint lowbit can load and quantize.

    Reads headers only, so it runs before any compute; messages start with ``key=path``.
    """
    path = Path(path)
    where = f"{key}={path}" if key else str(path)
    if not (path / "config.json").is_file():
        raise CheckpointNotFoundError(
            f"{where} is not a HF checkpoint: config.json is missing; point it at a directory "
            "written by save_pretrained (config.json + *.safetensors + tokenizer files)"
        )
    try:
        _check_architecture(read_json(path / "config.json"))
        files, index, is_bin = weight_files(path, allow_bin=True)
        if is_bin and not allow_bin:
            raise CheckpointError(
                "holds only pickled .bin weights, which can run code when loaded; convert them "
                f"once with `python -m pipeline.models.shards {path} OUT_DIR`, or set "
                "model.allow_bin=true if you trust them"
            )
        if not is_bin:  # pickles cannot be checked without unpickling them
            # a truncated or corrupt shard, or one the index does not describe, fails here
            tensor_locations(files, index)
    except CheckpointNotFoundError as err:
        raise CheckpointNotFoundError(
            f"{where}: {err}; copy the complete checkpoint there (all its *.safetensors)"
        ) from None
    except LowbitError as err:
        # The shard-level messages name the file and the fix; prefix the setting that chose it.
        raise type(err)(f"{where}: {err}") from None


def _check_architecture(config: dict) -> None:
    from transformers import __version__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        raise CheckpointError(
            "config.json has no model_type; re-save the checkpoint with save_pretrained"
        )
    get_adapter(config)  # lowbit's own limit: the families its streaming quantizer addresses
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not a causal LM that the installed transformers "
            f"{__version__} knows (a remote-code model?); use a checkpoint of one of: "
            f"{', '.join(supported())}"
        )


# The dtypes a checkpoint may be loaded in (model.<role>.dtype); "auto" keeps the stored one.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# device_map values that spread one model over several devices (accelerate's planners).
MULTI_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    """``torch.float32`` for "float32" (and for a torch dtype); "auto" stays "auto"."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in DTYPES:
        raise LowbitError(f"dtype {dtype!r} is not one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def placement(device=None, device_map=None) -> dict:
    """``from_pretrained``'s ``device_map`` kwargs for loading onto ``device``, or ``{}`` (CPU:
    without accelerate, the caller moves the model)."""
    from transformers.utils import is_accelerate_available

    if device_map is not None:
        if not is_accelerate_available():
            raise LowbitError(
                f"model.device_map={device_map!r} needs accelerate, which is not installed: "
                "`pip install accelerate`, or set model.device_map=null"
            )
        return {"device_map": device_map}
    if device is None or torch.device(device).type == "cpu" or not is_accelerate_available():
        return {}
    return {"device_map": torch.device(device)}


def load_causal_lm(
    path: Path | str,
    dtype: torch.dtype | str = torch.float32,
    allow_bin: bool = False,
    device: torch.device | str | None = None,
    device_map: str | dict | None = None,
):
    """A local HF checkpoint as a transformers model in eval mode; ``dtype`` "auto" keeps the
    saved one, ``device_map`` overrides ``device``."""
    from transformers import AutoModelForCausalLM

    from pipeline.models import hf_quantizer

    hf_quantizer.register()  # a checkpoint with a lowbit quantization_config loads as well
    check_checkpoint(Path(path), allow_bin)
    where = placement(device, device_map)
    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=resolve_dtype(dtype),
        use_safetensors=not allow_bin,
        local_files_only=True,
        **where,
    )
    _check_finite(model, Path(path))
    if device is not None and not where:
        model = model.to(device)
    # bf16/fp16 only where the device computes it natively; judged once the device is known
    if device is not None or device_map is not None:
        if dtype == "auto":
            model = model.to(compute_dtype(model.dtype, model.device.type, "model.dtype=auto"))
        else:
            warn_if_emulated(model.dtype, model.device.type, "model.dtype")
    log.info("loaded %s: %s on %s", path, model.dtype, model.device)  # what the stage runs in
    return model.eval()


def _check_finite(model, path: Path) -> None:
    """One line naming the first NaN/Inf parameter and its file, before any compute."""
    files, index, _ = weight_files(path, allow_bin=True)
    homes = weight_map(index) if index else {}
    other = files[0] if len(files) == 1 else path  # for a renamed or tied parameter
    for name, param in model.named_parameters():
        check_finite(param, name, path / homes[name] if name in homes else other)


# Any of these next to config.json means the tokenizer was saved; its load error then matters.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.*")


def load_tokenizer(path: Path | str, key: str | None = None):
    """The checkpoint's tokenizer, with a pad token; one clear line when it does not load."""
    from transformers import AutoTokenizer

    where = f"{key}={path}" if key else str(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers, tokenizers, sentencepiece and json each raise theirs
        if not any(any(Path(path).glob(p)) for p in _TOKENIZER_FILES):
            # transformers would blame a missing sentencepiece/tiktoken, which is not the cause.
            raise LowbitError(
                f"{where} holds no tokenizer files (tokenizer.json, tokenizer_config.json, "
                "tokenizer.model); save the model's tokenizer there with save_pretrained"
            ) from None
        raise LowbitError(
            f"{where}: the tokenizer does not load ({type(err).__name__}: {first_line(err)}); "
            "re-save it with the model's tokenizer.save_pretrained"
        ) from err
    if tok.eos_token_id is None:
        raise LowbitError(
            f"{where}: the tokenizer has no EOS token; set eos_token in tokenizer_config.json"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def vocabulary_difference(target, draft) -> str | None:
    """Where two tokenizers' vocabularies differ, in words; None when they are the same
    (config vocab_size may still differ: it is the padded embedding)."""
    a, b = target.get_vocab(), draft.get_vocab()
    if a == b:
        return None
    by_id_a, by_id_b = {i: t for t, i in a.items()}, {i: t for t, i in b.items()}
    first = next(
        (i for i in sorted(by_id_a.keys() | by_id_b.keys()) if by_id_a.get(i) != by_id_b.get(i)),
        None,
    )
    where = (
        f"the first differing id is {first}: {by_id_a.get(first)!r} in the target, "
        f"{by_id_b.get(first)!r} in the draft"
        if first is not None
        else "the same ids carry different tokens"  # a vocabulary with duplicate ids
    )
    return f"{len(target)} tokens in the target, {len(draft)} in the draft; {where}"


def train_tokenizer(docs: list[str], vocab_size: int):
    """A byte-level BPE trained on `docs` (seconds on a few MB), wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=specials[0], bos_token=specials[0], pad_token=specials[1]
    )


def llama_config(spec: ModelSpec, tokenizer, max_positions: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def new_llama(spec: ModelSpec, tokenizer, max_positions: int, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(spec, tokenizer, max_positions))


def save_hf(model, tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


@torch.no_grad()
def input_device(model: torch.nn.Module) -> torch.device:
    """Where ``model`` takes its input ids: its input embeddings' device (a device map's first)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    param = next((embed or model).parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def perplexity(model, windows: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) over the windows. windows: (W, T)"""
    model.eval()
    total, count = 0.0, 0
    device = input_device(model)
    for i in progress(range(0, windows.shape[0], batch_size), "perplexity", unit="batch"):
        x = windows[i : i + batch_size].to(device)
        logits = model(input_ids=x).logits[:, :-1].float()  # (B, T-1, V)
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += x[:, 1:].numel()
    return float(torch.exp(torch.tensor(total / count)))
