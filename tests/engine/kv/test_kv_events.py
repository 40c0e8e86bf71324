"""KV cache events (service/engine/kv/kv_events.py), read the way llm-d's and Dynamo's
routers read vLLM's: a ZMQ subscriber decoding vLLM's event types (written out here as
their example subscriber has them), each stored block's hash the prefix cache's key with
its parent and tokens, removals on eviction, the host tier's blocks as medium CPU, and
missed batches replayed."""

import time
from typing import Any

import msgspec
import zmq

from service.engine.kv.prefix_keys import chain_hashes, root_digest
from tests.engine.helpers import greedy, run_all
from tests.factories import make_engine, small_model


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


MODEL = small_model()
PER_BLOCK = MODEL.cfg.n_layers * 2 * MODEL.cfg.kv_heads * MODEL.cfg.head_dim * 4 * 4


def test_a_subscriber_sees_blocks_stored_evicted_and_replayed(tmp_path) -> None:
    pub, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    engine = make_engine(MODEL, num_kv_blocks=16, kv_host_gib=32 * PER_BLOCK / 2**30,
                         kv_events_endpoint=pub, kv_events_replay_endpoint=replay)  # fmt: skip
    ctx = zmq.Context()
    try:  # closed whatever happens: a replay thread left running would hang the suite
        stored_evicted_replayed(engine, ctx, pub, replay)
    finally:
        engine.close()
        ctx.destroy(linger=0)


def stored_evicted_replayed(engine, ctx: zmq.Context, pub: str, replay: str) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    time.sleep(0.3)  # the subscription reaches the publisher
    prompt = list(range(1, 22))  # five full blocks of 4 and a token
    run_all(engine, {"a": (prompt, greedy(2))})
    run_all(engine, {"b": ([200 + i for i in range(62)], greedy(2))})  # takes all 16 blocks
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    frames = []
    while sub.poll(500):
        frames.append(sub.recv_multipart())
    assert frames and all(topic == b"kv-events" for topic, _, _ in frames)
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in frames]
    assert seqs == list(range(len(seqs)))
    events = [e for _, _, payload in frames for e in decode(payload).events]
    assert isinstance(events[0], AllBlocksCleared)
    keys = chain_hashes(prompt, 4, [], root_digest(engine.blocks.namespace, None))
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium is None]
    first = stored[:5]
    assert [e.block_hashes for e in first] == [[k] for k in keys]
    assert [e.parent_block_hash for e in first] == [None, *keys[:4]]
    assert first[1].token_ids == prompt[4:8] and first[0].block_size == 4
    removed = {k for e in events if isinstance(e, BlockRemoved) and e.medium is None
               for k in e.block_hashes}  # fmt: skip
    assert set(keys) <= removed  # b's prompt took the pool
    host = [e.block_hashes[0] for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert set(keys) <= set(host)  # ... and they went to the host tier
    # a subscriber that missed everything from batch 1 on asks for it again
    asker = ctx.socket(zmq.DEALER)
    asker.connect(replay)
    asker.send_multipart((b"", (1).to_bytes(8, "big")))
    again = []
    while True:
        _, seq, payload = asker.recv_multipart()
        if not payload:
            break
        again.append(int.from_bytes(seq, "big"))
    assert again == seqs[1:]


def replayed(asker: Any, start: int) -> list[int]:
    """The sequence numbers a replay request from `start` gets back."""
    asker.send_multipart((b"", start.to_bytes(8, "big")))
    got = []
    while True:
        assert asker.poll(5000), "the replay socket did not answer"
        _, seq, payload = asker.recv_multipart()
        if not payload:
            return got
        got.append(int.from_bytes(seq, "big"))


def test_malformed_replay_requests_are_dropped_and_the_socket_answers_on(tmp_path) -> None:
    """One frame, too many, an empty delimiter's absence, a start of the wrong size:
    each dropped and counted; the next subscriber still gets its replay. A thread that
    fails shows in the engine's snapshot (what /health and the metrics read)."""
    pub, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    engine = make_engine(MODEL, num_kv_blocks=16, kv_events_endpoint=pub,
                         kv_events_replay_endpoint=replay)  # fmt: skip
    ctx = zmq.Context()
    try:  # closed whatever happens: a replay thread left running would hang the suite
        run_all(engine, {"a": (list(range(1, 22)), greedy(2))})
        malformed_then_failed(engine, ctx, replay)
    finally:
        engine.close()
        ctx.destroy(linger=0)


def malformed_then_failed(engine, ctx: zmq.Context, replay: str) -> None:
    bad = [(b"x",), (b"", b"1", b"2", b"3"), (b"nodelim", b"12345678"), (b"", b"123")]
    for frames in bad:
        asker = ctx.socket(zmq.DEALER)
        asker.connect(replay)
        asker.send_multipart(frames)
    good = ctx.socket(zmq.DEALER)
    good.connect(replay)
    assert replayed(good, 0) == list(range(engine.blocks.events.seq))
    # the bad requests came on sockets of their own: they may still be on their way
    deadline = time.monotonic() + 10
    while engine.snapshot().kv_events_malformed < len(bad) and time.monotonic() < deadline:
        time.sleep(0.05)
    snap = engine.snapshot()
    assert snap.kv_events_replay_up is True and snap.kv_events_malformed == len(bad)
    events = engine.blocks.events

    def fail() -> None:
        raise RuntimeError("a failure the thread cannot answer past")

    events._answer_one = fail  # the thread's next request meets it
    good.send_multipart((b"", (0).to_bytes(8, "big")))
    events._thread.join(5)
    assert engine.snapshot().kv_events_replay_up is False


def test_token_ids_can_be_left_out(tmp_path) -> None:
    """--kv-events-omit-token-ids: the hashes and their chain, no prompt tokens."""
    pub = f"ipc://{tmp_path}/events"
    engine = make_engine(MODEL, num_kv_blocks=16, kv_events_endpoint=pub,
                         kv_events_omit_token_ids=True)  # fmt: skip
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    time.sleep(0.3)
    prompt = list(range(1, 22))
    run_all(engine, {"a": (prompt, greedy(2))})
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    events = []
    while sub.poll(500):
        events += decode(sub.recv_multipart()[2]).events
    stored = [e for e in events if isinstance(e, BlockStored)]
    keys = chain_hashes(prompt, 4, [], root_digest(engine.blocks.namespace, None))
    assert [e.block_hashes for e in stored[:5]] == [[k] for k in keys]
    assert stored and all(e.token_ids == [] for e in stored)
    engine.close()
    ctx.destroy(linger=0)


def test_a_wildcard_endpoint_is_told_apart() -> None:
    from service.engine.kv.kv_events import is_wildcard

    for endpoint in ("tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557", "tcp://:::5557"):
        assert is_wildcard(endpoint), endpoint
    for endpoint in (
        "tcp://127.0.0.1:5557",
        "tcp://10.0.0.7:5557",
        "ipc:///run/kv",
        "tcp://[::1]:1",
    ):
        assert not is_wildcard(endpoint), endpoint
