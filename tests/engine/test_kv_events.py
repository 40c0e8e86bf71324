"""KV cache events (service/engine/kv_events.py), read the way llm-d's and Dynamo's
routers read vLLM's: a ZMQ subscriber decoding vLLM's event types (written out here as
their example subscriber has them), each stored block's hash the prefix cache's key with
its parent and tokens, removals on eviction, the host tier's blocks as medium CPU, and
missed batches replayed."""

import time
from typing import Any

import msgspec
import zmq

from service.engine.prefix_keys import chain_hashes, root_digest
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
    engine.close()
    ctx.destroy(linger=0)
