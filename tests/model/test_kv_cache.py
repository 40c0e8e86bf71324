"""Invariants of attention over the paged KV cache."""

import itertools

import pytest
import torch

from model.kv_cache import PagedKVCache
from model.metadata import AttentionMetadata
from tests.factories import tiny_model
from tests.model.backends import BACKENDS, auto_backend, block_size_for, make_backend

SCHEMES = [
    dict(position="rope"),
    dict(position="rope", rope_theta=500.0),
    dict(
        position="learned",
        norm="layernorm",
        ffn="gelu_tanh",
        qkv_bias=True,
        attn_out_bias=True,
        mlp_bias=True,
    ),
    dict(position="sinusoidal", ffn="relu"),
    dict(position="alibi", ffn="gelu"),
]
PLACEMENTS = ["pre", "post"]
KV_HEADS = [4, 2, 1]  # MHA, GQA, MQA


def paged_cache(name: str, model, num_blocks: int, block_size: int, dtype=torch.float32):
    """(cache, block size, backend) for backend `name` (the size it takes, if it needs more)."""
    block_size = block_size_for(name, block_size)
    backend = make_backend(name, model.cfg, block_size, dtype)
    return PagedKVCache(model.cfg, num_blocks, block_size, dtype, "cpu", backend), backend


# every combination on the compiled backends; in Triton's interpreter (seconds a case)
# every scheme with GQA, and the first scheme post-norm, with MHA and with MQA: the
# kernels see the position scheme and the K/V heads, the placement only through the
# fused add + norm, which the first scheme's cases take both ways
CASES = [
    (name, *case)
    for name in BACKENDS
    for case in itertools.product(SCHEMES, PLACEMENTS, KV_HEADS)
    if name != "triton"
    or (case[1] == "pre" and case[2] == 2)
    or (case[0] == SCHEMES[0] and (case[1] == "pre" or case[2] == 2))
]


