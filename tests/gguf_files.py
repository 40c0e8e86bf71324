"""GGUF files written from a Hugging Face checkpoint the way llama.cpp's converter
(convert_hf_to_gguf.py) writes them, with the `gguf` package's writer, name table and
quantizers: the `{arch}.*` hyper-parameters, the tokenizer.json as tokenizer.ggml.* (the
vocabulary padded to the model's with [PADn] tokens), q and k rows of a Llama permuted
for llama.cpp's rotation, each layer's experts stacked into one tensor (gpt-oss's split
into gate and up), and each tensor in the type `types` picks (norms, biases and other
vectors stay F32)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

# Hugging Face architectures -> GGUF's
ARCHS = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "OlmoeForCausalLM": "olmoe",
    "GraniteForCausalLM": "granite",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "SmolLM3ForCausalLM": "smollm3",
    "GptOssForCausalLM": "gpt-oss",
}
PERMUTED = ("llama", "granite", "smollm3")  # written through the converter's LlamaModel
# Granite's scalings and the metadata the converter writes them as
GRANITE_SCALES = {"attention_multiplier": "attention_scale", "embedding_multiplier":
                  "embedding_scale", "residual_multiplier": "residual_scale",
                  "logits_scaling": "logit_scale"}  # fmt: skip
GEMMAS = ("gemma2", "gemma3")  # norms stored as 1 + w; no RoPE base for Gemma 2


def gpt_oss_types(name: str) -> str:
    """gpt-oss's experts in MXFP4 (as its released files hold them), the rest as
    default_types."""
    return "MXFP4" if "_exps." in name else default_types(name)


def default_types(name: str) -> str:
    """A mix of the block types llama-quantize writes: Q8_0 embeddings, Q4_0 attention,
    Q4_1/Q5_0 FFN, F16 head."""
    if name.startswith("token_embd"):
        return "Q8_0"
    if name.startswith("output."):
        return "F16"
    if ".attn_" in name:
        return "Q4_0"
    return "Q5_0" if "down" in name else "Q4_1"


def write_gguf(
    hf_dir: Path,
    out: Path,
    types: Callable[[str], str] = default_types,
    template: str = "",
    sentencepiece: Path | None = None,
    pre: str = "gpt-2",
    split_max_tensors: int = 0,
) -> Path:
    """The GGUF file of the checkpoint in hf_dir; its tokenizer the folder's tokenizer.json
    (its pre-tokenizer named `pre`), or with `sentencepiece` that tokenizer.model's
    vocabulary. split_max_tensors: split into shards of that many tensors (the gguf
    package's writer names them OUT-00001-of-0000N.gguf, as llama.cpp's gguf-split does);
    the first shard's path is returned."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    _hyper_parameters(w, config, arch)
    if arch in GEMMAS:
        _gemma(w, config, arch)
    if arch == "phi3":
        _phi3(w, config)
    for field, writes in GRANITE_SCALES.items() if arch == "granite" else ():
        getattr(w, f"add_{writes}")(float(config[field]))
    if sentencepiece is not None:
        _sentencepiece_tokenizer(w, sentencepiece, config["vocab_size"])
    else:
        _tokenizer(w, hf_dir, config["vocab_size"], template, pre)
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])
    if (freqs := _rope_freqs(config)) is not None:
        w.add_tensor("rope_freqs.weight", freqs)
    for name, value in _tensors(hf_dir, config, arch).items():
        gg = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gg is not None, name
        data = value.float().numpy()
        vector = data.ndim == 1 or gg.endswith(".bias")  # llama-quantize keeps them
        kind = gguf.GGMLQuantizationType["F32" if vector else types(gg)]
        if data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:  # rows not whole blocks
            kind = gguf.GGMLQuantizationType.F16  # llama-quantize falls back likewise
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(gg, data.astype(np.float16 if kind.name == "F16" else np.float32))
        else:
            w.add_tensor(gg, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf")) if split_max_tensors else []
    return shards[0] if shards else out


def _hyper_parameters(w, config: dict, arch: str) -> None:
    heads = config["num_attention_heads"]
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch != "gemma2":  # Gemma 2's converter writes none: llama.cpp takes 10000
        w.add_rope_freq_base(float(_rope(config, "full_attention")))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if arch == "gpt-oss":
        w.add_sliding_window(config["sliding_window"])
        w.add_expert_feed_forward_length(config["intermediate_size"])
    _yarn(w, config)


def _yarn(w, config: dict) -> None:
    """YaRN's fields as the converter writes them (TextModel.set_gguf_parameters)."""
    import gguf

    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type") != "yarn":
        return
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key in ("beta_fast", "beta_slow"):
        if key in rope:
            getattr(w, f"add_rope_scaling_yarn_{key}")(rope[key])


def _rope(config: dict, layers: str) -> float | None:
    """The RoPE base of a layer type (`full_attention`, `sliding_attention`), from a 4.x
    or 5.x config of transformers."""
    params = config.get("rope_parameters") or {}
    if layers in params:
        return params[layers]["rope_theta"]
    if layers == "sliding_attention":
        return config.get("rope_local_base_freq")
    return config.get("rope_theta") or params.get("rope_theta")


def _phi3(w, config: dict) -> None:
    """Phi-3's fields as the converter writes them: the rotated dimensions of a head, a
    window of 0 for none, LongRoPE's factors as tensors with its attention factor."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    heads = config["num_attention_heads"]
    w.add_rope_dimension_count(
        int(rope.get("partial_rotary_factor", 1.0) * config["hidden_size"]) // heads
    )
    w.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = config["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            w.add_tensor(
                f"rope_factors_{kind}.weight", np.asarray(rope[f"{kind}_factor"], np.float32)
            )


def _gemma(w, config: dict, arch: str) -> None:
    """Gemma 2's and 3's fields as the converter writes them: the soft-caps it has, the
    window, Gemma 3's local RoPE base."""
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(cap):
            getattr(w, f"add_{cap}")(float(config[cap]))
    w.add_sliding_window(config["sliding_window"])
    if arch == "gemma3":
        w.add_rope_freq_base_swa(float(_rope(config, "sliding_attention")))


def _rope_freqs(config: dict) -> np.ndarray | None:
    """Llama 3.1's scaling as the converter stores it: each frequency's divisor, in
    float32 as it computes them (LlamaModel.generate_extra_tensors)."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type") != "llama3":
        return None
    base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _tokenizer(w, hf_dir: Path, vocab_size: int, template: str, pre: str) -> None:
    data = json.loads((hf_dir / "tokenizer.json").read_text())
    added = {t["id"]: t["content"] for t in data.get("added_tokens", [])}
    by_id = {i: t for t, i in data["model"]["vocab"].items()} | added
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [3 if i in added else 1 if i in by_id else 5 for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    ids = {t: i for i, t in added.items()}
    own = hf_dir / "tokenizer_config.json"  # its bos, eos and template where it has one
    config = (
        json.loads(own.read_text())
        if own.exists()
        else {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    )
    if config.get("bos_token"):
        w.add_bos_token_id(ids[config["bos_token"]])
    w.add_eos_token_id(ids[config["eos_token"]])
    w.add_add_bos_token(False)
    if template := template or config.get("chat_template", ""):
        w.add_chat_template(template)


def _sentencepiece_tokenizer(w, model_file: Path, vocab_size: int) -> None:
    """A tokenizer.model's pieces, scores and types as llama.cpp's converter writes them
    (_set_vocab_sentencepiece: [PADn] pieces of type UNUSED up to the model's vocabulary;
    its types in its order of checks, so a user-defined piece is NORMAL); a model that
    puts no space before the text says so (add_space_prefix false, as Gemma's converter
    writes; llama.cpp assumes one where the file does not say)."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor(model_file=str(model_file))
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores, kinds = [-10000.0] * vocab_size, [5] * vocab_size
    for i in range(sp.vocab_size()):
        tokens[i], scores[i] = sp.id_to_piece(i), sp.get_score(i)
        checks = [(sp.is_unknown, 2), (sp.is_control, 3), (sp.is_unused, 5), (sp.is_byte, 6)]
        kinds[i] = next((kind for check, kind in checks if check(i)), 1)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(kinds)
    if not sp.encode("a", out_type=str)[0].startswith("\u2581"):  # no space put before
        w.add_add_space_prefix(False)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)


