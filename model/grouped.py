"""Grouped integer weights, the formats kvserve's int4, int5 and int8g kernels read: a linear's
weight (N, K) in groups of GROUP consecutive in features, each group with its own scales.
- int4: codes q in 0..15 and a float16 step d and minimum m a group, w ~ d * q + m (5/8 of
  a byte a weight): `--quantization int4`, and a checkpoint's 4-bit groups (GGUF Q4_0,
  Q4_K, AWQ, GPTQ) kept on their own levels.
- int5: codes q in 0..31 and a float16 step d and minimum m a group, w ~ d * q + m (3/4
  of a byte): a checkpoint's 5-bit groups (GGUF Q5_0, Q5_1, Q5_K) on their own levels.
- int8g: codes q in -127..127 and a float16 step d a group, w ~ d * q (17/16 of a byte):
  a checkpoint's 6- to 8-bit types (GGUF Q8_0's blocks as they are, Q6_K).
Scales are float16, three bits finer than bf16 (a Q4_K step, a float16 times a 6-bit
scale, comes within 2^-11 of itself, not 2^-8); a step under float16's normal range
(6.1e-5: a group spanning under 1e-3) is held to a multiple of 6e-8, a fixed quantum,
not a share.

How a float weight is rounded to them, in torch: the readable arithmetic the C
quantizers (model/backends/cpu/kernels/linear_vec.c) match bit for bit, and what the
backends without them (torch, Triton) run on the weight's own device.
"""

from __future__ import annotations

import torch

GROUP = 32  # k a group's scales cover (linear_vec.c's GROUP)

# int4's search: each group's codes for these many step counts over its range, (14 + 0.1 i)
# steps for i = 0.., each fitted a step and minimum by weighted least squares (llama.cpp's
# K-quant search without an importance matrix, make_qkx2_quants: -1 + 0.1 i steps about 15)
INT4_SEARCH = 21
# a group of 16 distinct values or fewer (a 4-bit checkpoint's: AWQ, GPTQ, GGUF) is held
# on its own levels, its range in one of these step counts, not searched
INT4_STEPS = tuple(range(1, 16))


def _scalar(x: float) -> torch.Tensor:
    """A float32 constant, rounded from the double C's cast rounds too."""
    return torch.tensor(x, dtype=torch.float32)


