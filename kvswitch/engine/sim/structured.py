"""Structured output in the simulator: the text a constrained request emits (sans-IO).

A request with a constraint (`SamplingOptions.constraint`) emits one fixed text that satisfies
it, then eos; the text is built once per constraint (`StructuredOutput.token_ids`, cached):
- `choice`: the first choice.
- `regex`: the shortest match, built from Python's regex parse tree: literals, classes, `.`,
  `\\d \\w \\s` and their negations, groups, alternation (first branch), repeats (their
  minimum), anchors. Lookarounds and backreferences are refused.
- `json_schema`: an instance of the schema, JSON-encoded. Supported: `type` (one or a list),
  `properties` (all emitted, in order), `items` / `prefixItems` with `minItems` / `maxItems`,
  `enum`, `const`, `anyOf` / `oneOf` (first), `allOf` (merged), local `$ref`, string
  `minLength` / `maxLength` / `pattern` (as a regex above) / common `format`s, and numeric
  `minimum` / `maximum` (exclusive too). Other keywords are ignored.
- `json_object`: `{}`.
`grammar` and `structural_tag` are refused (INVALID_ARGUMENT), as is anything that does not
parse, whose text exceeds `MAX_TEXT_CHARS`, or whose JSON instance exceeds 4,096 values.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

# Python's own regex parser: the tree it builds is what the generator walks.
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

from kvswitch.engine.sim.request import SimSequence
from kvswitch.errors import InvalidRequest

__all__ = ["MAX_TEXT_CHARS", "StructuredOutput", "constrained_text", "force_output"]

MAX_TEXT_CHARS = 16_384
_MAX_DEPTH = 32
_MAX_NODES = 4096
_CACHE_SIZE = 256
_FORMATS = {"date-time": "2024-01-01T00:00:00Z", "date": "2024-01-01", "time": "00:00:00",
            "email": "user@example.com", "uri": "https://example.com/", "hostname": "example.com",
            "uuid": "00000000-0000-4000-8000-000000000000", "ipv4": "127.0.0.1", "ipv6": "::1"}


def _too_long(text: str) -> str:
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidRequest(f"the structured output would exceed {MAX_TEXT_CHARS} characters",
                             param="structured_outputs")
    return text


# -- regex -------------------------------------------------------------------------------------
_CATEGORY = {"CATEGORY_DIGIT": "0", "CATEGORY_NOT_DIGIT": "a", "CATEGORY_SPACE": " ",
             "CATEGORY_NOT_SPACE": "a", "CATEGORY_WORD": "a", "CATEGORY_NOT_WORD": " "}


def _class_char(items: list[tuple[Any, Any]]) -> str:
    """A character of a `[...]` class (the first it allows; for a negated class, a letter or
    digit it leaves out)."""
    negate = bool(items) and str(items[0][0]) == "NEGATE"
    if not negate:
        for op, arg in items:
            name = str(op)
            if name == "LITERAL":
                return chr(arg)
            if name == "RANGE":
                return chr(arg[0])
            if name == "CATEGORY":
                return _CATEGORY.get(str(arg), "a")
        raise InvalidRequest("regex: empty character class", param="regex")
    pattern = re.compile(_unparse_class(items))
    for char in "aA0_ -.xyz":
        if pattern.fullmatch(char):
            return char
    raise InvalidRequest("regex: cannot pick a character for a negated class", param="regex")


def _unparse_class(items: list[tuple[Any, Any]]) -> str:
    parts = []
    for op, arg in items:
        name = str(op)
        if name == "NEGATE":
            parts.append("^")
        elif name == "LITERAL":
            parts.append(re.escape(chr(arg)))
        elif name == "RANGE":
            parts.append(f"{re.escape(chr(arg[0]))}-{re.escape(chr(arg[1]))}")
        elif name == "CATEGORY":
            parts.append({"CATEGORY_DIGIT": r"\d", "CATEGORY_NOT_DIGIT": r"\D",
                          "CATEGORY_SPACE": r"\s", "CATEGORY_NOT_SPACE": r"\S",
                          "CATEGORY_WORD": r"\w", "CATEGORY_NOT_WORD": r"\W"}[str(arg)])
    return "[" + "".join(parts) + "]"


def _walk(tree: Any, depth: int = 0) -> str:
    if depth > _MAX_DEPTH:
        raise InvalidRequest("regex: nested too deeply", param="regex")
    out: list[str] = []
    size = 0
    for op, arg in tree:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(arg))
        elif name == "NOT_LITERAL":
            out.append("a" if chr(arg) != "a" else "b")
        elif name == "ANY":
            out.append("a")
        elif name == "IN":
            out.append(_class_char(list(arg)))
        elif name == "CATEGORY":
            out.append(_CATEGORY.get(str(arg), "a"))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, _, body = arg
            if low > MAX_TEXT_CHARS:
                raise InvalidRequest("regex: a repeat's minimum is too large", param="regex")
            piece = _walk(body, depth + 1)
            if len(piece) * low > MAX_TEXT_CHARS:
                _too_long(" " * (MAX_TEXT_CHARS + 1))
            out.append(piece * low)
        elif name == "SUBPATTERN":
            out.append(_walk(arg[-1], depth + 1))
        elif name == "ATOMIC_GROUP":
            out.append(_walk(arg, depth + 1))
        elif name == "BRANCH":
            out.append(_walk(arg[1][0], depth + 1))
        elif name == "AT":
            out.append("")  # ^ $ \b: the whole text is the match
        else:
            raise InvalidRequest(f"regex: {name.lower()} is not supported by the simulator",
                                 param="regex")
        size += len(out[-1])
        if size > MAX_TEXT_CHARS:
            _too_long(" " * size)
    return "".join(out)


def regex_text(pattern: str) -> str:
    """The shortest text the simulator finds that fully matches `pattern`."""
    try:
        compiled = re.compile(pattern)
        tree = sre_parse.parse(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        raise InvalidRequest(f"invalid regex: {exc}", param="regex") from None
    text = _walk(tree)
    if compiled.fullmatch(text) is None:
        raise InvalidRequest("regex: the simulator cannot build a match for this pattern",
                             param="regex")
    return text


# -- JSON schema -------------------------------------------------------------------------------
def _resolve(root: dict[str, Any], schema: dict[str, Any], depth: int) -> dict[str, Any]:
    ref = schema.get("$ref")
    if not isinstance(ref, str):
        return schema
    parts = ref.removeprefix("#/").split("/") if ref.startswith("#/") else None
    target: Any = root
    for part in parts or ():
        target = target.get(part) if isinstance(target, dict) else None
    if parts is None or not isinstance(target, dict):
        raise InvalidRequest(f"json_schema: cannot resolve $ref {ref!r} (only local refs)",
                             param="json_schema")
    merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return _resolve(root, merged, depth + 1) if depth < _MAX_DEPTH else merged


def _number(schema: dict[str, Any], integer: bool) -> int | float:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    if low is not None:
        value = math.ceil(low) if integer else low
        if "minimum" not in schema and value <= low:
            value = value + 1 if integer else low + 1
    elif high is not None:
        value = min(0, math.floor(high) if integer else high)
        if "maximum" not in schema and value >= high:
            value = value - 1
    else:
        value = 0
    return int(value) if integer else value


def _string(schema: dict[str, Any]) -> str:
    if isinstance(schema.get("pattern"), str):
        return regex_text(schema["pattern"])
    text = _FORMATS.get(schema.get("format", ""), "text")
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    if low > MAX_TEXT_CHARS:
        raise InvalidRequest("json_schema: minLength is too large", param="json_schema")
    text = text + "x" * max(0, low - len(text))
    return text[: int(high)] if isinstance(high, int) else text


_TYPES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "string": _string, "integer": lambda s: _number(s, True),
    "number": lambda s: _number(s, False), "boolean": lambda s: True, "null": lambda s: None}


def _instance(root: dict[str, Any], schema: Any, depth: int, budget: list[int]) -> Any:
    if depth > _MAX_DEPTH:
        raise InvalidRequest("json_schema: nested too deeply", param="json_schema")
    budget[0] -= 1
    if budget[0] < 0:
        raise InvalidRequest(f"json_schema: the instance would have more than {_MAX_NODES} "
                             "values", param="json_schema")
    if schema is True or schema == {}:
        return {}
    if not isinstance(schema, dict):
        raise InvalidRequest("json_schema: a schema must be an object", param="json_schema")
    schema = _resolve(root, schema, 0)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return _instance(root, schema[key][0], depth + 1, budget)
    if isinstance(schema.get("allOf"), list):
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            merged.update(_resolve(root, part, 0) if isinstance(part, dict) else {})
        return _instance(root, merged, depth + 1, budget)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = ("object" if "properties" in schema else
                "array" if "items" in schema or "prefixItems" in schema else "object")
    if kind == "object":
        properties = schema.get("properties") or {}
        return {name: _instance(root, sub, depth + 1, budget) for name, sub in properties.items()}
    if kind == "array":
        prefix = schema.get("prefixItems") or []
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        count = max(low, len(prefix), 1)
        if isinstance(high, int):
            count = min(count, high)
        if count > 1024:
            raise InvalidRequest("json_schema: minItems is too large", param="json_schema")
        items = schema.get("items", {})
        return [_instance(root, prefix[i] if i < len(prefix) else items, depth + 1, budget)
                for i in range(count)]
    make = _TYPES.get(kind)
    if make is None:
        raise InvalidRequest(f"json_schema: unknown type {kind!r}", param="json_schema")
    return make(schema)


def json_schema_text(schema_json: str) -> str:
    try:
        schema = json.loads(schema_json)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past Python's limit
        raise InvalidRequest(f"json_schema is not valid JSON: {exc}", param="json_schema") \
            from None
    root = schema if isinstance(schema, dict) else {}
    return _too_long(json.dumps(_instance(root, schema, 0, [_MAX_NODES]), ensure_ascii=False))


def constrained_text(kind: str, value: str) -> str:
    """The text a request constrained by (kind, value) emits (see the module docstring)."""
    if kind == "choice":
        choices = json.loads(value)
        if not choices:
            raise InvalidRequest("choice needs at least one option", param="choice")
        return _too_long(str(choices[0]))
    if kind == "regex":
        return regex_text(value)
    if kind == "json_schema":
        return json_schema_text(value)
    if kind == "json_object":
        return "{}"
    raise InvalidRequest(f"the simulator does not support {kind} constraints", param=kind)


class StructuredOutput:
    """Constrained texts as token ids, built once per constraint (a bounded cache)."""

    def __init__(self, encode: Callable[[str], list[int]]) -> None:
        self._encode = encode
        self._cache: dict[tuple[str, str], list[int]] = {}

    def token_ids(self, constraint: tuple[str, str]) -> list[int]:
        ids = self._cache.get(constraint)
        if ids is None:
            ids = self._encode(constrained_text(*constraint))
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[constraint] = ids
        return ids


def force_output(seq: SimSequence, token_ids: list[int]) -> None:
    """Make `seq` emit `token_ids` then eos (length and stop rules still apply)."""
    seq.echo = list(token_ids) or None
    if not seq.sampling.ignore_eos:
        seq.planned_len = max(len(token_ids) + 1, seq.sampling.min_tokens + 1)
