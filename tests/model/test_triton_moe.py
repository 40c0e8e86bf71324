"""A mixture's routed experts in Triton (model/backends/triton/moe.py) against the torch
reference experts (model/moe.py), in Triton's interpreter where there is no GPU: the
aligned layout of the step's pairs, and the two kernels over it at the decode and the
prefill tile sizes, with gpt-oss's biases and clamped activation."""

import pytest
import torch

from model.config import Experts as ExpertSpec
from model.config import ModelConfig
from model.moe import Experts, MoE, route
from tests.model.backends import make_backend

pytestmark = pytest.mark.interpreter


def triton_moe():
    """The module, once the triton backend can run here (skips, or fails where required,
    saying why not)."""
    cfg = ModelConfig(vocab_size=8, d_model=64, n_layers=1, n_heads=4, n_kv_heads=4, d_ff=8)
    return make_backend("triton", cfg).moe


def experts(spec: ExpertSpec, d: int, dtype: torch.dtype) -> Experts:
    torch.manual_seed(1)
    e = Experts(spec, d)
    with torch.no_grad():
        e.w_in.normal_(0, d**-0.5)
        e.w_out.normal_(0, spec.d_ff**-0.5)
        if spec.bias:
            e.b_in.normal_(0, 1)
            e.b_out.normal_(0, 1)
    return e.to(dtype)


def test_aligned_tiles_hold_one_expert_each_and_every_pair_once() -> None:
    moe = triton_moe()
    torch.manual_seed(0)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(11)])  # (11, 2) over 6 experts
    ids[:, 0] = torch.where(ids[:, 0] == 4, 5, ids[:, 0])  # expert 4 meets fewer rows
    pairs, tiles = moe.aligned(ids, 6, 4)
    flat = ids.flatten()
    # the most tiles any routing of 22 pairs over 6 experts can fill: (22 + 6 * 3) / 4
    assert tiles.numel() == 10 and pairs.numel() == 40
    used = tiles[tiles >= 0]
    counts = torch.bincount(flat, minlength=6)
    assert used.tolist() == sorted(used.tolist())  # experts in order, tile by tile
    assert used.numel() == int(((counts + 3) // 4).sum())
    assert (tiles[used.numel() :] == -1).all()  # the rest empty
    seen = []
    for t, e in enumerate(tiles.tolist()):
        rows = pairs[t * 4 : (t + 1) * 4]
        real = rows[rows < flat.numel()].long()
        if e < 0:
            assert real.numel() == 0
            continue
        assert (flat[real] == e).all()
        assert real.tolist() == sorted(real.tolist())  # each expert's pairs in order
        seen += real.tolist()
    assert sorted(seen) == list(range(flat.numel()))


CASES = {
    # (experts, top_k, d, d_ff, bias, clamped)
    "swiglu": (8, 3, 96, 80, False, None),
    "gpt-oss": (8, 2, 64, 48, True, (1.702, 7.0)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_give_the_reference_experts(case: str, dtype: torch.dtype) -> None:
    """One row, a few, and a prefill of 300 rows whose pairs fill the larger tiles, with
    an expert that no row chose: float32 within 1e-5 of the reference,
    bf16 within its rounding."""
    moe = triton_moe()
    n, top_k, d, ff, bias, clamped = CASES[case]
    ref = experts(ExpertSpec(n, top_k, ff, bias=bias, clamped=clamped), d, dtype)
    fused = moe.TritonExperts(ref)
    sizes = {1: 16, 3: 16, 300: 64}
    for rows in sizes:
        torch.manual_seed(rows)
        x = torch.randn(rows, d).to(dtype)
        logits = (3 * torch.randn(rows, n)).to(dtype)
        logits[:, 0] = -30  # expert 0 is never chosen
        weights, ids = route(logits, top_k, normalize=True)
        assert moe.block_m(ids.numel(), n) == sizes.get(rows, 64)
        got, want = fused(x, weights, ids).float(), ref(x, weights, ids).float()
        tol = 1e-5 if dtype == torch.float32 else 0.02 * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol, rows


def test_triton_backend_runs_a_mixture_by_its_kernels() -> None:
    """prepare() gives each mixture the Triton experts over the reference's parameters."""
    spec = ExpertSpec(4, 2, 16)
    cfg = ModelConfig(vocab_size=8, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=8,
                      experts=spec)  # fmt: skip
    backend = make_backend("triton", cfg)
    mixture = MoE(cfg)
    w_in = mixture.experts.w_in
    backend.prepare(mixture)
    assert isinstance(mixture.experts, backend.moe.TritonExperts)
    assert mixture.experts.w_in is w_in


INT4_CASES = {
    # (experts, top_k, d, d_ff, bias, clamped): in and out features whole groups of 32
    "swiglu": (8, 3, 96, 64, False, None),
    "gpt-oss": (8, 2, 64, 96, True, (1.702, 7.0)),
}


@pytest.mark.parametrize("stacks", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("case", list(INT4_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_stacks_give_the_int4_reference_experts(
    stacks: tuple[bool, bool], case: str, dtype: torch.dtype
) -> None:
    """Either stack or both in int4 (model/backends/int4.py's Int4Experts), the tiles
    widened from the codes in the kernels: the reference's experts on the dequantized
    codes at the decode and prefill tiles, float32 within 1e-5, bf16 within its
    rounding; and not the float stacks' (the codes are what the kernels read)."""
    from model.backends.int4 import Int4Experts

    moe = triton_moe()
    n, top_k, d, ff, bias, clamped = INT4_CASES[case]
    plain = experts(ExpertSpec(n, top_k, ff, bias=bias, clamped=clamped), d, dtype)
    ref = Int4Experts(plain, *stacks)
    fused = moe.TritonExperts(ref)
    for rows in (1, 3, 300):
        torch.manual_seed(rows)
        x = torch.randn(rows, d).to(dtype)
        weights, ids = route((3 * torch.randn(rows, n)).to(dtype), top_k, normalize=True)
        got, want = fused(x, weights, ids).float(), ref(x, weights, ids).float()
        tol = 1e-5 if dtype == torch.float32 else 0.02 * want.abs().max().item()
        assert (got - want).abs().max().item() <= tol, rows
        if dtype == torch.float32:
            assert (plain(x, weights, ids) - want).abs().max().item() > 100 * tol
