"""A corpus of JSON Schemas, each with one valid instance: what structured-output tests
sample against (the grammar engines were measured on them too: docs/decisions.md)."""

SCHEMAS: dict[str, tuple[dict, object]] = {
    "nested_object": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 10},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        {"name": "Ada", "address": {"city": "London", "zip": "12345"}},
    ),
    "array_bounds": (
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 6},
                    "minItems": 2,
                    "maxItems": 4,
                }
            },
            "required": ["tags"],
            "additionalProperties": False,
        },
        {"tags": ["red", "green", "blue"]},
    ),
    "enum_and_const": (
        {
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "blue"]},
                "version": {"const": 2},
            },
            "required": ["color", "version"],
            "additionalProperties": False,
        },
        {"color": "green", "version": 2},
    ),
    "any_of": (
        {
            "type": "object",
            "properties": {
                "id": {
                    "anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "null"}]
                },
                "kind": {"anyOf": [{"const": "user"}, {"const": "group"}]},
            },
            "required": ["id", "kind"],
            "additionalProperties": False,
        },
        {"id": 42, "kind": "user"},
    ),
    "string_formats": (
        {
            "type": "object",
            "properties": {
                "when": {"type": "string", "format": "date"},
                "id": {"type": "string", "format": "uuid"},
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            },
            "required": ["when", "id", "code"],
            "additionalProperties": False,
        },
        {"when": "2026-11-23", "id": "123e4567-e89b-12d3-a456-426614174000", "code": "ABC-12"},
    ),
    "number_bounds": (
        {
            "type": "object",
            "properties": {
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                # bounded digits too: a random model's number would go on for ~1,000 tokens
                "score": {"type": "number", "minimum": -1.5, "maximum": 1.5, "multipleOf": 0.25},
                "ok": {"type": "boolean"},
            },
            "required": ["age", "score", "ok"],
            "additionalProperties": False,
        },
        {"age": 37, "score": 0.25, "ok": True},
    ),
    "optional_fields": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 16},
                "subtitle": {"type": "string", "maxLength": 16},
                "pages": {"type": "integer", "minimum": 1, "maximum": 5000},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
        {"title": "Dune", "pages": 412},
    ),
    "array_of_objects": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]{3}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
        {"items": [{"sku": "ab123", "qty": 2}, {"sku": "cd456", "qty": 1}]},
    ),
}
