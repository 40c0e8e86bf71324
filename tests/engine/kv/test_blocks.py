"""Property test of the block pool: never double-allocate, always return every block."""

from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.kv.blocks import BlockManager
from service.engine.kv.window_blocks import WindowBlocks
from service.engine.request import Request, SamplingParams

PARAMS = SamplingParams()
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 2), st.integers(1, 20)),
        st.tuples(st.just("append"), st.integers(0, 30), st.integers(1, 6)),
        st.tuples(st.just("free"), st.integers(0, 30), st.just(0)),
    ),
    max_size=80,
)


def check_invariants(bm: BlockManager, live: list[Request]) -> None:
    holders: dict[int, int] = {}
    for r in live:
        assert len(set(r.block_table)) == len(r.block_table)
        for b in r.block_table:
            holders[b] = holders.get(b, 0) + 1
    for b in range(bm.num_blocks):
        assert bm.ref_count[b] == holders.get(b, 0), f"block {b}"
        assert (b in bm.free) == (bm.ref_count[b] == 0)
        if holders.get(b, 0) > 1:  # shared only when it is a full, hashed prefix block
            assert bm.records[b] is not None
    for h, b in bm.cached.items():
        assert bm.records[b].key == h


def run_operations(bm: BlockManager, operations: list, check, forward=None) -> None:
    """Allocate (a prompt on one of PREFIXES, with its prefix-cache hits), append, free;
    check(live, last) after each, `last` each request's tokens of its last step;
    forward(r, start), where given, once a step's blocks are in place, before they are
    registered: r's tokens from the block-aligned `start` on are computed. At the end
    every request is freed."""
    live: list[Request] = []
    last: dict[str, int] = {}
    for counter, (op, a, b) in enumerate(operations):
        if op == "allocate":
            r = Request(f"r{counter}", PREFIXES[a] + list(range(100, 100 + b)), PARAMS, 0.0)
            hits = bm.lookup(r)
            cached = len(hits) * bm.block_size
            if bm.can_allocate(hits, r.num_tokens):
                bm.allocate(r, hits, r.num_tokens)
                if forward is not None:
                    forward(r, cached)
                last[r.request_id] = r.num_tokens - cached
                r.num_computed = r.num_tokens
                bm.cache_full_blocks(r)
                live.append(r)
                assert cached < r.num_tokens
        elif op == "append" and live:
            r = live[a % len(live)]
            if bm.can_append(r, b):
                start = r.num_computed
                bm.append(r, b)
                r.output_ids.extend([5] * b)
                if forward is not None:
                    forward(r, start - start % bm.block_size)
                last[r.request_id] = b
                r.num_computed = r.num_tokens
                bm.cache_full_blocks(r)
        elif op == "free" and live:
            r = live.pop(a % len(live))
            bm.free_request(r)
            bm.forget(r)
        check(live, last)
    for r in live:
        bm.free_request(r)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(4, 24))
def test_random_operations_keep_the_pool_consistent(operations: list, num_blocks: int) -> None:
    bm = BlockManager(num_blocks, 4)
    run_operations(bm, operations, lambda live, _: check_invariants(bm, live))
    assert bm.num_free == num_blocks and bm.num_used == 0
    assert all(c == 0 for c in bm.ref_count)


def check_window_invariants(pool: WindowBlocks, live: list[Request], last: dict) -> None:
    holders: dict[int, int] = {}
    for r in live:
        assert len(r.window_table) == len(r.block_table)
        held = [b for b in r.window_table if b != pool.null]
        assert len(set(held)) == len(held)
        # nothing held behind the window of the last step's start
        first = pool.first_needed(r.num_computed - last[r.request_id])
        assert all(b == pool.null for b in r.window_table[:first])
        for b in held:
            holders[b] = holders.get(b, 0) + 1
    for b in range(pool.num_blocks):
        assert pool.ref_count[b] == holders.get(b, 0), f"window block {b}"
        assert (b in pool.free) == (pool.ref_count[b] == 0)
    for key, b in pool.cached.items():
        assert pool.block_key[b] == key


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(8, 24), st.integers(4, 16), st.integers(1, 9))
def test_random_operations_keep_a_window_pool_consistent(
    operations: list, num_blocks: int, window_blocks: int, window: int
) -> None:
    """The same operations with the windowed layers' pool beside it (window_blocks.py):
    its blocks behind a sequence's window released, every hit's window held, and every
    block back at the end."""
    pool = WindowBlocks(window_blocks, 4, window, True)
    bm = BlockManager(num_blocks, 4, windows=pool)

    def check(live: list[Request], last: dict) -> None:
        check_invariants(bm, live)
        check_window_invariants(pool, live, last)

    run_operations(bm, operations, check)
    assert bm.num_free == num_blocks and pool.num_free == window_blocks
    assert all(c == 0 for c in pool.ref_count)


def test_prefix_hit_and_lru_eviction() -> None:
    bm = BlockManager(4, 4)
    a = Request("a", list(range(10)), PARAMS, 0.0)
    bm.allocate(a, [], 10)
    a.num_computed = 10
    bm.cache_full_blocks(a)
    bm.free_request(a)
    b = Request("b", [*list(range(9)), 99], PARAMS, 0.0)
    hits = bm.lookup(b)
    assert len(hits) == 2 and bm.can_allocate(hits, 10)
    # a full-cover hit leaves the last token to compute
    c = Request("c", list(range(8)), PARAMS, 0.0)
    assert len(bm.lookup(c)) == 1
    # taking every block evicts the cached ones
    d = Request("d", [50] * 16, PARAMS, 0.0)
    bm.allocate(d, [], 16)
    assert bm.cached == {} and bm.lookup(b) == []


@given(st.lists(st.integers(0, 99), min_size=1, max_size=6), st.lists(st.integers(0, 99), max_size=6), st.data())  # fmt: skip
def test_a_requests_token_range_is_that_slice_of_its_tokens(
    prompt: list[int], output: list[int], data: st.DataObject
) -> None:
    """Request.tokens(start, stop), which the runner and the prefix cache read, is
    token_ids[start:stop] wherever the range falls: in the prompt, the output, or both."""
    r = Request("r", prompt, PARAMS, 0.0, output_ids=output)
    start = data.draw(st.integers(0, r.num_tokens))
    stop = data.draw(st.integers(start, r.num_tokens))
    assert r.tokens(start, stop) == r.token_ids[start:stop]
