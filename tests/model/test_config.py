import math

import pytest

from model.config import Experts, LinearRope, LongRope, ModelConfig, RopeScaling

BASE = dict(vocab_size=100, d_model=64, n_layers=2, n_heads=4, d_ff=128)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vocab_size", 0),
        ("d_model", -1),
        ("n_layers", 0),
        ("n_heads", 0),
        ("d_ff", 0),
        ("max_position", 0),
        ("norm", "batchnorm"),
        ("norm_placement", "middle"),
        ("qk_norm", "layer"),
        ("sliding_window", 0),
        ("ffn", "geglu2"),
        ("position", "nope"),
        ("n_kv_heads", 3),
        ("rope_theta", 0.0),
        ("norm_eps", 0.0),
        ("d_head", 0),
        ("eos_token_ids", (100,)),
    ],
)
def test_invalid_config_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**BASE, field: value})


def test_indivisible_heads_and_odd_rope_dims() -> None:
    with pytest.raises(ValueError, match="d_model"):
        ModelConfig(**{**BASE, "n_heads": 5})
    with pytest.raises(ValueError, match="d_head"):
        ModelConfig(**{**BASE, "d_head": 7})
    with pytest.raises(ValueError, match="rope_scaling"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)


def test_gqa_mqa_defaults() -> None:
    assert ModelConfig(**BASE).kv_heads == 4
    assert ModelConfig(**BASE, n_kv_heads=1).kv_heads == 1
    assert ModelConfig(**BASE).head_dim == 16


LLAMA_HF = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def test_hf_config_4x_and_5x_forms_agree() -> None:
    v4 = {
        **LLAMA_HF,
        "torch_dtype": "bfloat16",
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_SCALING,
    }
    v5 = {
        **LLAMA_HF,
        "dtype": "bfloat16",
        "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_SCALING},
    }
    a, b = ModelConfig.from_hf_config(v4), ModelConfig.from_hf_config(v5)
    assert a == b
    assert a.rope_theta == 500000.0 and a.torch_dtype == "bfloat16"
    assert a.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert a.kv_heads == 8 and a.head_dim == 128 and a.eos_token_ids == (128001, 128008, 128009)


def test_hf_config_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown architecture 'MambaForCausalLM'"):
        ModelConfig.from_hf_config({"architectures": ["MambaForCausalLM"]})
    broken = {k: v for k, v in LLAMA_HF.items() if k != "hidden_size"}
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_config(broken)
    with pytest.raises(ValueError, match="type 'dynamic' is not supported"):
        ModelConfig.from_hf_config(
            {**LLAMA_HF, "rope_scaling": {"rope_type": "dynamic", "factor": 4}}
        )


def test_dict_roundtrip() -> None:
    cfg = ModelConfig(**BASE, position="alibi", norm_placement="post", rope_scaling=RopeScaling())
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="bogus"):
        ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})


HF_LLAMA_LIKE = {
    "vocab_size": 1000,
    "hidden_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
}


def test_qwen3_reads_its_head_dim_and_q_k_norms() -> None:
    """Qwen3-0.6B's shape: head_dim 128 where hidden_size / heads is 64."""
    hf = HF_LLAMA_LIKE | {"architectures": ["Qwen3ForCausalLM"], "head_dim": 128}
    cfg = ModelConfig.from_hf_config(hf | {"attention_bias": False})
    assert (cfg.head_dim, cfg.qk_norm, cfg.qkv_bias) == (128, "head", False)
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert (
        ModelConfig.from_hf_config({**hf, "architectures": [], "model_type": "qwen3"}).qk_norm
        == "head"
    )


def test_mistral_reads_its_sliding_window() -> None:
    """Mistral 7B v0.1 attends over a 4096-token window in every layer, over its whole
    context; v0.2 and later have none."""
    hf = HF_LLAMA_LIKE | {"architectures": ["MistralForCausalLM"]}
    cfg = ModelConfig.from_hf_config(hf | {"sliding_window": 4096})
    assert (cfg.sliding_window, cfg.max_position, cfg.window(0), cfg.window(1)) == (
        4096,
        40960,
        4096,
        4096,
    )
    assert "sliding_window=4096" in cfg.features
    assert ModelConfig.from_hf_config(hf | {"sliding_window": None}).sliding_window is None
    off = hf | {"sliding_window": 4096, "use_sliding_window": False}  # Qwen2's switch
    assert ModelConfig.from_hf_config(off).sliding_window is None
    assert ModelConfig.from_hf_config(hf).qk_norm == "none"