def _error(
    groups: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, mn: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Each group's sum in k order of (s * codes + mn - w) squared, each times its weight
    where `weights` are given."""
    e = s[..., None] * codes + mn[..., None] - groups
    return _sum_in_order(e * e if weights is None else weights * (e * e))


def _codes(groups: torch.Tensor, iscale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    return torch.round(iscale[..., None] * (groups - mn[..., None])).clamp(0, 15)


def _least_squares(
    groups: torch.Tensor, weights: torch.Tensor, codes: torch.Tensor,
    sums: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(fits, step, minimum) of the weighted least-squares line through (codes, w): the
    minimum at most 0 (refitted as a step alone where the line puts it above); fits is
    false where the codes are all one value. sums: the weights' and the weighted w's."""
    sum_w, sum_x = sums
    wl = weights * codes
    sl, sl2, sxl = _sum_in_order(wl), _sum_in_order(wl * codes), _sum_in_order(wl * groups)
    det = sum_w * sl2 - sl * sl
    fits = det > 0
    safe = torch.where(fits, det, 1.0)
    s, m = (sum_w * sxl - sum_x * sl) / safe, (sl2 * sum_x - sl * sxl) / safe
    above = m > 0
    s = torch.where(above, sxl / torch.where(sl2 > 0, sl2, 1.0), s)
    return fits, s, torch.where(above, 0.0, m)


def _int4_search(
    groups: torch.Tensor, weights: torch.Tensor, mn: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (step, minimum) in float32: the codes of 15 steps over mn..hi, then of
    each of INT4_SEARCH step counts, fitted by weighted least squares (_least_squares),
    the fit of least weighted squared error kept (the first of ties); a group of one
    value: step 0 at it."""
    span = hi - mn
    flat = span == 0
    span = torch.where(flat, 1.0, span)
    sums = _sum_in_order(weights), _sum_in_order(weights * groups)
    iscale = _scalar(15.0) / span
    best_s, best_m = _scalar(1.0) / iscale, mn
    best = _error(groups, _codes(groups, iscale, mn), best_s, best_m, weights)
    for c in range(INT4_SEARCH):
        codes = _codes(groups, _scalar(-1 + 0.1 * c + 15) / span, mn)
        fits, s, m = _least_squares(groups, weights, codes, sums)
        err = _error(groups, codes, s, m, weights)
        better = fits & (err < best)
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
        best = torch.where(better, err, best)
    return torch.where(flat, 0.0, best_s), best_m


def _on_grid(
    groups: torch.Tensor, d: torch.Tensor, m: torch.Tensor, top: int = 15
) -> tuple[torch.Tensor, torch.Tensor]:
    """(squared error, codes 0..top) of groups rounded to nearest on the grid (m, d)."""
    step = torch.where(d.float() > 0, d.float(), 1.0)
    q = torch.round((groups - m.float()[..., None]) / step[..., None]).clamp(0, top)
    return _error(groups, q, d.float(), m.float()), q


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
    """(N, K) -> q (N, K) uint8 in 0..15, d and m (N, K/32) float16, each group of 32 k
    w ~ d * q + m, fitted as llama.cpp fits a K-quant's groups without an importance
    matrix: each weight counted by its group's root mean square plus its own magnitude
    (the large weights, which make the large logits, rounded closer), the minimum at most
    0, the step and minimum searched by weighted least squares (_int4_search), then
    rounded to float16 and the codes to nearest on them; a group of 16
    distinct values or fewer (a 4-bit checkpoint's) on its own levels instead: its range
    in INT4_STEPS steps, the first of the least squared error."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    lo, hi = groups.amin(dim=2) + 0.0, groups.amax(dim=2) + 0.0  # -0 to +0
    few = (groups.sort(dim=2).values.diff(dim=2) > 0).sum(dim=2) < 16
    q = torch.empty_like(groups)
    d, m = torch.empty_like(lo, dtype=torch.float16), torch.empty_like(lo, dtype=torch.float16)
    for part, fit in ((few, _on_levels), (~few, _searched)):  # each group fitted once
        if part.any():
            q[part], d[part], m[part] = fit(groups[part], lo[part], hi[part])
    return q.reshape(n, k).to(torch.uint8), d, m


def _searched(
    groups: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, d, m) of groups (G, 32) by the weighted least-squares search
    (_int4_search), d and m rounded to float16 and the codes to nearest on them."""
    # C's sqrtf rounds correctly; torch's float32 sqrt can be an ulp off: the root in
    # float64, rounded once to float32, is the correctly rounded one
    rms = torch.sqrt((_sum_in_order(groups * groups) / _scalar(GROUP)).double()).float()
    weights = rms[..., None] + groups.abs()
    s, mn = _int4_search(groups, weights, torch.where(lo < 0, lo, 0.0), hi)
    d, m = s.to(torch.float16), mn.to(torch.float16)
    return _on_grid(groups, d, m)[1], d, m


def _on_levels(
    groups: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, d, m) of groups (G, 32) of few levels: their range in INT4_STEPS steps on
    float16 (m, d), the first of the least squared error, then re-centred (_recentred)."""
    mc = lo.to(torch.float16)
    kept: list[torch.Tensor] = []
    for steps in INT4_STEPS:
        dc = ((hi - mc.float()) / steps).to(torch.float16)
        trial = [*_on_grid(groups, dc, mc), dc, mc]
        kept = _keep_better(kept, trial) if kept else trial
    return _recentred(groups, kept, 15)


def _recentred(
    groups: torch.Tensor, best: list[torch.Tensor], top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..top, d, m) of groups (G, 32) from `best` ([squared error, codes, d, m]):
    its step's float16 neighbours and the step itself, each with the minimum that centres
    best's codes on the group (rounded to float16), tried in that order, each kept where
    its squared error is less. A file's step and minimum (Q4_K's: a float16 scale times
    a 6-bit one) rounded to float16, or its values rounded to bf16 on load, leave the
    codes off-centre; a minimum that takes the offset back lowers that error."""
    codes, d = best[1], best[2]
    positive = d.float() > 0
    bits = d.view(torch.int16)
    for step in ((bits - 1).view(torch.float16), (bits + 1).view(torch.float16), d):
        centre = _sum_in_order(groups - step.float()[..., None] * codes) / _scalar(GROUP)
        centre = centre.to(torch.float16)
        trial = [*_on_grid(groups, step, centre, top), step, centre]
        trial[0] = torch.where(positive, trial[0], torch.inf)
        best = _keep_better(best, trial)
    return best[1], best[2], best[3]


def int5_quantize_reference(
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) -> q (N, K) uint8 in 0..31, d and m (N, K/32) float16, each group of 32 k
    w ~ d * q + m, held on its own levels (_int5_levels: a 5-bit file's group, Q5_0's,
    Q5_1's or Q5_K's, comes back on its own grid), then re-centred (_recentred)."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.reshape(-1, GROUP)
    q, d, m = _recentred(groups, _int5_levels(groups), 31)
    return q.reshape(n, k).to(torch.uint8), d.reshape(n, k // GROUP), m.reshape(n, k // GROUP)


def _int5_levels(groups: torch.Tensor) -> list[torch.Tensor]:
    """[squared error, codes, d, m] of groups (G, 32): the range lo..hi in as many steps
    as the smallest gap between distinct values makes (at most 31), the minimum lo or the
    fewest steps under it that float16 holds exactly where the codes leave room (a
    file's minimum where its code 0 is unused: Q5_0's -16 d), the codes to nearest on
    that float16 grid; or one or two steps fewer from lo where that does better (values
    rounded to bf16 on load leave gaps a little under the file's step)."""
    ordered = groups.sort(dim=1).values
    lo, hi = ordered[:, 0] + 0.0, ordered[:, -1] + 0.0
    gaps = ordered.diff(dim=1)
    gap = torch.where(gaps > 0, gaps, torch.inf).amin(dim=1)
    span = hi - lo
    steps = torch.where(gap.isinf(), 1.0, torch.round(span / gap).clamp(1, 31))
    d = (span / steps).to(torch.float16)
    below = torch.arange(32, dtype=torch.float32)
    under = lo[:, None] - below * d.float()[:, None]
    exact = (under.to(torch.float16).float() == under) & (steps[:, None] + below <= 31)
    first = torch.where(exact.any(dim=1), exact.float().argmax(dim=1), 0)
    m = under.gather(1, first[:, None])[:, 0].to(torch.float16)
    best = [*_on_grid(groups, d, m, 31), d, m]
    for fewer in (1, 2):
        fd, fm = (span / (steps - fewer).clamp(min=1)).to(torch.float16), lo.to(torch.float16)
        best = _keep_better(best, [*_on_grid(groups, fd, fm, 31), fd, fm])
    return _int5_rescued(groups, best, lo, span)


def _int5_rescued(
    groups: torch.Tensor, best: list[torch.Tensor], lo: torch.Tensor, span: torch.Tensor
) -> list[torch.Tensor]:
    """`best` ([squared error, codes, d, m] of groups (G, 32)) with each group that lies
    farther from its grid than values rounded to bf16 could (its squared error over
    d^2 / 16: the smallest gap misjudged the step, as in an MXFP4 block, whose 4-bit
    floats are -6..6 in halves, 2 and 3 halves apart) refitted: its range from lo in each
    of 1..31 steps, the nearest kept (of ties the fewest steps). A float checkpoint's
    group (int4's fallback rows) takes it too: the scan lowers its squared error."""
    off = best[0] * 16 > best[2].float().square()
    if not off.any():
        return best
    part = [b[off] for b in best]
    fm = lo[off].to(torch.float16)
    for steps in range(1, 32):
        fd = (span[off] / steps).to(torch.float16)
        part = _keep_better(part, [*_on_grid(groups[off], fd, fm, 31), fd, fm])
    for whole, kept in zip(best, part, strict=True):
        whole[off] = kept
    return best


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
