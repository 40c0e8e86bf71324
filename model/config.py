"""ModelConfig: every architectural choice of the decoder-only transformer.

One frozen dataclass covers the Llama family (RMSNorm, RoPE, SwiGLU, GQA), Mistral,
Qwen2 (q/k/v bias), Qwen3 (a norm over each head of q and k), SmolLM3 (layers without
RoPE), Granite (scaled embeddings, residuals, scores and logits), Phi-3 and Phi-4-mini
(LongRoPE, partial rotary), OLMo 2 (norms on the sublayers' outputs, q/k norms over the
whole projection), Gemma 3 (sandwich norms, GeGLU, sliding windows with a RoPE base of
their own) and GPT-2 / 2017-style models (LayerNorm, learned or sinusoidal
positions, GELU, biases, post-norm), plus ALiBi; and the mixtures of experts Qwen3-MoE,
Qwen2-MoE (a shared expert), Mixtral, OLMoE and gpt-oss (`Experts`; gpt-oss also
attention sinks and YaRN). `from_hf_config` reads transformers' config.json
in both its 4.x (`torch_dtype`, `rope_theta`, `rope_scaling`) and 5.x (`dtype`,
`rope_parameters`) forms.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

NORMS = ("rmsnorm", "layernorm")
# pre: x + f(norm(x)); post: norm(x + f(x)) (GPT-1, 2017); output: x + norm(f(x)) (OLMo 2);
# sandwich: x + norm'(f(norm(x))) (Gemma)
PLACEMENTS = ("pre", "post", "output", "sandwich")
# none; head: one RMSNorm over each head of q and of k (Qwen3); all: one over all of q's
# heads together and one over k's (OLMo 2)
QK_NORMS = ("none", "head", "all")
FFNS = ("swiglu", "geglu", "gelu", "gelu_tanh", "relu")  # geglu: Gemma's gated tanh-GELU
POSITIONS = ("rope", "learned", "sinusoidal", "alibi")

# transformers' activation names -> our FFN kinds (for non-gated MLPs)
_HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                "rope_scaling.high_freq_factor must exceed low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )
        if self.original_max_position <= 0:
            raise ValueError("rope_scaling.original_max_position must be > 0")


@dataclass(frozen=True, slots=True)
class LinearRope:
    """Positions divided by `factor` (Gemma 3's global layers in the 4B and larger)."""

    factor: float

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")


@dataclass(frozen=True, slots=True)
class LongRope:
    """Phi-3's LongRoPE: each rotated pair's wavelength stretched by its own factor, the
    short factors up to the pretraining length and the long ones past it, and cos and sin
    scaled by `attention_factor`."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position: int
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(
                f"rope_scaling: {len(self.short_factor)} short factors but "
                f"{len(self.long_factor)} long ones"
            )
        if min(self.short_factor + self.long_factor) <= 0:
            raise ValueError("rope_scaling: every short and long factor must be > 0")
        if self.original_max_position <= 0:
            raise ValueError("rope_scaling.original_max_position must be > 0")


@dataclass(frozen=True, slots=True)
class Yarn:
    """YaRN (gpt-oss): each rotated pair's frequency blended between itself (fast pairs,
    more than `beta_fast` turns over the pretraining length) and itself over `factor`
    (slow pairs, fewer than `beta_slow` turns), linearly between; cos and sin scaled by
    `attention_factor`."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the blend's bounds rounded out to whole pairs
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.original_max_position <= 0:
            raise ValueError("rope_scaling.original_max_position must be > 0")


