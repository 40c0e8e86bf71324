"""Tool calling on /v1/chat/completions in the form the model's chat template teaches it
(service/api/tool_formats.py: Hermes-style blocks, Llama 3's JSON, Mistral's
`[TOOL_CALLS]` array).

Every tool_choice but "none" holds the output to a grammar built from the tools' schemas
(service/engine/structured.py): "required" and a named function to one or more calls of
a given tool with arguments its parameters' schema accepts; "auto" to any text or calls,
each call, from its opening on, held the same.

The split of an output into text and calls reads the text alone (as the reasoning split
does): a stream split delta by delta gives the calls and content the whole gives. A
Hermes call is sent whole (its id, name and arguments in one delta) once its block
closes; Llama 3's and Mistral's calls run to the end of the output and are sent with its
last delta."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from service.api.protocol import APIError
from service.api.reasoning import marker_tail
from service.api.tool_formats import MISTRAL_OPENING, ToolFormat, read_calls
from service.engine.request import Constraint
from service.limits import MAX_CONSTRAINT_CHARS, MAX_TOOLS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Tools:
    """A request's tools (name -> the function object as sent) and what it may call:
    "auto", "required", or one name."""

    functions: dict[str, dict[str, Any]]
    choice: str
    parallel: bool
    format: ToolFormat

    def template_value(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions.values()]

    def constraint(self) -> Constraint:
        """The grammar the output holds to (ToolFormat.grammar)."""
        names = list(self.functions) if self.choice in ("auto", "required") else [self.choice]
        key = self.format.arguments_key
        calls = [_call_schema(n, self.functions[n], key) for n in names]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        spec = self.format.grammar(f"%json {json.dumps(schema)}", self.choice, self.parallel)
        if len(spec) > MAX_CONSTRAINT_CHARS:
            raise APIError(400, f"the tools' schemas exceed {MAX_CONSTRAINT_CHARS} characters",
                           param="tools")  # fmt: skip
        return Constraint("grammar", spec, "tools")


def tools_of(raw: list[Any] | None, choice: Any, parallel: bool, fmt: ToolFormat) -> Tools | None:
    """A request's tools and tool_choice, checked (None: no tools, or tool_choice none)."""
    if not raw:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if len(raw) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools", param="tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}] must be a function tool", param=f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise APIError(400, f"tools[{i}].function.name must match {NAME.pattern}",
                           param=f"tools[{i}].function.name")  # fmt: skip
        if name in functions:
            raise APIError(400, f"tool {name!r} is given twice", param=f"tools[{i}]")
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(400, "parameters must be a JSON Schema object",
                           param=f"tools[{i}].function.parameters")  # fmt: skip
        functions[name] = fn
    return _choose(functions, choice, parallel, fmt)


def _choose(
    functions: dict[str, dict[str, Any]], choice: Any, parallel: bool, fmt: ToolFormat
) -> Tools | None:
    if choice in (None, "auto", "required"):
        return Tools(functions, choice or "auto", parallel, fmt)
    if choice == "none":
        return None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
        raise APIError(400, "tool_choice must be none, auto, required or a function",
                       param="tool_choice")  # fmt: skip
    if name not in functions:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools",
                       param="tool_choice")  # fmt: skip
    return Tools(functions, name, False, fmt)


def _call_schema(name: str, fn: dict[str, Any], key: str) -> dict[str, Any]:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: params},
        "required": ["name", key],
        "additionalProperties": False,
    }


# ---- reading the output ---------------------------------------------------------------


def splitter(tools: Tools) -> ToolSplitter | TailSplitter:
    """The reader of an output's calls in the tools' format."""
    return ToolSplitter(tools) if tools.format.name == "hermes" else TailSplitter(tools)


def _call(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ToolSplitter:
    """A Hermes-style output's text, delta by delta -> its content and complete calls."""

    def __init__(self, tools: Tools) -> None:
        self.names = set(tools.functions)
        self.format = tools.format
        self.held = ""  # text from an opening marker (or the start of one) on
        self.calls = 0
        self.after_call = False  # the newlines after a call's block are not content

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
                break  # a call still being written
            block = self.held[: end + len(CLOSE)]
            self.held = self.held[end + len(CLOSE) :]
            call = self._call(block[len(OPEN) : end])
            if call is None:
                content += block  # not a call of a given tool: text
            else:
                calls.append(call)
                self.after_call = True
        return content, calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is held at the end: an unclosed block's text."""
        held, self.held = self.held, ""
        return held, []

    def _call(self, body: str) -> dict[str, Any] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if not isinstance(arguments, dict):
            return None
        index, self.calls = self.calls, self.calls + 1
        return _call(index, self.format.call_id(), value["name"], json.dumps(arguments))


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
        return "", [_call(i, self.format.call_id(), n, a) for i, (n, a) in enumerate(read)]


def split_calls(text: str, tools: Tools) -> tuple[str, list[dict[str, Any]]]:
    split = splitter(tools)
    content, calls = split.feed(text)
    rest, more = split.finish()
    return content + rest, calls + more
