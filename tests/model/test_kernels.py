"""The C paged-attention kernels against torch's attention on gathered K/V."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from model.backends.cpu.kernels.attention import (
    WINDOW_RUN,
    attention_isa,
    paged_attention,
    paged_attention_supported,
    window_view,
)
from model.backends.cpu.kernels.build import c_compiler
from model.backends.cpu.kernels.fused import fused_supported, greedy_tokens
from model.config import ModelConfig
from model.kv_cache import PagedKVCache
from model.layers import alibi_slopes
from tests.model.backends import auto_backend

pytestmark = pytest.mark.skipif(
    c_compiler() is None or bool(os.environ.get("KVSERVE_DISABLE_KERNELS")),
    reason="no C compiler, or kernels disabled",
)


POOL = 256  # blocks: the long batches' 1,101 keys fit at 8-token blocks (138)


def random_cache(heads, kv_heads, d, bs, dtype, nb=POOL):
    """A one-layer PagedKVCache filled with random K/V through its own layout, and the
    same K (nb, KV, BS, D) and V (nb, KV, BS, D) token-major for the reference."""
    cfg = ModelConfig(
        vocab_size=8, d_model=heads * d, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, d_ff=8
    )
    cache = PagedKVCache(cfg, nb, bs, dtype, "cpu", auto_backend(cfg, dtype, bs))
    k_ref = torch.randn(nb + 1, kv_heads, bs, d).to(dtype)
    v_ref = torch.randn(nb + 1, kv_heads, bs, d).to(dtype)
    k_cache, v_cache = cache.layer(0)
    p = 2 if dtype.itemsize == 2 else 1  # the cpu backend's pair of lanes
    # K (nb, KV, D/P, BS, P): element (d, t) at [d // P, t, d % P]
    k_cache.copy_(k_ref.view(nb + 1, kv_heads, bs, d // p, p).permute(0, 1, 3, 2, 4))
    # V (nb, KV, BS/P, D, P): element (t, d) at [t // P, d, t % P]
    v_cache.copy_(v_ref.view(nb + 1, kv_heads, bs // p, p, d).permute(0, 1, 2, 4, 3))
    return k_cache, v_cache, k_ref, v_ref


def reference(q, k_ref, v_ref, tables, row_seq, lens, scale, slopes, window=None, softcap=None):
    """Row i over the first lens[i] keys of its sequence (the last `window` of them; each
    score soft-capped: softcap * tanh(score / softcap))."""
    r, h, d = q.shape
    kv, bs = k_ref.shape[1], k_ref.shape[2]
    outs = []
    for i in range(r):
        n = int(lens[i])
        blocks = tables[int(row_seq[i]), : -(-n // bs)]
        keys = k_ref[blocks].transpose(0, 1).reshape(kv, -1, d)[:, :n].float()
        values = v_ref[blocks].transpose(0, 1).reshape(kv, -1, d)[:, :n].float()
        keys = keys.repeat_interleave(h // kv, 0)
        values = values.repeat_interleave(h // kv, 0)
        mask = None
        if slopes is not None:
            dist = (n - 1 - torch.arange(n)).float()
            mask = (-slopes[:, None] * dist[None, :])[:, None, :]  # (H, 1, n)
        if window is not None:
            outside = torch.zeros(n).masked_fill(torch.arange(n) < n - window, float("-inf"))
            mask = outside[None, None, :] if mask is None else mask + outside
        if softcap is None:
            out = F.scaled_dot_product_attention(
                q[i].float()[:, None], keys, values, attn_mask=mask, scale=scale
            )
        else:  # SDPA has no soft-cap: by hand
            scores = q[i].float()[:, None] @ keys.transpose(-1, -2) * scale
            scores = torch.tanh(scores / softcap) * softcap
            if mask is not None:
                scores = scores + mask
            out = torch.softmax(scores, dim=-1) @ values
        outs.append(out[:, 0])
    return torch.stack(outs)


# (rows of sequence 0, 1, 2 as (cached, new)): decodes, prefill chunks, a mix, rows
# longer than the kernels' 512-key parts (a chunk across the first part's end, rows of
# exactly 512 and 513 keys, a row of three parts), and one long decode (with an odd
# number of K/V heads, fewer tasks than two threads share evenly: its parts spread)
BATCHES = {
    "decodes": [(0, 1), (15, 1), (16, 1), (76, 1), (111, 1)],
    "prefills": [(0, 37), (16, 20), (3, 1)],
    "mixed": [(40, 1), (0, 9), (70, 41), (17, 1)],
    "long": [(1100, 1), (506, 12), (0, 1), (511, 2), (700, 9)],
    "long decode": [(1100, 1)],
}


@pytest.fixture(autouse=True)
def two_threads():
    """The kernels share tasks among torch's threads: two, on any machine, so that the
    tests see the calls that spread a long row's parts (split_plan in the C source)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def rows_of(batch):
    row_seq, lens = [], []
    for b, (cached, new) in enumerate(batch):
        row_seq += [b] * new
        lens += list(range(cached + 1, cached + new + 1))
    return torch.tensor(row_seq), torch.tensor(lens)


