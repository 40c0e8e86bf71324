"""Engine cores for the client's tests, over either transport: a tiny random model built
in the core's thread or process, the same either way (`variant` breaks it on purpose)."""

from __future__ import annotations

import functools
from typing import Any

from service.build import Built
from service.engine.core.engine import LLMEngine
from service.engine.process import core
from service.engine.process.client import EngineClient
from service.engine.process.transport import CoreSide, InProcess, InThread
from tests.factories import make_engine, small_model

TRANSPORTS = ("thread", "process")


def built(engine: LLMEngine) -> Built:
    return Built(engine, engine.tokenizer, "tiny", None, {}, {}, dict, lambda: None)


def make(variant: str, observers: Any) -> Built:
    """The tiny engine; "dies-at-step": its loop dies at its first step; "fails-to-load":
    building it fails."""
    if variant == "fails-to-load":
        raise ValueError("cannot load this model")
    engine = make_engine(small_model())
    engine.observer = observers("tiny")
    if variant == "dies-at-step":

        def boom() -> list:
            raise RuntimeError("simulated engine fault")

        engine.step = boom  # type: ignore[method-assign]
    return built(engine)


def in_process(variant: str, inputs: list[str], outputs: list[str], parent: int) -> None:
    """The engine process's main (spawn target)."""
    core.run(functools.partial(make, variant), inputs, outputs, parent)


def in_thread(variant: str, side: CoreSide, keep: Any) -> int:
    return core.serve(functools.partial(make, variant), side, keep=keep)


def client(transport: str, variant: str = "tiny") -> EngineClient:
    """A started client of a core over `transport` (thread or process)."""
    link: Any
    if transport == "thread":
        link = InThread(functools.partial(in_thread, variant))
    else:
        link = InProcess(functools.partial(in_process, variant))
    engine = EngineClient(link)
    engine.start(timeout=120)
    return engine
