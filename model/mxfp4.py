"""MXFP4 weights, as gpt-oss checkpoints ship their experts: each weight a 4-bit float
(e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two to a byte (the low nibble
first), and one power-of-two scale per 32 consecutive weights of a row, stored as its
exponent plus 127 (`*_blocks` (..., out, in / 32, 16) and `*_scales` (..., out, in / 32),
uint8). Read back to real values at load; every value is exact in bf16 and float32."""

from __future__ import annotations

import torch
from torch import Tensor

METHOD = "mxfp4"  # quantization_config.quant_method
BLOCKS, SCALES = "_blocks", "_scales"  # after a weight's name: its two tensors
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: Tensor, scales: Tensor) -> Tensor:
    """blocks (..., out, G, 16) and scales (..., out, G) -> float32 (..., out, G * 32)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks of shape {tuple(blocks.shape)} do not match scales of "
            f"{tuple(scales.shape)}"
        )
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    pairs = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)
    values = pairs.flatten(-2)  # (..., out, G, 32)
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)
