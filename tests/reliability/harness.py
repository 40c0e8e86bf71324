"""`python -m tests.reliability.harness serve ...`: the real `kvserve serve`, plus what the
reliability tests need to look inside and to break it on purpose.

- GET /debug/state: process RSS, Python objects tracked by the garbage collector (total,
  per kvserve class, and the 80 most numerous types: where a growth comes from) and those
  frozen out of its sight after the load, and the engine's and API's per-request tables.
- KVSERVE_TEST_FAULT=nan-token:ID  turns the embedding of token ID into NaN, so
  any request whose prompt holds ID gets non-finite logits.
- KVSERVE_TEST_FAULT=die-on-token:ID  makes the engine loop raise as soon as a request
  whose prompt holds ID is running: the loop itself dies.
- raise-in-add:ID / raise-in-update:ID  a bug hit by a request whose prompt holds ID, in
  the engine's add (after it queued the request) or while it takes a new token.
Faults are installed in the engine's process too, where it has its own.
- raise-in-observer:0  the metrics observer raises on every engine step.
- collide-prefix:0  every prefix-cache key is the same (a forged collision at its worst).
- encode-off-loop:0  the tokenizer raises if it is called on a thread running an event
  loop (tokenizing a large body there would hold up every stream).
Several faults: separate them with commas.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
from typing import Any

import model.loader
import service.server
from service.cli import main
from service.engine.core.engine import LLMEngine

# kvserve's per-request objects, by qualified name
TRACKED = (
    "service.engine.request.Request",
    "service.engine.output.RequestOutput",
    "service.engine.text.processor.TextState",
    "service.engine.process.client._Stream",
    "service.api.state.Admission",
)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _debug_state(app: Any) -> dict[str, Any]:
    gc.collect()
    objects = gc.get_objects()
    by_type = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in objects)
    state = app.state.serving
    engine = state.engine
    served = engine.link.shared()
    if served is not None:  # the engine core in a thread of this process: its objects
        inner = served.engine
        requests, waiting = len(inner.requests), len(inner.scheduler.waiting)
        running, blocks_used = len(inner.scheduler.running), inner.blocks.num_used
    else:  # --engine-process on: what the engine process published after its last step
        snap = engine.snapshot()
        requests, waiting = snap.running + snap.waiting, snap.waiting
        running, blocks_used = snap.running, snap.kv_blocks_used
    return {
        "rss_bytes": _rss_bytes(),
        "gc_objects": len(objects),
        "gc_frozen": gc.get_freeze_count(),
        "tracked": {name.rpartition(".")[2]: by_type.get(name, 0) for name in TRACKED},
        "most": dict(by_type.most_common(80)),
        "engine_requests": requests,
        "engine_streams": len(engine._streams),
        "inflight": state.inflight,
        "waiting": waiting,
        "running": running,
        "blocks_used": blocks_used,
    }


def _with_debug_route(create_app: Any) -> Any:
    def create(settings: Any) -> Any:
        app = create_app(settings)

        @app.get("/debug/state")
        async def debug_state() -> dict[str, Any]:
            return _debug_state(app)

        return app

    return create


def _install_fault(spec: str) -> None:
    kind, _, arg = spec.partition(":")
    token = int(arg)
    if kind == "raise-in-add":
        add = LLMEngine.add

        def failing_add(self: LLMEngine, request_id: str, checked: Any) -> Any:
            ids = add(self, request_id, checked)
            if token in checked.prompt_ids:
                raise RuntimeError(f"injected fault in add_request (token {token})")
            return ids

        LLMEngine.add = failing_add  # type: ignore[method-assign]
        return
    if kind == "raise-in-update":
        from service.engine.core.postprocess import PostProcessor

        stop_reason = PostProcessor._stop_reason

        def failing_stop(self: PostProcessor, request: Any, new_token: int) -> Any:
            if token in request.prompt_ids:
                raise RuntimeError(f"injected fault while taking a token (token {token})")
            return stop_reason(self, request, new_token)

        PostProcessor._stop_reason = failing_stop  # type: ignore[method-assign]
        return
    if kind == "raise-in-observer":
        from service.api.metrics import Metrics

        def failing_step(self: Any, *args: Any) -> None:
            raise RuntimeError("injected fault in the metrics observer")

        Metrics.on_step = failing_step  # type: ignore[method-assign]
        return
    if kind == "encode-off-loop":
        import asyncio

        from model.tokenizer import Tokenizer

        encode = Tokenizer.encode

        def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop on this thread: a worker (or the engine) thread
                return encode(self, *args, **kwargs)
            raise RuntimeError("the tokenizer ran on the event loop")

        Tokenizer.encode = checked  # type: ignore[method-assign]
        return
    if kind == "collide-prefix":
        import service.engine.kv.prefix_keys as prefix_keys

        prefix_keys.block_digest = lambda parent, tokens: b"\0" * 32
        return
    if kind == "nan-token":
        load = model.loader.load

        def poison(module: Any, inputs: tuple, out: Any) -> Any:
            # the looked-up rows only: the weight itself is also the (tied) output head
            return out.masked_fill((inputs[0] == token)[..., None], float("nan"))

        def poisoned(*args: Any, **kwargs: Any) -> Any:
            loaded = load(*args, **kwargs)
            loaded.model.embed.register_forward_hook(poison)
            return loaded

        model.loader.load = poisoned
    elif kind == "die-on-token":
        step = LLMEngine.step

        def dying(self: LLMEngine) -> Any:
            if any(token in r.prompt_ids for r in self.scheduler.running):
                raise RuntimeError(f"injected engine fault (token {token})")
            return step(self)

        LLMEngine.step = dying  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown KVSERVE_TEST_FAULT {spec!r}")


# in the server's process, and (spawn runs this module again as __mp_main__) in an engine
# process it starts (--engine-process on): the faults are where the engine runs
if __name__ in ("__main__", "__mp_main__"):
    for fault in filter(None, os.environ.get("KVSERVE_TEST_FAULT", "").split(",")):
        _install_fault(fault)
if __name__ == "__main__":
    service.server.create_app = _with_debug_route(service.server.create_app)
    sys.exit(main(sys.argv[1:]))
