"""Logit and greedy-token parity with transformers on checkpoints it wrote."""

import json
from pathlib import Path

import pytest
import torch

from model.kv_cache import PagedKVCache
from model.weights import load_model
from tests.factories import (
    write_gemma2,
    write_gemma3,
    write_gemma3_multimodal,
    write_gpt2,
    write_gpt_oss,
    write_granite,
    write_llama,
    write_mistral,
    write_mixtral,
    write_olmo2,
    write_olmoe,
    write_phi3,
    write_qwen2,
    write_qwen2_moe,
    write_qwen3,
    write_qwen3_moe,
    write_smollm3,
)
from tests.model.backends import BACKENDS, generate_auto, make_backend

pytestmark = pytest.mark.slow

WRITERS = {
    "llama_gqa_untied": lambda p: write_llama(p, tied=False),
    "llama_gqa_tied": lambda p: write_llama(p, tied=True),
    "qwen2_qkv_bias": write_qwen2,
    "qwen3_qk_norm": write_qwen3,
    "mistral": write_mistral,
    "mistral_sliding_window": lambda p: write_mistral(p, sliding_window=8),
    "smollm3_nope": write_smollm3,
    "granite_scaled": write_granite,
    "phi3_partial_longrope": write_phi3,
    "olmo2_output_norms": write_olmo2,
    "gemma3_windows_sandwich": write_gemma3,
    "gemma2_softcaps": write_gemma2,
    "gemma3_in_image_text_checkpoint": write_gemma3_multimodal,
    "gpt2": write_gpt2,
    "qwen3_moe_dense_layer": write_qwen3_moe,
    "mixtral": write_mixtral,
    "olmoe": write_olmoe,
    "qwen2_moe_shared_expert": write_qwen2_moe,
    "gpt_oss": write_gpt_oss,
}


@pytest.mark.parametrize("family", list(WRITERS))
@torch.no_grad()
def test_logits_and_greedy_match_transformers(family: str, tmp_path: Path) -> None:
    hf = WRITERS[family](tmp_path)
    ours = load_model(tmp_path)
    vocab = hf.config.vocab_size
    tokens = torch.randint(3, vocab, (64,))
    ref = hf(tokens[None]).logits[0].float()
    got = ours(tokens)
    assert (ref - got).abs().max().item() <= 1e-4

    prompt = tokens[:16]
    hf.generation_config.eos_token_id = None  # 32 tokens whatever they are, eos included
    hf_out = hf.generate(
        prompt[None],
        max_new_tokens=32,
        do_sample=False,
        attention_mask=torch.ones(1, 16, dtype=torch.long),
        pad_token_id=0,
    )[0, 16:].tolist()
    our_out = generate_auto(ours, prompt.tolist(), 32)  # no eos given: 32 tokens
    assert our_out == hf_out


# In Triton's interpreter (seconds a case), the families whose variation its kernels see
# (the norms it fuses, the rotation it applies, windows, soft-capping, q/k norms, layers
# without RoPE, Granite's scaled residuals, GPT-2's layout); a tied head, q/k/v biases,
# Mistral without a window and Gemma 3 inside an image-and-text checkpoint differ from
# those in model-level code alone, which the compiled backends' cases run
MODEL_LEVEL = ("llama_gqa_tied", "qwen2_qkv_bias", "mistral", "gemma3_in_image_text_checkpoint")
PAGED = [(f, b) for f in WRITERS for b in BACKENDS if b != "triton" or f not in MODEL_LEVEL]


@pytest.mark.parametrize(("family", "name"), PAGED)
@torch.no_grad()
def test_paged_logits_match_transformers_on_each_backend(
    family: str, name: str, tmp_path: Path
) -> None:
    """A 30-token prompt in two chunks, then 10 decodes, over each backend's paged cache
    give the logits transformers gives for the 40 tokens at once (with a sliding window
    of 8: the chunks, and the decodes, reach past it)."""
    hf = WRITERS[family](tmp_path)
    ours = load_model(tmp_path)
    backend = make_backend(name, ours.cfg)
    cache = PagedKVCache(ours.cfg, 8, 16, torch.float32, "cpu", backend)
    tokens = torch.randint(3, hf.config.vocab_size, (40,))
    ref = hf(tokens[None]).logits[0].float()
    table, outs = [[5, 2, 7]], []
    for start, n in [(0, 13), (13, 17), *[(30 + i, 1) for i in range(10)]]:
        meta = backend.metadata(table, [start], [n], 16, "cpu", cache.null_block)
        outs.append(ours(tokens[start : start + n], meta, cache))
    assert (torch.cat(outs) - ref).abs().max().item() <= 1e-4


