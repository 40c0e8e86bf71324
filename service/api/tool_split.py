"""An output's text -> its content and its tool calls (the request's Tools: their names
and format), read from the text alone, as the reasoning split is: a stream split delta
by delta gives the calls and content the whole text gives.

Calls come as OpenAI's `tool_calls` delta entries: a call's first entry has its `index`,
`id`, `type` and name, the entries after it more of its `arguments` text, so the
fragments add up to the whole response's arguments. A Hermes call is streamed as it is
written (its arguments the model's own text, never re-serialized): its header once
`{"name": "...", "arguments":` is read, then its arguments as they grow (a call cut by
max_tokens keeps what was written, as OpenAI's responses do). Llama 3's and Mistral's
calls run to the end of the output and come, whole, with its last delta (their
arguments parsed and written back as JSON). Text that is not a call of a given tool
stays content."""

from __future__ import annotations

import json
import re
from typing import Any

from service.api.reasoning import marker_tail
from service.api.tool_formats import MISTRAL_OPENING, read_calls
from service.api.tools import CLOSE, OPEN, Tools

# the start of a Hermes block's JSON, up to its arguments' value
HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)


def splitter(tools: Tools) -> ToolSplitter | TailSplitter:
    """The reader of an output's calls in the tools' format."""
    return ToolSplitter(tools) if tools.format.name == "hermes" else TailSplitter(tools)


def call_header(index: int, call_id: str, name: str, arguments: str = "") -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def call_fragment(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


class ValueScan:
    """Where the JSON object or array a text begins with ends, read as the text grows
    (each character once: a long call's arguments cost no more per delta than a short
    one's). The text is a grammar's, or checked by a parse once its block closes."""

    def __init__(self) -> None:
        self.pos, self.depth, self.in_string, self.escaped = 0, 0, False, False
        self.end: int | None = None

    def scan(self, text: str) -> int | None:
        """The value's end in text (which extends the text scanned before), or None."""
        while self.end is None and self.pos < len(text):
            ch = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos
        return self.end


class ToolSplitter:
    """A Hermes-style output, delta by delta -> its content and call entries."""

    def __init__(self, tools: Tools) -> None:
        self.names = set(tools.functions)
        self.format = tools.format
        self.held = ""  # text from an opening marker (or the start of one) on
        self.calls = 0
        self.after_call = False  # the newlines after a call's block are not content
        # the streamed call: its index, where its arguments start in held, how much of
        # them was sent, and the scan for their end
        self.open: tuple[int, int, int, ValueScan] | None = None

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content, calls = "", []
        self.held += text
        while self.held:
            if self.after_call:
                self.held = self.held.lstrip("\n")
                self.after_call = not self.held
                continue
            start = self.held.find(OPEN)
            if start < 0:
                keep = marker_tail(self.held, OPEN)
                content += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                break
            content += self.held[:start]
            self.held = self.held[start:]
            end = self.held.find(CLOSE)
            if end < 0:
                calls += self._stream()  # a call still being written
                break
            block, self.held = self.held[: end + len(CLOSE)], self.held[end + len(CLOSE) :]
            entries = self._close(block)
            if entries is None:
                content += block  # not a call of a given tool: text
            else:
                calls += entries
                self.after_call = True
        return content, calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is held at the end: a cut call's (its entries were sent), else text."""
        held, self.held = self.held, ""
        if self.open is not None:
            self.open = None
            return "", []
        return held, []

    def _stream(self) -> list[dict[str, Any]]:
        """The entries of the open block's call so far: its header once read, then the
        arguments written since the last entry."""
        out = []
        if self.open is None:
            m = HEADER.match(self.held, len(OPEN))
            if m is None or m.group(1) not in self.names:
                return []
            self.open = (self._next_index(), m.end(), 0, ValueScan())
            out.append(call_header(self.open[0], self.format.call_id(), m.group(1)))
        index, at, sent, scan = self.open
        args = self.held[at:]
        end = scan.scan(args)
        args = args[:end] if end is not None else args
        if len(args) > sent:
            out.append(call_fragment(index, args[sent:]))
            self.open = (index, at, len(args), scan)
        return out

    def _close(self, block: str) -> list[dict[str, Any]] | None:
        """A closed block's entries (what of its call was not sent); None: not a call of
        a given tool (a block whose header was streamed is one: its grammar held it)."""
        m = HEADER.match(block, len(OPEN))
        end = ValueScan().scan(block[m.end() :]) if m is not None else None
        args = block[m.end() : m.end() + end] if m is not None and end is not None else ""
        streamed, self.open = self.open, None
        if streamed is not None:
            index, _, sent, _ = streamed
            return [call_fragment(index, args[sent:])] if len(args) > sent else []
        if m is None or not self._is_call(block[len(OPEN) : -len(CLOSE)], m.group(1)):
            return None
        return [call_header(self._next_index(), self.format.call_id(), m.group(1), args)]

    def _is_call(self, body: str, name: str) -> bool:
        try:
            value = json.loads(body)
        except ValueError:
            return False
        arguments = (
            value.get("arguments", value.get("parameters")) if isinstance(value, dict) else None
        )
        return name in self.names and value.get("name") == name and isinstance(arguments, dict)

    def _next_index(self) -> int:
        index, self.calls = self.calls, self.calls + 1
        return index


class TailSplitter:
    """A Llama 3 JSON or Mistral output, delta by delta -> its content and, at its end,
    its calls: from the opening (Llama 3: a "{" that begins the output; Mistral: the
    [TOOL_CALLS] token) on, the text is held and read whole when the output ends."""

    def __init__(self, tools: Tools) -> None:
        self.names = set(tools.functions)
        self.format = tools.format
        self.held = ""
        self.state = "start"  # then "content" (no calls), or "calls" (held to the end)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.held += text
        if self.state == "start":
            if self.format.name == "llama3_json":
                if not self.held.strip():
                    return "", []
                self.state = "calls" if self.held.lstrip().startswith("{") else "content"
            else:
                at = self.held.find(MISTRAL_OPENING)
                if at >= 0:
                    content, self.held = self.held[:at], self.held[at:]
                    self.state = "calls"
                    return content, []
                keep = marker_tail(self.held, MISTRAL_OPENING)
                content = self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                return content, []
        if self.state == "content":
            content, self.held = self.held, ""
            return content, []
        return "", []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        held, self.held = self.held, ""
        if self.state != "calls":
            return held, []
        body = held.removeprefix(MISTRAL_OPENING) if self.format.name == "mistral" else held
        read = read_calls(self.format, body, self.names)
        if read is None:
            return held, []  # not calls of given tools: text
        return "", [call_header(i, self.format.call_id(), n, a) for i, (n, a) in enumerate(read)]


def merge(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Call entries (headers and fragments) -> one whole call per index."""
    calls: dict[int, dict[str, Any]] = {}
    for e in entries:
        if e["index"] not in calls:
            calls[e["index"]] = json.loads(json.dumps(e))  # a copy
        else:
            calls[e["index"]]["function"]["arguments"] += e["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def split_calls(text: str, tools: Tools) -> tuple[str, list[dict[str, Any]]]:
    """A whole output's content and its whole calls."""
    split = splitter(tools)
    content, calls = split.feed(text)
    rest, more = split.finish()
    return content + rest, merge(calls + more)
