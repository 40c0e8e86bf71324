"""int4 weights for the torch and Triton backends: `--quantization int4`, and under
`auto` the linears a checkpoint stores in 4-bit groups (GGUF Q4_0 and Q4_K, AWQ, GPTQ,
compressed-tensors W4A16). Each linear holds model/grouped.py's int4 codes, two to a
byte, with a float16 step and minimum each 32 in features: 5/8 of a byte a weight. The
rounding is the cpu backend's (the same codes and scales from the same weights), so a
checkpoint's 4-bit groups keep their own levels; the LM head is quantized too (a tied one
as an int4 copy of the embedding table, which the lookup keeps), as on the cpu backend,
and a mixture's routed experts (Int4Experts: each stack, gate | up and down, int4 where
its weights take it).

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
from model.moe import Experts, GroupedExperts, MoE, gated, linear_quantization

# kernel(x rows (M, K), codes, steps, minimums, bias) -> (M, N) in x's dtype
Int4Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor | None], Tensor]


def quantized(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(out, in) -> codes (out, in / 2) uint8, two a byte (k = 2j in byte j's low nibble),
    and float16 steps and minimums (out, in / 32): model/grouped.py's rounding."""
    q, d, m = int4_quantize_reference(weight.detach())
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), d, m


def dequantized(codes: Tensor, steps: Tensor, minimums: Tensor) -> Tensor:
    """The weight (out, in) float32 that codes, steps and minimums hold."""
    q = torch.stack([codes & 0xF, codes >> 4], dim=2)
    return int4_dequantize(q.reshape(codes.shape[0], -1), steps, minimums)


class Int4Linear(nn.Module):
    kernel: Int4Kernel | None = None  # a backend's, set by its prepare()

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, steps, minimums = quantized(weight)
        self.register_buffer("codes", codes)
        self.register_buffer("steps", steps)  # (out, in / 32) float16
        self.register_buffer("minimums", minimums)
        self.bias = bias

    def dequantized(self) -> Tensor:
        """The weight the codes hold, float32 (out, in)."""
        return dequantized(self.codes, self.steps, self.minimums)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel is not None:
            out = self.kernel(rows, self.codes, self.steps, self.minimums, self.bias)
        else:
            out = F.linear(rows, self.dequantized().to(x.dtype), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def takes_int4(weight: Tensor, quantization: str) -> bool:
    """Whether a linear's weight (or a stack of experts') is held as int4 under
    `quantization`: 'int4', or 'auto' for a weight the checkpoint stores in 4-bit groups;
    its in features whole groups."""
    wanted = quantization == "int4" or (quantization == "auto" and stored_kind(weight) == "int4")
    return wanted and weight.shape[-1] % GROUP == 0


class Int4Stack(nn.Module):
    """A stack of experts' weights (E, out, in) in int4: codes (E, out, in / 2) and steps
    and minimums (E, out, in / 32), quantized one expert at a time."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        parts = [quantized(w) for w in weight]
        for name, i in (("codes", 0), ("steps", 1), ("minimums", 2)):
            self.register_buffer(name, torch.stack([p[i] for p in parts]))

    def expert(self, e: int) -> Tensor:
        """Expert e's weight (out, in), float32."""
        return dequantized(self.codes[e], self.steps[e], self.minimums[e])


class Int4Experts(GroupedExperts):
    """model/moe.py's Experts with either stack (w_in, w_out) an Int4Stack: the experts
    a backend's kernel reads in int4 (the triton backend's TritonExperts); run() is the
    reference, each expert's weights dequantized."""

    def __init__(self, experts: Experts, int4_in: bool, int4_out: bool) -> None:
        super().__init__()
        self.n_experts, self.d_ff, self.clamped = experts.n_experts, experts.d_ff, experts.clamped
        self.w_in = Int4Stack(experts.w_in) if int4_in else experts.w_in
        self.w_out = Int4Stack(experts.w_out) if int4_out else experts.w_out
        self.b_in, self.b_out = experts.b_in, experts.b_out

    @staticmethod
    def _weight(stack: nn.Module | Tensor, e: int, dtype: torch.dtype) -> Tensor:
        return stack.expert(e).to(dtype) if isinstance(stack, Int4Stack) else stack[e]

    def run(self, expert: int, x: Tensor) -> Tensor:
        b_in = self.b_in[expert] if self.b_in is not None else None
        b_out = self.b_out[expert] if self.b_out is not None else None
        w_in, w_out = (self._weight(w, expert, x.dtype) for w in (self.w_in, self.w_out))
        gate, up = F.linear(x, w_in, b_in).split(self.d_ff, dim=-1)
        return F.linear(gated(gate, up, self.clamped), w_out, b_out)


def _int4_experts(model: nn.Module, quantization: str) -> int:
    """Each mixture's Experts -> Int4Experts where a stack takes int4; how many stacks."""
    n = 0
    for moe in [m for m in model.modules() if isinstance(m, MoE)]:
        if type(moe.experts) is not Experts:
            continue
        takes = [takes_int4(w, quantization) for w in (moe.experts.w_in, moe.experts.w_out)]
        if any(takes):
            moe.experts = Int4Experts(moe.experts, *takes)
            n += sum(takes)
    return n


def to_int4(model: nn.Module, quantization: str) -> int:
    """Every nn.Linear of a Transformer (model/transformer.py) whose weight takes_int4 (a
    mixture's router as model.moe.linear_quantization says) -> an Int4Linear, in place,
    a tied head an Int4Linear copy of the embedding table where the table takes it, and
    a mixture's expert stacks that take it int4 (Int4Experts); how many linears and
    stacks."""
    n = _int4_experts(model, quantization)
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
