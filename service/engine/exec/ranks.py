"""The engine across tensor-parallel ranks: rank 0 schedules and samples, and before each
forward it broadcasts the step's inputs; every other rank receives them and runs the same
forward on its share of the model (model/parallel.py), so the ranks' collectives line up.

Failures are bounded, never hangs: every collective has the process group's timeout
(--rank-timeout), rank 0 sends a heartbeat that needs every rank's answer while idle (so
an idle follower never waits longer than that, and a hung one is found out), and with
more than one rank any failed forward is fatal (`RankError`): the ranks may be out of step.
The server then turns /health 503 and exits non-zero; a follower exits non-zero too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.parallel import TensorParallel
from service.engine.batch import Step

log = logging.getLogger("kvserve.ranks")
HEARTBEAT_S = 1.0


class RankError(RuntimeError):
    """A rank failed, died or stopped answering; the engine cannot go on."""


@dataclass(frozen=True, slots=True)
class Clear:
    """Zero these KV blocks (a request's K/V that must not be reused), and these of the
    windowed layers' pool."""

    blocks: list[int]
    window_blocks: list[int]


@dataclass(frozen=True, slots=True)
class SlotFill:
    """Put the LoRA adapter `name` into the bank's `slot` (every rank, its own share of
    the adapter: model/adapters.py's Adapters.fill)."""

    name: str
    slot: int


_HEARTBEAT, _STOP = "heartbeat", "stop"
Message = Step | Clear | SlotFill | str


class Ranks:
    """One rank's end of the step channel: rank 0 sends, the others receive."""

    def __init__(self, tp: TensorParallel, device: torch.device) -> None:
        """device: where the collectives' tensors live (NCCL needs them on the GPU)."""
        self.tp, self.device = tp, device
        self.last_sent = time.monotonic()
        self._token = torch.zeros(1, device=device)  # the heartbeat's answer

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    def send(self, message: Message) -> None:
        try:
            dist.broadcast_object_list([message], src=0, group=self.tp.group)
            if message == _HEARTBEAT:
                dist.all_reduce(self._token, group=self.tp.group)  # every rank answers
        except Exception as exc:
            raise RankError(f"tensor-parallel ranks stopped answering: {exc}") from exc
        self.last_sent = time.monotonic()

    def receive(self) -> Message:
        box: list[Message | None] = [None]
        dist.broadcast_object_list(box, src=0, group=self.tp.group)
        if box[0] == _HEARTBEAT:
            dist.all_reduce(self._token, group=self.tp.group)
        return box[0]  # type: ignore[return-value]

    def keepalive(self) -> None:
        """Rank 0 while idle: a heartbeat when the last message is HEARTBEAT_S old."""
        if time.monotonic() - self.last_sent >= HEARTBEAT_S:
            self.send(_HEARTBEAT)

    def stop(self) -> None:
        """Rank 0: the followers leave their loop (best effort: they may be gone)."""
        try:
            self.send(_STOP)
            self.leave()
        except Exception as exc:
            log.warning("could not stop the other ranks: %s", exc)

    def leave(self) -> None:
        """Leave the process group after a clean stop, every rank together (a rank whose
        peers vanish while it tears its connections down can abort at exit)."""
        if dist.is_initialized():
            dist.barrier(group=self.tp.group)
            dist.destroy_process_group()

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value (each rank sizes its KV pool on its own
        device; the pool must be the same number of blocks on all)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
        return int(t.item())

    @staticmethod
    def is_stop(message: Message) -> bool:
        return message == _STOP
