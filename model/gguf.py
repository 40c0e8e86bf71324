"""GGUF files (llama.cpp's format; what Ollama and llama.cpp users download), read with
the `gguf` package, llama.cpp's own reader.

One file holds the hyper-parameters (`{arch}.*` metadata), the tokenizer
(`tokenizer.ggml.*`: tokens, merges, token types, the pre-tokenizer's name, bos/eos and
the chat template) and the tensors under llama.cpp's names (`blk.N.attn_q.weight`, ...),
each in its own type (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, ...). This module
presents it as a Hugging Face checkpoint: `hf_config()` is the config.json the file was
converted from, `resolve`/`shape`/`read` serve tensors by their Hugging Face names
(model/weights.py loads through them as through safetensors), and `field` reads the
tokenizer's metadata (model/tokenizer.py turns it into a tokenizer.json).

A tensor is read as the `gguf` package's dequantization gives it, float32, in which every
GGUF type's values are exact; the serving dtype rounds them once. llama.cpp's converter
permutes a Llama-architecture checkpoint's q and k rows for its rotary layout; reading
undoes it.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF's architecture names -> the Hugging Face architecture each was converted from
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "granite": "GraniteForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# architectures llama.cpp's converter writes through its LlamaModel, which permutes q's
# and k's rows for its rotation
_PERMUTED = frozenset({"llama", "granite", "smollm3"})
# Gemma's architectures, whose norm weights llama.cpp's converter stores as 1 + w (the
# norms scale by 1 + w; the checkpoint holds w), each with the layer count of its 27B
# shape (llama.cpp's LLM_TYPE_27B), whose queries llama.cpp scales by hidden / heads, not
# head_dim (Gemma's query_pre_attn_scalar, which the file does not hold)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# one expert's projection (or its bias) in a Hugging Face checkpoint; llama.cpp stacks
# the experts'
_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.(weight|bias)$"
)
# GGUF's float types; every other type is integer blocks, and of those these are 4-bit
# groups of 32 with a scale (and a minimum) that kvserve's int4 holds exactly
_FLOATS = frozenset({"F32", "F16", "BF16", "F64"})
_INT4_EXACT = frozenset({"Q4_0", "Q4_1", "Q4_K"})
_INT5_EXACT = frozenset({"Q5_0", "Q5_1", "Q5_K"})
# tokenizer.ggml.token_type's kinds (gguf.TokenType, llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
# a harmony model's (gpt-oss's) turn ends
_HARMONY_ENDS = frozenset({"<|return|>", "<|call|>"})
# a split GGUF file's shard: NAME-00001-of-00003.gguf
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# GGUF tensors dequantized at once: a layer's expert stacks are read expert by expert,
# gate, up and down in turn
_KEPT = 3


def kept_as(tensor_type: str) -> str | None:
    """The integer kind that keeps a tensor of GGUF type `tensor_type` (GgufFile.stored_kind)."""
    if tensor_type in _FLOATS:
        return None
    if tensor_type in _INT4_EXACT:
        return "int4"
    return "int5" if tensor_type in _INT5_EXACT else "int8"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (the one place that decides)."""
    p = Path(path)
    return p.suffix.lower() == ".gguf" and p.is_file()


def served_name(path: str | Path) -> str:
    """The name a GGUF file is served under: its own less `.gguf`, a split file's less
    its shard number too."""
    p = Path(path)
    m = _SHARD.match(p.name)
    return m.group("stem") if m else p.stem


def first_shard(path: Path) -> bool:
    """Whether `path` is a GGUF model's file to open: an unsplit file, or a split one's
    first shard."""
    m = _SHARD.match(path.name)
    return m is None or int(m.group("no")) == 1


