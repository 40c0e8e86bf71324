"""Which weights `--quantization int4` holds in more than 4 bits: llama.cpp's Q4_K_M
choice of the tensors that take more bits, in kvserve's kinds.

Q4_K_M (llama.cpp's llama_tensor_get_type) holds most linears in 4-bit Q4_K and gives
6-bit Q6_K to the LM head and, in its `use_more_bits` layers (the first and last eighth
of the stack and every third layer between), to the attention's V projection and the
FFN's down projection. A tensor whose rows are not whole K-quant blocks (K_BLOCK input
features) cannot be Q4_K or Q6_K: llama.cpp takes Q5_0 and Q8_0 for it. On the cpu
backend `--quantization int4` does the same with its kinds, int4, int5 and int8g (5-
and 8-bit groups): int8g for the head and, in those layers, the whole (q | k | v)
projection (the fused weight takes one kind) and the down projection (a mixture's
routed experts' and its shared expert's too); int5 for every other linear whose input
features are not whole K-quant blocks (a small model's: SmolLM's 576, Qwen2.5-0.5B's
896; gpt-oss's 2880). A mixture's router stays in the model's dtype
(model.moe.linear_quantization). The torch and Triton backends have no 5- or 8-bit
grouped kernel: they hold these in int4 like the rest.

The choice is marked on the modules when a Transformer is built (they outlive the load,
which replaces their parameters): `held` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from model.config import ModelConfig

EIGHT_BIT, FIVE_BIT = "int8g", "int5"
K_BLOCK = 256  # the weights in a row of one of llama.cpp's K-quant super-blocks
_MARK = "_int4_kinds"  # a module attribute: its marked parameters' names and kinds


def more_bits(index: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: layer `index` is in the first or last eighth of the
    stack, or every third between."""
    eighth = n_layers // 8
    return index < eighth or index >= 7 * n_layers // 8 or (index - eighth) % 3 == 2


def mark(module: nn.Module, name: str = "weight", kind: str = EIGHT_BIT) -> None:
    """Parameter `name` of `module` is one int4 holds in `kind`."""
    setattr(module, _MARK, {**getattr(module, _MARK, {}), name: kind})


@dataclass(frozen=True, slots=True)
class Part:
    """One of a decoder layer's quantized weights: parameter `name` of the module at
    `path` under the layer, `count` matrices (a mixture's routed experts) of
    (in_features, out_features); `more`: Q4_K_M gives it more bits in this layer."""

    path: str
    name: str
    in_features: int
    out_features: int
    count: int = 1
    more: bool = False

    @property
    def kind(self) -> str:
        """What int4 holds it in: int8g where it takes more bits (Q4_K_M's Q6_K, or Q8_0
        where its rows are not whole K-quant blocks), int5 where its rows are not whole
        blocks (Q4_K_M's Q5_0), else int4."""
        if self.more:
            return EIGHT_BIT
        return FIVE_BIT if self.in_features % K_BLOCK else "int4"


def layer_parts(cfg: ModelConfig, index: int) -> list[Part]:
    """Layer `index`'s linears as --quantization int4 takes them, at `cfg`'s (the whole
    model's, not a tensor-parallel rank's) widths: (q | k | v), the attention output,
    and the FFN's (gate | up) and down, or a mixture's routed experts' stacks, its
    shared expert's and the shared expert's gate (its router stays unquantized)."""
    d, dh, more = cfg.d_model, cfg.head_dim, more_bits(index, cfg.n_layers)
    parts = [
        Part("attn.wqkv", "weight", d, (cfg.n_heads + 2 * cfg.kv_heads) * dh, more=more),
        Part("attn.wo", "weight", cfg.n_heads * dh, d),
    ]
    if not cfg.sparse(index):
        ffn_in = (2 if cfg.gated else 1) * cfg.d_ff
        parts.append(Part("ffn.w_in", "weight", d, ffn_in))
        parts.append(Part("ffn.w_out", "weight", cfg.d_ff, d, more=more))
        return parts
    e = cfg.experts
    assert e is not None
    parts += [
        Part("ffn.experts", "w_in", d, 2 * e.d_ff, e.n_experts),
        Part("ffn.experts", "w_out", e.d_ff, d, e.n_experts, more),
    ]
    if e.shared_d_ff:
        parts += [
            Part("ffn.shared.w_in", "weight", d, 2 * e.shared_d_ff),
            Part("ffn.shared.w_out", "weight", e.shared_d_ff, d, more=more),
            Part("ffn.shared_gate", "weight", d, 1),
        ]
    return parts


def mark_layer(block: nn.Module, index: int, cfg: ModelConfig) -> None:
    """Mark layer `index`'s parts that int4 holds in another kind; `block` has
    model/transformer.py's Block's parts."""
    for part in layer_parts(cfg, index):
        if part.kind != "int4":
            mark(block.get_submodule(part.path), part.name, part.kind)


def held(module: nn.Module, quantization: str, name: str = "weight") -> str:
    """What parameter `name` of `module` is held as on a backend with the mix's kinds
    (the cpu backend): its marked kind where `quantization` is int4, else
    `quantization`."""
    kind = getattr(module, _MARK, {}).get(name)
    return kind if quantization == "int4" and kind is not None else quantization
