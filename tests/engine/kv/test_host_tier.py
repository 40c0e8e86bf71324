"""The prefix cache's host tier (service/engine/kv/host_tier.py): cached blocks the device
pool evicts are copied out and, on a later hit, copied back into fresh blocks; the block
manager's bookkeeping against a model of the bytes, and the engine on a real model
(restored K/V give the logits of K/V that never left, bit for bit on the CPU)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.weights import load_model
from service.config import Settings
from service.engine.kv import memory
from service.engine.kv.blocks import BlockManager
from service.engine.kv.host_tier import HostTier
from service.engine.kv.prefix_keys import Cached
from service.engine.request import Request, SamplingParams
from tests.engine.helpers import greedy, run_all, tokens_of
from tests.engine.kv.test_blocks import check_invariants, ops, run_operations
from tests.factories import make_engine, small_model, write_gemma3

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(cache_salt=salt), 0.0)


class Bytes:
    """What the device pool's blocks and the host slots hold: each block the tokens it
    was computed from, moved by the tier's copies as the runner moves K/V."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm, self.device, self.host = bm, {}, {}

    def step(self, r: Request, start: int) -> None:
        """The copies the allocation owes, then the forward: r's blocks from `start`."""
        copies = self.bm.tier.drain()
        for block, slot in copies.out:
            self.host[slot] = self.device.get(block)
        for slot, block in copies.into:
            self.device[block] = self.host[slot]
        for i, block in enumerate(r.block_table):
            if i * BS >= start:
                self.device[block] = tuple(r.token_ids[i * BS : (i + 1) * BS])

    def check_hits(self, r: Request, n_hits: int) -> None:
        for i in range(n_hits):
            assert self.device[r.block_table[i]] == tuple(r.token_ids[i * BS : (i + 1) * BS])


def computed(bm: BlockManager, data: Bytes, r: Request) -> int:
    hits = bm.lookup(r)
    bm.allocate(r, hits, r.num_tokens)
    data.step(r, len(hits) * BS)
    data.check_hits(r, len(hits))
    r.num_computed = r.num_tokens
    bm.cache_full_blocks(r)
    return len(hits)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(4, 16), st.integers(1, 8))
