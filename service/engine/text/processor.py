"""The front's output processor: the token ids the engine core sends -> each sequence's
text. Detokenizing and watching for stop strings happen here, in the process that serves
the request's HTTP (N fronts share the work), never in the core. A stop string ends its
sequence here: the output is cut after the token that completed it, and the caller tells
the core (`Stop`), which finishes the sequence as stopped, its output counted to there."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from model.tokenizer import Tokenizer
from service.engine.output import RequestOutput
from service.engine.request import FinishReason, SamplingParams


class TextState:
    """Detokenizes a sequence's output and watches for stop strings, which may span
    tokens. Text that could be the start of a stop string is held back until it is not;
    a matched stop string and everything after it is never emitted."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], skip_special: bool) -> None:
        self.detok = tokenizer.detokenizer(skip_special=skip_special)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (up to a stop match)
        self.emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> bool:
        """Add a token; True when a stop string has matched."""
        before = len(self.text)
        self.text += self.detok.push([token_id])
        if not self.stop:
            return False
        start = max(0, before - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def take(self, final: bool) -> str:
        """The text that can be emitted now (all of it when the sequence is finishing)."""
        if final:
            if not self.stopped:
                self.text += self.detok.flush()
            end = len(self.text)
        else:
            end = max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


@dataclass(frozen=True, slots=True)
class Stop:
    """A stop string ended this sequence after `kept` output tokens (the last of them
    completed it): the core finishes it as stopped."""

    sequence_id: str
    kept: int


class RequestText:
    """One request's sequences (n of them): each output's `text` filled in, an output cut
    at a stop string and marked finished, and nothing more of a sequence handed on once
    it has ended (the core may have run ahead of the stop)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer, self.params = tokenizer, params
        self.states: dict[int, TextState] = {}  # by choice index
        self.ended: set[int] = set()

    def process(self, outputs: list[RequestOutput]) -> tuple[list[RequestOutput], list[Stop]]:
        """The outputs to hand on (each with its text), and the stops to tell the core."""
        shown: list[RequestOutput] = []
        stops: list[Stop] = []
        for out in outputs:
            if out.index in self.ended:
                continue
            stop = self._fill(out)
            shown.append(out)
            if stop is not None:
                stops.append(stop)
            if out.finished:
                self.ended.add(out.index)
        return shown, stops

    def _fill(self, out: RequestOutput) -> Stop | None:
        state = self.states.get(out.index) or self._start(out.index)
        if out.error is not None:  # held-back text is dropped: the sequence failed
            out.text = ""
            return None
        for j, token in enumerate(out.token_ids):
            if state.push(token):
                return self._cut(out, j + 1, state)
        out.text = state.take(final=out.finished)
        return None

    def _start(self, index: int) -> TextState:
        p = self.params
        state = self.states[index] = TextState(self.tokenizer, p.stop, p.skip_special_tokens)
        return state

    @staticmethod
    def _cut(out: RequestOutput, keep: int, state: TextState) -> Stop | None:
        """The output ends with its `keep`-th token, which completed a stop string."""
        kept = out.num_output_tokens - len(out.token_ids) + keep
        told = None if out.finished else Stop(out.request_id, kept)
        out.token_ids, out.logprobs = out.token_ids[:keep], out.logprobs[:keep]
        out.text = state.take(final=True)
        out.finished, out.finish_reason, out.num_output_tokens = True, FinishReason.STOP, kept
        return told


class Texts:
    """Every request of an engine driven in this process (offline, or a test): the
    outputs of `LLMEngine.step()` with their text, and a stop string's end told to the
    engine through `stop(sequence_id, kept)`."""

    def __init__(self, tokenizer: Tokenizer, stop: Callable[[str, int], object]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.requests: dict[str, RequestText] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        self.requests[request_id] = RequestText(self.tokenizer, params)

    def process(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        shown: list[RequestOutput] = []
        for out in outputs:
            text = self.requests.get(out.asked_as)
            if text is None:
                continue
            outs, stops = text.process([out])
            shown += outs
            for stop in stops:
                self.stop(stop.sequence_id, stop.kept)
            if len(text.ended) == text.params.n:
                del self.requests[out.asked_as]
        return shown
