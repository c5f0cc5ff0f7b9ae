"""The CPU extension's decode ops (``csrc/decode_ops.cpp``) against torch written out: odd widths
for the vector tails, grouped and plain heads, a cache with a past, several rows, each ISA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline import cpu_ext
from tests.runtime.test_kernels import CODE_ISAS, built


def _ops():
    return cpu_ext.loaded()


@built
@pytest.mark.parametrize("isa", CODE_ISAS)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (3, 70)])
def test_add_rms_norm_adds_in_place_then_normalises(isa, rows, hidden):
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    want_x = x + delta
    want = F.rms_norm(want_x, (hidden,), None, 1e-6) * w
    h = _ops().add_rms_norm(x, delta, w, 1e-6, isa)
    torch.testing.assert_close(x, want_x)  # the residual stream, updated in place
    torch.testing.assert_close(h, want)
    torch.testing.assert_close(_ops().add_rms_norm(x, None, w, 1e-6, isa), want)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin


@built
@pytest.mark.parametrize("isa", CODE_ISAS)
@pytest.mark.parametrize(
    ("heads", "kv", "d", "past", "n"), [(4, 2, 16, 0, 1), (4, 4, 32, 37, 3), (6, 2, 16, 9, 5)]
)
def test_rope_attention_writes_the_cache_and_attends_causally(isa, heads, kv, d, past, n):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(n, (heads + 2 * kv) * d, generator=g)
    angle = torch.rand(n, d // 2, generator=g).repeat(1, 2) * 6
    cos, sin = angle.cos(), angle.sin()
    cap = past + n + 3
    k_cache, v_cache = torch.randn(kv, cap, d, generator=g), torch.randn(kv, cap, d, generator=g)
    old_k = k_cache.clone()
    half = d // 2
    signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # as the lean forward passes
    out = _ops().rope_attention(qkv, cos, signed_sin, k_cache, v_cache, past, heads, 0.3, isa)

    q, k, v = qkv.split([heads * d, kv * d, kv * d], dim=-1)
    q = _rotate(q.view(n, heads, d).transpose(0, 1), cos, sin)  # (heads, n, d)
    k = _rotate(k.view(n, kv, d).transpose(0, 1), cos, sin)
    v = v.view(n, kv, d).transpose(0, 1)
    torch.testing.assert_close(k_cache[:, past : past + n], k)
    torch.testing.assert_close(v_cache[:, past : past + n], v)
    torch.testing.assert_close(k_cache[:, :past], old_k[:, :past])  # the past left as it was
    torch.testing.assert_close(k_cache[:, past + n :], old_k[:, past + n :])
    keys, values = k_cache[:, : past + n], v_cache[:, : past + n]
    mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    want = F.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=mask, scale=0.3, enable_gqa=heads != kv
    )[0]  # (heads, n, d)
    torch.testing.assert_close(out, want.transpose(0, 1).reshape(n, heads * d))


@built
@pytest.mark.parametrize("isa", CODE_ISAS)
@pytest.mark.parametrize(("rows", "inter"), [(1, 96), (2, 75)])
def test_silu_mul_of_side_by_side_gate_and_up(isa, rows, inter):
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(2)) * 6
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(_ops().silu_mul(gate_up, isa), F.silu(gate) * up)


@built
def test_decode_ops_name_what_is_wrong():
    ops, isa = _ops(), cpu_ext.supported()[0]
    qkv, trig = torch.zeros(1, 4 * 8), torch.zeros(1, 8)
    cache = torch.zeros(1, 4, 8)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        ops.rope_attention(qkv, trig, trig, cache, cache, 0, 2, 1.0, isa)
    qkv, trig, cache = torch.zeros(1, 4 * 16), torch.zeros(1, 16), torch.zeros(1, 4, 16)
    with pytest.raises(RuntimeError, match="the cache holds 4 positions, need 5"):
        ops.rope_attention(qkv, trig, trig, cache, cache, 4, 2, 1.0, isa)
    with pytest.raises(RuntimeError, match=r"gate_up must be \(rows, 2 intermediate\)"):
        ops.silu_mul(torch.zeros(1, 5), isa)