def shards(path: Path) -> list[Path]:
    """The files of a GGUF model: `path` itself, or where it is the first shard of a
    split one (`NAME-00001-of-0000N.gguf`, as llama.cpp's gguf-split and the gguf
    package's writer name them) every shard, each beside it; ValueError for a later
    shard or a missing one."""
    m = _SHARD.match(path.name)
    if m is None:
        return [path]
    no, count = int(m.group("no")), int(m.group("count"))
    names = [f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    if no != 1:
        raise ValueError(f"{path}: shard {no} of {count} of a split GGUF file; serve its first, {path.with_name(names[0])}")  # fmt: skip
    missing = [n for n in names if not (path.parent / n).is_file()]
    if missing:
        raise ValueError(f"{path}: split GGUF file of {count} shards; missing {', '.join(missing)}")  # fmt: skip
    return [path.parent / n for n in names]


@functools.cache
def _gguf() -> Any:
    """The gguf package, imported on first use (a GGUF file is the only reader of it)."""
    import gguf

    return gguf


def open_gguf(path: str | Path) -> GgufFile:
    """The file's GgufFile, one a process per file as it is on disk: its metadata takes
    seconds to parse (a 128k-token vocabulary is a million small fields), and the config,
    the weights, the tokenizer and the chat template all read it."""
    p = Path(path).resolve()
    return _opened(p, p.stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _opened(path: Path, mtime_ns: int) -> GgufFile:
    return GgufFile(path)


def _llama3_divisors(
    wavelen: np.ndarray, factor: float, low: float, high: float, old: float
) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs for Llama 3.1's scaling."""
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended))