DTYPES = [torch.float32, torch.bfloat16]  # bf16: the tile unit at the amx level


def attend_batch(heads, kv_heads, d, bs, dtype, batch, slopes):
    """BATCHES[batch] through the kernel on a random cache (seed 0, the same inputs on
    every call): its output and torch's reference."""
    torch.manual_seed(0)
    k_cache, v_cache, k_ref, v_ref = random_cache(heads, kv_heads, d, bs, dtype)
    assert paged_attention_supported(k_cache, heads, kv_heads, d)
    row_seq, lens = rows_of(BATCHES[batch])
    width = -(-int(lens.max()) // bs)  # each sequence's blocks, drawn independently
    tables = torch.stack([torch.randperm(POOL)[:width] for _ in BATCHES[batch]])
    q = torch.randn(len(lens), heads, d).to(dtype)
    got = paged_attention(q, k_cache, v_cache, tables, lens, d**-0.5, slopes, row_seq)
    return got, reference(q, k_ref, v_ref, tables, row_seq, lens, d**-0.5, slopes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "bs"),
    [(9, 3, 64, 16), (4, 4, 16, 8), (8, 1, 32, 16), (8, 2, 128, 16), (6, 2, 32, 32)],
)
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_kernel_matches_torch(isa, dtype, heads, kv_heads, d, bs, alibi, batch) -> None:
    slopes = alibi_slopes(heads) if alibi else None
    got, want = attend_batch(heads, kv_heads, d, bs, dtype, batch, slopes)
    assert got.dtype == dtype
    tiles = attention_isa(d, bs, heads // kv_heads, dtype) == "amx"
    assert tiles == (isa == "amx" and dtype == torch.bfloat16 and bs == 16 and d % 32 == 0)
    # fp32: exact math; bf16: the output is rounded to bf16 (and on AMX the probabilities)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max().item() < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "d", "bs"), [(9, 3, 64, 16), (4, 4, 16, 8)])
@pytest.mark.parametrize("window", [1, 37, 600])
@pytest.mark.parametrize("batch", ["prefills", "long"])
def test_sliding_window_matches_torch(isa, dtype, heads, kv_heads, d, bs, window, batch) -> None:
    """Each row over the last `window` of its keys (window_view: each run of rows on a
    table shifted to its window's first block, the keys before the window skipped). The
    blocks wholly before the window of every row of a sequence are freed, as the block
    manager frees them: their table entries point at a block of NaN, which a kernel that
    read it would return."""
    pool = 1024
    torch.manual_seed(0)
    k_cache, v_cache, k_ref, v_ref = random_cache(heads, kv_heads, d, bs, dtype, pool)
    row_seq, lens = rows_of(BATCHES[batch])
    width = -(-int(lens.max()) // bs)
    seqs = len(BATCHES[batch])
    tables = torch.randperm(pool - 1)[: seqs * width].view(seqs, width)
    q = torch.randn(len(lens), heads, d).to(dtype)
    want = reference(q, k_ref, v_ref, tables, row_seq, lens, d**-0.5, None, window)
    for b in range(seqs):
        dead = max(int(lens[row_seq == b].min()) - window, 0) // bs
        tables[b, :dead] = pool - 1
    k_cache[pool - 1] = float("nan")
    v_cache[pool - 1] = float("nan")
    view = window_view(tables, lens, row_seq, window, bs)
    assert int(view[3].max()) < bs + WINDOW_RUN  # skips stay within a block and a run
    got = paged_attention(q, k_cache, v_cache, tables, lens, d**-0.5, None, row_seq, view)
    assert torch.isfinite(got.float()).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max().item() < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "d", "bs"), [(9, 3, 64, 16)])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("batch", ["mixed", "long"])
