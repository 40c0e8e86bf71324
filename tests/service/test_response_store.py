"""The Responses store: bounded by count (oldest out first) and age, and one file shared
by every front's store (what `--api-server-count` N > 1 opens)."""

from service.api.response_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_oldest_is_evicted_past_the_size_and_an_expired_one_is_gone() -> None:
    clock = Clock()
    store = ResponseStore(size=2, ttl=60.0, clock=clock)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}], {"id": f"r{i}"}, [{"id": i}])
        clock.now += 10
    assert store.get("r0") is None and len(store) == 2
    assert store.get("r1") == [{"role": "user", "content": "1"}]
    assert store.response("r2") == {"id": "r2"} and store.inputs("r2") == [{"id": 2}]
    clock.now = 1075.0  # r1 (stored at 1010) is past its 60 s, r2 (1020) is not
    assert store.get("r1") is None and store.response("r2") == {"id": "r2"}
    assert store.delete("r2") and not store.delete("r2") and len(store) == 0


def test_stores_on_one_file_share_their_responses(tmp_path) -> None:
    path = str(tmp_path / "responses.sqlite")
    front0, front1 = ResponseStore(3, 60.0, path), ResponseStore(3, 60.0, path)
    front0.put("a", [{"role": "user", "content": "hi"}], {"id": "a"})
    assert front1.get("a") == [{"role": "user", "content": "hi"}]
    for rid in "bcd":
        front1.put(rid, [], {"id": rid})
    assert front0.response("a") is None  # the fourth evicted the first, in either front
    assert front0.delete("b") and front1.response("b") is None
    assert len(front0) == len(front1) == 2
