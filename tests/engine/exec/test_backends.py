"""The engine on each execution backend, and the CUDA-graph bucketing logic on the CPU."""

import pytest
import torch

from model.kv_cache import PagedKVCache
from model.weights import load_model
from service.engine.exec.cuda_graphs import DecodeGraphs, bucket_sizes
from tests.engine.core.test_engine import mixed_requests
from tests.engine.helpers import greedy, run_all, tokens_of
from tests.factories import (
    make_engine,
    small_model,
    write_gemma2,
    write_gpt_oss,
    write_mistral,
    write_qwen3_moe,
)
from tests.model.backends import BACKENDS, make_backend

MODEL = small_model()


@pytest.mark.parametrize("name", BACKENDS)
def test_each_backend_gives_the_cpu_backends_greedy_tokens(name: str) -> None:
    """Mixed requests (chunked prefills beside decodes) give the same greedy tokens on
    every backend (six of them: Triton's interpreter takes seconds a step)."""
    make_backend(name, MODEL.cfg)  # skips, or fails where required, if it cannot run
    requests = mixed_requests(6)
    want = {
        rid: tokens_of(outs)
        for rid, outs in run_all(
            make_engine(MODEL, block_size=16, attention_backend="cpu"), requests
        ).items()
    }
    engine = make_engine(MODEL, block_size=16, attention_backend=name)
    assert engine.backend.name == name
    got = {rid: tokens_of(outs) for rid, outs in run_all(engine, requests).items()}
    assert got == want
    assert engine.blocks.num_used == 0


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(256)[-3:] == [240, 248, 256]


@torch.no_grad()
def test_decode_graphs_pad_to_their_bucket_and_match_eager() -> None:
    """Decode batches of every size run on the static buffers of their bucket (padding rows
    store nothing and read nothing) and give the logits of the eager forward; the buffers
    are the same tensors from step to step, as a captured graph needs."""
    model = small_model()
    backend = make_backend("triton", model.cfg)
    cache = PagedKVCache(model.cfg, 64, 16, torch.float32, "cpu", backend)
    graphs = DecodeGraphs(model, cache, max_num_seqs=6, max_model_len=128, capture=False)
    assert graphs.buckets == [1, 2, 4, 6]
    addresses = [t.data_ptr() for t in (graphs.tokens, graphs.tables, graphs.seq_lens)]
    # five sequences with prompts of different lengths, prefilled eagerly
    prompts = [torch.randint(0, 300, (n,)) for n in (5, 17, 1, 33, 9)]
    tables = [[i * 4 + j for j in range(4)] for i in range(5)]
    lens = [len(p) for p in prompts]
    meta = backend.metadata(tables, [0] * 5, lens, 16, "cpu", cache.null_block)
    model(torch.cat(prompts), meta, cache)
    before = cache.data.clone()
    for n in (5, 3, 1):  # buckets 6, 4 and 1: two, one and no padding rows
        tokens = torch.randint(0, 300, (n,))
        meta = backend.metadata(tables[:n], lens[:n], [1] * n, 16, "cpu", cache.null_block)
        eager_cache = cache.data.clone()
        got = graphs.run(tokens, meta)
        after = cache.data.clone()
        cache.data.copy_(eager_cache)  # the same step again, eagerly
        want = model(tokens, meta, cache)
        # a padded batch rounds the matmuls differently (oneDNN/MKL pick their kernels by
        # row count): logits and stores within float32 rounding of each other
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.data, after, atol=1e-5, rtol=0)
        for i in range(n):
            lens[i] += 1
    assert [t.data_ptr() for t in (graphs.tokens, graphs.tables, graphs.seq_lens)] == addresses
    assert not torch.equal(before, cache.data)
    with pytest.raises(ValueError, match="up to 6 decodes"):
        graphs.run(torch.zeros(7, dtype=torch.long), meta)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_engine_replays_decode_graphs_and_runs_other_steps_eagerly(async_scheduling: str) -> None:
    """Through the engine: decode-only steps go to the graphs (here replayed eagerly),
    prefill and mixed steps do not, and the tokens are those of a run without graphs
    (with async scheduling too: the graphs' inputs then come from the step before)."""
    requests = {f"r{i}": ([7 * i + 1] * (3 + 5 * i), greedy(6 + i)) for i in range(4)}
    plain = make_engine(MODEL, block_size=16, attention_backend="triton")
    want = {rid: tokens_of(o) for rid, o in run_all(plain, requests).items()}
    engine = make_engine(
        MODEL, block_size=16, attention_backend="triton", async_scheduling=async_scheduling
    )
    graphs = DecodeGraphs(MODEL, engine.kv_cache, 16, 512, capture=False)
    sizes: list[int] = []
    run = graphs.run
    graphs.run = lambda tokens, meta, *lora: (
        sizes.append(tokens.shape[0]) or run(tokens, meta, *lora)
    )
    engine.runner.graphs = graphs
    got = {rid: tokens_of(o) for rid, o in run_all(engine, requests).items()}
    assert got == want
    assert sizes and max(sizes) == 4 and sum(sizes) < sum(6 + i for i in range(4))


GRAPHED = {
    # windowed layers (their own pool) beside global ones, soft-capped scores and logits
    "gemma2": lambda path: write_gemma2(path),
    "mistral": lambda path: write_mistral(path, sliding_window=8),  # every layer windowed
    # mixtures of experts in Triton's kernels, a dense layer between; gpt-oss's sinks,
    # windows and biased experts
    "qwen3_moe": lambda path: write_qwen3_moe(path),
    "gpt_oss": lambda path: write_gpt_oss(path),
}


@pytest.mark.parametrize("family", list(GRAPHED))
def test_decode_graphs_keep_windows_soft_caps_and_experts(family: str, tmp_path) -> None:
    """Windowed, soft-capped and mixture-of-experts models on the graphs' static buffers
    (replayed eagerly here): the windows, the window pool's tables, the caps and the
    experts (whose tiles are sized by the bucket, padding rows routed too) apply as in a
    run without graphs, with prompts and decodes past the window of 8 (a graph that ran
    windowed layers as global ones, or read another pool's table, gives other tokens)."""
    GRAPHED[family](tmp_path)
    model = load_model(tmp_path, torch.float32)
    kw = dict(block_size=16, num_kv_blocks=32, max_num_seqs=4, attention_backend="triton")
    requests = {f"r{i}": ([(5 * i + j) % 300 + 1 for j in range(11 + 6 * i)], greedy(8))
                for i in range(2)}  # fmt: skip
    want = {rid: tokens_of(o) for rid, o in run_all(make_engine(model, **kw), requests).items()}
    engine = make_engine(model, **kw)
    graphs = DecodeGraphs(model, engine.kv_cache, 4, 64, capture=False)
    assert (graphs.window_tables is not None) == bool(engine.kv_cache.window_blocks)
    sizes: list[int] = []
    run = graphs.run
    graphs.run = lambda tokens, meta, *lora: (
        sizes.append(tokens.shape[0]) or run(tokens, meta, *lora)
    )
    engine.runner.graphs = graphs
    got = {rid: tokens_of(o) for rid, o in run_all(engine, requests).items()}
    assert got == want and sum(sizes) >= 2 * 6  # most decodes went through the graphs
    assert engine.blocks.num_used == 0
