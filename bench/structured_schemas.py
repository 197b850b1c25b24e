"""JSON schemas for structured-output tests and the constrained-throughput figure.

A spread of what services send: nested objects, arrays, enums, bounded numbers, required and
optional properties, ``$defs`` references, unions, patterns. ``BOUNDED_SCHEMAS`` keep every
string and number short and every array small, so even a random-weight model finishes them
quickly (a real model finishes the open ones on its own).
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_POINT: Schema = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100},
        "y": {"type": "integer", "minimum": -100, "maximum": 100},
    },
    "required": ["x", "y"],
}

BOUNDED_SCHEMAS: dict[str, Schema] = {
    "nested_object": {
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
            },
        },
        "required": ["name", "address"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 999},
                "label": {"type": "string", "maxLength": 8},
            },
            "required": ["id", "label"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "count": {"enum": [1, 2, 3]},
        },
        "required": ["color", "size", "count"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": 1, "maximum": 10},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "delta": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
        },
        "required": ["score", "ratio", "delta"],
    },
    "required_and_optional": {
        "type": "object",
        "properties": {
            "done": {"type": "boolean"},
            "note": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
            "priority": {"type": "integer", "minimum": 0, "maximum": 5},
        },
        "required": ["done"],
    },
    "defs_refs": {
        "$defs": {"point": _POINT},
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/point"},
            "end": {"$ref": "#/$defs/point"},
        },
        "required": ["start", "end"],
    },
    "union": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"cat": {"type": "string", "maxLength": 8}},
                "required": ["cat"],
            },
            {
                "type": "object",
                "properties": {"dog": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["dog"],
            },
        ]
    },
    "string_array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "maxItems": 4,
            }
        },
        "required": ["tags"],
    },
}

# The same shapes without length limits (what a real model is asked for).
OPEN_SCHEMAS: dict[str, Schema] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string"},
        },
        "required": ["name", "age"],
    },
    "city": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "population": {"type": "integer", "minimum": 0},
        },
        "required": ["city", "country", "population"],
    },
}

ALL_SCHEMAS: dict[str, Schema] = {**BOUNDED_SCHEMAS, **OPEN_SCHEMAS}