def test_smollm3_marks_the_layers_without_rope() -> None:
    """Every fourth layer by default (`no_rope_layer_interval`), or as `no_rope_layers`
    lists them (0: no RoPE)."""
    hf = HF_LLAMA_LIKE | {"architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 8}
    assert ModelConfig.from_hf_config(hf).nope_layers == (3, 7)
    listed = hf | {"no_rope_layers": [1, 0, 1, 1, 1, 1, 1, 0]}
    assert ModelConfig.from_hf_config(listed).nope_layers == (1, 7)
    with pytest.raises(ValueError, match="no_rope_layers has 3 entries for 8 layers"):
        ModelConfig.from_hf_config(hf | {"no_rope_layers": [1, 0, 1]})


PHI4_MINI_ROPE = {  # Phi-4-mini's rotation: 3/4 of 128 dims, 48 factors each
    "type": "longrope",
    "short_factor": [1.0] * 48,
    "long_factor": [1.5] * 48,
}


def test_phi3_reads_partial_rotary_and_long_rope_in_both_config_forms() -> None:
    """Phi-4-mini in the 4.x form (rope_scaling, top-level partial_rotary_factor and
    original_max_position_embeddings) and the 5.x form (all in rope_parameters); the
    attention factor from the context over the pretraining length, as transformers
    computes it."""
    hf = HF_LLAMA_LIKE | {
        "architectures": ["Phi3ForCausalLM"],
        "hidden_size": 3072,
        "num_attention_heads": 24,
        "max_position_embeddings": 131072,
    }
    old = hf | {
        "rope_scaling": PHI4_MINI_ROPE,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
    }
    new = hf | {
        "rope_parameters": {
            **PHI4_MINI_ROPE,
            "rope_type": "longrope",
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 4096,
            "rope_theta": 10000.0,
        }
    }
    for form in (old, new):
        cfg = ModelConfig.from_hf_config(form)
        assert (cfg.head_dim, cfg.rotary_dim, cfg.rotary) == (128, 96, 96)
        assert isinstance(cfg.rope_scaling, LongRope)
        assert cfg.rope_scaling.original_max_position == 4096
        assert cfg.rope_scaling.attention_factor == pytest.approx(
            (1 + math.log(32) / math.log(4096)) ** 0.5
        )
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    su = old | {"rope_scaling": PHI4_MINI_ROPE | {"type": "su"}}  # Phi-3's first name
    assert isinstance(ModelConfig.from_hf_config(su).rope_scaling, LongRope)
    with pytest.raises(ValueError, match="rope_scaling: 48 factors for a rotary dimension of 128"):
        ModelConfig.from_hf_config(old | {"partial_rotary_factor": 1.0})
    with pytest.raises(ValueError, match="type 'dynamic' is not supported"):
        ModelConfig.from_hf_config(old | {"rope_scaling": {"type": "dynamic", "factor": 4.0}})


def test_phi3_mini_4k_reads_its_window() -> None:
    hf = HF_LLAMA_LIKE | {"architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 4096}
    cfg = ModelConfig.from_hf_config(hf | {"sliding_window": 2047})
    assert (cfg.max_position, cfg.sliding_window, cfg.rotary_dim) == (4096, 2047, None)


def test_olmo2_norms_the_sublayer_outputs_and_whole_q_and_k() -> None:
    cfg = ModelConfig.from_hf_config(HF_LLAMA_LIKE | {"model_type": "olmo2"})
    assert (cfg.norm_placement, cfg.qk_norm) == ("output", "all")
    assert cfg.architecture == "Olmo2ForCausalLM"
    # a native config written when qk_norm was a flag still reads
    old = ModelConfig.from_dict(cfg.to_dict() | {"qk_norm": True})
    assert old.qk_norm == "head"


GEMMA3_1B = {  # google/gemma-3-1b-it's config.json (4.x form), but 2 of its 1152 dims a head
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
}


def test_gemma3_reads_windows_rope_bases_and_its_norms() -> None:
    cfg = ModelConfig.from_hf_config(GEMMA3_1B)
    assert (cfg.norm_placement, cfg.ffn, cfg.qk_norm, cfg.tie_embeddings) == (
        "sandwich",
        "geglu",
        "head",
        True,
    )
    assert cfg.global_layers == (5, 11, 17, 23) and cfg.sliding_window == 512
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.window(5), cfg.window(6)) == (
        1e6,
        1e4,
        None,
        512,
    )
    assert cfg.attention_multiplier == 256**-0.5 and cfg.embedding_multiplier == 1152**0.5
    # the 4B's global layers: positions divided by 8
    scaled = ModelConfig.from_hf_config(
        GEMMA3_1B | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    )
    assert scaled.rope_scaling == LinearRope(8.0) and "rope_scaling=linear" in scaled.features
    assert ModelConfig.from_dict(scaled.to_dict()) == scaled
    with pytest.raises(ValueError, match="hidden_activation 'silu' is not supported"):
        ModelConfig.from_hf_config(GEMMA3_1B | {"hidden_activation": "silu"})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_config(GEMMA3_1B | {"layer_types": ["chunked_attention"] * 26})


def test_gemma2_reads_every_other_layer_windowed_and_its_caps() -> None:
    """google/gemma-2-2b's config.json (4.x form, no layer_types): odd layers global."""
    hf = GEMMA3_1B | {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "num_hidden_layers": 6,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "rope_theta": 10000.0,
    }
    del hf["sliding_window_pattern"], hf["rope_local_base_freq"]
    cfg = ModelConfig.from_hf_config(hf)
    assert (cfg.global_layers, cfg.qk_norm, cfg.local_rope_theta) == ((1, 3, 5), "none", None)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.rope_theta) == (50.0, 30.0, 1e4)
    assert cfg.architecture == "Gemma2ForCausalLM"


