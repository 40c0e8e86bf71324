"""A chat choice's generated text -> what the response says: a reasoning model's thinking
(service/api/reasoning.py), the answer's content and its tool calls (service/api/tools.py).
One reader per choice, fed the whole text (a response) or delta by delta (a stream): the
same splits, so the parts a stream sends add up to the whole."""

from __future__ import annotations

from typing import Any

from service.api.reasoning import ReasoningSplitter
from service.api.tool_split import merge, splitter
from service.api.tools import Tools


class MessageReader:
    """What a chat choice's reader gives: deltas as its text arrives (feed), the finish
    reason, the whole text's message. Subclasses read one output format."""

    called = False  # a call was read: the choice finishes with tool_calls

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        raise NotImplementedError

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.called else reason

    def message(self, text: str) -> dict[str, Any]:
        """The whole text's assistant message."""
        parts = self.feed(text, final=True)
        message: dict[str, Any] = {"role": "assistant", "content": parts.get("content", "")}
        if "reasoning" in parts:
            message["reasoning_content"] = message["reasoning"] = parts["reasoning"]
        if "tool_calls" in parts:
            message["content"] = parts.get("content")  # OpenAI: null beside the calls
            message["tool_calls"] = [
                {k: v for k, v in c.items() if k != "index"} for c in parts["tool_calls"]
            ]
        return message


class ChoiceReader(MessageReader):
    def __init__(self, thinking: bool | None, tools: Tools | None, include_reasoning: bool):
        """thinking: None for a model that does not reason, else whether the prompt left
        its think block open; tools: the request's (None: calls are not read)."""
        self.reasoning = ReasoningSplitter(thinking) if thinking is not None else None
        self.include = include_reasoning
        self.tools = splitter(tools) if tools is not None else None

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """A delta of text (final: the choice's last) -> its parts, as a delta: thinking
        in reasoning_content and reasoning (both names clients read), content, and the
        tool-call entries written in it (service/api/tool_split.py)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                r, c = self.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                rest, more = self.tools.finish()
                content, calls = content + rest, calls + more
        delta: dict[str, Any] = {}
        if reasoning and self.include:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            self.called = True
            delta["tool_calls"] = merge(calls)  # one entry per call
        return delta
