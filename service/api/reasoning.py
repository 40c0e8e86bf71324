"""Reasoning output (Qwen3, DeepSeek-R1 and the models that think in `<think>...</think>`):
the text a chat choice generates, split into the thinking (`reasoning_content`, and vLLM's
newer `reasoning`) and the answer (`content`).

The split reads the text alone, so a stream split delta by delta gives what the whole
text gives: a block opens with `<think>` at the start of the output, or is already open
when the rendered prompt left it open (DeepSeek-R1's template ends with `<think>`); it
closes at `</think>`, and the newlines after it are not part of the answer. A closing
marker split across deltas is held back until it is whole or cannot be one."""

from __future__ import annotations

from collections.abc import Sequence

from model.tokenizer import Tokenizer
from service.engine.sample.structured import THINK_CLOSE as CLOSE
from service.engine.sample.structured import THINK_OPEN as OPEN


def think_markers(tokenizer: Tokenizer) -> tuple[int, int] | None:
    """The (start, end) marker ids where the tokenizer has each as one token and the
    text of an output keeps it (not a special token skipped from it): a reasoning model's.
    """
    ids = []
    for marker in (OPEN, CLOSE):
        encoded = tokenizer.encode(marker, add_bos=False)
        if len(encoded) != 1 or tokenizer.decode(encoded, skip_special=True) != marker:
            return None
        ids.append(encoded[0])
    return ids[0], ids[1]


def opens_thinking(prompt: Sequence[int], markers: tuple[int, int]) -> bool:
    """Whether the rendered prompt leaves a think block open (its last start marker
    after its last end marker)."""
    start, end = markers
    last = {start: -1, end: -1}
    for i, token in enumerate(prompt):
        if token in last:
            last[token] = i
    return last[start] > last[end]


CLOSED_TAIL = 4  # "</think>" and the newlines after it: the block the template closed


def grammar_start(prompt: Sequence[int], markers: tuple[int, int] | None) -> str:
    """Where a constraint holds a reasoning model's output (Constraint.think): after the
    think block the prompt left open ("open"); from the first token ("") where the
    prompt's last tokens closed an empty block (Qwen3's template for enable_thinking
    false) or the model does not reason; else after a think block the output may open
    ("maybe")."""
    if markers is None:
        return ""
    if opens_thinking(prompt, markers):
        return "open"
    return "" if markers[1] in prompt[-CLOSED_TAIL:] else "maybe"


class ReasoningSplitter:
    def __init__(self, thinking: bool) -> None:
        """thinking: the prompt left a think block open."""
        self.state = "reasoning" if thinking else "start"
        self.opened = thinking  # the output has a think block
        self.held = ""  # text that may be the start of a marker (or of the answer)

    def feed(self, text: str) -> tuple[str, str]:
        """A delta of text -> its (reasoning, content) parts."""
        reasoning, content = "", ""
        self.held += text
        while self.held:
            if self.state == "start":  # the output's first characters: a block opening?
                if self.held.startswith(OPEN):
                    self.held, self.state = self.held[len(OPEN) :], "reasoning"
                    self.opened = True
                elif OPEN.startswith(self.held):
                    break  # too little text to tell
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = self.held.find(CLOSE)
                if end >= 0:
                    reasoning += self.held[:end]
                    self.held, self.state = self.held[end + len(CLOSE) :], "after"
                    continue
                keep = marker_tail(self.held, CLOSE)
                reasoning += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                break
            elif self.state == "after":  # the newlines between the block and the answer
                self.held = self.held.lstrip("\n")
                if self.held:
                    self.state = "content"
            else:
                content += self.held
                self.held = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back at the end of the output."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held if self.state in ("start", "content") else ""


def marker_tail(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split(text: str, thinking: bool) -> tuple[str | None, str]:
    """A whole output's (reasoning or None when it has none, content)."""
    splitter = ReasoningSplitter(thinking)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2 if splitter.opened else None), c1 + c2