def test_granite_reads_its_four_multipliers() -> None:
    hf = HF_LLAMA_LIKE | {"architectures": ["GraniteForCausalLM"]}
    scaled = hf | {
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.0078125,
        "logits_scaling": 8.0,
    }
    cfg = ModelConfig.from_hf_config(scaled)
    assert (cfg.embedding_multiplier, cfg.residual_multiplier) == (12.0, 0.22)
    assert (cfg.attention_multiplier, cfg.logits_scaling, cfg.scaled) == (0.0078125, 8.0, True)
    plain = ModelConfig.from_hf_config(hf)
    assert (plain.attention_multiplier, plain.scaled) == (None, False)


# Qwen3-30B-A3B's config.json (transformers 4.x form), its layer count cut to 6
QWEN3_MOE_HF = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
}


def test_qwen3_moe_reads_its_experts_and_dense_layers() -> None:
    cfg = ModelConfig.from_hf_config(QWEN3_MOE_HF)
    e = cfg.experts
    assert (e.n_experts, e.top_k, e.d_ff, e.norm_top_k, e.shared_d_ff) == (128, 8, 768, True, 0)
    assert cfg.sparse_layers == tuple(range(6)) and cfg.d_ff == 6144 and cfg.qk_norm == "head"
    # mlp_only_layers and decoder_sparse_step leave dense layers (of intermediate_size)
    mixed = ModelConfig.from_hf_config(
        QWEN3_MOE_HF | {"mlp_only_layers": [0], "decoder_sparse_step": 2}
    )
    assert mixed.experts.dense_layers == (0, 2, 4) and mixed.sparse_layers == (1, 3, 5)
    assert "experts=8/128x768" in cfg.features and "dense_layers=0,2,4" in mixed.features
    # transformers 5.x writes the count as num_local_experts
    v5 = {k: v for k, v in QWEN3_MOE_HF.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert ModelConfig.from_hf_config(v5) == cfg
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_dict(mixed.to_dict()) == mixed


def test_moe_families_read_their_routing() -> None:
    """Mixtral renormalizes the chosen weights whatever the config says; OLMoE and
    Qwen2-MoE as norm_topk_prob says (false in their releases); Qwen2-MoE's shared expert."""
    mixtral = ModelConfig.from_hf_config(
        HF_LLAMA_LIKE
        | {
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        }
    )
    assert (mixtral.experts.n_experts, mixtral.experts.d_ff, mixtral.experts.norm_top_k) == (
        8,
        3072,
        True,
    )
    olmoe = ModelConfig.from_hf_config(
        HF_LLAMA_LIKE
        | {"architectures": ["OlmoeForCausalLM"], "num_experts": 64, "num_experts_per_tok": 8}
    )
    assert (olmoe.qk_norm, olmoe.experts.norm_top_k, olmoe.experts.d_ff) == ("all", False, 3072)
    qwen2 = ModelConfig.from_hf_config(
        HF_LLAMA_LIKE
        | {
            "architectures": ["Qwen2MoeForCausalLM"],
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
        }
    )
    assert (qwen2.qkv_bias, qwen2.experts.d_ff, qwen2.experts.shared_d_ff) == (True, 1408, 5632)
    assert "shared_expert=5632" in qwen2.features


def test_moe_config_errors_speak_config_json() -> None:
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) exceeds num_experts \(8\)"):
        ModelConfig.from_hf_config(QWEN3_MOE_HF | {"num_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="missing field 'num_experts_per_tok'"):
        ModelConfig.from_hf_config(
            {k: v for k, v in QWEN3_MOE_HF.items() if k != "num_experts_per_tok"}
        )
    with pytest.raises(ValueError, match="clip_qkv 8.0 is not supported"):
        ModelConfig.from_hf_config(
            HF_LLAMA_LIKE
            | {"architectures": ["OlmoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2}
            | {"clip_qkv": 8.0}
        )
    with pytest.raises(ValueError, match="experts are SwiGLU"):
        ModelConfig(**BASE, ffn="gelu", experts=Experts(4, 2, 16))


def test_gpt_oss_reads_sinks_windows_yarn_and_its_experts() -> None:
    """gpt-oss-20b's config.json, its layers cut to 4."""
    hf = {
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 4,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "rope_theta": 150000,
        "quantization_config": {"quant_method": "mxfp4"},
    }
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.attn_sinks and cfg.qkv_bias and cfg.attn_out_bias
    assert (cfg.sliding_window, cfg.global_layers) == (128, (1, 3))
    e = cfg.experts
    assert (e.n_experts, e.top_k, e.d_ff, e.norm_top_k, e.bias, e.router_bias) == (
        32, 4, 2880, True, True, True,
    )  # fmt: skip
    assert e.clamped == (1.702, 7.0)
    yarn = cfg.rope_scaling
    assert (yarn.factor, yarn.original_max_position, yarn.truncate) == (32.0, 4096, False)
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(32) + 1)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
