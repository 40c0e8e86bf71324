"""The prefix cache as a security boundary: keys are SHA-256 chained from a root naming
the model and the request's cache_salt, and a hit is trusted only if the cached block
holds exactly the request's tokens on top of exactly the block it matched one level up,
so even a forced hash collision shares nothing it should not."""

import pytest

import service.engine.kv.prefix_keys as prefix_keys
from service.engine.kv.blocks import BlockManager
from service.engine.request import Request, SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(cache_salt=salt), 0.0)


def computed(bm: BlockManager, r: Request) -> Request:
    """Admit r with whatever it hits, compute every token, register its full blocks."""
    bm.allocate(r, bm.lookup(r), r.num_tokens)
    r.num_computed = r.num_tokens
    bm.cache_full_blocks(r)
    return r


def test_equal_prefixes_share_and_keys_are_sha256() -> None:
    bm = BlockManager(32, BS, namespace="model-a")
    a = computed(bm, req("a", list(range(13))))
    b = req("b", [*range(12), 99, 98])
    assert bm.lookup(b) == a.block_table[:3]
    assert all(len(k) == 32 for k in bm.cached)  # SHA-256 digests
    other_model = BlockManager(32, BS, namespace="model-b")
    assert other_model._request_hashes(b) != bm._request_hashes(b)


def test_salts_keep_tenants_apart() -> None:
    bm = BlockManager(32, BS)
    prompt = list(range(13))
    computed(bm, req("a", prompt, salt="tenant-1"))
    assert bm.lookup(req("b", prompt, salt="tenant-2")) == []
    assert bm.lookup(req("c", prompt)) == []  # no salt is a namespace of its own
    assert len(bm.lookup(req("d", prompt, salt="tenant-1"))) == 3


@pytest.fixture
def colliding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block key is the same: the strongest forgery there is."""
    monkeypatch.setattr(prefix_keys, "block_digest", lambda parent, tokens: b"\0" * 32)


def test_a_forced_collision_shares_no_block(colliding: None) -> None:
    bm = BlockManager(32, BS)
    computed(bm, req("attacker", [5, 5, 5, 5, 6, 6, 6, 6, 1]))
    assert bm.cached  # the attacker's first block sits under the colliding key
    victim = req("victim", [1, 2, 3, 4, 6, 6, 6, 6, 9])
    assert bm.lookup(victim) == []  # same key, other tokens
    # the same second block on top of another first block: its tokens match, its parent not
    bm2 = BlockManager(32, BS)
    first = computed(bm2, req("first", [1, 2, 3, 4, 0]))
    other = computed(bm2, req("other", [7, 7, 7, 7, 6, 6, 6, 6, 0]))
    probe = req("probe", [1, 2, 3, 4, 6, 6, 6, 6, 9])
    hits = bm2.lookup(probe)
    assert hits == first.block_table[:1]  # its own first block, and nothing of "other"
    assert other.block_table[1] not in hits


def test_a_refilled_parent_does_not_revive_its_old_children() -> None:
    """A cached block whose parent block was evicted and refilled with other tokens is
    no longer reachable: entries carry ids that are never reused."""
    bm = BlockManager(3, BS)
    a = computed(bm, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    table = list(a.block_table)
    parent_entry = bm.records[table[0]].entry
    bm.free_request(a)
    bm._uncache(table[0])  # the parent block is evicted (and may be refilled)
    assert bm.records[table[0]] is None
    assert bm.records[table[1]].parent == parent_entry  # the child is still cached...
    assert bm.lookup(req("b", [1, 2, 3, 4, 5, 6, 7, 8, 0])) == []  # ...but unreachable
