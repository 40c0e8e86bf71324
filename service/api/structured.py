"""The structured-output parameters of a request, read into one engine Constraint:
OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}), vLLM's `structured_outputs` ({"json" |
"regex" | "choice" | "grammar": ...}) and its older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar`. At most one may be given. Whether the schema, regex
or grammar compiles is the engine's check (a 400 naming the same parameter)."""

from __future__ import annotations

import json
from typing import Any

from service.api.protocol import APIError, SamplingFields
from service.engine.request import Constraint
from service.limits import MAX_CHOICES, MAX_CONSTRAINT_CHARS

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def constraint_of(req: SamplingFields) -> Constraint | None:
    found = [c for c in (_response_format(req), *_structured_outputs(req), *_guided(req)) if c]
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise APIError(
            400, f"give one structured-output constraint, got {names}", param=found[1].param
        )
    if found and len(found[0].spec) > MAX_CONSTRAINT_CHARS:
        raise APIError(400, f"at most {MAX_CONSTRAINT_CHARS} characters", param=found[0].param)
    return found[0] if found else None


def _response_format(req: SamplingFields) -> Constraint | None:
    fmt = req.response_format
    param = "response_format"
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("json_object", "", param)
    if kind != "json_schema":
        raise APIError(
            400, "response_format type must be text, json_object or json_schema", param=param
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise APIError(
            400,
            "json_schema must be an object with a 'schema' object",
            param=f"{param}.json_schema",
        )
    if not isinstance(spec.get("name", ""), str):
        raise APIError(400, "json_schema.name must be a string", param=f"{param}.json_schema")
    return Constraint("json", json.dumps(spec.get("schema", {})), f"{param}.json_schema.schema")


def _structured_outputs(req: SamplingFields) -> list[Constraint]:
    given = req.structured_outputs or {}
    out = []
    for key, value in given.items():
        if value is None:
            continue
        param = f"structured_outputs.{key}"
        if key not in ("json", "regex", "choice", "grammar"):
            raise APIError(
                400, "structured_outputs takes json, regex, choice or grammar", param=param
            )
        out.append(_constraint(key, value, param))
    return out


def _guided(req: SamplingFields) -> list[Constraint]:
    return [
        _constraint(kind, value, name)
        for name, kind in _GUIDED.items()
        if (value := getattr(req, name)) is not None
    ]


def _constraint(kind: str, value: Any, param: str) -> Constraint:
    if kind == "json":
        if isinstance(value, str):  # vLLM accepts the schema as JSON text too
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise APIError(400, f"not valid JSON: {exc}", param=param) from None
        if not isinstance(value, dict):
            raise APIError(400, "must be a JSON Schema object", param=param)
        return Constraint("json", json.dumps(value), param)
    if kind == "choice":
        strings = isinstance(value, list) and all(isinstance(s, str) and s for s in value)
        if not strings or not 0 < len(value) <= MAX_CHOICES:
            raise APIError(
                400, f"must be a list of 1 to {MAX_CHOICES} non-empty strings", param=param
            )
        return Constraint("choice", json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise APIError(400, "must be a non-empty string", param=param)
    return Constraint(kind, value, param)
