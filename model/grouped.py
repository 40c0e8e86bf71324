"""Grouped integer weights, the formats kvserve's int4 and int8g kernels read: a linear's
weight (N, K) in groups of GROUP consecutive in features, each group with its own scales.
- int4: codes q in 0..15 and a bf16 step d and minimum m a group, w ~ d * q + m (5/8 of
  a byte a weight): `--quantization int4`, and a checkpoint's 4-bit groups (GGUF Q4_0,
  Q4_K, AWQ, GPTQ) kept on their own levels.
- int8g: codes q in -127..127 and a float16 step d a group, w ~ d * q (17/16 of a byte):
  a checkpoint's 5- to 8-bit types (GGUF Q8_0's and Q5_0's blocks as they are).

How a float weight is rounded to them, in torch: the readable arithmetic the C
quantizers (model/backends/cpu/kernels/linear_vec.c) match bit for bit, and what the
backends without them (torch, Triton) run on the weight's own device.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

GROUP = 32  # k a group's scales cover (linear_vec.c's GROUP)

# each group's range cut by these shares at its low and high ends, the cut with the least
# squared error taken (the plain min..max range is the first)
INT4_CUTS = ((0.0, 0.0), (0.0, 0.05), (0.05, 0.0), (0.05, 0.05), (0.0, 0.1), (0.1, 0.0),
             (0.1, 0.1), (0.05, 0.1), (0.1, 0.05))  # fmt: skip
# and, for a group of 16 distinct values or fewer, its uncut range in these fewer steps: a
# 4-bit checkpoint's group (AWQ, GPTQ, GGUF) is then held on its own levels
INT4_STEPS = tuple(range(1, 15))


def _int4_cuts(lo: torch.Tensor, hi: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each (m, d) of INT4_CUTS for groups ranging lo..hi, rounded to bf16."""
    width = hi - lo
    for low_cut, high_cut in INT4_CUTS:
        m = (lo + low_cut * width).to(torch.bfloat16)
        yield m, ((hi - high_cut * width - m.float()) / 15).to(torch.bfloat16)


def _int4_steps(lo: torch.Tensor, hi: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each (m, d) of INT4_STEPS for groups ranging lo..hi, rounded to bf16."""
    m = lo.to(torch.bfloat16)
    for steps in INT4_STEPS:
        yield m, ((hi - m.float()) / steps).to(torch.bfloat16)


def _nearest(
    groups: torch.Tensor, grids: Iterator[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """[squared error, q, d, m] of groups (..., 32) rounded to nearest on the grid (m, d)
    of `grids` that puts them nearest."""
    best: list[torch.Tensor] = []
    for m, d in grids:
        step = torch.where(d.float() > 0, d.float(), 1.0)
        q = torch.round((groups - m.float()[..., None]) / step[..., None]).clamp(0, 15)
        err = _sum_in_order((q * d.float()[..., None] + m.float()[..., None] - groups).square())
        best = _keep_better(best, [err, q, d, m]) if best else [err, q, d, m]
    return best


def _keep_better(best: list[torch.Tensor], trial: list[torch.Tensor]) -> list[torch.Tensor]:
    """[error, q, scales...] of each group from `trial` where its error (first) is less
    than in `best`, else from `best`; q has the groups' 32 weights as its last dimension."""
    better = trial[0] < best[0]
    return [torch.where(better if b.dim() == better.dim() else better[..., None], t, b)
            for b, t in zip(best, trial, strict=True)]  # fmt: skip


def _sum_in_order(x: torch.Tensor) -> torch.Tensor:
    """x summed over its last dimension one element after another (as C's loop adds)."""
    total = x[..., 0].clone()
    for i in range(1, x.shape[-1]):
        total += x[..., i]
    return total


def int4_quantize_reference(
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) -> q (N, K) uint8 in 0..15, d and m (N, K/32) bf16, each group of 32 k
    w ~ d * q + m, rounded to nearest on the nearest of its candidate grids (INT4_CUTS;
    INT4_STEPS too for a group of 16 distinct values or fewer), the first of the least
    squared error."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    lo, hi = groups.amin(dim=2) + 0.0, groups.amax(dim=2) + 0.0  # -0 to +0
    err, q, d, m = _nearest(groups, _int4_cuts(lo, hi))
    few = (groups.sort(dim=2).values.diff(dim=2) > 0).sum(dim=2) < 16
    if few.any():
        e, q2, d2, m2 = _nearest(groups[few], _int4_steps(lo[few], hi[few]))
        better = e < err[few]
        q[few] = torch.where(better[:, None], q2, q[few])
        d[few] = torch.where(better, d2, d[few])
        m[few] = torch.where(better, m2, m[few])
    return q.reshape(n, k).to(torch.uint8), d, m


def int4_dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """int4 codes and scales read back: float32 (N, K)."""
    n, k = q.shape
    groups = q.reshape(n, k // GROUP, GROUP).float()
    return (groups * d.float()[..., None] + m.float()[..., None]).reshape(n, k)


# int8g's candidate steps: max|w| / 127, and a group's smallest nonzero |w| over 1 .. this
INT8G_DIVISORS = 8


def _int8g_try(groups: torch.Tensor, step: torch.Tensor) -> list[torch.Tensor]:
    """[squared error, q, d] of groups (G, 32) rounded on the grid `step` (G,) as
    float16."""
    d = step.to(torch.float16)
    unit = torch.where(d.float() > 0, d.float(), 1.0)
    q = torch.round(groups / unit[:, None]).clamp(-127, 127)
    return [_sum_in_order((q * d.float()[:, None] - groups).square()), q, d]


def int8g_quantize_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> q (N, K) int8 in -127..127 and d (N, K/32) float16, each group of 32 k
    w ~ d * q, on the nearest (least squared error, the first of ties) of the steps
    max|w| / 127 and the smallest nonzero |w| over 1 .. INT8G_DIVISORS (a GGUF Q8_0 or
    Q5_0 block, any grid of 127 steps or fewer whose codes reach one of those, is kept on
    its own step), then on the kept codes' least-squares step where that does better."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.reshape(-1, GROUP)
    mags = groups.abs()
    amax = mags.amax(dim=1)
    least = torch.where(mags > 0, mags, torch.inf).amin(dim=1)
    least = torch.where(least.isinf(), 0.0, least)
    best = _int8g_try(groups, amax / 127)
    for divisor in range(1, INT8G_DIVISORS + 1):
        best = _keep_better(best, _int8g_try(groups, least / divisor))
    cs, qq = _sum_in_order(groups * best[1]), _sum_in_order(best[1] * best[1])
    fitted = _int8g_try(groups, torch.where(qq > 0, cs / torch.where(qq > 0, qq, 1), 0))
    best = _keep_better(best, [torch.where(qq > 0, fitted[0], torch.inf), *fitted[1:]])
    return best[1].reshape(n, k).to(torch.int8), best[2].reshape(n, k // GROUP)


def int8g_dequantize(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """int8g codes and steps read back: float32 (N, K)."""
    n, k = q.shape
    return (q.reshape(n, k // GROUP, GROUP).float() * d.float()[..., None]).reshape(n, k)