class GgufFile:
    """One GGUF file's metadata and tensors; ValueError naming the file for anything it
    cannot read or serve."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        readers = [self._reader(p) for p in shards(self.path)]
        self.reader = readers[0]  # the metadata: a split file's first shard holds it
        self.arch = str(self.field("general.architecture", ""))
        self.tensors = {t.name: t for r in readers for t in r.tensors}
        blocks = int(self.field(f"{self.arch}.block_count", 0))
        g = _gguf()
        arch = next((a for a, n in g.MODEL_ARCH_NAMES.items() if n == self.arch), None)
        if arch is None:
            raise ValueError(self._unsupported())
        self._names = g.get_tensor_name_map(arch, blocks)
        self._kept: dict[str, torch.Tensor] = {}

    @staticmethod
    def _reader(path: Path) -> Any:
        try:
            return _gguf().GGUFReader(str(path))
        except Exception as exc:  # the reader raises bare ValueError/struct errors on junk
            raise ValueError(f"{path}: not a readable GGUF file ({exc})") from None

    def release(self) -> None:
        """Drop the dequantized tensors kept for the next reads (the load is done)."""
        self._kept.clear()

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return f.contents() if f is not None else default

    def _unsupported(self) -> str:
        known = ", ".join(sorted(ARCHITECTURES))
        return f"{self.path}: GGUF architecture {self.arch!r} is not served (known: {known})"

    # ---- the config ---------------------------------------------------------------

    def hf_config(self) -> dict[str, Any]:
        """The Hugging Face config.json this file's metadata describes."""
        if self.arch not in ARCHITECTURES:
            raise ValueError(self._unsupported())
        a = f"{self.arch}."
        heads = int(self.field(a + "attention.head_count"))
        d = int(self.field(a + "embedding_length"))
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "vocab_size": int(self.field(a + "vocab_size", 0)) or len(self.field("tokenizer.ggml.tokens", [])),
            "hidden_size": d,
            "intermediate_size": int(self.field(a + "feed_forward_length", 0)),
            "num_hidden_layers": int(self.field(a + "block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(a + "attention.head_count_kv", heads)),
            "head_dim": int(self.field(a + "attention.key_length", d // heads)),
            "rms_norm_eps": float(self.field(a + "attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.field(a + "rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.field(a + "context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
        }  # fmt: skip
        if (window := self.field(a + "attention.sliding_window")) is not None:
            config["sliding_window"] = int(window)
        if "rope_freqs.weight" in self.tensors:
            config["rope_scaling"] = self._llama3_rope(config)
        if self.field(a + "rope.scaling.type") == "yarn":
            config["rope_scaling"] = self._yarn(a)
        if self.arch in _GEMMA_27B_LAYERS:
            config |= self._gemma_config(a, config)
        if self.arch == "phi3":
            config |= self._phi3_config(a, config)
        config |= self._llama_kin_config(a)
        return config | self._experts_config(a)

    def _llama_kin_config(self, a: str) -> dict[str, Any]:
        """Granite's four scalings (stored as `*_scale`), SmolLM3's layers without RoPE
        (every fourth, in llama.cpp's code: the file does not say)."""
        if self.arch == "smollm3":
            return {"no_rope_layer_interval": 4}
        if self.arch != "granite":
            return {}
        scales = {"attention_multiplier": "attention.scale", "embedding_multiplier":
                  "embedding_scale", "residual_multiplier": "residual_scale",
                  "logits_scaling": "logit_scale"}  # fmt: skip
        return {k: float(v) for k, f in scales.items() if (v := self.field(a + f)) is not None}

    def _phi3_config(self, a: str, config: dict[str, Any]) -> dict[str, Any]:
        """Phi-3's and Phi-4-mini's fields: the rotated share of each head (its RoPE
        dimensions), no window where the file says 0 (Phi-4's), and LongRoPE from the
        factor tensors the converter writes beside the weights."""
        out: dict[str, Any] = {"sliding_window": config.get("sliding_window") or None}
        dims = int(self.field(a + "rope.dimension_count", config["head_dim"]))
        out["partial_rotary_factor"] = dims / config["head_dim"]
        if "rope_factors_long.weight" in self.tensors:
            original = int(self.field(a + "rope.scaling.original_context_length"))
            out["original_max_position_embeddings"] = original
            out["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": self._factors("rope_factors_long.weight"),
                "short_factor": self._factors("rope_factors_short.weight"),
                "original_max_position_embeddings": original,
                "attention_factor": float(self.field(a + "rope.scaling.attn_factor", 1.0)),
            }
        return out

    def _yarn(self, a: str) -> dict[str, Any]:
        """YaRN's fields as the converter writes them. gpt-oss's checkpoint blends the
        frequencies over the exact band (its config's `truncate: false`, which the file
        does not hold; llama.cpp rounds the band out to whole dimensions)."""
        scaling: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": float(self.field(a + "rope.scaling.factor")),
            "original_max_position_embeddings": int(
                self.field(a + "rope.scaling.original_context_length")
            ),
            "truncate": self.arch != "gpt-oss",
        }
        for key, field in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                           ("attention_factor", "yarn_attn_factor")):  # fmt: skip
            if (value := self.field(a + "rope.scaling." + field)) is not None:
                scaling[key] = float(value)
        return scaling

    def _factors(self, source: str) -> list[float]:
        t = self.tensors[source]
        return np.asarray(_gguf().quants.dequantize(t.data, t.tensor_type)).ravel().tolist()

    def _gemma_config(self, a: str, config: dict[str, Any]) -> dict[str, Any]:
        """Gemma 2's and 3's fields as llama.cpp reads them: from the file the soft-caps,
        Gemma 3's local RoPE base, linear RoPE scaling and a windowed-layer pattern where
        it has one; in llama.cpp's code Gemma 2's window of 4096 where none is stored,
        the query scale (query_pre_attn_scalar: hidden / heads for the 27B shapes, else
        head_dim) and one global layer in 2 (Gemma 2) or 6 (Gemma 3)."""
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        big = layers == _GEMMA_27B_LAYERS[self.arch]
        out: dict[str, Any] = {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": config["hidden_size"] // heads if big else config["head_dim"],
            "attn_logit_softcapping": self.field(a + "attn_logit_softcapping"),
            "final_logit_softcapping": self.field(a + "final_logit_softcapping"),
        }
        if self.arch == "gemma2":
            out["sliding_window"] = config.get("sliding_window", 4096)
        else:
            out["rope_local_base_freq"] = float(self.field(a + "rope.freq_base_swa", 10000.0))
            if self.field(a + "rope.scaling.type") == "linear":
                factor = float(self.field(a + "rope.scaling.factor"))
                out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        pattern = self.field(a + "attention.sliding_window_pattern")
        if isinstance(pattern, list):  # a flag a layer: windowed or not
            out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in pattern]
        elif pattern is not None:
            out["sliding_window_pattern"] = int(pattern)
        return out

    def _llama3_rope(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """Llama 3.1's rope_scaling from the rope_freqs tensor llama.cpp's converter
        computes with it (each frequency's divisor: 1 for the high ones, `factor` for the
        low ones, a blend between). The divisors fix the parameters only up to scaling
        original_max_position, low and high together, so low_freq_factor is taken as 1;
        the parameters found must give the file's divisors back."""
        t = self.tensors["rope_freqs.weight"]
        got = np.asarray(_gguf().quants.dequantize(t.data, t.tensor_type), np.float64).ravel()
        dim, theta = config["head_dim"], config["rope_theta"]
        wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        factor = float(got.max())
        if factor <= 1 + 1e-6:
            return None
        between = (got > 1 + 1e-6) & (got < factor * (1 - 1e-6))
        smooth = (1 / got - 1 / factor) / (1 - 1 / factor)  # 0 at 1, 1 at factor
        ones, fulls = wavelen[got <= 1 + 1e-6], wavelen[got >= factor * (1 - 1e-6)]
        if between.sum() >= 2:  # smooth = old / (high - 1) / wavelen - 1 / (high - 1)
            slope, icept = np.polyfit(1 / wavelen[between], smooth[between], 1)
            high = 1 - 1 / icept
            old = round(slope * (high - 1))  # an integer in the config; the fit is far closer
        else:  # one blended frequency or none: old between the groups, high to match
            w = wavelen[between].max(initial=ones.max(initial=1.0))
            old = round(np.sqrt(w * fulls.min(initial=4 * w)))
            high = 1 + (old / w - 1) / smooth[between][0] if between.any() else (old / w + 1) / 2
        params = {"factor": factor, "low": 1.0, "high": float(high), "old": float(old)}
        if not np.allclose(_llama3_divisors(wavelen, **params), got, rtol=1e-5):
            raise ValueError(f"{self.path}: rope_freqs is not a Llama 3.1 rope scaling")
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                "high_freq_factor": float(high), "original_max_position_embeddings": int(old)}  # fmt: skip

    def _experts_config(self, a: str) -> dict[str, Any]:
        experts = int(self.field(a + "expert_count", 0))
        if not experts:
            return {}
        fields = {
            "num_experts_per_tok": int(self.field(a + "expert_used_count")),
            "moe_intermediate_size": int(self.field(a + "expert_feed_forward_length", 0)),
            # llama.cpp renormalizes Qwen3-MoE's top k (its config's norm_topk_prob)
            "norm_topk_prob": self.arch == "qwen3moe",
            "shared_expert_intermediate_size": int(
                self.field(a + "expert_shared_feed_forward_length", 0)
            ),
        }
        if self.arch == "gpt-oss":  # every layer's FFN its experts, biased
            return {"num_experts_per_tok": fields["num_experts_per_tok"],
                    "num_local_experts": experts, "attention_bias": True,
                    "intermediate_size": fields["moe_intermediate_size"]}  # fmt: skip
        if self.arch == "llama":  # Mixtral: a Llama with experts
            return fields | {
                "architectures": ["MixtralForCausalLM"],
                "num_local_experts": experts,
                "intermediate_size": fields.pop("moe_intermediate_size")
                or int(self.field(a + "feed_forward_length")),
            }
        return fields | {"num_experts": experts}

    def eos_ids(self) -> tuple[int, ...]:
        """The tokens generation ends at: the file's eos (and end-of-turn, end-of-message
        where it names them); a gpt-oss file's harmony ends, <|return|> and <|call|>, by
        their text as llama.cpp's loader finds them (the checkpoint's generation_config
        lists both; the file holds one eos)."""
        keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        ids = [int(v) for k in keys if (v := self.field("tokenizer.ggml." + k)) is not None]
        if self.arch == "gpt-oss":
            tokens = self.field("tokenizer.ggml.tokens", [])
            ids += [i for i, t in enumerate(tokens) if t in _HARMONY_ENDS]
        return tuple(dict.fromkeys(ids))

    # ---- the tensors, by Hugging Face names ---------------------------------------

    def resolve(self, name: str) -> str | None:
        """The checkpoint name `name` if this file holds its tensor (an expert's: the
        tensor that stacks every expert's), else None."""
        return name if self.source(name) is not None else None

    def source(self, name: str) -> tuple[str, int | None] | None:
        """(GGUF tensor name, expert index in it or None) of a Hugging Face name; a
        parameter stored without a suffix (gpt-oss's sinks) is the file's `.weight`."""
        expert = None
        if m := _EXPERT.match(name):
            expert = int(m.group(2))
            name = f"{m.group(1)}.{m.group(3)}.{m.group(4)}"
        found = self._names.get_name(name, try_suffixes=(".weight", ".bias"))
        if found is not None and found not in self.tensors:
            found += ".weight"
        return (found, expert) if found in self.tensors else None

    def where(self, name: str) -> Path:
        """The file that holds tensor `name` (for errors): this one."""
        return self.path

    def shape(self, name: str) -> tuple[int, ...]:
        source, expert = self.source(name) or (None, None)
        assert source is not None, name
        dims = tuple(int(n) for n in reversed(self.tensors[source].shape.tolist()))
        return dims[1:] if expert is not None else dims

    def stored_kind(self, name: str) -> str | None:
        """The integer kind that keeps tensor `name`'s values (model.int_weights.stored_kind):
        int4 for Q4_0, Q4_1 and Q4_K, int8 for the other integer types, None for floats."""
        source, _ = self.source(name) or (None, None)
        assert source is not None, name
        return kept_as(self.tensors[source].tensor_type.name)

    def read(
        self,
        name: str,
        rows: range | None = None,
        cols: range | None = None,
        expert: int | None = None,
    ) -> torch.Tensor:
        """The tensor in float32 (of rows / cols in those ranges, of one expert where the
        name or `expert` says)."""
        source, own = self.source(name) or (None, None)
        assert source is not None, name
        whole = self._dequantized(source)
        at = own if own is not None else expert
        part = whole[at] if at is not None else whole
        if rows is not None:
            part = part[rows.start : rows.stop]
        if cols is not None:
            part = part[:, cols.start : cols.stop]
        return part

    def _dequantized(self, source: str) -> torch.Tensor:
        """One GGUF tensor's float32 values in Hugging Face's layout, the last _KEPT kept
        (an expert stack is read once per expert)."""
        if source in self._kept:
            return self._kept[source]
        t = self.tensors[source]
        try:
            values = _gguf().quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(
                f"{self.path}: tensor {source} is in {t.tensor_type.name}, which the gguf "
                f"package cannot dequantize"
            ) from None
        dims = tuple(int(n) for n in reversed(t.shape.tolist()))
        values = np.array(values, dtype=np.float32).reshape(dims)  # a copy torch may own
        tensor = self._unpermuted(source, torch.from_numpy(values))
        if self.arch in _GEMMA_27B_LAYERS and source.endswith("norm.weight"):
            tensor -= 1  # the checkpoint's w, which the loader makes 1 + w again
        if len(self._kept) == _KEPT:
            del self._kept[next(iter(self._kept))]
        self._kept[source] = tensor
        return tensor

    def _unpermuted(self, source: str, w: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's converter's permutation of a Llama q or k projection: per
        head it interleaves the two rotary halves (llama.cpp rotates adjacent pairs)."""
        if self.arch not in _PERMUTED or not source.endswith(("attn_q.weight", "attn_k.weight")):
            return w
        a = f"{self.arch}."
        heads = int(self.field(a + "attention.head_count"))
        if source.endswith("attn_k.weight"):
            heads = int(self.field(a + "attention.head_count_kv", heads))
        half = w.shape[0] // heads // 2
        return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    # ---- the tokenizer ------------------------------------------------------------

    def tokenizer_config(self) -> dict[str, Any]:
        """The tokenizer_config.json fields the file has: bos/eos tokens (as text),
        whether a bos is added, and the chat template."""
        tokens = self.field("tokenizer.ggml.tokens", [])
        config: dict[str, Any] = {}
        for field in ("bos", "eos"):
            tid = self.field(f"tokenizer.ggml.{field}_token_id")
            if tid is not None and int(tid) < len(tokens):
                config[f"{field}_token"] = str(tokens[int(tid)])
        config["add_bos_token"] = bool(self.field("tokenizer.ggml.add_bos_token", False))
        if (template := self.field("tokenizer.chat_template")) is not None:
            config["chat_template"] = str(template)
        return config
