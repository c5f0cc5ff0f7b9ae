"""StreamingCheckpoint: streamed block-by-block forward == fully loaded HF model."""

from __future__ import annotations

import pytest
import torch

import pipeline.models.checkpoint as ckpt_mod
from pipeline.models import StreamingCheckpoint, attention_kind


def streamed_logits(ck: StreamingCheckpoint, ids: torch.Tensor) -> torch.Tensor:
    """embeddings -> blocks -> norm -> lm_head, one module loaded at a time."""
    with torch.no_grad():
        h = ck.load_embeddings()(ids)  # (B, T, C)
        for i in range(ck.num_layers):
            h = ck.load_block(i)(h, **ck.block_forward_inputs(h.shape, layer_idx=i))
        return ck.load_lm_head()(ck.load_norm()(h))  # (B, T, V)


def reference_logits(path, ids: torch.Tensor, attn: str) -> torch.Tensor:
    full = StreamingCheckpoint(path, attn_implementation=attn).full_model(torch.float32)
    with torch.no_grad():
        return full(ids).logits


IDS = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("key", ["llama", "llama_tied", "mistral", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_streamed_logits_match_full_model(hf_dirs, key, attn):
    ck = StreamingCheckpoint(hf_dirs[key], attn_implementation=attn)
    # The reference always uses the other kernel, so our masks are checked against HF's.
    ref = reference_logits(hf_dirs[key], IDS, "eager" if attn == "sdpa" else "sdpa")
    out = streamed_logits(ck, IDS)
    assert out.shape == (2, 10, 61)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_synthetic_checkpoint_matches_full_model(llama_dir):
    ck = StreamingCheckpoint(llama_dir)
    assert ck.verify()["files"] > 3  # really multi-shard
    torch.testing.assert_close(
        streamed_logits(ck, IDS), reference_logits(llama_dir, IDS, "sdpa"), atol=1e-5, rtol=1e-5
    )


def test_sliding_window_mask_is_used(hf_dirs):
    """A full causal mask where the window applies changes the output (sequence > window)."""
    ck = StreamingCheckpoint(hf_dirs["qwen2"], attn_implementation="eager")
    assert [attention_kind(ck.config, i) for i in range(3)] == [
        "full_attention", "sliding_attention", "sliding_attention",
    ]  # fmt: skip
    block, h = ck.load_block(1), torch.randn(1, 10, 32)
    with torch.no_grad():
        windowed = block(h, **ck.block_forward_inputs(10, layer_idx=1))
        full = block(h, **ck.block_forward_inputs(10, layer_idx=0))
    assert not torch.allclose(windowed, full, atol=1e-4)


def test_tied_lm_head_is_the_embedding(hf_dirs):
    ck = StreamingCheckpoint(hf_dirs["llama_tied"])
    assert "lm_head.weight" not in ck
    torch.testing.assert_close(ck.load_lm_head().weight, ck.load_embeddings().weight)


def test_qwen2_blocks_carry_qkv_biases(hf_dirs):
    attn = StreamingCheckpoint(hf_dirs["qwen2"]).load_block(0).self_attn
    assert all(getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
    assert attn.o_proj.bias is None
    assert attn.q_proj.bias.abs().sum() > 0  # real values, not an initialiser's zeros


def test_load_block_reads_and_allocates_only_that_block(llama_dir, monkeypatch):
    read: list[str] = []
    real_read = ckpt_mod.read_tensors

    def recording_read(file, entries):  # records every tensor materialised from disk
        read.extend(entries)
        return real_read(file, entries)

    monkeypatch.setattr(ckpt_mod, "read_tensors", recording_read)
    ck = StreamingCheckpoint(llama_dir)
    assert read == []  # opening reads headers only
    block = ck.load_block(1)
    assert read and all(n.startswith("model.layers.1.") for n in read)
    assert len(read) == len(block.state_dict())

    h, kv, inter = 32, 2 * (32 // 4), 48  # hidden, kv_heads * head_dim, intermediate
    expected = (2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h) * 4  # fp32 bytes
    params = list(block.parameters())
    assert sum(p.numel() * p.element_size() for p in params) == expected == ck.block_nbytes(1)
    # Each parameter owns exactly its bytes: no view into a whole shard or a larger buffer.
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in params)
    assert not any(p.is_meta for p in params)
    assert block.self_attn.layer_idx == 1


def test_load_blocks_and_dtype_cast(llama_dir):
    ck = StreamingCheckpoint(llama_dir, dtype=torch.bfloat16)
    blocks = [ck.load_block(1), ck.load_block(2)]
    assert [b.self_attn.layer_idx for b in blocks] == [1, 2]
    assert {p.dtype for b in blocks for p in b.parameters()} == {torch.bfloat16}
    kwargs = ck.block_forward_inputs((4, 6, 32))
    assert kwargs["position_embeddings"][0].dtype == torch.bfloat16
    with torch.no_grad():  # kwargs for T broadcast over any batch size
        out = blocks[0](torch.randn(4, 6, 32, dtype=torch.bfloat16), **kwargs)
    assert out.shape == (4, 6, 32)
    with pytest.raises(IndexError, match="3 layers"):
        ck.load_block(3)


def test_tensor_materialises_one_tensor(llama_dir):
    ck = StreamingCheckpoint(llama_dir)
    assert ck.tensor("model.norm.weight").shape == (32,)
    with pytest.raises(KeyError, match="model.nope"):
        ck.tensor("model.nope")


@pytest.mark.gpu
def test_streamed_on_cuda_matches_cpu(hf_dirs):
    ck = StreamingCheckpoint(hf_dirs["qwen2"], device="cuda")
    out = streamed_logits(ck, IDS.cuda())
    assert out.device.type == "cuda"
    torch.testing.assert_close(
        out.cpu(), reference_logits(hf_dirs["qwen2"], IDS, "eager"), atol=1e-4, rtol=1e-4
    )
