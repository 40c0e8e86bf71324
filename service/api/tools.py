"""Tool calling on /v1/chat/completions in the form the model's chat template teaches it:
Hermes-style (Qwen2.5, Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
one block per call).

Every tool_choice but "none" holds the output to a grammar built from the tools' schemas
(service/engine/structured.py): "required" and a named function to one or more blocks
whose JSON is a call of a given tool with arguments its parameters' schema accepts;
"auto" to any text, in which each block, from its opening marker on, is held the same.

The split of an output into text and calls reads the text alone (as the reasoning split
does): a stream split delta by delta gives the calls and content the whole gives, each
call sent whole (its id, name and arguments in one delta) once its block closes."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from service.api.protocol import APIError
from service.api.reasoning import marker_tail
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

    def template_value(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions.values()]

    def constraint(self) -> Constraint:
        """The grammar the output holds to: for "required" or a named function, one or
        more calls (one where parallel calls are off); for "auto", any text, in which each
        opening marker starts a call held to the same grammar (a lazy lexeme: the text
        ends at the marker's first occurrence)."""
        names = list(self.functions) if self.choice in ("auto", "required") else [self.choice]
        calls = [_call_schema(n, self.functions[n]) for n in names]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = f'"\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
        if self.choice == "auto":
            start = "call* TEXT" if self.parallel else "call | TEXT"
            spec = (
                f"%llguidance {{}}\nstart: {start}\ncall: opening {body}\n"
                f'opening[lazy]: TEXT "{OPEN}"\nTEXT: /(.|\\n)*/\n'
            )
        else:
            more = ' ("\\n" call)*' if self.parallel and self.choice == "required" else ""
            spec = f'start: call{more}\ncall: "{OPEN}" {body}\n'
        if len(spec) > MAX_CONSTRAINT_CHARS:
            raise APIError(400, f"the tools' schemas exceed {MAX_CONSTRAINT_CHARS} characters",
                           param="tools")  # fmt: skip
        return Constraint("grammar", spec, "tools")


def tools_of(raw: list[Any] | None, choice: Any, parallel: bool) -> Tools | None:
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
    return _choose(functions, choice, parallel)


def _choose(functions: dict[str, dict[str, Any]], choice: Any, parallel: bool) -> Tools | None:
    if choice in (None, "auto"):
        return Tools(functions, "auto", parallel)
    if choice == "none":
        return None
    if choice == "required":
        return Tools(functions, "required", parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
        raise APIError(400, "tool_choice must be none, auto, required or a function",
                       param="tool_choice")  # fmt: skip
    if name not in functions:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools",
                       param="tool_choice")  # fmt: skip
    return Tools(functions, name, False)


def _call_schema(name: str, fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# ---- reading the output ---------------------------------------------------------------


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolSplitter:
    """An output's text, delta by delta -> its content and its complete calls."""

    def __init__(self, tools: Tools) -> None:
        self.names = set(tools.functions)
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

    def finish(self) -> str:
        """What is held at the end: an unclosed block's text."""
        held, self.held = self.held, ""
        return held

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
        return {
            "index": index,
            "id": call_id(),
            "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments)},
        }


def split_calls(text: str, tools: Tools) -> tuple[str, list[dict[str, Any]]]:
    splitter = ToolSplitter(tools)
    content, calls = splitter.feed(text)
    return content + splitter.finish(), calls
