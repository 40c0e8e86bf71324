"""Tool calling on /v1/chat/completions in the form the model's chat template teaches it
(service/api/tool_formats.py: Hermes-style blocks, Llama 3's JSON, Mistral's
`[TOOL_CALLS]` array).

Every tool_choice but "none" holds the output to a grammar built from the tools' schemas
(service/engine/sample/structured.py): "required" and a named function to one or more calls of
a given tool with arguments its parameters' schema accepts; "auto" to any text or calls,
each call, from its opening on, held the same.

Reading the calls back out of an output: service/api/tool_split.py."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from service.api.protocol import APIError
from service.api.tool_formats import ToolFormat
from service.engine.request import Constraint
from service.limits import MAX_CONSTRAINT_CHARS, MAX_TOOLS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# A call's JSON laid out as templates write it (tojson: ", " and ": "), no other
# whitespace: a model writes its calls as it was trained to, and cannot pad them
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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

    def constraint(self) -> Constraint | None:
        """The grammar the output holds to (ToolFormat.grammar); None where it is free
        (harmony's auto: the model's own channels)."""
        names = list(self.functions) if self.choice in ("auto", "required") else [self.choice]
        if self.format.name == "harmony":
            if self.choice == "auto":
                return None
            return self._checked(self.format.harmony_grammar(self._arguments(names)))
        key = self.format.arguments_key
        calls = [_call_schema(n, key) for n in names]
        defs = {_DEF + n: _rebased(_parameters(self.functions[n]), _DEF + n) for n in names}
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {**one, "$defs": defs, "x-guidance": LAYOUT}
        spec = self.format.grammar(f"%json {json.dumps(schema)}", self.choice, self.parallel)
        return self._checked(spec)

    def _arguments(self, names: list[str]) -> dict[str, str]:
        """Each named tool's arguments as a grammar (`%json {...}` of its parameters)."""
        out = {}
        for n in names:
            schema = {**_parameters(self.functions[n]), "x-guidance": LAYOUT}  # its own root
            out[n] = f"%json {json.dumps(schema)}"
        return out

    def _checked(self, spec: str) -> Constraint:
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
        if (cycle := _ref_cycle(_parameters(fn))) is not None:
            raise APIError(400, f"parameters: {cycle} refers only to references, in a cycle: "
                           "no value can match it", param=f"tools[{i}].function.parameters")  # fmt: skip
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


# Each tool's parameters sit under the grammar's root `$defs` by this prefix and the
# tool's name, so that the references inside them (pydantic's `#/$defs/...`, older
# drafts' `#/definitions/...`, `#` for recursion) still point into their own schema once
# it is nested in a call
_DEF = "tool-"
_DATA = ("const", "enum", "default", "examples")  # values, not schemas: kept as written


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def _call_schema(name: str, key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: {"$ref": f"#/$defs/{_DEF}{name}"}},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _ref_cycle(schema: dict[str, Any]) -> str | None:
    """A local reference whose chain of references-only schemas comes back to itself
    (`A: {$ref: B}, B: {$ref: A}`), which no value matches and a grammar would hold
    to no output at all; None where there is none."""
    for ref in _local_refs(schema):
        seen, at = set(), ref
        while at is not None and at not in seen:
            seen.add(at)
            target = _pointer(schema, at)
            at = target.get("$ref") if isinstance(target, dict) and len(target) == 1 else None
            at = at if isinstance(at, str) and at.startswith("#") else None
        if at is not None:
            return at
    return None


def _local_refs(schema: Any) -> set[str]:
    if isinstance(schema, list):
        return set().union(*(_local_refs(v) for v in schema)) if schema else set()
    if not isinstance(schema, dict):
        return set()
    found = {v for k, v in schema.items() if k == "$ref" and isinstance(v, str) and v[:1] == "#"}
    return found.union(*(_local_refs(v) for k, v in schema.items() if k not in _DATA))


def _pointer(schema: dict[str, Any], ref: str) -> Any:
    """What a local reference (`#/a/b`) points to in `schema` (None: nothing)."""
    at: Any = schema
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(at, dict):
            at = at.get(part)
        elif isinstance(at, list) and part.isdigit() and int(part) < len(at):
            at = at[int(part)]
        else:
            return None
    return at


def _rebased(schema: Any, name: str) -> Any:
    """A copy of a schema whose local references (`#...`) point to where it now sits,
    under the root's `$defs[name]`."""
    if isinstance(schema, list):
        return [_rebased(v, name) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA else _rebased(v, name) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = f"#/$defs/{name}{ref[1:]}"
    return out
