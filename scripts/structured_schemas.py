"""JSON schemas for the structured-output tests: each with what to ask the model for.

They cover what users send: nested objects, arrays with min/maxItems, enums, const, numbers with
bounds, string patterns, anyOf with null, $ref/$defs and additionalProperties false. Strings are
bounded (maxLength, pattern or enum) so that a 135M model at temperature 1 finishes within the
test's max_tokens.
"""

from __future__ import annotations

NAME = {"type": "string", "maxLength": 16}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person with a name and an age", {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("an address", {
        "type": "object",
        "properties": {
            "street": {"type": "string", "maxLength": 24},
            "city": NAME,
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"], "additionalProperties": False}),
    ("a customer with a nested address", {
        "type": "object",
        "properties": {
            "name": NAME,
            "address": {"type": "object",
                        "properties": {"city": NAME, "country": NAME},
                        "required": ["city", "country"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}),
    ("one to three tags", {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False}),
    ("a colour", {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"], "additionalProperties": False}),
    ("a versioned flag", {
        "type": "object",
        "properties": {"version": {"const": 2}, "enabled": {"type": "boolean"}},
        "required": ["version", "enabled"], "additionalProperties": False}),
    ("a temperature reading", {
        "type": "object",
        "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 50},
                       "station": NAME},
        "required": ["celsius", "station"], "additionalProperties": False}),
    ("a phone contact", {
        "type": "object",
        "properties": {"name": NAME, "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
        "required": ["name", "phone"], "additionalProperties": False}),
    ("a user whose nickname may be null", {
        "type": "object",
        "properties": {"name": NAME,
                       "nickname": {"anyOf": [{"type": "string", "maxLength": 10},
                                              {"type": "null"}]}},
        "required": ["name", "nickname"], "additionalProperties": False}),
    ("a line between two points", {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                           "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False}),
    ("a book, its year optional", {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 24},
                       "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
        "required": ["title"], "additionalProperties": False}),
    ("two inventory items", {
        "type": "object",
        "properties": {"items": {
            "type": "array", "minItems": 2, "maxItems": 2,
            "items": {"type": "object",
                      "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                     "kind": {"enum": ["tool", "part"]}},
                      "required": ["id", "kind"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}),
    ("feature switches", {
        "type": "object",
        "properties": {"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"}},
        "required": ["dark_mode", "beta"], "additionalProperties": False}),
    ("a score strictly between 0 and 10", {
        "type": "object",
        "properties": {"score": {"type": "integer", "exclusiveMinimum": 0,
                                 "exclusiveMaximum": 10}},
        "required": ["score"], "additionalProperties": False}),
    ("a small matrix", {
        "type": "object",
        "properties": {"rows": {"type": "array", "minItems": 1, "maxItems": 2,
                                "items": {"type": "array", "minItems": 1, "maxItems": 2,
                                          "items": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False}),
    ("a list of sizes", {
        "type": "array", "minItems": 1, "maxItems": 4,
        "items": {"enum": ["S", "M", "L"]}}),
    ("yes or no", {"type": "string", "enum": ["yes", "no"]}),
    ("a pet, a cat or a dog", {
        "anyOf": [
            {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {
                "type": "integer", "minimum": 1, "maximum": 9}},
             "required": ["kind", "lives"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {
                "type": "boolean"}},
             "required": ["kind", "good"], "additionalProperties": False}]}),
    ("an event on a date", {
        "type": "object",
        "properties": {"event": NAME,
                       "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["event", "date"], "additionalProperties": False}),
    ("a short code and a label", {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 4},
                       "label": {"type": "string", "minLength": 1, "maxLength": 12}},
        "required": ["code", "label"], "additionalProperties": False}),
    ("a priority", {
        "type": "object",
        "properties": {"priority": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["priority"], "additionalProperties": False}),
    ("a deeply nested setting", {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {
            "type": "object", "properties": {"c": {"type": "string", "maxLength": 8}},
            "required": ["c"], "additionalProperties": False}},
            "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False}),
]
