"""The arithmetic of a draw from a row's distribution: the top_p cut, the inversion of
the row's CDF at a uniform number, and a seeded request's generator seed for a position."""

from __future__ import annotations

import torch
from torch import Tensor


def invert(cdf: Tensor, u: Tensor) -> Tensor:
    """Draws: the token of each uniform number in u (R, N) under the CDF of its row of
    cdf (R, V), unnormalised: the first token whose cdf exceeds u times the row's mass."""
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return picked.clamp_(max=cdf.shape[1] - 1)


# On the CPU top_p looks for its tokens among each row's most likely first: a model's
# distribution usually has its top_p mass in a few hundred tokens, and a topk of those is
# far cheaper than sorting the vocabulary (docs/decisions.md). A row whose set is not
# among them goes on alone, so one flat row does not sort the batch. On a GPU the sort is
# cheap, and checking whether the candidates suffice would wait for the device.
TOP_P_CANDIDATES = (256, 4096)


def top_p_filter(probs: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (a (B, 1)
    column) per row; probs normalised."""
    v = probs.shape[1]
    candidates = [k for k in TOP_P_CANDIDATES if k < v] if probs.device.type == "cpu" else []
    out = torch.zeros_like(probs)
    rows = torch.arange(len(probs), device=probs.device)  # the rows still looking
    for k in (*candidates, v):
        whole = len(rows) == len(probs)
        top, order = (probs if whole else probs[rows]).topk(k, dim=-1)  # most likely first
        p = top_p if whole else top_p[rows]
        before = top.cumsum(dim=-1) - top  # mass strictly before each token
        # a row is done once its set lies within its k most likely tokens
        done = (before[:, -1] + top[:, -1] >= p[:, 0]) if k < v else None
        drop = before >= p
        # the top token always survives, also where top_p is 0 in float32: the API takes
        # any top_p > 0, and 5e-324 rounds to 0 here (nothing kept, and the draw fell
        # past the row's end: a token outside a grammar's mask)
        drop[:, 0] = False
        kept = top.masked_fill_(drop, 0.0)
        if done is None or bool(done.all()):
            if whole:
                return out.scatter_(1, order, kept)
            return out.index_copy_(0, rows, probs.new_zeros(len(rows), v).scatter_(1, order, kept))
        spread = probs.new_zeros(int(done.sum()), v).scatter_(1, order[done], kept[done])
        out.index_copy_(0, rows[done], spread)
        rows = rows[~done]
    return out  # not reached: the last pass (k = v) takes every row left


def seed_for(seed: int, position: int) -> int:
    """A 63-bit generator seed from a request's seed and an output position (splitmix64's
    finaliser, so that neighbouring seeds and positions give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1