def test_soft_capped_scores_match_torch(isa, dtype, heads, kv_heads, d, bs, window, batch):
    """Gemma 2's scores: softcap * tanh(score / softcap), a cap low enough to change
    them (queries scaled up), alone and with a sliding window."""
    torch.manual_seed(2)
    k_cache, v_cache, k_ref, v_ref = random_cache(heads, kv_heads, d, bs, dtype, 1024)
    row_seq, lens = rows_of(BATCHES[batch])
    width = -(-int(lens.max()) // bs)
    seqs = len(BATCHES[batch])
    tables = torch.randperm(1024)[: seqs * width].view(seqs, width)
    q = (4 * torch.randn(len(lens), heads, d)).to(dtype)
    view = window_view(tables, lens, row_seq, window, bs) if window else None
    got = paged_attention(
        q, k_cache, v_cache, tables, lens, d**-0.5, None, row_seq, view, softcap=2.5
    )
    want = reference(q, k_ref, v_ref, tables, row_seq, lens, d**-0.5, None, window, 2.5)
    uncapped = reference(q, k_ref, v_ref, tables, row_seq, lens, d**-0.5, None, window)
    assert (uncapped - want).abs().max() > 0.1  # the cap matters here
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max().item() < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("peak", [8.0, 40.0])
def test_peaked_scores_match_torch(isa, dtype, peak) -> None:
    """Queries scaled up until most keys' probabilities underflow (scores far below the
    row's max, where the kernels' exp clamps at -87): still torch's attention, the
    weight on the few keys near the max as torch gives it."""
    heads, kv_heads, d, bs = 9, 3, 64, 16
    torch.manual_seed(3)
    k_cache, v_cache, k_ref, v_ref = random_cache(heads, kv_heads, d, bs, dtype)
    row_seq, lens = rows_of(BATCHES["mixed"])
    width = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(POOL)[:width] for _ in BATCHES["mixed"]])
    q = (torch.randn(len(lens), heads, d) * peak).to(dtype)
    got = paged_attention(q, k_cache, v_cache, tables, lens, d**-0.5, None, row_seq)
    want = reference(q, k_ref, v_ref, tables, row_seq, lens, d**-0.5, None)
    assert torch.isfinite(got.float()).all()
    # fp32: scores `peak` times larger carry rounding `peak` times larger, in any order
    tol = 1e-5 * peak / 8 if dtype == torch.float32 else 2e-2
    assert (got.float() - want).abs().max().item() < tol


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_of_many_parts_gets_the_same_bits_spread_or_not(isa, dtype) -> None:
    """A decode of 9,000 keys (18 of the kernels' 512-key parts): alone, its parts are
    tasks of their own, spread over the threads; beside another sequence's decode, one
    task runs them all. The same bits both ways, and torch's attention."""
    heads, kv_heads, d, bs = 9, 3, 64, 16
    torch.manual_seed(2)
    k_cache, v_cache, k_ref, v_ref = random_cache(heads, kv_heads, d, bs, dtype, nb=600)
    tables = torch.stack([torch.randperm(600)[:563] for _ in range(2)])
    q = torch.randn(2, heads, d).to(dtype)
    alone = paged_attention(q[:1], k_cache, v_cache, tables[:1], torch.tensor([9000]), 0.125)
    lens = torch.tensor([9000, 300])
    both = paged_attention(q, k_cache, v_cache, tables, lens, 0.125, None, torch.tensor([0, 1]))
    assert torch.equal(both[:1], alone)
    want = reference(q, k_ref, v_ref, tables, torch.tensor([0, 1]), lens, 0.125, None)
    assert (both.float() - want).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_however_it_is_batched(isa, dtype) -> None:
    """A query row's result depends on the row alone: the same bits as a decode on its
    own, as one token of a prefill chunk, and beside other sequences' rows."""
    heads, kv_heads, d, bs = 9, 3, 64, 16
    torch.manual_seed(1)
    k_cache, v_cache, _, _ = random_cache(heads, kv_heads, d, bs, dtype)
    tables = torch.randperm(POOL)[:80].view(2, 40)
    q = torch.randn(600, heads, d).to(dtype)  # query of sequence 0 at each position

    other = torch.randn(7, heads, d).to(dtype)  # rows of sequence 1

    def run(parts):  # (table, cached tokens, query rows) per sequence
        row_seq, lens = rows_of([(cached, len(rows)) for _, cached, rows in parts])
        return paged_attention(
            torch.cat([rows for *_, rows in parts]),
            k_cache,
            v_cache,
            tables[[table for table, _, _ in parts]],
            lens,
            0.125,
            None,
            row_seq,
        )

    alone = torch.cat(  # each position as a decode on its own (no row_seq)
        [
            paged_attention(
                q[p : p + 1],
                k_cache,
                v_cache,
                tables[:1],
                torch.tensor([p + 1]),
                0.125,
            )
            for p in range(600)
        ]
    )
    got, start = [], 0
    # chunks of sequence 0, each batched with sequence 1; one across the first 512-key
    # part's end, and a decode of two parts (alone, its parts are spread over the threads;
    # beside sequence 1, each task runs all its parts)
    for n in (37, 1, 50, 32, 130, 1, 49, 250, 1, 49):
        mine = (0, start, q[start : start + n])
        if n == 1:
            got.append(run([mine, (1, 90, other[:1])])[:1])
        else:
            got.append(run([(1, 5, other), mine])[len(other) :])
        start += n
    assert torch.equal(torch.cat(got), alone)


