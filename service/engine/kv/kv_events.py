"""KV cache events for precise prefix-aware routing (`--kv-events-endpoint`): each block
the prefix cache stores or removes, published over ZMQ in vLLM's wire format, which
llm-d's KV cache manager and Dynamo's KV router read.

One batch per engine step that changed the cache: a PUB socket sends the frames (topic
`kv-events`, an 8-byte big-endian sequence number, the msgpack batch); a batch is
`[ts, [event, ...]]`, an event `["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium]` (token_ids empty with
`--kv-events-omit-token-ids`), `["BlockRemoved", block_hashes, medium]` or
`["AllBlocksCleared"]`. A block's hash is its prefix-cache key (32 bytes of SHA-256,
chained from the model and the request's cache_salt). The medium: "GPU" for the KV
pool on CUDA (None on the CPU), "CPU" for the host tier. With
`--kv-events-replay-endpoint`, a ROUTER socket answers a subscriber that missed batches:
it sends a start sequence number and gets every batch still kept from there, then an
empty frame; a malformed request is dropped (counted) and the thread answers on.

Neither socket authenticates its reader, and the token ids are the prompts' own: bind
an address only the routers reach (docs/operations.md, "What is exposed"); a wildcard
address is warned of at start-up."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

log = logging.getLogger("kvserve.engine")
TOPIC = b"kv-events"
KEPT = 10_000  # batches kept for replay
END = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame's sequence number


class BlockStored(msgspec.Struct, array_like=True, tag=True):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(msgspec.Struct, array_like=True, tag=True):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, array_like=True, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Quiet:
    """No events asked for: what the block manager and the host tier report goes nowhere."""

    def stored(self, key: bytes, parent: bytes | None, tokens: Any, host: bool = False) -> None:
        pass

    def stored_entry(self, cached: Any, host: bool = False) -> None:
        pass

    def removed(self, key: bytes, host: bool = False) -> None:
        pass

    def publish(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def replay_up(self) -> bool | None:
        """Whether the replay socket's thread answers (None: there is none)."""
        return None

    @property
    def malformed(self) -> int:
        """Replay requests dropped as malformed."""
        return 0


QUIET = Quiet()


class KVEvents(Quiet):
    """What the block manager and the host tier report, published once per step."""

    def __init__(
        self,
        endpoint: str,
        replay: str | None,
        block_size: int,
        pool: str | None,
        token_ids: bool = True,
    ):
        self.block_size, self.pool, self.token_ids = block_size, pool, token_ids
        self.pending: list[Any] = []
        self.seq = 0
        self._malformed = 0
        self._failed: BaseException | None = None
        for where in (endpoint, replay):
            if where is not None and is_wildcard(where):
                log.warning(
                    "KV events bound to every interface (%s): anyone who reaches this "
                    "port reads the prompts' token ids; bind a private address",
                    where,
                )
        self._encode = msgspec.msgpack.Encoder().encode
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=KEPT)
        self._lock = threading.Lock()
        self._replay = None
        if replay is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._answer, name="kvserve-kv-events")
            self._thread.start()
        self.pending.append(AllBlocksCleared())  # a (re)started server holds nothing

    def stored(
        self, key: bytes, parent: bytes | None, tokens: tuple[int, ...], host: bool = False
    ) -> None:
        ids = list(tokens) if self.token_ids else []
        self.pending.append(BlockStored([key], parent, ids, self.block_size, None,
                                        "CPU" if host else self.pool))  # fmt: skip

    def stored_entry(self, cached: Any, host: bool = False) -> None:
        """A prefix-cache entry (service/engine/kv/host_tier.py's Cached) stored; one on the
        root (a first block) has no parent block."""
        parent = None if isinstance(cached.parent, bytes) else cached.parent_key
        self.stored(cached.key, parent, cached.tokens, host)

    def removed(self, key: bytes, host: bool = False) -> None:
        self.pending.append(BlockRemoved([key], "CPU" if host else self.pool))

    def publish(self) -> None:
        """Send what the step changed, as one batch (nothing if it changed nothing)."""
        if not self.pending:
            return
        payload = self._encode(EventBatch(time.time(), self.pending))
        self.pending = []
        seq = self.seq.to_bytes(8, "big")
        with self._lock:
            self._kept.append((self.seq, payload))
        self.seq += 1
        self._pub.send_multipart((TOPIC, seq, payload))

    @property
    def replay_up(self) -> bool | None:
        if self._replay is None:
            return None
        return self._failed is None and self._thread.is_alive()

    @property
    def malformed(self) -> int:
        return self._malformed

    def _answer(self) -> None:
        """The replay socket's thread, until closed (a failure it cannot answer past
        is kept for /health and the metrics)."""
        try:
            while not self._stop.is_set():
                if self._replay.poll(100):  # type: ignore[union-attr]
                    self._answer_one()
        except BaseException as exc:
            log.error("the KV events replay thread failed: %r", exc)
            self._failed = exc

    def _answer_one(self) -> None:
        """[client, "", start (8 bytes)] -> the kept batches from start, then END; any
        other message is dropped."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self._malformed += 1
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        with self._lock:
            batches = [(s, p) for s, p in self._kept if s >= first]
        for s, payload in batches:
            self._replay.send_multipart((client, b"", s.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END, b""))

    def close(self) -> None:
        if self._replay is not None:
            self._stop.set()
            self._thread.join()
        self._ctx.destroy(linger=0)


def is_wildcard(endpoint: str) -> bool:
    """Whether a ZMQ endpoint binds every interface (tcp://*, 0.0.0.0 or ::)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    return host in ("*", "0.0.0.0", "::", "")
