"""A lean inference forward for Llama-shaped causal LMs (docs/kernels.md): the model's own
modules, called without transformers' per-step bookkeeping, on a KV cache written in place.
It speaks ``CachedLM``'s protocol; :func:`lean` wraps only models whose forward it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import cpu_ext

TYPES = ("llama", "mistral", "qwen2")  # model types whose decoder layer is this forward
FUSED_ROWS = 12  # rows up to which a CPU forward runs the extension's decode ops (decode, verify)
FUSED_SPAN = 2 * FUSED_ROWS  # run as FUSED_ROWS chunks: beats torch up to ~24 rows (2 cores)


class LeanCache:
    """Per-layer keys and values (B, kv_heads, capacity, head_dim), written in place; the
    capacity doubles when full. ``crop`` as transformers' caches: keep n, or drop -n."""

    def __init__(self, layers: int) -> None:
        self.k: list[Tensor | None] = [None] * layers
        self.v: list[Tensor | None] = [None] * layers
        self.length = 0

    def get_seq_length(self, layer: int = 0) -> int:
        return self.length

    def crop(self, n: int) -> None:
        self.length = max(0, self.length + n if n < 0 else min(n, self.length))

    def room(self, i: int, like: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """Layer ``i``'s whole key and value buffers, grown to hold ``n`` more positions of
        ``like``'s (B, kv, *, d) shape, dtype and device (the held ones copied over)."""
        end = self.length + n
        held = self.k[i]
        if held is None or held.shape[2] < end or held.shape[0] != like.shape[0]:
            cap = max(64, 2 * end)
            grown_k = like.new_empty(*like.shape[:2], cap, like.shape[3])
            grown_v = torch.empty_like(grown_k)
            if held is not None and held.shape[0] == like.shape[0]:
                grown_k[:, :, : self.length] = held[:, :, : self.length]
                grown_v[:, :, : self.length] = self.v[i][:, :, : self.length]
            self.k[i], self.v[i] = grown_k, grown_v
        return self.k[i], self.v[i]

    def update(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store (B, kv, n, d) at the cache's end; the layer's keys and values so far (views)."""
        end = self.length + k.shape[2]
        keys, values = self.room(i, k, k.shape[2])
        keys[:, :, self.length : end] = k
        values[:, :, self.length : end] = v
        return keys[:, :, :end], values[:, :, :end]


@dataclass
class LeanOutput:
    logits: Tensor
    cache: LeanCache


def fits(model: nn.Module) -> bool:
    """Whether ``model`` is a causal LM whose forward :class:`LeanLM` reproduces."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or inner is None or getattr(config, "model_type", None) not in TYPES:
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False  # windowed attention: a mask the lean path does not build
    if getattr(config, "pretraining_tp", 1) != 1 or not hasattr(inner, "rotary_emb"):
        return False
    param = next(model.parameters(), None)  # NPU: its SDPA's grouped-query path is untested
    if param is None or param.device.type not in ("cpu", "cuda"):
        return False
    return all(_plain_layer(layer) for layer in inner.layers)


def lean(model: nn.Module) -> nn.Module:
    """``model`` behind :class:`LeanLM` where :func:`fits`, else ``model`` itself."""
    return LeanLM(model) if fits(model) else model


class LeanLM(nn.Module):
    """``model``'s inference forward (no grad, no attention mask: every row attends to the
    cache and the rows before it), batch of equal-length rows."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model
        self.config = cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        # q/k/v and gate/up as one call each where they join; lists: not this module's state
        self.qkv = [
            _joined(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in model.model.layers
        ]
        self.gate_up = [
            _joined(layer.mlp, ("gate_proj", "up_proj")) for layer in model.model.layers
        ]
        self.ops = _decode_ops(model, self.head_dim)
        self._table: tuple[Tensor, Tensor] | None = None  # rotary rows by position
        # dynamic (NTK) and long RoPE change their frequencies with the length: no table
        rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
        self.static_rope = rope_type not in ("dynamic", "longrope")
        if self.ops is not None:  # each layer's (qkv, o, gate_up, down) as (rows, in) functions
            self.rows = [
                (
                    _side_by_side(self.qkv[i], layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                    _rows_fn(layer.self_attn.o_proj),
                    _side_by_side(self.gate_up[i], layer.mlp, ("gate_proj", "up_proj")),
                    _rows_fn(layer.mlp.down_proj),
                )
                for i, layer in enumerate(model.model.layers)
            ]
            self.head = _rows_fn(model.lm_head)

    def get_output_embeddings(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        use_cache: bool = True,
        cache: LeanCache | None = None,
        logits_to_keep: int | Tensor = 0,
    ) -> LeanOutput:
        inner = self.hf.model
        cache = cache if cache is not None else LeanCache(len(inner.layers))
        b, n = input_ids.shape
        past = cache.length
        x = inner.embed_tokens(input_ids)
        if position_ids is None and self.static_rope:  # the cache's next positions: table rows
            cos, sin = (t[past : past + n][None] for t in self._rope_table(x, past + n))
        else:
            if position_ids is None:
                position_ids = torch.arange(past, past + n, device=input_ids.device)[None]
            cos, sin = self._rope(x, position_ids)  # (1 | B, n, d)
        half = self.head_dim // 2
        if self.ops is not None and b == 1 and n <= FUSED_SPAN and x.dtype == torch.float32:
            chunks = []  # FUSED_ROWS at a time, each attending to the cache the last one wrote
            for start in range(0, n, FUSED_ROWS):
                end = min(n, start + FUSED_ROWS)
                rows = (x[0, start:end].clone(), cos[0, start:end], sin[0, start:end])
                chunks.append(self._fused(*rows, cache, past + start))
                cache.length = past + end
            x = chunks[0] if len(chunks) == 1 else torch.cat(chunks)  # a step: no copy
            h = _kept(x[None], logits_to_keep)[0]  # (kept, hidden)
            return LeanOutput(self.head(h.contiguous())[None], cache)
        cos, sin = cos[:, None], sin[:, None]
        # row i sees the cache and rows 0..i; a single row sees everything (no mask)
        mask = None
        if n > 1:
            mask = torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(past)
        for i, layer in enumerate(inner.layers):
            attn, h = layer.self_attn, _norm(layer.input_layernorm, x)
            q, k, v = _outputs(self.qkv[i], attn, ("q_proj", "k_proj", "v_proj"), h)
            q = q.view(b, n, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + q.roll(half, -1) * sin
            k = k * cos + k.roll(half, -1) * sin
            k, v = cache.update(i, k, v)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=self.heads != self.kv_heads
            )
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, n, -1))
            mlp, h = layer.mlp, _norm(layer.post_attention_layernorm, x)
            gate, up = _outputs(self.gate_up[i], mlp, ("gate_proj", "up_proj"), h)
            x = x + mlp.down_proj(mlp.act_fn(gate) * up)
        cache.length = past + n
        return LeanOutput(self.hf.lm_head(_norm(inner.norm, _kept(x, logits_to_keep))), cache)

    def _rope(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """The model's rotary cos and sin at ``position_ids``, sin's first half negated:
        rotate_half(t) = cat(-t2, t1) = roll(t, d/2) with that half negated."""
        cos, sin = self.hf.model.rotary_emb(x, position_ids)
        half = self.head_dim // 2
        return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    def _rope_table(self, x: Tensor, end: int) -> tuple[Tensor, Tensor]:
        """:meth:`_rope` of positions 0.. (at least ``end``), kept: read, not computed, a step."""
        table = self._table
        if (
            table is None
            or table[0].shape[0] < end
            or (table[0].dtype, table[0].device) != (x.dtype, x.device)
        ):
            positions = torch.arange(max(256, 2 * end), device=x.device)[None]
            self._table = table = tuple(t[0] for t in self._rope(x, positions))
        return table

    def _fused(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LeanCache, past: int) -> Tensor:
        """The layers on (n, hidden) rows of one sequence, the extension's decode ops between
        the linears' row functions; the final norm's output (n, hidden)."""
        ops, isa = self.ops
        n = x.shape[0]
        delta = None  # the last linear's output, added to the residual stream by the next norm
        like = x.new_empty(1, self.kv_heads, 0, self.head_dim)
        for i, layer in enumerate(self.hf.model.layers):
            qkv, o_proj, gate_up, down = self.rows[i]
            h = ops.add_rms_norm(x, delta, *_weight_eps(layer.input_layernorm), isa)
            keys, values = cache.room(i, like, n)
            o = ops.rope_attention(
                qkv(h), cos, sin, keys[0], values[0], past, self.heads, layer.self_attn.scaling, isa
            )
            h = ops.add_rms_norm(x, o_proj(o), *_weight_eps(layer.post_attention_layernorm), isa)
            delta = down(ops.silu_mul(gate_up(h), isa))
        return ops.add_rms_norm(x, delta, *_weight_eps(self.hf.model.norm), isa)


def _kept(x: Tensor, keep: int | Tensor) -> Tensor:
    """The (B, n, C) rows whose logits are kept: the last ``keep`` (0: all), or those indexed."""
    if isinstance(keep, int):
        return x[:, -keep:] if keep else x
    return x[:, keep]


def _rows_fn(linear: nn.Module) -> Callable[[Tensor], Tensor]:
    """``linear`` on (rows, in) rows: its ``rows_fn`` where it offers one, else the module."""
    fn = getattr(linear, "rows_fn", None)
    return (fn() if fn is not None else None) or linear


def _side_by_side(joined: nn.Module | None, parent: nn.Module, names: tuple[str, ...]):
    """A function of rows giving the linears ``names``' outputs side by side (rows, sum out)."""
    if joined is not None:
        return _rows_fn(joined)
    fns = [_rows_fn(getattr(parent, name)) for name in names]
    return lambda h: torch.cat([fn(h) for fn in fns], dim=-1)


def _weight_eps(norm: nn.Module) -> tuple[Tensor, float]:
    return norm.weight, norm.variance_epsilon


def _decode_ops(model: nn.Module, head_dim: int):
    """(the CPU extension, its ISA) where its decode ops run ``model``'s layers, else None."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        return None
    if head_dim % 16 or getattr(model.config, "hidden_act", None) not in ("silu", "swish"):
        return None
    ext = cpu_ext.extension()  # built at its first use
    return None if ext is None else (ext, cpu_ext.isa())


def _joined(parent: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    """The linears ``names`` of ``parent`` as one layer, where their class can join them."""
    layers = [getattr(parent, name) for name in names]
    join = getattr(type(layers[0]), "joined", None)
    return None if join is None else join(layers)


def _outputs(joined: nn.Module | None, parent: nn.Module, names: tuple[str, ...], h: Tensor):
    """Each linear's output on ``h``: one call of the joined layer split, or one call each."""
    if joined is None:
        return [getattr(parent, name)(h) for name in names]
    return joined(h).split(joined.sizes, dim=-1)


def _norm(norm: nn.Module, x: Tensor) -> Tensor:
    """transformers' RMSNorm (fp32 statistics, then the weight) as torch's one fused op."""
    return (
        F.rms_norm(x.float(), norm.weight.shape, None, norm.variance_epsilon).to(x.dtype)
        * norm.weight
    )


def _plain_layer(layer: nn.Module) -> bool:
    """Whether a decoder layer has exactly the modules :meth:`LeanLM.forward` calls."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (
        getattr(layer, "input_layernorm", None),
        getattr(layer, "post_attention_layernorm", None),
    )
    return (
        all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling"))
        and not hasattr(attn, "q_norm")  # Qwen3-style per-head norms: not this forward
        and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        and all(hasattr(n, "variance_epsilon") for n in norms)
    )