def _tensors(hf_dir: Path, config: dict, arch: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the names llama.cpp's table maps: q/k permuted for
    a Llama and its kin (PERMUTED), each layer's experts stacked (E, out, in) under `...experts.<proj>.weight`."""
    tensors = load_file(str(hf_dir / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, value in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            at = parts.index("experts")
            stack = ".".join(parts[: at + 1] + parts[at + 2 :])
            stacks.setdefault(stack, {})[int(parts[at + 1])] = value
            continue
        if arch in GEMMAS and name.endswith("norm.weight"):
            value = value + 1  # the converter's norm shift: Gemma's norms scale by 1 + w
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"]
            if name.endswith("k_proj.weight"):
                heads = config["num_key_value_heads"]
            value = _permute(value, heads)
        out[name] = value
    for stack, experts in stacks.items():
        out[stack] = torch.stack([experts[e] for e in sorted(experts)])
    return _gpt_oss_split(out) if arch == "gpt-oss" else out


def _gpt_oss_split(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's tensors as GptOssModel.modify_tensors writes them: the experts' (in, out)
    stacks turned (out, in), gate and up (alternate outputs) split apart with their
    biases, the sinks named as a weight."""
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        stem = name.rpartition(".")[0]
        if name.endswith("gate_up_proj"):
            value = value.transpose(-1, -2)
            out[stem + ".gate_proj.weight"], out[stem + ".up_proj.weight"] = (
                value[:, ::2],
                value[:, 1::2],
            )
        elif name.endswith("gate_up_proj_bias"):
            out[stem + ".gate_proj.bias"], out[stem + ".up_proj.bias"] = (
                value[:, ::2],
                value[:, 1::2],
            )
        elif name.endswith("down_proj"):
            out[stem + ".down_proj.weight"] = value.transpose(-1, -2)
        elif name.endswith("down_proj_bias"):
            out[stem + ".down_proj.bias"] = value
        else:
            out[name + ".weight" if name.endswith("sinks") else name] = value
    return out


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )
