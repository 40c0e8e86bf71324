"""kvserve's Triton kernels against the torch reference backend, on the same cache layout.

Without a GPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before any kernel import); the interpreter does not check bounds, so every block a
sequence does not use is filled with NaN: a stray read shows up in the output.
"""

import pytest
import torch

from model.backends.reference import TorchBackend
from model.config import ModelConfig
from model.kv_cache import PagedKVCache
from model.layers import alibi_slopes
from model.metadata import AttentionMetadata
from tests.model.backends import make_backend

pytestmark = pytest.mark.interpreter

# (H, KV, head_dim, block_size): GQA groups 1, 3, 4, 8; head sizes 64, 80, 128
SHAPES = [(4, 4, 64, 16), (6, 2, 80, 16), (8, 2, 128, 32), (8, 1, 64, 32), (12, 4, 80, 32)]
# (cached, new) per sequence
BATCHES = {
    "decodes": [(0, 1), (15, 1), (16, 1), (76, 1), (111, 1)],
    "fresh_prompts": [(0, 37), (0, 5), (0, 16)],
    "chunks_after_prefix": [(32, 20), (16, 33), (3, 1)],
    "mixed": [(40, 1), (0, 9), (70, 41), (17, 1)],
}
DTYPES = [torch.float32, torch.bfloat16]


def setup(shape, batch, dtype, nb=64):
    h, kv, d, bs = shape
    cfg = ModelConfig(vocab_size=8, d_model=h * d, n_layers=1, n_heads=h, n_kv_heads=kv, d_ff=8)
    triton = make_backend("triton", cfg, bs, dtype)
    cache = PagedKVCache(cfg, nb, bs, dtype, "cpu", triton)
    cached = [c for c, _ in batch]
    new = [n for _, n in batch]
    perm = torch.randperm(nb).tolist()  # scattered blocks
    tables, used = [], torch.zeros(nb + 1, bs, dtype=torch.bool)
    for c, n in batch:
        need = -(-(c + n) // bs)
        tables.append(perm[:need])
        perm = perm[need:]
        for p in range(c + n):
            used[tables[-1][p // bs], p % bs] = True
    k_cache, v_cache = cache.layer(0)  # (NB, BS, KV, D)
    k_cache.copy_(torch.randn(k_cache.shape).to(dtype))
    v_cache.copy_(torch.randn(v_cache.shape).to(dtype))
    q = torch.randn(sum(new), h, d).to(dtype)
    return cfg, cache, triton, tables, cached, new, used, q


def poison(cache: PagedKVCache, used: torch.Tensor) -> None:
    """NaN in every slot no sequence uses (the null block included)."""
    for t in cache.layer(0):
        t[~used] = float("nan")


# every shape, batch and dtype causal; ALiBi on one shape (its bias does not depend on it)
CASES = [
    (shape, batch, dtype, alibi)
    for shape in SHAPES
    for batch in BATCHES
    for dtype in DTYPES
    for alibi in (False, True)
    if not alibi or shape == SHAPES[1]
]


@pytest.mark.parametrize(("shape", "batch", "dtype", "alibi"), CASES, ids=str)
def test_paged_attention_matches_reference(shape, batch, dtype, alibi) -> None:
    cfg, cache, triton, tables, cached, new, used, q = setup(shape, BATCHES[batch], dtype)
    slopes = alibi_slopes(cfg.n_heads) if alibi else None
    scale = cfg.head_dim**-0.5
    ref_meta = AttentionMetadata.paged(tables, cached, new, cache.block_size)
    ref = TorchBackend().attend(q, q, q, cache.layer(0), ref_meta, scale, slopes).float()
    poison(cache, used)
    meta = triton.metadata(tables, cached, new, cache.block_size, "cpu", cache.null_block)
    out = triton.attend(q, q, q, cache.layer(0), meta, scale, slopes).float()
    assert torch.isfinite(out).all()
    atol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out, ref, atol=atol, rtol=0)
    assert meta._dense is None  # no mask built for it


@pytest.mark.parametrize("window", [1, 20])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [(SHAPES[0], torch.float32), (SHAPES[1], torch.float32), (SHAPES[1], torch.bfloat16)],
    ids=str,
)
def test_sliding_window_matches_reference(shape, batch, dtype, window) -> None:
    """Each query over the last `window` keys up to its own, in one pass and in
    flash-decoding's shares. The blocks wholly before every window of a sequence hold NaN
    besides the unused ones: the block manager frees those, so the kernel must not read
    them."""
    cfg, cache, triton, tables, cached, new, used, q = setup(shape, BATCHES[batch], dtype)
    scale, bs = cfg.head_dim**-0.5, cache.block_size
    ref_meta = AttentionMetadata.paged(tables, cached, new, bs)
    ref = TorchBackend().attend(q, q, q, cache.layer(0), ref_meta, scale, None, window)
    for table, c in zip(tables, cached, strict=True):  # freed: before the first window
        for block in table[: max(c + 1 - window, 0) // bs]:
            used[block] = False
    poison(cache, used)
    meta = triton.metadata(tables, cached, new, bs, "cpu", cache.null_block)
    out = triton.attend(q, q, q, cache.layer(0), meta, scale, None, window).float()
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref.float(), atol=atol, rtol=0)
    if max(new) == 1:  # flash-decoding's shares, some wholly before the window
        from model.backends.triton import kernels as triton_kernels

        split = triton_kernels.paged_attention(
            q, *cache.layer(0), meta.block_tables, meta.seq_lens_t, meta.query_start, 1,
            scale, None, splits=4, window=window,
        ).flatten(1)  # fmt: skip
        torch.testing.assert_close(split.float(), ref.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("batch", ["decodes", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_soft_capped_scores_match_reference(dtype, batch, window) -> None:
    """Gemma 2's softcap * tanh(score / softcap), a cap low enough to change the scores,
    alone and with a window; one pass and flash-decoding's shares."""
    torch.manual_seed(5)
    shape = SHAPES[1]
    cfg, cache, triton, tables, cached, new, used, q = setup(shape, BATCHES[batch], dtype)
    q = 4 * q
    scale, bs = cfg.head_dim**-0.5, cache.block_size
    ref_meta = AttentionMetadata.paged(tables, cached, new, bs)
    ref = TorchBackend().attend(q, q, q, cache.layer(0), ref_meta, scale, None, window, 2.5)
    plain = TorchBackend().attend(q, q, q, cache.layer(0), ref_meta, scale, None, window)
    assert (ref.float() - plain.float()).abs().max() > 0.05  # the cap matters here
    poison(cache, used)
    meta = triton.metadata(tables, cached, new, bs, "cpu", cache.null_block)
    out = triton.attend(q, q, q, cache.layer(0), meta, scale, None, window, 2.5).float()
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref.float(), atol=atol, rtol=0)
    if max(new) == 1:
        from model.backends.triton import kernels as triton_kernels

        split = triton_kernels.paged_attention(
            q, *cache.layer(0), meta.block_tables, meta.seq_lens_t, meta.query_start, 1,
            scale, None, splits=4, window=window, softcap=2.5,
        ).flatten(1)  # fmt: skip
        torch.testing.assert_close(split.float(), ref.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("batch", ["decodes", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_sinks_match_reference(dtype, batch, window) -> None:
    """gpt-oss's sink logit per head beside the scores, large enough to take a share;
    one pass and flash-decoding's shares."""
    torch.manual_seed(6)
    shape = SHAPES[1]
    cfg, cache, triton, tables, cached, new, used, q = setup(shape, BATCHES[batch], dtype)
    sinks = 2 + torch.randn(q.shape[1])
    scale, bs = cfg.head_dim**-0.5, cache.block_size
    ref_meta = AttentionMetadata.paged(tables, cached, new, bs)
    how = (None, window, None, sinks)
    ref = TorchBackend().attend(q, q, q, cache.layer(0), ref_meta, scale, *how)
    plain = TorchBackend().attend(q, q, q, cache.layer(0), ref_meta, scale, None, window)
    assert (ref.float() - plain.float()).abs().max() > 0.05  # the sinks matter here
    poison(cache, used)
    meta = triton.metadata(tables, cached, new, bs, "cpu", cache.null_block)
    out = triton.attend(q, q, q, cache.layer(0), meta, scale, *how).float()
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref.float(), atol=atol, rtol=0)
    if max(new) == 1:
        from model.backends.triton import kernels as triton_kernels

        split = triton_kernels.paged_attention(
            q, *cache.layer(0), meta.block_tables, meta.seq_lens_t, meta.query_start, 1,
            scale, None, splits=4, window=window, sinks=sinks,
        ).flatten(1)  # fmt: skip
        torch.testing.assert_close(split.float(), ref.float(), atol=atol, rtol=0)


def test_padding_rows_give_zeros_and_leave_real_rows_alone() -> None:
    """A CUDA graph pads a decode batch with rows of no context (seq_len 0, slot -1): they
    read nothing and give zeros, and the real rows are what they are without them."""
    shape, batch = SHAPES[1], BATCHES["decodes"]
    cfg, cache, triton, tables, cached, new, used, q = setup(shape, batch, torch.float32)
    poison(cache, used)
    scale = cfg.head_dim**-0.5
    meta = triton.metadata(tables, cached, new, cache.block_size, "cpu", cache.null_block)
    alone = triton.attend(q, q, q, cache.layer(0), meta, scale, None)
    pad = 3
    qp = torch.cat([q, torch.randn(pad, *q.shape[1:])])
    tables_p = meta.block_tables.new_full((len(batch) + pad, meta.block_tables.shape[1]), 64)
    tables_p[: len(batch)] = meta.block_tables
    padded = AttentionMetadata(
        positions=torch.cat([meta.positions, torch.zeros(pad, dtype=torch.long)]),
        query_lens=[1] * (len(batch) + pad),
        seq_lens=[*meta.seq_lens, *[0] * pad],
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((pad,), -1, dtype=torch.int32)]),
        block_tables=tables_p,
        query_start=torch.arange(len(batch) + pad + 1, dtype=torch.int32),
        seq_lens_t=torch.cat([meta.seq_lens_t, torch.zeros(pad, dtype=torch.int32)]),
    )
    from model.backends.triton import kernels as triton_kernels

    for splits in (1, 4):  # one pass, and flash-decoding's shares
        out = triton_kernels.paged_attention(
            qp, *cache.layer(0), padded.block_tables, padded.seq_lens_t, padded.query_start,
            1, scale, None, splits=splits,
        ).flatten(1)  # fmt: skip
        torch.testing.assert_close(out[: len(batch)], alone, atol=1e-6, rtol=0)
        assert (out[len(batch) :] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "no-rope"])
def test_rope_store_matches_reference(dtype, shape, rope) -> None:
    """Rotation of q and k in place and the K/V stores; a slot of -1 stores nothing."""
    h, kv, d, bs = shape
    cfg, cache, triton, *_ = setup(shape, BATCHES["decodes"], dtype)
    t = 9
    qkv = torch.randn(t, (h + 2 * kv) * d).to(dtype)
    angles = torch.rand(t, d // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    tables = [[5, 9]]
    meta = triton.metadata(tables, [0], [t], bs, "cpu", cache.null_block)
    meta.slot_mapping[3] = -1  # a padding row
    ref_cache = PagedKVCache(cfg, 64, bs, dtype, "cpu", TorchBackend())
    args = (h, kv, d)
    rot = (cos, sin) if rope else None
    q_ref, k_ref, v_ref = TorchBackend().rope_store(
        qkv.clone(), rot, *args, ref_cache.layer(0), meta
    )
    q, k, v = triton.rope_store(qkv.clone(), rot, *args, cache.layer(0), meta)
    tol = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    if not rope or dtype == torch.float32:
        tol = dict(atol=1e-6, rtol=1e-6)
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
        torch.testing.assert_close(got.float(), want.float(), **tol)
    for got, want in zip(cache.layer(0), ref_cache.layer(0)):
        # the reference wrote the same slots; untouched slots are the random fill
        stored = want.view(-1, kv, d)[meta.slot_mapping[meta.slot_mapping >= 0].long()]
        mine = got.view(-1, kv, d)[meta.slot_mapping[meta.slot_mapping >= 0].long()]
        torch.testing.assert_close(mine.float(), stored.float(), **tol)
    skipped = 5 * bs + 3  # row 3's slot: block 5, offset 3
    assert not torch.equal(cache.layer(0)[0].view(-1, kv, d)[skipped], k[3])


@pytest.mark.parametrize("splits", [1, 2, 5, 16])
@pytest.mark.parametrize("alibi", [False, True], ids=["causal", "alibi"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_decode_matches_reference(splits, alibi, dtype) -> None:
    """Flash-decoding: each decode row's blocks split into shares (more shares than a
    short sequence has blocks, too) and merged by their log-sum-exp give the one-pass
    answer."""
    from model.backends.triton import kernels as triton_kernels

    shape = SHAPES[2]  # GQA 4, head_dim 128, blocks of 32
    batch = [(0, 1), (31, 1), (200, 1), (450, 1)]
    cfg, cache, triton, tables, cached, new, used, q = setup(shape, batch, dtype, nb=40)
    slopes = alibi_slopes(cfg.n_heads) if alibi else None
    scale = cfg.head_dim**-0.5
    ref_meta = AttentionMetadata.paged(tables, cached, new, cache.block_size)
    ref = TorchBackend().attend(q, q, q, cache.layer(0), ref_meta, scale, slopes).float()
    poison(cache, used)
    meta = triton.metadata(tables, cached, new, cache.block_size, "cpu", cache.null_block)
    out = triton_kernels.paged_attention(
        q, *cache.layer(0), meta.block_tables, meta.seq_lens_t, meta.query_start, 1, scale,
        slopes, splits=splits,
    ).float().flatten(1)  # fmt: skip
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=atol, rtol=0)


def test_decode_splits_follow_the_batch_shape_only(monkeypatch) -> None:
    from model.backends.triton import kernels as triton_kernels
    from model.backends.triton.kernels import MAX_SPLITS, decode_splits

    monkeypatch.setattr(triton_kernels, "INTERPRET", False)  # the GPU's policy
    assert decode_splits(1, 8) == MAX_SPLITS  # one stream: fill the GPU with shares
    assert decode_splits(4, 8) == 4
    assert decode_splits(64, 8) == 1  # enough programs already: one pass


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 576], ids=lambda d: f"d{d}")  # 576: SmolLM2's, padded
@pytest.mark.parametrize("add", [True, False], ids=["add", "no-add"])
@pytest.mark.parametrize("rows", [1, 4], ids=lambda r: f"{r}-rows-a-program")
def test_add_rms_norm_matches_reference(dtype, d, add, rows, monkeypatch) -> None:
    """The residual add (in place) and the RMSNorm in one kernel give the reference's
    x + delta and weight * norm(x + delta), x's dtype throughout; one row a program (as
    on a GPU) or several, the last program part empty."""
    from model.backends.triton import kernels as triton_kernels
    from model.layers import RMSNorm

    monkeypatch.setattr(triton_kernels, "NORM_ROWS", rows)

    cfg = ModelConfig(vocab_size=8, d_model=d, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=8)
    triton = make_backend("triton", cfg, 16, dtype)
    norm = RMSNorm(d, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d) + 0.5)
    x = (torch.randn(7, d) * 3).to(dtype)
    delta = torch.randn(7, d).to(dtype) if add else None
    x_ref, h_ref = TorchBackend().add_norm(norm, x.clone(), delta)
    mine = x.clone()
    x_out, h = triton.add_norm(norm, mine, delta)
    assert x_out.data_ptr() == mine.data_ptr() and h.dtype == dtype
    assert torch.equal(x_out, x_ref)  # one rounding of the same sum
    if dtype == torch.float32:
        torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)
    else:  # the sum of squares in another order: at most a rare ulp, then rounded the same
        torch.testing.assert_close(h.float(), h_ref.float(), atol=0, rtol=2**-7)
        assert (h != h_ref).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 64], ids=lambda r: f"{r}-rows-a-program")
def test_silu_mul_is_swiglus_gate_in_one_kernel(dtype, rows, monkeypatch) -> None:
    """silu(gate) * up from the fused gate | up output: bf16 bit-equal to torch's two ops
    (the silu rounded before the multiply, as torch rounds it); fp32 within an ulp or two
    (the exponential's last bits). A row count that leaves the last program part empty,
    and a width over one program's columns."""
    import torch.nn.functional as F

    from model.backends.triton import pointwise

    monkeypatch.setattr(pointwise, "GATE_ROWS", rows)
    f = pointwise.GATE_BLOCK + 300
    both = (torch.randn(5, 2 * f) * 4).to(dtype)
    gate, up = both.split(f, dim=-1)
    want = F.silu(gate) * up
    got = pointwise.silu_mul(both)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)


def test_the_triton_backend_gives_swiglu_its_fused_gate() -> None:
    """prepare() hands SwiGLU blocks the one-kernel gate, and a layer computes what torch's
    ops compute with it."""
    from model.layers import SwiGLU

    cfg = ModelConfig(vocab_size=8, d_model=64, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=96)
    ffn = SwiGLU(cfg)
    x = torch.randn(9, 64)
    want = ffn(x)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([ffn])
    triton = make_backend("triton", cfg, 16, torch.float32)
    assert triton.prepare(holder) is False
    assert ffn.gate_mul is triton.pointwise.silu_mul
    torch.testing.assert_close(ffn(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fp8_gemv_is_the_dequantized_linear(dtype, rows, bias) -> None:
    """The FP8 decode kernel: x times the e4m3 weight widened and scaled per row, summed
    in fp32, as F.linear of the dequantized weight; a K over two of its steps with a
    ragged last one, and N not a multiple of its output block."""
    import torch.nn.functional as F

    from model.backends.triton import fp8_gemv
    from model.fp8 import dequantize, quantize

    k, n = 2 * fp8_gemv.ROW_TILE[1] + 40, 3 * fp8_gemv.DOT_TILE[0] + 5
    weight, scale = quantize(torch.randn(n, k) * 0.05)
    b = torch.randn(n).to(dtype) if bias else None
    x = torch.randn(rows, k).to(dtype)
    got = fp8_gemv.fp8_gemv(x, weight, scale, b)
    want = F.linear(x.float(), dequantize(weight, scale), b.float() if bias else None)
    assert got.shape == (rows, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # one rounding of an fp32 sum to bf16
        torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=2**-8)
