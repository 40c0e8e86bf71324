"""int4 weights for the torch and Triton backends: `--quantization int4`, and under
`auto` the linears a checkpoint stores in 4-bit groups (GGUF Q4_0 and Q4_K, AWQ, GPTQ,
compressed-tensors W4A16). Each linear holds model/grouped.py's int4 codes, two to a
byte, with a bf16 step and minimum each 32 in features: 5/8 of a byte a weight. The
rounding is the cpu backend's (the same codes and scales from the same weights), so a
checkpoint's 4-bit groups keep their own levels; the LM head is quantized too (a tied one
as an int4 copy of the embedding table, which the lookup keeps), as on the cpu backend. A
mixture's routed experts stay in the model's dtype: no expert kernel here reads int4.

A backend's prepare() gives the linears its kernel (the triton backend's int4_linear:
codes widened in registers, on the GPU and in the interpreter); without one (the torch
backend, the reference) forward dequantizes the weight and runs F.linear: the same
values, at bf16 speed or less."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.grouped import GROUP, int4_dequantize, int4_quantize_reference
from model.int_weights import stored_kind
from model.moe import linear_quantization

# kernel(x rows (M, K), codes, steps, minimums, bias) -> (M, N) in x's dtype
Int4Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor | None], Tensor]


class Int4Linear(nn.Module):
    kernel: Int4Kernel | None = None  # a backend's, set by its prepare()

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, d, m = int4_quantize_reference(weight.detach())
        self.register_buffer("codes", (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous())
        self.register_buffer("steps", d)  # (out, in / 32) bf16
        self.register_buffer("minimums", m)
        self.bias = bias

    def dequantized(self) -> Tensor:
        """The weight the codes hold, float32 (out, in)."""
        q = torch.stack([self.codes & 0xF, self.codes >> 4], dim=2)
        return int4_dequantize(q.reshape(self.out_features, -1), self.steps, self.minimums)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel is not None:
            out = self.kernel(rows, self.codes, self.steps, self.minimums, self.bias)
        else:
            out = F.linear(rows, self.dequantized().to(x.dtype), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def takes_int4(weight: Tensor, quantization: str) -> bool:
    """Whether a linear's weight is held as int4 under `quantization`: 'int4', or 'auto'
    for a weight the checkpoint stores in 4-bit groups; its in features whole groups."""
    wanted = quantization == "int4" or (quantization == "auto" and stored_kind(weight) == "int4")
    return wanted and weight.shape[1] % GROUP == 0


def to_int4(model: nn.Module, quantization: str) -> int:
    """Every nn.Linear of a Transformer (model/transformer.py) whose weight takes_int4 (a
    mixture's router as model.moe.linear_quantization says) -> an Int4Linear, in place, and a tied head an Int4Linear copy of the embedding table
    where the table takes it; how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            held = linear_quantization(parent, name, quantization)
            if type(child) is nn.Linear and takes_int4(child.weight, held):
                setattr(parent, name, Int4Linear(child.weight, child.bias))
                n += 1
    table = model.embed.weight
    if model.lm_head is None and model.cfg.tie_embeddings and takes_int4(table, quantization):
        model.lm_head = Int4Linear(table)
        n += 1
    return n
