"""The Responses store: bounded by count and bytes (oldest out first) and age, each
response its owner's alone, and one file shared by every front's store (what
`--api-server-count` N > 1 opens)."""

from service.api.response_store import ResponseStore

BIG = 1 << 20  # a byte budget no test here reaches


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_oldest_is_evicted_past_the_size_and_an_expired_one_is_gone() -> None:
    clock = Clock()
    store = ResponseStore(size=2, ttl=60.0, budget=BIG, clock=clock)
    for i in range(3):
        store.put(f"r{i}", "", [{"role": "user", "content": str(i)}], {"id": f"r{i}"}, [{"id": i}])
        clock.now += 10
    assert store.get("r0", "") is None and len(store) == 2
    assert store.get("r1", "") == [{"role": "user", "content": "1"}]
    assert store.response("r2", "") == {"id": "r2"} and store.inputs("r2", "") == [{"id": 2}]
    clock.now = 1075.0  # r1 (stored at 1010) is past its 60 s, r2 (1020) is not
    assert store.get("r1", "") is None and store.response("r2", "") == {"id": "r2"}
    assert store.delete("r2", "") and not store.delete("r2", "") and len(store) == 0


def test_the_oldest_are_evicted_past_the_byte_budget() -> None:
    """Each response's JSON counts: past the budget the oldest go until the rest fit;
    one larger than the whole budget is not kept."""
    store = ResponseStore(size=100, ttl=60.0, budget=1000)
    for i in range(5):
        assert store.put(f"r{i}", "", [], {"text": "x" * 300})
        assert store.num_bytes <= 1000
    assert [store.response(f"r{i}", "") is not None for i in range(5)] == [False] * 2 + [True] * 3
    assert not store.put("huge", "", [], {"text": "x" * 1000})
    assert store.response("huge", "") is None and len(store) == 3


def test_a_response_is_its_owners_alone() -> None:
    """Another owner can neither read, list, continue nor delete it."""
    store = ResponseStore(size=10, ttl=60.0, budget=BIG)
    store.put("r", "alice", [{"role": "user", "content": "secret"}], {"id": "r"}, [{"id": 1}])
    for owner in ("bob", ""):
        assert store.get("r", owner) is None and store.response("r", owner) is None
        assert store.inputs("r", owner) is None and not store.delete("r", owner)
    assert store.get("r", "alice") == [{"role": "user", "content": "secret"}]
    assert store.delete("r", "alice")


def test_stores_on_one_file_share_their_responses(tmp_path) -> None:
    path = str(tmp_path / "responses.sqlite")
    front0, front1 = ResponseStore(3, 60.0, BIG, path), ResponseStore(3, 60.0, BIG, path)
    front0.put("a", "", [{"role": "user", "content": "hi"}], {"id": "a"})
    assert front1.get("a", "") == [{"role": "user", "content": "hi"}]
    for rid in "bcd":
        front1.put(rid, "", [], {"id": rid})
    assert front0.response("a", "") is None  # the fourth evicted the first, in either front
    assert front0.delete("b", "") and front1.response("b", "") is None
    assert len(front0) == len(front1) == 2