def test_random_operations_restore_the_bytes_that_left(
    operations: list, num_blocks: int, slots: int
) -> None:
    """Allocations, appends and frees on a small pool with a smaller tier: every hit,
    on the device or restored from the tier, holds its tokens' bytes once the step's
    copies ran, and every block is back at the end."""
    bm = BlockManager(num_blocks, BS, tier=HostTier(slots))
    data = Bytes(bm)

    def forward(r: Request, start: int) -> None:
        assert all(isinstance(b, int) for b in r.block_table)
        data.step(r, start)
        data.check_hits(r, start // BS)

    def check(live: list[Request], _: dict) -> None:
        check_invariants(bm, live)
        assert bm.tier.num_used + len(bm.tier.free) + len(bm.tier.held) == slots

    run_operations(bm, operations, check, forward)
    assert bm.num_free == num_blocks


def test_evicted_blocks_come_back_from_the_tier_under_their_salt() -> None:
    bm = BlockManager(4, BS, tier=HostTier(8))
    data = Bytes(bm)
    prompt = list(range(1, 11))  # two full blocks and a part
    a = req("a", prompt, salt="tenant-1")
    computed(bm, data, a)
    bm.free_request(a)
    filler = req("filler", [50] * 16)
    computed(bm, data, filler)  # takes every block: a's two cached ones go to the tier
    assert set(bm.cached) == {bm.records[b].key for b in filler.block_table}
    assert bm.tier.num_used == 2 and bm.tier.stats.stored == 2
    bm.free_request(filler)
    assert bm.lookup(req("b", prompt, salt="tenant-2")) == []  # another tenant's
    assert bm.lookup(req("c", prompt)) == []
    again = req("d", prompt, salt="tenant-1")
    hits = bm.lookup(again)
    assert [type(h) for h in hits] == [Cached, Cached]  # the tier's entries
    assert [h.tokens for h in hits] == [(1, 2, 3, 4), (5, 6, 7, 8)]
    assert computed(bm, data, again) == 2  # restored, the bytes as they left
    # they left the tier; the three blocks they and the rest of d took, the filler's, went in
    assert bm.tier.stats.restored == 2 and bm.tier.num_used == 3
    bm.free_request(again)
    # now on the device again, with the entry ids they had: a longer prompt chains on
    longer = req("e", [*prompt, 11, 12, 13], salt="tenant-1")
    assert len(bm.lookup(longer)) == 2


def test_a_forged_collision_is_not_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    import service.engine.kv.prefix_keys as prefix_keys

    monkeypatch.setattr(prefix_keys, "block_digest", lambda parent, tokens: b"\0" * 32)
    bm = BlockManager(2, BS, tier=HostTier(4))
    data = Bytes(bm)
    attacker = req("attacker", [5, 5, 5, 5, 1])
    computed(bm, data, attacker)
    bm.free_request(attacker)
    computed(bm, data, req("filler", [7] * 8))  # the attacker's block goes to the tier
    assert bm.tier.num_used == 1
    assert bm.lookup(req("victim", [1, 2, 3, 4, 9])) == []  # same key, other tokens


MODEL = small_model()


def restoring_engine(**kw):
    """A pool of 24 blocks of 4 tokens, and a host tier of 64 such blocks."""
    per_block = MODEL.cfg.n_layers * 2 * MODEL.cfg.kv_heads * MODEL.cfg.head_dim * BS * 4
    return make_engine(MODEL, num_kv_blocks=24, kv_host_gib=64 * per_block / 2**30, **kw)


@torch.no_grad()
def test_a_restored_prefix_gives_the_logits_of_one_that_never_left() -> None:
    """A conversation's prompt, then others that evict it from the pool, then the next
    turn: with the tier its prefix comes back from host memory, and its logprobs are
    those of an engine with a pool large enough to keep it (bit for bit: the same bytes),
    its tokens those of an engine without the prefix cache."""
    turn = list(range(1, 42))
    others = {f"o{i}": ([100 + 7 * i + j for j in range(30)], greedy(4)) for i in range(3)}
    later = {"next": ([*turn, 200, 201, 202], greedy(8, logprobs=3))}

    def conversation(engine) -> tuple[list, int]:
        """The next turn's outputs, and the blocks restored for it."""
        run_all(engine, {"first": (turn, greedy(4))})
        run_all(engine, others)  # these evict the turn (and restore what they preempt)
        tier = engine.blocks.tier
        before = tier.stats.restored if tier else 0
        outputs = run_all(engine, later)["next"]
        return outputs, (tier.stats.restored - before if tier else 0)

    tiered = restoring_engine()
    got, restored = conversation(tiered)
    assert restored == 10  # the turn's ten full blocks
    assert got[0].num_cached_tokens == 40  # the 10 blocks of the turn
    kept, _ = conversation(make_engine(MODEL, num_kv_blocks=256))
    assert kept[0].num_cached_tokens == 40
    assert tokens_of(got) == tokens_of(kept)
    assert [o.logprobs for o in got] == [o.logprobs for o in kept]
    plain, _ = conversation(make_engine(MODEL, num_kv_blocks=24, disable_prefix_caching=True))
    assert tokens_of(got) == tokens_of(plain)
    assert tiered.blocks.num_used == 0


def test_preemption_and_eviction_under_load_keep_the_tokens() -> None:
    """Many requests on shared prefixes in a pool too small for them: preemptions,
    evictions to the tier and restores in the same steps give the tokens of an engine
    without the prefix cache."""
    prefixes = [[p * 10 + j for j in range(17)] for p in range(1, 5)]
    requests = {f"r{i}": ([*prefixes[i % 4], 150 + i], greedy(12)) for i in range(16)}
    plain = run_all(make_engine(MODEL, num_kv_blocks=24, disable_prefix_caching=True), requests)
    engine = restoring_engine(max_num_seqs=6)
    got = run_all(engine, requests)
    assert {r: tokens_of(o) for r, o in got.items()} == {r: tokens_of(o) for r, o in plain.items()}
    snap = engine.snapshot()
    assert snap.preemptions > 0 and snap.kv_host_restored_blocks > 0
    assert engine.blocks.num_used == 0


def test_a_host_tier_is_refused_where_it_cannot_be_kept(tmp_path) -> None:
    write_gemma3(tmp_path, sliding_window=8)
    gemma = load_model(tmp_path, torch.float32)
    with pytest.raises(ValueError, match="kv_host_gib: no host tier .* windowed layers"):
        make_engine(gemma, kv_host_gib=0.01)
    with pytest.raises(ValueError, match="kv_host_gib: no host tier .* prefix cache is off"):
        make_engine(MODEL, kv_host_gib=0.01, disable_prefix_caching=True)
    assert make_engine(MODEL).blocks.tier is None  # the CPU's default: none


def test_the_default_host_tier_fits_the_machine_and_its_container(monkeypatch) -> None:
    """On CUDA a quarter of the RAM free, at most 8 GiB, within a container's cgroup
    limit (a container sees the host's meminfo); none on the CPU unless asked for."""
    gib = 2**30
    files = {"/proc/meminfo": 64 * gib // 1024, "/sys/fs/cgroup/memory.max": 10 * gib,
             "/sys/fs/cgroup/memory.current": 6 * gib}  # fmt: skip
    monkeypatch.setattr(memory, "_read_int", lambda path, field=None: files.get(path, 0))
    assert memory.available_ram() == 4 * gib
    settings = Settings()
    assert settings.engine.host_tier_bytes("cuda", memory.available_ram()) == gib
    assert settings.engine.host_tier_bytes("cuda", 64 * gib) == 8 * gib
    assert settings.engine.host_tier_bytes("cpu", 64 * gib) == 0
    assert Settings(kv_host_gib=0.5).engine.host_tier_bytes("cpu", 0) == gib // 2
    del files["/sys/fs/cgroup/memory.max"]  # no limit: the machine's
    assert memory.available_ram() == 64 * gib
