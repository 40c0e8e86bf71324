"""FP8 weights for the torch and Triton backends (`--quantization fp8`): every linear of
the decoder layers holds e4m3 values with one scale per output row (model/fp8.py), half
the bytes of bf16; the embedding and the LM head stay in the model's dtype.

On CUDA a linear of many rows (a prefill) is one `torch._scaled_mm`: the activations
quantized to e4m3 per token (dynamic scales, as vLLM's and SGLang's FP8 linears), the
weight's row scales, bf16 out; a few rows (a decode batch) go through the backend's
weight-only kernel where it gives one (bf16 activations; the triton backend's fp8_gemv).
Elsewhere (the CPU tests' reference) it is the dequantized weight's F.linear: the same
values, at bf16 speed or less; the server takes fp8 on CUDA only (service/config.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.fp8 import E4M3, E4M3_MAX, dequantize, quantize
from model.moe import linear_quantization


def quantize_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """(T, K) activations -> e4m3 values and one float32 scale per token (T, 1): the
    token's largest magnitude lands on 448 (a row of zeros: a scale of 1e-12 / 448)."""
    amax = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (rows.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


class Fp8Linear(nn.Module):
    # the activations' quantizer on CUDA: quantize_rows (torch's ops), or one kernel
    # that a backend's prepare() gives (the triton backend's, model/backends/triton)
    quantize_act: Callable[[Tensor], tuple[Tensor, Tensor]] = staticmethod(quantize_rows)
    # up to gemv_rows activation rows (a decode batch) on CUDA: a weight-only kernel a
    # backend's prepare() gives, gemv(x, weight, scale, bias), which reads the weights at
    # the bandwidth _scaled_mm reaches only with many rows (the triton backend's)
    gemv: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor] | None = None
    gemv_rows = 0

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        values, scale = quantize(linear.weight.detach())
        self.register_buffer("weight", values)  # (out, in) e4m3
        self.register_buffer("scale", scale)  # (out, 1) float32
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda:
            return self._scaled(x)
        w = dequantize(self.weight, self.scale).to(x.dtype)
        return F.linear(x, w, self.bias)

    def _scaled(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.gemv is not None and rows.shape[0] <= self.gemv_rows:
            out = self.gemv(rows, self.weight, self.scale, self.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        xq, scale_x = self.quantize_act(rows)
        out = torch._scaled_mm(
            xq, self.weight.t(), scale_a=scale_x, scale_b=self.scale.t(), out_dtype=x.dtype
        )
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def to_fp8(model: nn.Module) -> int:
    """Every linear of the decoder layers (a mixture's router as
    model.moe.linear_quantization says) -> an Fp8Linear, in place; how many."""
    n = 0
    for layer in model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if (
                    isinstance(child, nn.Linear)
                    and linear_quantization(parent, name, "fp8") == "fp8"
                ):
                    setattr(parent, name, Fp8Linear(child))
                    n += 1
    return n
