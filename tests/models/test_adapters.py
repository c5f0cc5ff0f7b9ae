"""Adapters: supported families, full linear names, fused groups, attention kinds."""

from __future__ import annotations

import pytest

from pipeline.models import attention_kind, fused_groups, get_adapter, linear_names
from pipeline.models.synthetic import synthetic_config

SIZES = dict(hidden=16, layers=2, intermediate=32, heads=2, kv_heads=1, vocab=11)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_adapter_builds_the_family_layer(arch):
    config = synthetic_config(arch=arch, **SIZES)
    adapter = get_adapter(config)
    assert adapter.name == arch
    # Every listed linear exists in the real decoder layer, with the family's class name.
    layer = adapter.decoder_layer_class()(config, layer_idx=0)
    assert type(layer).__name__.lower().startswith(arch)
    modules = dict(layer.named_modules())
    assert all(type(modules[n]).__name__ == "Linear" for n in adapter.linears)
    assert sorted(adapter.linears) == sorted(
        n for n, m in modules.items() if type(m).__name__ == "Linear"
    )


def test_linear_names_cover_the_hf_model():
    from transformers import AutoModelForCausalLM

    config = synthetic_config(arch="qwen2", **SIZES)
    model = AutoModelForCausalLM.from_config(config)
    hf = [n for n, m in model.named_modules() if type(m).__name__ == "Linear"]
    names = linear_names(model)
    assert names == hf  # same names, same (execution) order, lm_head last
    assert names[0] == "model.layers.0.self_attn.q_proj" and names[-1] == "lm_head"
    assert linear_names(config, include_lm_head=False) == names[:-1]
    assert linear_names(config.to_dict()) == names  # a plain config.json dict works too


def test_fused_groups_have_full_names():
    groups = fused_groups(synthetic_config(arch="llama", **SIZES))
    assert len(groups) == 2 * 2
    assert groups[0] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert groups[3] == ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]


def test_unsupported_config_lists_supported():
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*supported: LlamaForCausalLM"):
        get_adapter({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_attention_kind_per_family():
    llama = synthetic_config(arch="llama", **SIZES)
    mistral_v01 = synthetic_config(arch="mistral", sliding_window=4096, **SIZES)
    mistral_v03 = synthetic_config(arch="mistral", sliding_window=None, **SIZES)
    assert attention_kind(llama, 1) == "full_attention"
    assert attention_kind(mistral_v01, 0) == "sliding_attention"
    assert attention_kind(mistral_v03, 0) == "full_attention"
