"""`passthrough-parser`: claims every path and reads no body.

Requests it claims are routed as soon as their headers arrive (with an empty `ParsedBody`) and
their body is streamed through untouched, so it belongs last in `requestHandler.parsers`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvswitch.epp.contracts import ParsedBody

__all__ = ["TYPE", "PassthroughParser", "create"]

TYPE = "passthrough-parser"

_EMPTY = ParsedBody()


class PassthroughParser:
    needs_body = False
    """Route on headers; the ext_proc stream never buffers the body."""

    def __init__(self, name: str = TYPE) -> None:
        self.name = name

    def matches(self, path: str, content_type: str) -> bool:
        return True

    def parse(self, path: str, headers: Mapping[str, str], body: bytes) -> ParsedBody:
        return _EMPTY


def create(name: str, parameters: Mapping[str, Any], handle: Any) -> PassthroughParser:
    return PassthroughParser(name)