def test_sharded_checkpoint_and_4x_config_form(tmp_path: Path) -> None:
    import transformers as tf

    hf = write_llama(tmp_path / "ref", tied=False)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    # rewrite config.json in the transformers 4.x form
    cfg = json.loads((tmp_path / "sharded" / "config.json").read_text())
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    (tmp_path / "sharded" / "config.json").write_text(json.dumps(cfg))
    ours = load_model(tmp_path / "sharded")
    tokens = torch.randint(0, 384, (64,))
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0]
        assert (ref - ours(tokens)).abs().max().item() <= 1e-4
    assert ours.cfg.rope_theta == 5000.0
    assert isinstance(hf, tf.LlamaForCausalLM)


def test_long_rope_past_the_pretraining_length_is_transformers_long_rotation(
    tmp_path: Path,
) -> None:
    """From the pretraining length on, a token turns by the long factors, as transformers
    turns a sequence past that length (within it, the parity tests above: the short)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf = write_phi3(tmp_path)
    ours = load_model(tmp_path)
    long = torch.arange(128, 256)[None]  # past original_max_position_embeddings (128)
    cos, sin = Phi3RotaryEmbedding(hf.config)(torch.zeros(1, dtype=torch.float32), long)
    pairs = cos.shape[-1] // 2  # 3 rotated pairs of the 8-dim head
    for ref, got in ((cos[0], ours._rope[0][128:256]), (sin[0], ours._rope[1][128:256])):
        assert (ref[:, :pairs] - got[:, :pairs]).abs().max().item() <= 1e-5
        assert (ref[:, pairs:] - got[:, 4 : 4 + pairs]).abs().max().item() <= 1e-5


@torch.no_grad()
def test_a_long_rope_sequence_past_the_pretraining_length_is_transformers(tmp_path: Path) -> None:
    """A sequence longer than the pretraining length turns every token by the long
    factors, as transformers turns it (its first 128 by the short ones were 8e-3 away)."""
    hf = write_phi3(tmp_path)
    ours = load_model(tmp_path)
    tokens = torch.randint(3, hf.config.vocab_size, (160,))
    ref = torch.log_softmax(hf(tokens[None]).logits[0].float(), dim=-1)
    got = torch.log_softmax(ours(tokens).float(), dim=-1)
    assert (ref - got).abs().max().item() <= 1e-4


def test_llama3_rope_scaling_parity(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = write_llama(tmp_path, tied=True, rope_scaling=scaling, max_position_embeddings=512)
    ours = load_model(tmp_path)
    assert ours.cfg.rope_scaling is not None
    tokens = torch.randint(0, 384, (200,))
    with torch.no_grad():
        assert (hf(tokens[None]).logits[0] - ours(tokens)).abs().max().item() <= 1e-4


def test_generation_config_eos_and_bf16_load(tmp_path: Path) -> None:
    write_llama(tmp_path, tied=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    assert set(ours.cfg.eos_token_ids) == {2, 7}
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    logits = ours(torch.arange(10))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


@torch.no_grad()
def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    """The release's form: every expert's weights in MXFP4 (`_blocks` + `_scales`,
    quant_method mxfp4) read as transformers' own dequantization gives them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = write_gpt_oss(tmp_path / "bf16")
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        e, inner, out = tensors.pop(name).shape  # stored (E, in, out); MXFP4 (E, out, in)
        blocks = torch.randint(0, 256, (e, out, inner // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 130, (e, out, inner // 32), generator=gen, dtype=torch.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        layer = int(name.split(".")[2])
        weight = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        getattr(hf.model.layers[layer].mlp.experts, name.rsplit(".", 1)[1]).copy_(weight)
    root = tmp_path / "mxfp4"
    root.mkdir()
    save_file(tensors, str(root / "model.safetensors"))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (root / "config.json").write_text(json.dumps(config))
    ours = load_model(root)
    tokens = torch.randint(3, hf.config.vocab_size, (48,))
    assert (hf(tokens[None]).logits[0] - ours(tokens)).abs().max().item() <= 1e-4
