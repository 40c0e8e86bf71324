"""FP8 (e4m3) weights: per-output-channel quantization of a linear's weight, and the
scales the Hub's FP8 checkpoints ship, read back to real values.

An e4m3 value has 3 mantissa bits and a largest finite magnitude of 448; a weight row r
is stored as round(w[r] / s[r]) with s[r] = max|w[r]| / 448, so the row's largest value
lands on the format's largest. Checkpoints carry their scales beside each weight:
transformers' FineGrainedFP8 (`quant_method: fp8`, Qwen3-FP8, DeepSeek-V3) as
`weight_scale_inv`, one per block of `weight_block_size` (128 x 128), a multiplier
despite its name; compressed-tensors and FBGEMM FP8 checkpoints as `weight_scale`, one
for the tensor or one per output row."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from model.int_weights import METHODS as INT_METHODS
from model.mxfp4 import METHOD as MXFP4

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
# quantization_config.quant_method values whose weights are FP8 with scales beside them
# (compressed-tensors: its "float-quantized" format)
FP8_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # after a weight's name: its scales' name


def quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """(out, in) weight -> its e4m3 values and per-row scales (out, 1), float32: w is
    about values * scales. A row of zeros gets the scale 1."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(values: Tensor, scale: Tensor, block: tuple[int, int] | None = None) -> Tensor:
    """FP8 values (out, in) and their scales -> float32: a scale for the tensor (a scalar
    or one element), one per row ((out,) or (out, 1)), or with `block` one per block of
    block[0] rows by block[1] columns (the last blocks may be partial)."""
    w = values.float()
    s = scale.float()
    if block is not None and s.dim() == 2 and s.numel() > 1:
        rows, cols = block
        s = s.repeat_interleave(rows, dim=0)[: w.shape[0]]
        s = s.repeat_interleave(cols, dim=1)[:, : w.shape[1]]
        return w * s
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == w.shape[0]:
        return w * s.reshape(-1, 1)
    raise ValueError(
        f"FP8 scales of shape {tuple(scale.shape)} for a weight of {tuple(values.shape)}"
    )


def checkpoint_block(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """The block of a checkpoint's FP8 scales (None: per tensor or per row), from its
    quantization_config; a quantization kvserve cannot read is a ValueError naming it
    (integer ones are model/int_weights.py's, asked first)."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == MXFP4:  # gpt-oss's experts: their scales are model/mxfp4.py's own
        return None
    if method == "compressed-tensors" and q.get("format") != "float-quantized":
        raise ValueError(
            f"compressed-tensors format {q.get('format')!r} is not supported "
            "(compressed-tensors checkpoints are: float-quantized, pack-quantized)"
        )
    if method not in FP8_METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported (FP8 "
            f"checkpoints are: {', '.join(FP8_METHODS)}; integer ones: {', '.join(INT_METHODS)}; "
            f"and gpt-oss's {MXFP4})"
        )
    block = q.get("weight_block_size")
    if block is None:
        return None
    if not (
        isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
    ):
        raise ValueError(f"quantization_config.weight_block_size {block!r} is not two sizes")
    return block[0], block[1]