@dataclass(frozen=True, slots=True)
class Experts:
    """A mixture of experts in place of the FFN (model/moe.py): a router scores
    `n_experts` SwiGLU experts of `d_ff` features each for every token, the `top_k`
    best run and their outputs are summed by the router's weights. The weights are the
    softmax over all experts' logits at the chosen ones (renormalized to sum 1 where
    `norm_top_k`). Qwen2-MoE adds a shared expert of `shared_d_ff` features that every
    token runs, scaled by a sigmoid gate of its own. `dense_layers` keep the model's
    dense FFN (Qwen's `mlp_only_layers`, and those `decoder_sparse_step` skips)."""

    n_experts: int
    top_k: int
    d_ff: int
    norm_top_k: bool = False
    shared_d_ff: int = 0  # 0: no shared expert
    dense_layers: tuple[int, ...] = ()
    bias: bool = False  # biases on every expert's projections (gpt-oss)
    router_bias: bool = False
    # gpt-oss's clamped SwiGLU, (alpha, limit): gate clamped below limit, up to +-limit,
    # (up + 1) * gate * sigmoid(alpha * gate); None: silu(gate) * up
    clamped: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"experts.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.n_experts:
            raise ValueError(
                f"experts.top_k ({self.top_k}) exceeds experts.n_experts ({self.n_experts})"
            )
        if self.shared_d_ff < 0:
            raise ValueError(f"experts.shared_d_ff must be >= 0, got {self.shared_d_ff}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Experts:
        clamped = data.get("clamped")
        return cls(
            **{
                **data,
                "dense_layers": tuple(data.get("dense_layers") or ()),
                "clamped": tuple(clamped) if clamped is not None else None,
            }
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    n_kv_heads: int | None = None  # None -> MHA (= n_heads); 1 -> MQA
    d_head: int | None = None  # None -> d_model // n_heads
    max_position: int = 2048  # the model's context length
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    norm_placement: str = "pre"
    ffn: str = "swiglu"
    position: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | LongRope | LinearRope | Yarn | None = None
    local_rope_theta: float | None = None  # Gemma 3: the windowed layers' own RoPE base
    rotary_dim: int | None = None  # None: the whole head; less: Phi-4-mini's partial rotary
    qkv_bias: bool = False
    qk_norm: str = "none"  # a QK_NORMS choice, before RoPE
    nope_layers: tuple[int, ...] = ()  # SmolLM3: the layers that do not rotate q and k
    # sliding-window attention: a query sees the keys of the `sliding_window` positions
    # ending at its own, in every layer but `global_layers` (Gemma's interleaving)
    sliding_window: int | None = None
    global_layers: tuple[int, ...] = ()
    # Granite's scalings: the embeddings, each sublayer's output before its residual add,
    # the attention scores (None: 1 / sqrt(head_dim)), and the logits (divided by it)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    attn_logit_softcap: float | None = None  # the same on each attention score (Gemma 2)
    attn_sinks: bool = False  # a learned logit per head in each softmax, attending nothing
    attn_out_bias: bool = False
    mlp_bias: bool = False
    experts: Experts | None = None  # a mixture of experts in place of the FFN
    tie_embeddings: bool = True
    name: str = "kvserve-model"
    architecture: str = "native"
    torch_dtype: str = "float32"  # the dtype the checkpoint was saved in
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        _choice("norm", self.norm, NORMS)
        _choice("norm_placement", self.norm_placement, PLACEMENTS)
        _choice("ffn", self.ffn, FFNS)
        _choice("position", self.position, POSITIONS)
        _choice("qk_norm", self.qk_norm, QK_NORMS)
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise ValueError(
                f"n_kv_heads must divide n_heads ({self.n_heads}), got {self.n_kv_heads}"
            )
        if self.d_head is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                "unless d_head is given"
            )
        if self.d_head is not None and self.d_head <= 0:
            raise ValueError(f"d_head must be > 0, got {self.d_head}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"d_head must be even for RoPE, got {self.head_dim}")
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(
                f"rotary_dim must be even and within the head's {self.head_dim}, "
                f"got {self.rotary_dim}"
            )
        if isinstance(self.rope_scaling, LongRope) and 2 * len(self.rope_scaling.short_factor) != (
            self.rotary_dim or self.head_dim
        ):
            raise ValueError(
                f"rope_scaling: {len(self.rope_scaling.short_factor)} factors for a rotary "
                f"dimension of {self.rotary_dim or self.head_dim} (one per rotated pair)"
            )
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"d_model must be even for sinusoidal positions, got {self.d_model}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        for name in ("nope_layers", "global_layers"):
            for i in getattr(self, name):
                if not 0 <= i < self.n_layers:
                    raise ValueError(f"{name}: layer {i} is outside the {self.n_layers} layers")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {self.sliding_window}")
        if self.logits_scaling == 0:
            raise ValueError("logits_scaling must not be 0")
        for tok in self.eos_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"eos_token_ids: {tok} is outside the vocabulary")
        if self.experts is not None:
            self._check_experts(self.experts)

    def _check_experts(self, experts: Experts) -> None:
        if self.ffn != "swiglu":
            raise ValueError(f"experts are SwiGLU FFNs; ffn is {self.ffn!r}")
        for i in experts.dense_layers:
            if not 0 <= i < self.n_layers:
                raise ValueError(
                    f"experts.dense_layers: layer {i} is outside the {self.n_layers} layers"
                )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def scaled(self) -> bool:
        """Whether Granite's multipliers change the block (not just its ends)."""
        return self.residual_multiplier != 1.0 or self.attention_multiplier is not None

    @property
    def gated(self) -> bool:
        """Whether the FFN's input projection is (gate | up): twice d_ff rows."""
        return self.ffn in ("swiglu", "geglu")

    @property
    def head_dim(self) -> int:
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s FFN is a mixture of experts."""
        return self.experts is not None and layer not in self.experts.dense_layers

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose FFN is a mixture of experts."""
        return tuple(i for i in range(self.n_layers) if self.sparse(i))

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`'s attention (None: it sees every key)."""
        return None if layer in self.global_layers else self.sliding_window

    @property
    def windowed_layers(self) -> tuple[int, ...]:
        """The layers with a sliding window."""
        return tuple(i for i in range(self.n_layers) if self.window(i) is not None)

    @property
    def mixed_windows(self) -> bool:
        """Windowed layers beside global ones (Gemma 2 and 3): those need their keys' KV
        for a window alone, the others for the whole context."""
        return 0 < len(self.windowed_layers) < self.n_layers

    @property
    def features(self) -> list[str]:
        """The variations on Llama's block this config uses, named for the model card."""
        out = [
            f"{f}={getattr(self, f)}" for f, llama in _LLAMA_CHOICES if getattr(self, f) != llama
        ]
        if self.qkv_bias:
            out.append("qkv_bias")
        if self.qk_norm != "none":
            out.append(f"qk_norm={self.qk_norm}")
        if self.nope_layers:
            out.append("nope_layers=" + ",".join(map(str, self.nope_layers)))
        if self.sliding_window is not None:
            out.append(f"sliding_window={self.sliding_window}")
        if self.global_layers:
            out.append("global_layers=" + ",".join(map(str, self.global_layers)))
        if self.rotary_dim is not None:
            out.append(f"rotary_dim={self.rotary_dim}/{self.head_dim}")
        if self.rope_scaling is not None:
            kinds = {
                LongRope: "longrope",
                LinearRope: "linear",
                RopeScaling: "llama3",
                Yarn: "yarn",
            }
            out.append(f"rope_scaling={kinds[type(self.rope_scaling)]}")
        if self.local_rope_theta is not None:
            out.append(f"local_rope_theta={self.local_rope_theta:g}")
        if (e := self.experts) is not None:
            out.append(f"experts={e.top_k}/{e.n_experts}x{e.d_ff}")
            if e.shared_d_ff:
                out.append(f"shared_expert={e.shared_d_ff}")
            if e.dense_layers:
                out.append("dense_layers=" + ",".join(map(str, e.dense_layers)))
        if self.attn_sinks:
            out.append("attn_sinks")
        for name in ("final_logit_softcap", "attn_logit_softcap"):
            if (cap := getattr(self, name)) is not None:
                out.append(f"{name}={cap:g}")
        for name, plain in _PLAIN_SCALES:
            if getattr(self, name) != plain:
                out.append(f"{name}={getattr(self, name):g}")
        return out

    @property
    def rotary(self) -> int:
        """How many of a head's dimensions RoPE rotates."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    def describe(self, *fields: str) -> str:
        """`fields` with their values, under the names config.json uses for this
        architecture ("num_attention_heads=8, head_dim=64"), for error messages."""
        names = _NAMES_BY_ARCH.get(self.architecture, {})
        values = {"n_kv_heads": self.kv_heads, "d_head": self.head_dim}
        return ", ".join(f"{names.get(f, f)}={values.get(f, getattr(self, f))}" for f in fields)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        out["nope_layers"] = list(self.nope_layers)
        out["global_layers"] = list(self.global_layers)
        if self.experts is not None:
            out["experts"]["dense_layers"] = list(self.experts.dense_layers)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config field(s): {', '.join(unknown)}")
        scaling = data.get("rope_scaling")
        if scaling is not None and "short_factor" in scaling:
            factors = {k: tuple(scaling[k]) for k in ("short_factor", "long_factor")}
            data["rope_scaling"] = LongRope(**{**scaling, **factors})
        elif scaling is not None and set(scaling) == {"factor"}:
            data["rope_scaling"] = LinearRope(**scaling)
        elif scaling is not None and "beta_fast" in scaling:
            data["rope_scaling"] = Yarn(**scaling)
        elif scaling is not None:
            data["rope_scaling"] = RopeScaling(**scaling)
        if isinstance(data.get("qk_norm"), bool):  # written when it was a flag
            data["qk_norm"] = "head" if data["qk_norm"] else "none"
        data["eos_token_ids"] = tuple(data.get("eos_token_ids") or ())
        data["nope_layers"] = tuple(data.get("nope_layers") or ())
        data["global_layers"] = tuple(data.get("global_layers") or ())
        if data.get("experts") is not None:
            data["experts"] = Experts.from_dict(data["experts"])
        return cls(**data)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a transformers config.json dict (4.x or 5.x form)."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else hf.get("model_type", "")
        reader = _HF_READERS.get(arch) or _HF_READERS.get(hf.get("model_type", ""))
        if reader is None:
            supported = ", ".join(sorted(k for k in _HF_READERS if k[0].isupper()))
            raise ValueError(f"unknown architecture {arch!r}; supported: {supported}")
        try:
            return reader(hf)
        except ValueError as exc:  # say it in config.json's words, not ModelConfig's
            names = _HF_NAMES[reader]
            raise ValueError(_FIELD.sub(lambda m: names.get(m[0], m[0]), str(exc))) from None


# the scalings a Llama block leaves at 1 (or to 1/sqrt(head_dim)), named where set
_PLAIN_SCALES = (
    ("embedding_multiplier", 1.0),
    ("residual_multiplier", 1.0),
    ("attention_multiplier", None),
    ("logits_scaling", 1.0),
)
# the choices a Llama block makes, which `features` names where a config differs
_LLAMA_CHOICES = (
    ("norm", "rmsnorm"),
    ("norm_placement", "pre"),
    ("ffn", "swiglu"),
    ("position", "rope"),
)


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")


def _require(hf: dict[str, Any], key: str) -> Any:
    if key not in hf or hf[key] is None:
        raise ValueError(f"missing field {key!r}")
    return hf[key]


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _hf_dtype(hf: dict[str, Any]) -> str:
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def _hf_rope(
    hf: dict[str, Any],
) -> tuple[float, RopeScaling | LongRope | LinearRope | Yarn | None]:
    """RoPE theta and scaling from `rope_parameters` (5.x) or `rope_theta`/`rope_scaling` (4.x)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return theta, None
    if kind in ("longrope", "su"):  # "su": Phi-3's first name for it
        return theta, _long_rope(hf, scaling)
    if kind == "linear":
        return theta, LinearRope(float(_require(scaling, "factor")))
    if kind == "yarn":
        return theta, _yarn(hf, scaling)
    if kind != "llama3":
        raise ValueError(
            f"rope_scaling: type {kind!r} is not supported (llama3, longrope, linear, yarn are)"
        )
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _yarn(hf: dict[str, Any], scaling: dict[str, Any]) -> Yarn:
    """YaRN as transformers reads it: the attention factor, unless given, 0.1 ln(factor)
    + 1 (or the ratio of two such with DeepSeek's mscale and mscale_all_dim)."""
    original = int(_require(scaling, "original_max_position_embeddings"))
    factor = scaling.get("factor") or int(_require(hf, "max_position_embeddings")) / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return Yarn(
        factor=factor,
        original_max_position=original,
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        truncate=bool(scaling.get("truncate", True)),
        attention_factor=float(attention),
    )


def _long_rope(hf: dict[str, Any], scaling: dict[str, Any]) -> LongRope:
    """LongRoPE as transformers computes it: the attention factor, unless given, from the
    ratio of the context to the pretraining length."""
    original = scaling.get("original_max_position_embeddings")
    original = int(original or hf.get("original_max_position_embeddings") or 0)
    if original <= 0:
        raise ValueError("rope_scaling: longrope needs original_max_position_embeddings")
    factor = scaling.get("factor") or int(hf.get("max_position_embeddings", original)) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(
        short_factor=tuple(float(f) for f in _require(scaling, "short_factor")),
        long_factor=tuple(float(f) for f in _require(scaling, "long_factor")),
        original_max_position=original,
        attention_factor=float(attention),
    )


def _read_llama_like(
    hf: dict[str, Any], *, qkv_bias_default: bool, rotary_factor: float = 1.0
) -> ModelConfig:
    """Llama's fields; `rotary_factor`: the share of each head RoPE turns."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported for gated MLPs")
    theta, scaling = _hf_rope(hf)
    attention_bias = bool(hf.get("attention_bias", qkv_bias_default))
    n_heads = int(_require(hf, "num_attention_heads"))
    d_head = hf.get("head_dim") or int(_require(hf, "hidden_size")) // n_heads
    rotary = int(d_head * rotary_factor)
    if not 0 < rotary <= d_head:
        raise ValueError(f"partial_rotary_factor {rotary_factor} leaves no rotary dimension")
    return ModelConfig(
        vocab_size=int(_require(hf, "vocab_size")),
        d_model=int(_require(hf, "hidden_size")),
        n_layers=int(_require(hf, "num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        d_head=hf.get("head_dim"),
        rotary_dim=None if rotary == d_head else rotary,
        d_ff=int(_require(hf, "intermediate_size")),
        max_position=int(hf.get("max_position_embeddings", 2048)),
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        ffn="swiglu",
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=attention_bias,
        attn_out_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        name=str(hf.get("_name_or_path") or hf.get("model_type", "model")),
        architecture=(hf.get("architectures") or ["LlamaForCausalLM"])[0],
        torch_dtype=_hf_dtype(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
    )


def _read_llama(hf: dict[str, Any]) -> ModelConfig:
    return _read_llama_like(hf, qkv_bias_default=False)


def _read_qwen2(hf: dict[str, Any]) -> ModelConfig:
    # Qwen2 always has q/k/v biases and no output bias; it has no attention_bias field.
    cfg = _read_llama_like({**hf, "attention_bias": False}, qkv_bias_default=False)
    return cfg.replace(qkv_bias=True, architecture="Qwen2ForCausalLM")


def _read_qwen3(hf: dict[str, Any]) -> ModelConfig:
    # Qwen3: no q/k/v bias unless attention_bias says so, a norm over each head of q and
    # k, and a head_dim of its own (not hidden_size / heads)
    cfg = _read_llama_like(hf, qkv_bias_default=False)
    return cfg.replace(qk_norm="head", architecture="Qwen3ForCausalLM")


def _windowed(cfg: ModelConfig, hf: dict[str, Any]) -> ModelConfig:
    """`sliding_window` (Mistral 7B v0.1, Phi-3-mini-4k): each token attends to the
    window of positions ending at it, in every layer."""
    window = hf.get("sliding_window")
    if window is not None and hf.get("use_sliding_window", True) is not False:
        return cfg.replace(sliding_window=int(window))
    return cfg


def _read_mistral(hf: dict[str, Any]) -> ModelConfig:
    # Mistral is Llama's block, with a window in v0.1 (v0.2 and later have none)
    cfg = _windowed(_read_llama_like(hf, qkv_bias_default=False), hf)
    return cfg.replace(architecture="MistralForCausalLM")


def _read_phi3(hf: dict[str, Any]) -> ModelConfig:
    # Phi-3 and Phi-4-mini: Llama's block with q|k|v and gate|up each one tensor (as
    # ours are), LongRoPE in the long-context models, and Phi-4-mini's partial rotary
    params = hf.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    cfg = _read_llama_like(hf, qkv_bias_default=False, rotary_factor=float(partial or 1.0))
    return _windowed(cfg, hf).replace(architecture="Phi3ForCausalLM")


def _read_olmo2(hf: dict[str, Any]) -> ModelConfig:
    # OLMo 2: a norm on each sublayer's output (none before), and one RMSNorm over all of
    # q's heads and one over k's
    cfg = _read_llama_like(hf, qkv_bias_default=False)
    return cfg.replace(norm_placement="output", qk_norm="all", architecture="Olmo2ForCausalLM")


def _read_smollm3(hf: dict[str, Any]) -> ModelConfig:
    # SmolLM3: Llama's block, with no RoPE in the layers `no_rope_layers` marks 0 (every
    # fourth by default: `no_rope_layer_interval`)
    cfg = _read_llama_like(hf, qkv_bias_default=False)
    flags = hf.get("no_rope_layers")
    if flags is None:
        every = int(hf.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % every != 0) for i in range(cfg.n_layers)]
    if len(flags) != cfg.n_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {cfg.n_layers} layers")
    nope = tuple(i for i, rotate in enumerate(flags) if not rotate)
    return cfg.replace(nope_layers=nope, architecture="SmolLM3ForCausalLM")


def _read_granite(hf: dict[str, Any]) -> ModelConfig:
    # Granite: Llama's block with four scalings (ModelConfig's multipliers)
    cfg = _read_llama_like(hf, qkv_bias_default=False)
    attention = hf.get("attention_multiplier")
    return cfg.replace(
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        attention_multiplier=None if attention is None else float(attention),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
        architecture="GraniteForCausalLM",
    )


GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # the tanh GELU


def _read_gemma3(hf: dict[str, Any]) -> ModelConfig:
    # Gemma 3 (text): Gemma 2's block with q/k norms, sliding-window layers with a RoPE base
    # of their own, and every sixth layer global
    return _read_gemma(hf, qk_norm="head", every=6, architecture="Gemma3ForCausalLM")


def _read_gemma3_multimodal(hf: dict[str, Any]) -> ModelConfig:
    # Gemma 3 4B and larger: the text model of an image-and-text checkpoint, read from its
    # `text_config` (kvserve serves text; the vision tower's weights are not read)
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("missing field 'text_config'")
    cfg = _read_gemma3({"model_type": "gemma3_text", **text})
    return cfg.replace(architecture="Gemma3ForConditionalGeneration")


def _read_gemma2(hf: dict[str, Any]) -> ModelConfig:
    # Gemma 2: every other layer windowed, scores and logits soft-capped
    return _read_gemma(hf, qk_norm="none", every=2, architecture="Gemma2ForCausalLM")


def _read_gemma(hf: dict[str, Any], *, qk_norm: str, every: int, architecture: str) -> ModelConfig:
    """Gemma's block: Llama's projections around a sandwich of norms, each (1 + weight)
    (weights.py adds the 1), a gated tanh-GELU, embeddings times sqrt(hidden), scores
    scaled by query_pre_attn_scalar, windowed layers interleaved with global ones (the
    `every`-th by default), soft-capping where the config sets it."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ValueError(f"hidden_activation {act!r} is not supported ({GEMMA_ACTIVATIONS[0]} is)")
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # 5.x: one RoPE per layer type
        rope, local = params["full_attention"], params.get("sliding_attention") or {}
        local_theta = float(local.get("rope_theta", 10000.0))
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.sliding_attention: type {local['rope_type']!r}")
    elif architecture == "Gemma3ForCausalLM":  # 4.x: the local base a field of its own
        rope = {"rope_theta": hf.get("rope_theta", 1_000_000.0), **(hf.get("rope_scaling") or {})}
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    else:  # Gemma 2: one RoPE for every layer
        rope, local_theta = params or {"rope_theta": hf.get("rope_theta", 10000.0)}, None
    cfg = _read_llama_like(
        {**hf, "hidden_act": "silu", "rope_parameters": rope, "rope_scaling": None},
        qkv_bias_default=False,
    )
    types = hf.get("layer_types")
    if types is None:
        every = int(hf.get("sliding_window_pattern", every))
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(cfg.n_layers)
        ]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != cfg.n_layers:
        raise ValueError(
            f"layer_types: {unknown or len(types)} (full_attention, sliding_attention)"
        )
    window = hf.get("sliding_window")
    return cfg.replace(
        ffn="geglu",
        norm_placement="sandwich",
        qk_norm=qk_norm,
        embedding_multiplier=cfg.d_model**0.5,
        attention_multiplier=float(hf.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5,
        sliding_window=int(window) if window else None,
        global_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        local_rope_theta=None if local_theta is None else float(local_theta),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        architecture=architecture,
    )


def _experts(hf: dict[str, Any], *, top_k_normalized: bool | None = None) -> Experts:
    """The experts of a Qwen-style MoE config: `num_experts` (or Mixtral's
    `num_local_experts`) of `moe_intermediate_size` features (else `intermediate_size`),
    sparse in every `decoder_sparse_step`-th layer but `mlp_only_layers`.
    top_k_normalized: whether the chosen weights sum to 1 whatever `norm_topk_prob`
    says (Mixtral always renormalizes)."""
    n = hf.get("num_experts") or _require(hf, "num_local_experts")
    layers = int(_require(hf, "num_hidden_layers"))
    step = int(hf.get("decoder_sparse_step") or 1)
    only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    normalized = top_k_normalized
    if normalized is None:
        normalized = bool(hf.get("norm_topk_prob", False))
    return Experts(
        n_experts=int(n),
        top_k=int(_require(hf, "num_experts_per_tok")),
        d_ff=int(hf.get("moe_intermediate_size") or _require(hf, "intermediate_size")),
        norm_top_k=normalized,
        shared_d_ff=int(hf.get("shared_expert_intermediate_size") or 0),
        dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step),
    )


def _read_qwen3_moe(hf: dict[str, Any]) -> ModelConfig:
    # Qwen3-MoE: Qwen3's attention, experts in every decoder_sparse_step-th layer
    cfg = _read_qwen3(hf)
    return cfg.replace(experts=_experts(hf), architecture="Qwen3MoeForCausalLM")


def _read_qwen2_moe(hf: dict[str, Any]) -> ModelConfig:
    # Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention, routed experts beside a shared one
    cfg = _read_qwen2(hf)
    return cfg.replace(experts=_experts(hf), architecture="Qwen2MoeForCausalLM")


def _read_mixtral(hf: dict[str, Any]) -> ModelConfig:
    # Mixtral: Mistral's block with top-2 of 8 experts of intermediate_size features, the
    # chosen ones' weights renormalized
    cfg = _windowed(_read_llama_like(hf, qkv_bias_default=False), hf)
    experts = _experts(hf, top_k_normalized=True)
    return cfg.replace(experts=experts, architecture="MixtralForCausalLM")


def _read_olmoe(hf: dict[str, Any]) -> ModelConfig:
    # OLMoE: Llama's pre-norm block with q/k norms over the whole projections (as OLMo 2)
    # and experts of intermediate_size features in every layer
    if hf.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv {hf['clip_qkv']} is not supported (null is)")
    cfg = _read_llama_like(hf, qkv_bias_default=False)
    return cfg.replace(qk_norm="all", experts=_experts(hf), architecture="OlmoeForCausalLM")


def _read_gpt_oss(hf: dict[str, Any]) -> ModelConfig:
    # gpt-oss: Llama's projections with biases, a sink logit per head, sliding-window
    # layers (128) alternating with global ones, YaRN, and in every layer top-k experts
    # chosen by a biased router, their weights the softmax over the chosen logits, each
    # a clamped SwiGLU with biases
    cfg = _read_llama_like({**hf, "hidden_act": "silu"}, qkv_bias_default=True)
    types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.n_layers)
    ]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != cfg.n_layers:
        raise ValueError(
            f"layer_types: {unknown or len(types)} (full_attention, sliding_attention)"
        )
    experts = Experts(
        n_experts=int(_require(hf, "num_local_experts")),
        top_k=int(_require(hf, "num_experts_per_tok")),
        d_ff=int(_require(hf, "intermediate_size")),
        norm_top_k=True,
        bias=True,
        router_bias=True,
        clamped=(float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))),
    )
    window = hf.get("sliding_window")
    return cfg.replace(
        attn_sinks=True,
        experts=experts,
        sliding_window=int(window) if window else None,
        global_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        architecture="GptOssForCausalLM",
    )


def _read_gpt2(hf: dict[str, Any]) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in _HF_ACTIVATIONS:
        raise ValueError(f"activation_function {act!r} is not supported")
    d_model = int(_require(hf, "n_embd"))
    return ModelConfig(
        vocab_size=int(_require(hf, "vocab_size")),
        d_model=d_model,
        n_layers=int(_require(hf, "n_layer")),
        n_heads=int(_require(hf, "n_head")),
        d_ff=int(hf.get("n_inner") or 4 * d_model),
        max_position=int(hf.get("n_positions", 1024)),
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        ffn=_HF_ACTIVATIONS[act],
        position="learned",
        qkv_bias=True,
        attn_out_bias=True,
        mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        name=str(hf.get("_name_or_path") or "gpt2"),
        architecture="GPT2LMHeadModel",
        torch_dtype=_hf_dtype(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
    )


# ModelConfig field -> the config.json key it was read from, for error messages
_LLAMA_NAMES = {
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "d_head": "head_dim",
    "d_ff": "intermediate_size",
    "max_position": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "eos_token_ids": "eos_token_id",
}
_MOE_NAMES = _LLAMA_NAMES | {
    "experts.n_experts": "num_experts",
    "experts.top_k": "num_experts_per_tok",
    "experts.d_ff": "moe_intermediate_size",
    "experts.dense_layers": "mlp_only_layers",
}
_GPT_OSS_NAMES = _MOE_NAMES | {
    "experts.n_experts": "num_local_experts",
    "experts.d_ff": "intermediate_size",
}
_GPT2_NAMES = {
    "d_model": "n_embd",
    "n_layers": "n_layer",
    "n_heads": "n_head",
    "d_ff": "n_inner",
    "max_position": "n_positions",
    "norm_eps": "layer_norm_epsilon",
    "eos_token_ids": "eos_token_id",
}
_HF_NAMES = {
    _read_llama: _LLAMA_NAMES,
    _read_qwen2: _LLAMA_NAMES,
    _read_qwen3: _LLAMA_NAMES,
    _read_mistral: _LLAMA_NAMES,
    _read_smollm3: _LLAMA_NAMES,
    _read_granite: _LLAMA_NAMES,
    _read_phi3: _LLAMA_NAMES,
    _read_olmo2: _LLAMA_NAMES,
    _read_gemma3: _LLAMA_NAMES,
    _read_gemma3_multimodal: _LLAMA_NAMES,
    _read_gemma2: _LLAMA_NAMES,
    _read_gpt2: _GPT2_NAMES,
    _read_qwen3_moe: _MOE_NAMES,
    _read_qwen2_moe: _MOE_NAMES,
    _read_mixtral: _MOE_NAMES,
    _read_olmoe: _MOE_NAMES,
    _read_gpt_oss: _MOE_NAMES
    | {"experts.n_experts": "num_local_experts", "experts.d_ff": "intermediate_size"},
}
_NAMES_BY_ARCH = {
    "LlamaForCausalLM": _LLAMA_NAMES,
    "Qwen2ForCausalLM": _LLAMA_NAMES,
    "Qwen3ForCausalLM": _LLAMA_NAMES,
    "MistralForCausalLM": _LLAMA_NAMES,
    "SmolLM3ForCausalLM": _LLAMA_NAMES,
    "GraniteForCausalLM": _LLAMA_NAMES,
    "Phi3ForCausalLM": _LLAMA_NAMES,
    "Olmo2ForCausalLM": _LLAMA_NAMES,
    "Gemma3ForCausalLM": _LLAMA_NAMES,
    "Gemma3ForConditionalGeneration": _LLAMA_NAMES,
    "Gemma2ForCausalLM": _LLAMA_NAMES,
    "GPT2LMHeadModel": _GPT2_NAMES,
    "Qwen3MoeForCausalLM": _MOE_NAMES,
    "Qwen2MoeForCausalLM": _MOE_NAMES,
    "MixtralForCausalLM": _MOE_NAMES,
    "OlmoeForCausalLM": _MOE_NAMES,
    "GptOssForCausalLM": _GPT_OSS_NAMES,
}
_FIELD = re.compile(
    r"\b("
    + "|".join(map(re.escape, sorted(_MOE_NAMES | _GPT2_NAMES, key=len, reverse=True)))
    + r")\b"
)

_HF_READERS = {
    "LlamaForCausalLM": _read_llama,
    "Qwen2ForCausalLM": _read_qwen2,
    "Qwen3ForCausalLM": _read_qwen3,
    "MistralForCausalLM": _read_mistral,
    "SmolLM3ForCausalLM": _read_smollm3,
    "GraniteForCausalLM": _read_granite,
    "Phi3ForCausalLM": _read_phi3,
    "Olmo2ForCausalLM": _read_olmo2,
    "Gemma3ForCausalLM": _read_gemma3,
    "Gemma3ForConditionalGeneration": _read_gemma3_multimodal,
    "Gemma2ForCausalLM": _read_gemma2,
    "GPT2LMHeadModel": _read_gpt2,
    "Qwen3MoeForCausalLM": _read_qwen3_moe,
    "Qwen2MoeForCausalLM": _read_qwen2_moe,
    "MixtralForCausalLM": _read_mixtral,
    "OlmoeForCausalLM": _read_olmoe,
    "GptOssForCausalLM": _read_gpt_oss,
    "llama": _read_llama,
    "qwen2": _read_qwen2,
    "qwen3": _read_qwen3,
    "mistral": _read_mistral,
    "smollm3": _read_smollm3,
    "granite": _read_granite,
    "phi3": _read_phi3,
    "olmo2": _read_olmo2,
    "gemma3_text": _read_gemma3,
    "gemma3": _read_gemma3_multimodal,
    "gemma2": _read_gemma2,
    "gpt2": _read_gpt2,
    "qwen3_moe": _read_qwen3_moe,
    "qwen2_moe": _read_qwen2_moe,
    "mixtral": _read_mixtral,
    "olmoe": _read_olmoe,
    "gpt_oss": _read_gpt_oss,
}
