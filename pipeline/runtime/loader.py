"""Load an exported artifact (ascend / lowbit layout) and generate text with it.

``load`` verifies every manifest file before reading a weight and builds the model on the meta
device with the backend's quantized linears, so memory stays near the artifact's size.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pipeline.artifact.lowbit_format import LayerInfo, unpack_linear
from pipeline.artifact.manifest import ArtifactError, read_manifest, safe_relpath, verify
from pipeline.data.chat import render, require_template, user_turn
from pipeline.runtime import float_rows
from pipeline.runtime.backends import kernel_summary, make_linear, resolve
from pipeline.runtime.hf_generate import check_options, eos_ids, hf_generate
from pipeline.speculative.adaptive import AdaptiveGamma
from pipeline.speculative.cost import measure_cost_ratio, measure_verify_cost
from pipeline.speculative.decoding import SpecStats, plain_generate, speculative_generate
from pipeline.speculative.pipelined import pipelined_generate

log = logging.getLogger(__name__)
GAMMAS = (2, 3, 4, 5)  # the adaptive draft lengths
GENERATION_CONFIG = "generation_config.json"  # its eos list ends a generation (eos_ids)


@dataclass
class Generation:
    """Generated text, its token ids (new tokens only) and the decoding statistics."""

    text: str
    tokens: list[int]
    stats: SpecStats


@dataclass
class Runtime:
    """A loaded artifact: ``model`` (transformers causal LM with quantized linears)."""

    root: Path
    model: nn.Module
    tokenizer: object
    manifest: dict
    backend: str
    device: torch.device
    draft: Runtime | None = None
    layers: dict[str, LayerInfo] = field(default_factory=dict)
    cost_ratio: float | None = None  # draft step / target step, measured at the first use
    verify_cost: dict[int, float] = field(default_factory=dict)  # gamma -> v, likewise
    # Adaptive decoding's acceptance window, kept across prompts.
    adaptive: AdaptiveGamma | None = None

    @property
    def kernels(self) -> dict[str, str]:
        """{quantized layer: the kernel it runs}, read from the model's layers."""
        return {n: self.model.get_submodule(n).kernel for n in self.layers}

    def encode(self, prompt: str, chat: bool = False) -> torch.Tensor:
        """(1, T) prompt ids on the device; ``chat`` applies the tokenizer's chat template."""
        if chat:
            fix = "pass the prompt without --chat / chat=True, already formatted, or export from "
            fix += "a model whose tokenizer has one"
            require_template(self.tokenizer, str(self.root), fix, ArtifactError)
            prompt = render(self.tokenizer, user_turn(prompt), generation_prompt=True)
        ids = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=not chat).input_ids
        if ids.shape[1] == 0:
            ids = torch.tensor([[self.tokenizer.bos_token_id or 0]])
        return ids.to(self.device)

    def kernel_summary(self) -> str:
        """e.g. "int4pack x12, reference x2": what the quantized linears run."""
        return kernel_summary(self.model)

    @torch.no_grad()
    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        *,
        speculative: bool = True,
        gamma: int | None = None,
        seed: int = 0,
        pipelined: bool = False,
        temperature_schedule: bool = False,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: str | Sequence[str] = (),
        stream: bool = False,
        chat: bool = False,
    ) -> Generation:
        """Continue ``prompt`` (temperature 0 = greedy).

        ``top_p``, ``top_k``, ``stop`` (the text ends with the first, included) or ``stream``
        decode through transformers' ``generate``, the draft as its assistant. Otherwise lowbit's
        engine decodes plainly or with the draft (``speculative``) at a fixed ``gamma`` or an
        adaptive one (None), optionally ``pipelined`` (fixed gamma) or with the draft on the
        reinforce stage's ``temperature_schedule``. ``chat`` applies the chat template.

        Raises:
            ValueError: an option out of range, or engine and transformers options mixed.
            ArtifactError: ``chat`` with a tokenizer that has no chat template.
        """
        stop = [stop] if isinstance(stop, str) else list(stop)
        use_hf = check_options(
            temperature, top_p, top_k, stop, stream, gamma, pipelined, temperature_schedule
        )
        ids = self.encode(prompt, chat)
        draft = self.draft.model if speculative and self.draft is not None else None
        if use_hf:
            text, new, stats = hf_generate(
                self.model,
                self.tokenizer,
                ids,
                max_new_tokens,
                temperature,
                draft=draft,
                top_p=top_p,
                top_k=top_k,
                stop=stop,
                stream=stream,
                seed=seed,
            )
            return Generation(text, new, stats)
        seq, stats = self._decode(
            ids, draft, max_new_tokens, temperature, gamma, seed, pipelined, temperature_schedule
        )
        new = seq[0, ids.shape[1] :].tolist()
        return Generation(self.tokenizer.decode(new, skip_special_tokens=True), new, stats)

    def _decode(
        self,
        ids: torch.Tensor,
        draft: nn.Module | None,
        max_new_tokens: int,
        temperature: float,
        gamma: int | None,
        seed: int,
        pipelined: bool,
        temperature_schedule: bool,
    ) -> tuple[torch.Tensor, SpecStats]:
        """lowbit's engine: plain, speculative or pipelined speculative decoding."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        eos = eos_ids(self.model, self.tokenizer)
        if draft is not None and pipelined:
            seq, stats = pipelined_generate(
                self.model,
                draft,
                ids,
                max_new_tokens,
                gamma=gamma or 4,
                temperature=temperature,
                generator=gen,
                eos_token_id=eos,
                temperature_schedule=temperature_schedule,
            )
        elif draft is not None:
            seq, stats = speculative_generate(
                self.model,
                draft,
                ids,
                max_new_tokens,
                gamma=gamma or 4,
                adaptive=None if gamma is not None else self._adaptive(ids),
                temperature=temperature,
                generator=gen,
                eos_token_id=eos,
                temperature_schedule=temperature_schedule,
            )
        else:
            seq, stats = plain_generate(self.model, ids, max_new_tokens, temperature, gen, eos)
        return seq, stats

    def _adaptive(self, ids: torch.Tensor) -> AdaptiveGamma:
        """The shared draft-length controller; measures c and v(gamma) on first use."""
        if self.cost_ratio is None:
            self.cost_ratio = measure_cost_ratio(self.model, self.draft.model, input_ids=ids)
            self.verify_cost = measure_verify_cost(self.model, GAMMAS, input_ids=ids)
        if self.adaptive is None:
            self.adaptive = AdaptiveGamma(
                GAMMAS[0], GAMMAS[-1], cost_ratio=self.cost_ratio, verify_cost=self.verify_cost,
                timed=True,
            )  # fmt: skip
        return self.adaptive


def _float_dtype(device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.float32 if device.type == "cpu" else torch.float16  # fp16 kernels on NPU/GPU


def _rebuild_meta_buffers(model: nn.Module) -> None:
    """Recreate computed (non-persistent) buffers left on meta, e.g. rotary ``inv_freq``."""
    for name, module in list(model.named_modules()):
        own = [b for b in module.buffers(recurse=False) if b is not None and b.is_meta]
        if own and not any(p.is_meta for p in module.parameters(recurse=False)):
            with torch.device("cpu"):
                model.set_submodule(name, type(module)(config=model.config))


def _read_tensors(root: Path, manifest: dict) -> dict[str, torch.Tensor]:
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, entry in manifest.get("tensors", {}).items():
        by_file[entry["file"]].append(name)
    state = {}
    for rel, names in by_file.items():
        if rel not in manifest["files"]:
            raise ArtifactError(f"{root}: weights file {rel} is not covered by manifest.json")
        with safe_open(str(safe_relpath(root, rel)), framework="pt") as f:
            for name in names:
                state[name] = f.get_tensor(name)
    return state


def _read_manifest(root: Path, verify_hashes: bool, links_within: Path | None) -> dict:
    """The manifest, after checking paths (and hashes) and that lowbit-run reads its format."""
    manifest = verify(root, None, links_within) if verify_hashes else read_manifest(root)
    for rel in manifest["files"]:
        safe_relpath(root, rel)
    if manifest.get("format") not in ("ascend", "lowbit"):
        raise ArtifactError(
            f"{root} is a {manifest.get('format')!r} artifact; lowbit-run loads the ascend and "
            "lowbit formats (serve compressed-tensors checkpoints with vLLM)"
        )
    return manifest


def _build_model(
    root: Path,
    manifest: dict,
    layers: dict[str, LayerInfo],
    backend: str,
    dev: torch.device,
    dtype: torch.dtype,
    kernel: str,
) -> nn.Module:
    """The model skeleton on meta, quantized linears swapped in, float tensors assigned."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(root, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = _read_tensors(root, manifest)
    for lname, info in layers.items():
        prefix = f"{lname}."
        local = {k[len(prefix) :]: state.pop(k) for k in list(state) if k.startswith(prefix)}
        bias = local.pop("bias", None)
        codes = unpack_linear(local, info)
        bias = None if bias is None else bias.to(dtype)
        layer = make_linear(backend, codes, bias, dtype, kernel=kernel, device=dev, name=lname)
        model.set_submodule(lname, layer)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise ArtifactError(
            f"{root} holds tensors the model has no place for: {result.unexpected_keys[:5]}"
        )
    if (root / GENERATION_CONFIG).is_file():  # from_config derives one from config.json only
        model.generation_config = GenerationConfig.from_pretrained(root, local_files_only=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    _rebuild_meta_buffers(model)
    missing = [n for n, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise ArtifactError(f"{root} lacks tensors {missing[:5]}; export the artifact again")
    model = model.to(dev).eval()
    if backend == "torch" and kernel == "auto":
        float_rows.convert(model)  # float32 CPU linears (lm_head): few-row calls read W once
    return model


def load(
    artifact_dir: str | Path,
    backend: str = "auto",
    *,
    draft: str | Path | None = "auto",
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    verify_hashes: bool = True,
    kernel: str = "auto",
) -> Runtime:
    """Load an ascend / lowbit artifact (``<run_dir>/export/artifact``, or a hub id whose
    snapshot is in the local HF cache).

    Args:
        backend: "auto" (torch_npu when importable, else torch), "torch" or "npu".
        draft: "auto" loads the artifact's own draft if any; a path loads that one; None: none.
        device, dtype: Override the backend's device and float dtype (CPU: float32, else fp16).
        verify_hashes: Check every file's sha256 first (paths are always checked).
        kernel: torch backend: "auto" (docs/kernels.md) or "reference" (dequantize per call).

    Raises:
        ArtifactError: a missing, corrupt or tampered file, or a path outside the artifact.
    """
    from transformers import AutoTokenizer

    from pipeline.hub import local_dir

    root = local_dir(str(artifact_dir), None, "artifact")  # or one pushed to the hub, cached
    # A hub snapshot's files are links to its repo's blobs (snapshots/<commit>/../../blobs).
    from_hub = root.parents[1] if root != Path(artifact_dir) else None
    manifest = _read_manifest(root, verify_hashes, from_hub)
    name, dev = resolve(backend)
    dev = torch.device(device if device is not None else dev)
    dtype = _float_dtype(dev, dtype)
    layers = {n: LayerInfo.from_json(d) for n, d in manifest.get("layers", {}).items()}
    model = _build_model(root, manifest, layers, name, dev, dtype, kernel)
    tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
    rt = Runtime(root, model, tokenizer, manifest, name, dev, layers=layers)
    if draft == "auto":
        draft = safe_relpath(root, manifest["draft"]["path"]) if manifest.get("draft") else None
        verify_draft = False  # the parent manifest already hashed the draft's files
    else:
        verify_draft = verify_hashes
    if draft is not None:
        rt.draft = load(
            draft,
            backend,
            draft=None,
            device=dev,
            dtype=dtype,
            verify_hashes=verify_draft,
            kernel=kernel,
        )
    log.info(
        "runtime: loaded %s (%d quantized linears: %s; backend %s on %s)%s",
        root,
        len(layers),
        rt.kernel_summary() or "none",
        name,
        dev,
        " with a draft" if rt.draft else "",
    )
    return rt
