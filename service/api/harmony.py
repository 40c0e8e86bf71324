"""gpt-oss's output format (OpenAI's harmony): an assistant turn is one message or more,
each a header and a body,

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>

(the first message's `<|start|>assistant` is the prompt's). A message's channel says what
it is: `analysis` the thinking (reasoning_content), `final` the answer (content), and
`commentary` addressed to a function (`to=functions.NAME`, in the header after the
channel or after the role) a tool call whose body is its arguments; commentary to no
one is said to the user (content). The markers are special tokens, so the output's text
keeps special tokens for this reader, which drops them. Text a model writes with no
marker at all (outside the format) is content.

Read from the text alone, delta by delta, as ChoiceReader reads the other formats: a
marker split across deltas is held back until it is whole or cannot be one."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from service.api.chat_output import MessageReader
from service.api.tool_formats import CALL, CHANNEL, END, HARMONY_MARKERS, MESSAGE, RETURN, START
from service.api.tool_split import call_fragment, call_header, merge
from service.api.tools import Tools

ENDS = (END, CALL, RETURN)  # a message's body ends at one of these
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass
class _Message:
    header: str = ""
    channel: str = ""
    recipient: str | None = None
    index: int | None = None  # its tool call's index, once its header is sent


class HarmonyReader(MessageReader):
    """A harmony output's reader: feed() deltas, message() a whole."""

    def __init__(self, tools: Tools | None, include_reasoning: bool) -> None:
        self.tools, self.include = tools, include_reasoning
        self.held = ""  # text not yet read (a marker may be starting)
        self.in_body = False
        self.current = _Message()
        self.calls = 0

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """A delta of text (final: the choice's last) -> its parts, as a delta."""
        self.held += text
        parts: dict[str, Any] = {"reasoning": "", "content": "", "calls": []}
        while self._step(parts, final):
            pass
        if final and not self.in_body and "<|" not in self.current.header:
            parts["content"] += self.current.header  # text written outside the format
            self.current.header = ""
        delta: dict[str, Any] = {}
        if parts["reasoning"] and self.include:
            delta["reasoning_content"] = delta["reasoning"] = parts["reasoning"]
        if parts["content"]:
            delta["content"] = parts["content"]
        if parts["calls"]:
            self.called = True
            delta["tool_calls"] = merge(parts["calls"])
        return delta

    def _step(self, parts: dict[str, Any], final: bool) -> bool:
        """Read what the held text allows; whether there may be more to read."""
        at = self.held.find("<|")
        if at < 0:  # no marker: all of it, but a "<" that may open one
            cut = len(self.held) - (1 if self.held.endswith("<") and not final else 0)
            self._text(self.held[:cut], parts)
            self.held = self.held[cut:]
            return False
        self._text(self.held[:at], parts)
        self.held = self.held[at:]
        marker = next((m for m in HARMONY_MARKERS if self.held.startswith(m)), None)
        if marker is None:
            if not final and any(m.startswith(self.held) for m in HARMONY_MARKERS):
                return False  # too little text to tell
            self._text(self.held[:2], parts)  # a "<|" that opens no marker
            self.held = self.held[2:]
            return True
        self.held = self.held[len(marker) :]
        self._marker(marker, parts)
        return True

    def _marker(self, marker: str, parts: dict[str, Any]) -> None:
        if marker == MESSAGE:
            self._open_body(parts)
        elif marker in ENDS or marker == START:
            self.in_body, self.current = False, _Message()
        elif not self.in_body:  # <|channel|>, <|constrain|>: part of the header
            self.current.header += marker

    def _open_body(self, parts: dict[str, Any]) -> None:
        m = self.current
        channel = _CHANNEL.search(m.header)
        m.channel = channel.group(1) if channel else ""
        recipient = _RECIPIENT.search(m.header)
        m.recipient = recipient.group(1) if recipient else None
        self.in_body = True
        if m.recipient is not None and self.tools is not None:
            m.index = self.calls
            self.calls += 1
            call_id = self.tools.format.call_id()
            parts["calls"].append(call_header(m.index, call_id, m.recipient))

    def _text(self, text: str, parts: dict[str, Any]) -> None:
        if not text:
            return
        m = self.current
        if not self.in_body:
            m.header += text
        elif m.index is not None:
            parts["calls"].append(call_fragment(m.index, text))
        elif m.channel == "analysis":
            parts["reasoning"] += text
        else:  # final, and commentary said to the user
            parts["content"] += text
