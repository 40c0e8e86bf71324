"""The windowed layers' own KV pool (service/engine/kv/window_blocks.py) on Gemma 3 (five
windowed layers, a window of 8, beside a global one) and on Mistral with a window of 8 in
every layer (the window pool its only K/V): transformers' greedy tokens past the window,
the blocks behind each window released as the sequence moves on, prefix-cache hits that
reuse a cached window (and are cut back where its blocks were evicted), and nothing held
at the end."""

import random

import pytest
import torch

from model.weights import load_model
from tests.engine.helpers import greedy, run_all, tokens_of
from tests.factories import make_engine, write_gemma3, write_mistral
from tests.model.backends import BACKENDS, block_size_for, make_backend

WINDOW, BLOCK = 8, 4
HELD = -(-(WINDOW - 1) // BLOCK) + 2  # a decode's window, and the block it writes


WRITERS = {"gemma3": write_gemma3, "mistral": write_mistral}


@pytest.fixture(scope="module", params=list(WRITERS))
def gemma(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = WRITERS[request.param](path, sliding_window=WINDOW)
    return hf.eval(), load_model(path, torch.float32)


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 300) for _ in range(length + 7 * i)] for i in range(n)]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def engine(model, **kw):
    return make_engine(model, **(dict(num_kv_blocks=96, max_num_seqs=4) | kw))


def test_greedy_tokens_are_transformers_and_windows_release_blocks(gemma) -> None:
    hf, model = gemma
    e = engine(model)
    assert e.kv_cache.window_blocks and e.kv_cache.window_blocks < e.kv_cache.num_blocks
    pool = e.blocks.windows
    if len(model.cfg.windowed_layers) == model.cfg.n_layers:  # no K/V under the block ids
        assert e.kv_cache.window_only and e.kv_cache.window_blocks == 96
    requests = {f"r{i}": (p, greedy(24)) for i, p in enumerate(prompts(3, 19))}
    for rid, (prompt, params) in requests.items():
        e.add_request(rid, prompt, params)
    outputs: dict[str, list] = {}
    most = 0
    while e.has_unfinished():
        for out in e.step():
            outputs.setdefault(out.request_id, []).append(out)
        for r in e.scheduler.running:
            if len(r.output_ids) > 1:  # decoding: the window and the block it writes
                held = [b for b in r.window_table if b != pool.null]
                assert len(r.window_table) == len(r.block_table)
                most = max(most, len(held))
    assert 0 < most <= HELD
    for rid, (prompt, _) in requests.items():
        assert tokens_of(outputs[rid]) == hf_greedy(hf, prompt, 24), rid
    assert e.blocks.num_used == 0 and pool.num_free == pool.num_blocks
    snap = e.snapshot()  # /metrics: both pools' bytes
    assert snap.kv_bytes_total == e.kv_cache.nbytes and snap.kv_bytes_used == 0


def test_prefix_hits_reuse_a_cached_window(gemma) -> None:
    """The same prompt again: every full block but the last is a hit (the window of the
    hit's end still cached), and the tokens are those of the first run; a longer prompt
    on the same prefix hits that prefix."""
    _, model = gemma
    e = engine(model)
    [prompt] = prompts(1, 41)
    first = tokens_of(run_all(e, {"a": (prompt, greedy(12))})["a"])
    again = run_all(e, {"b": (prompt, greedy(12))})["b"]
    assert again[-1].num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert tokens_of(again) == first
    longer = prompt + first[:6]
    fresh = engine(model, disable_prefix_caching=True)
    want = tokens_of(run_all(fresh, {"c": (longer, greedy(12))})["c"])
    got = run_all(e, {"c": (longer, greedy(12))})["c"]
    assert got[-1].num_cached_tokens >= len(prompt) // BLOCK * BLOCK
    assert tokens_of(got) == want
    assert e.blocks.windows.num_free == e.blocks.windows.num_blocks


def test_an_evicted_window_cuts_the_hit_back(gemma) -> None:
    """Other requests take the window pool's blocks (a smaller pool than the global
    one; with every layer windowed, 12 blocks): the prompt's global blocks are still cached, the window of their end is not,
    so the hit stops where a cached window ends (here: none), and the tokens are right."""
    _, model = gemma
    kw = {"num_kv_blocks": 12} if len(model.cfg.windowed_layers) == model.cfg.n_layers else {}
    e = engine(model, max_num_seqs=1, max_num_batched_tokens=16, **kw)
    pool = e.blocks.windows
    assert pool.num_blocks < e.blocks.num_blocks
    [prompt] = prompts(1, 41)
    first = tokens_of(run_all(e, {"a": (prompt, greedy(8))})["a"])
    for i, other in enumerate(prompts(3, 41, seed=5)):  # through the whole window pool
        run_all(e, {f"o{i}": (other, greedy(8))})
    assert all(e.blocks.cached.get(k) is not None for k in e.blocks._hashes.get("a", []))
    again = run_all(e, {"b": (prompt, greedy(8))})["b"]
    assert again[-1].num_cached_tokens < (len(prompt) - 1) // BLOCK * BLOCK
    assert tokens_of(again) == first


@pytest.mark.parametrize("name", BACKENDS)
def test_a_window_only_pool_on_each_backend(name: str, tmp_path) -> None:
    """Mistral with every layer windowed: its K/V in the window pool alone (no bytes
    under the block ids) on each backend, in prompt chunks and decodes past the window,
    gives transformers' greedy tokens, and releases every block."""
    hf = write_mistral(tmp_path, sliding_window=WINDOW).eval()
    model = load_model(tmp_path, torch.float32)
    make_backend(name, model.cfg)  # skip (or fail where required) saying what is missing
    block = block_size_for(name, BLOCK)
    e = engine(model, attention_backend=name, block_size=block, max_num_batched_tokens=32)
    assert e.backend.name == name and e.kv_cache.window_only
    [prompt] = prompts(1, 41)
    out = tokens_of(run_all(e, {"a": (prompt, greedy(20))})["a"])
    assert out == hf_greedy(hf, prompt, 20)
    assert e.blocks.windows.num_free == e.blocks.windows.num_blocks
