"""Which weights `--quantization int4` holds in 8 bits: llama.cpp's Q4_K_M choice of the
tensors that take more bits, in kvserve's kinds.

Q4_K_M (llama.cpp's llama_tensor_get_type) holds most linears in 4-bit Q4_K and gives
6-bit Q6_K to the LM head and, in its `use_more_bits` layers (the first and last eighth
of the stack and every third layer between), to the attention's V projection and the
FFN's down projection. On the cpu backend `--quantization int4` does the same with its
kinds, int4 and int8g (8-bit groups, the kernels' kind above 4 bits): the head, and in
those layers the whole (q | k | v) projection (the fused weight takes one kind) and the
down projection (a mixture's routed experts' and its shared expert's too). A mixture's
router stays in the model's dtype (model.moe.linear_quantization). The torch and
Triton backends have no 8-bit grouped kernel: they hold these in int4 like the rest.

The choice is marked on the modules when a Transformer is built (they outlive the load,
which replaces their parameters): `held` reads it.
"""

from __future__ import annotations

from torch import nn

EIGHT_BIT = "int8g"
_MARK = "_int4_more_bits"  # a module attribute: the names of its parameters marked


def more_bits(index: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: layer `index` is in the first or last eighth of the
    stack, or every third between."""
    eighth = n_layers // 8
    return index < eighth or index >= 7 * n_layers // 8 or (index - eighth) % 3 == 2


def mark(module: nn.Module, name: str = "weight") -> None:
    """Parameter `name` of `module` is one int4 holds in 8 bits."""
    setattr(module, _MARK, getattr(module, _MARK, frozenset()) | {name})


def mark_layer(block: nn.Module, index: int, n_layers: int) -> None:
    """A decoder layer's (q | k | v) and down projections, where layer `index` of
    `n_layers` takes more bits; `block` has model/transformer.py's Block's parts."""
    if not more_bits(index, n_layers):
        return
    mark(block.attn.wqkv)
    ffn = block.ffn
    if hasattr(ffn, "experts"):  # a mixture: its routed experts' stack, its shared expert
        mark(ffn.experts, "w_out")
        if ffn.shared is not None:
            mark(ffn.shared.w_out)
    else:
        mark(ffn.w_out)


def held(module: nn.Module, quantization: str, name: str = "weight") -> str:
    """What parameter `name` of `module` is held as on a backend with 8-bit groups:
    EIGHT_BIT where `quantization` is int4 and the parameter is marked, else
    `quantization`."""
    marked = name in getattr(module, _MARK, ())
    return EIGHT_BIT if quantization == "int4" and marked else quantization
