"""The simulator's structured-output texts satisfy their constraints, and refuse what they
cannot build with INVALID_ARGUMENT (InvalidRequest)."""

from __future__ import annotations

import json
import re

import pytest

from kvswitch.engine.sim.structured import MAX_TEXT_CHARS, StructuredOutput, constrained_text
from kvswitch.errors import InvalidRequest


@pytest.mark.parametrize("pattern", [
    r"\d{3}-\d{4}", r"(yes|no)", r"[A-Z][a-z]+ \w+@example\.com", r"^[^0-9]{2,}$",
    r"a.b?c*d+", r"(?P<x>ab)+", r"[^a-z]\S\W\D", r"(?:x|y){2,3}z", r"\bword\b",
])
def test_regex_texts_fully_match(pattern: str) -> None:
    assert re.fullmatch(pattern, constrained_text("regex", pattern))


@pytest.mark.parametrize("pattern", [r"(a)\1", r"(?=a)a", r"(?<!b)a", "(", f"a{{{10**6}}}"])
def test_unsupported_or_bad_regexes_are_refused(pattern: str) -> None:
    with pytest.raises(InvalidRequest):
        constrained_text("regex", pattern)


def test_json_schema_instance() -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 6, "maxLength": 8},
        "age": {"type": "integer", "exclusiveMinimum": 17},
        "score": {"type": "number", "maximum": -1},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 3},
        "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "null"}]},
        "kind": {"$ref": "#/$defs/K"}, "x": {"type": ["null", "boolean"]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "both": {"allOf": [{"properties": {"a": {"const": 1}}}, {"type": "object"}]},
        "when": {"type": "string", "format": "date-time"}},
        "$defs": {"K": {"const": "k"}}}
    value = json.loads(constrained_text("json_schema", json.dumps(schema)))
    assert value == {"name": "textxx", "age": 18, "score": -1, "tags": ["a", "a"],
                     "pair": ["text", None], "kind": "k", "x": True, "either": 0,
                     "both": {"a": 1}, "when": "2024-01-01T00:00:00Z"}
    assert constrained_text("json_object", "true") == "{}"
    assert constrained_text("choice", json.dumps(["b", "a"])) == "b"


@pytest.mark.parametrize(("kind", "value"), [
    ("json_schema", "{"), ("json_schema", json.dumps({"$ref": "https://x/schema"})),
    ("json_schema", json.dumps({"type": "string", "minLength": MAX_TEXT_CHARS + 1})),
    ("json_schema", json.dumps({"type": "array", "minItems": 10**6})),
    ("json_schema", json.dumps({"type": "tuple"})),
    ("json_schema", "[" * 40 + "]" * 40), ("grammar", "root ::= 'a'"),
    ("structural_tag", "{}"), ("choice", "[]"),
])
def test_bad_or_unsupported_constraints_are_refused(kind: str, value: str) -> None:
    with pytest.raises(InvalidRequest):
        constrained_text(kind, value)


def test_deeply_nested_schemas_are_refused() -> None:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidRequest, match="deeply"):
        constrained_text("json_schema", json.dumps(schema))


def test_token_ids_are_cached_per_constraint() -> None:
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return [ord(c) for c in text]

    output = StructuredOutput(encode)
    assert output.token_ids(("regex", "ab")) == [97, 98]
    assert output.token_ids(("regex", "ab")) == [97, 98] and calls == ["ab"]


def test_schemas_that_multiply_into_huge_instances_are_refused() -> None:
    schema: dict[str, object] = {"type": "integer"}
    for _ in range(3):
        schema = {"type": "array", "items": schema, "minItems": 1000}
    with pytest.raises(InvalidRequest, match="more than"):
        constrained_text("json_schema", json.dumps(schema))


def test_nested_regex_repeats_are_bounded() -> None:
    with pytest.raises(InvalidRequest, match="exceed"):
        constrained_text("regex", "((ab){9000}){9000}")