def test_loading_the_kernels_keeps_subnormal_floats() -> None:
    """A library linked with -ffast-math would set flush-to-zero for the whole process
    (crtfastmath.o); our kernels must not change how the rest of kvserve computes."""
    code = (
        "import torch\n"
        "from model.backends.cpu.kernels.attention import attention_library\n"
        "from model.backends.cpu.kernels.fused import fused_library\n"
        "assert attention_library(64, 16, 3) is not None and fused_library() is not None\n"
        "tiny = torch.tensor([1e-40], dtype=torch.float32)\n"
        "print(5e-324 * 1.0 > 0, bool((tiny * 1.0 > 0).all()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 16, 49152 + 5])
def test_greedy_tokens_are_torch_max_and_isfinite(isa, dtype, n) -> None:
    """At every level: AVX-512's 16 lanes, AVX2's two sets of 8, the scalar tail."""
    if not fused_supported(torch.empty(1, dtype=dtype)):
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=gen).to(dtype)
    x[1] = x[1].round()  # ties: the first maximum wins, wherever it sits among the lanes
    x[1, n // 2] = x[1].max()
    x[2, n - 1] = 100.0  # the maximum in the tail
    x[3, n // 3] = float("nan")
    x[4, 0] = float("inf")
    x[5] = float("-inf")
    x[6, : n // 2] = float("-inf")
    x[7] = 0.0
    x[8, n // 2] = float("nan")
    x[8, 0] = float("inf")
    best = x.max(dim=-1)
    want = torch.where(best.values.isfinite(), best.indices, -1).tolist()
    assert greedy_tokens(x) == want
    assert want[3] == want[4] == want[5] == want[8] == -1 and want[7] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_geglu_is_torchs_tanh_gelu_times_up(isa, dtype) -> None:
    """Gemma's gelu_tanh(gate) * up in one pass (fused.c): torch's ops, to its rounding
    (bf16: each of the two results rounded, as torch rounds them)."""
    from model.backends.cpu.kernels.fused import geglu

    gen = torch.Generator().manual_seed(0)
    gate_up = (3 * torch.randn(37, 2 * 200, generator=gen)).to(dtype)
    gate, up = gate_up.split(200, dim=1)
    want = F.gelu(gate.float(), approximate="tanh").to(dtype).float() * up.float()
    got = geglu(gate_up).float()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_is_torchs_tanh(isa, dtype) -> None:
    """Gemma 2's final logits, cap * tanh(x / cap), in place in one pass (fused.c): torch's
    ops to float32 accuracy (bf16: within a rounding), across the whole range (tiny,
    saturated, signed zeros), a NaN kept."""
    from model.backends.cpu.backend import CpuBackend
    from model.backends.reference import TorchBackend

    gen = torch.Generator().manual_seed(0)
    x = torch.cat([60 * torch.randn(3000, generator=gen), torch.tensor([0.0, -0.0, 1e-30, 3e3])])
    x = x.to(dtype).reshape(4, -1)
    want = TorchBackend().softcap(x.float(), 30.0).to(dtype)
    cpu = CpuBackend.__new__(CpuBackend)  # its softcap alone
    got = cpu.softcap(x.clone(), 30.0)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.13, rtol=8e-3)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got.signbit(), want.signbit())
    x[0, 0] = float("nan")
    assert cpu.softcap(x.clone(), 30.0)[0, 0].isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_qk_norms_are_the_references(isa, dtype) -> None:
    """OLMo 2's q and k norms over every head at once (fused.c's qk_norm_all, in place)
    against the torch reference's RMSNorm over the whole projections; v left alone."""
    from model.backends.cpu.backend import CpuBackend
    from model.backends.reference import TorchBackend
    from model.layers import RMSNorm

    h, kv, d = 6, 2, 16
    gen = torch.Generator().manual_seed(1)
    q_norm, k_norm = RMSNorm(h * d, 1e-6).to(dtype), RMSNorm(kv * d, 1e-6).to(dtype)
    for norm in (q_norm, k_norm):
        norm.weight.data = (1 + 0.3 * torch.randn(norm.weight.shape, generator=gen)).to(dtype)
    qkv = (2 * torch.randn(9, (h + 2 * kv) * d, generator=gen)).to(dtype)
    want = TorchBackend().norm_heads(qkv.clone(), q_norm, k_norm, h, kv, whole=True)
    cpu = CpuBackend.__new__(CpuBackend)  # its norm_heads alone
    got = cpu.norm_heads(qkv.clone(), q_norm, k_norm, h, kv, whole=True)
    assert torch.equal(got[:, (h + kv) * d :], qkv[:, (h + kv) * d :])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