@pytest.mark.parametrize(("name", "scheme", "placement", "kv_heads"), CASES)
@torch.no_grad()
def test_token_by_token_equals_full_forward(
    name: str, scheme: dict, placement: str, kv_heads: int
) -> None:
    model = tiny_model(**scheme, norm_placement=placement, n_kv_heads=kv_heads)
    tokens = torch.randint(0, 97, (40,))
    full = model(tokens)  # (T, V), no cache
    cache, backend = paged_cache(name, model, 16, 4)
    bs = cache.block_size
    table = [9, 2, 14, 0, 5, 11, 3, 7, 1, 12][: -(-40 // bs)]  # scattered on purpose
    outs = []
    for pos in range(tokens.shape[0]):
        meta = backend.metadata([table], [pos], [1], bs, "cpu", cache.null_block)
        outs.append(model(tokens[pos : pos + 1], meta, cache))
    assert torch.allclose(torch.cat(outs), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", BACKENDS)
@torch.no_grad()
def test_chunked_prefill_then_decode_equals_full_forward(name: str) -> None:
    model = tiny_model(n_kv_heads=2)
    tokens = torch.randint(0, 97, (37,))
    full = model(tokens)
    cache, backend = paged_cache(name, model, 12, 8)
    table, start, outs = [4, 7, 1, 9, 2], 0, []
    for n in [13, 8, 5, 1, 1, 9]:
        meta = backend.metadata([table], [start], [n], cache.block_size, "cpu", cache.null_block)
        outs.append(model(tokens[start : start + n], meta, cache))
        start += n
    assert torch.allclose(torch.cat(outs), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", BACKENDS)
@torch.no_grad()
def test_mixed_batch_equals_each_sequence_alone(name: str, scheme: dict) -> None:
    """One step mixing prefill chunks and decodes of different lengths gives every
    sequence the logits it gets alone (the torch path pads the decodes together and each
    longer query alone, never every sequence to the longest query)."""
    model = tiny_model(**scheme, n_kv_heads=2)
    seqs = [torch.randint(0, 97, (n,)) for n in (23, 5, 17, 9)]
    alone = [model(s) for s in seqs]
    cache, backend = paged_cache(name, model, 40, 4)
    block_size = cache.block_size
    tables = [[0, 5, 10, 15, 20, 25], [1, 6], [2, 7, 12, 17, 22], [3, 8, 13]]
    # step 1: prefill a prefix of each; step 2: mixed (a chunk, decodes, the rest)
    first = [20, 4, 10, 8]
    meta = backend.metadata(tables, [0] * 4, first, block_size, "cpu", cache.null_block)
    out1 = model(torch.cat([s[:n] for s, n in zip(seqs, first)]), meta, cache)
    rest = [len(s) - n for s, n in zip(seqs, first)]
    meta = backend.metadata(tables, first, rest, block_size, "cpu", cache.null_block)
    out2 = model(torch.cat([s[n:] for s, n in zip(seqs, first)]), meta, cache)
    if name == "torch":  # rest = [3, 1, 7, 1]: the two decodes, then each chunk
        assert [sub.query_lens for _, sub in meta.groups(block_size)] == [[1, 1], [3], [7]]
    else:  # the kernels read lengths and positions: no dense mask was built
        assert meta._dense is None
    o1, o2 = out1.split(first), out2.split(rest)
    for i, ref in enumerate(alone):
        got = torch.cat([o1[i], o2[i]])
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), f"sequence {i}"


@torch.no_grad()
def test_paged_equals_dense_with_logits_indices() -> None:
    model = tiny_model(n_kv_heads=1)
    tokens = torch.randint(0, 97, (30,))
    dense = model(tokens)
    cache = PagedKVCache(
        model.cfg, 8, 16, torch.float32, "cpu", auto_backend(model.cfg, torch.float32)
    )
    meta = AttentionMetadata.paged([[6, 3]], [0], [30], 16)
    last = model(tokens, meta, cache, logits_indices=torch.tensor([29]))
    assert torch.allclose(last[0], dense[29], atol=1e-5, rtol=0)


def test_block_table_too_short_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.paged([[0]], [3], [2], 4)


def test_context_length_enforced() -> None:
    model = tiny_model(max_position=16)
    with pytest.raises(ValueError, match="context length"):
        model(torch.zeros(17, dtype=torch.long))


# the C kernels compute in float32 and bfloat16 only (float16 runs on the others)
@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        (n, d)
        for n in BACKENDS
        for d in (torch.float32, torch.bfloat16, torch.float16)
        if (n, d) != ("cpu", torch.float16)
    ],
)
@torch.no_grad()
def test_each_backend_reads_its_layout_in_each_dtype(name: str, dtype) -> None:
    """Each backend writes K/V in its own layout (the cpu one interleaves pairs in 16-bit
    dtypes) and reads them back: chunked prefill then decodes equal one full forward."""
    model = tiny_model(n_kv_heads=2).to(dtype)
    tokens = torch.randint(0, 97, (37,))
    full = model(tokens).float()
    cache, backend = paged_cache(name, model, 12, 8, dtype)
    table, start, outs = [4, 7, 1, 9, 2], 0, []
    for n in [13, 8, 5, 1, 1, 9]:
        meta = backend.metadata([table], [start], [n], cache.block_size, "cpu", cache.null_block)
        outs.append(model(tokens[start : start + n], meta, cache).float())
        start += n
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(torch.cat(outs), full, atol=atol, rtol=0)


@pytest.mark.parametrize(
    ("name", "dtype"), [(n, d) for n in BACKENDS for d in (torch.float32, torch.bfloat16)]
)
@torch.no_grad()
def test_each_backend_gathers_what_it_stored(name: str, dtype) -> None:
    """gather (what the torch reference attends over: past a sliding window, or with
    soft-capped scores) reads back from each backend's own layout the K and V its
    rope_store wrote, token for token."""
    model = tiny_model(n_kv_heads=2).to(dtype)
    cfg = model.cfg
    cache, backend = paged_cache(name, model, 12, 8, dtype)
    h, kv, dh, n = cfg.n_heads, cfg.kv_heads, cfg.head_dim, 21
    qkv = torch.randn(n, (h + 2 * kv) * dh).to(dtype)
    table = [4, 7, 1, 9, 2]
    meta = backend.metadata([table], [0], [n], cache.block_size, "cpu", cache.null_block)
    _, k, v = backend.rope_store(qkv.clone(), None, h, kv, dh, cache.layer(0), meta)
    keys, values = backend.gather(cache.layer(0), meta)  # (1, KV, n, dh)
    assert torch.equal(keys[0].transpose(0, 1), k) and torch.equal(values[0].transpose(0, 1), v)


def test_host_slots_take_blocks_in_runs_and_give_the_same_bytes_back() -> None:
    """The host tier's pool (add_host_pool): blocks copied out to slots that run
    consecutively and slots that do not, read back by host_block and copied into other
    blocks, are the same bytes, every layer's K and V."""
    model = tiny_model()
    cache, _ = paged_cache("torch", model, 12, 4)
    cache.data.normal_()
    cache.add_host_pool(8)
    out = [(3, 5), (7, 6), (1, 7), (9, 0), (2, 2)]  # slots 5-7 in one run, 0, 2
    cache.copy_blocks(out, out=True)
    for block, slot in out:
        assert torch.equal(cache.host_block(slot), cache.data[:, :, block : block + 1])
    before = cache.data.clone()
    into = [(5, 0), (6, 4), (7, 8), (0, 10), (2, 11)]
    cache.copy_blocks(into, out=False)
    for (block, _), (_, target) in zip(out, into, strict=True):
        assert torch.equal(cache.data[:, :, target], before[:, :, block])
