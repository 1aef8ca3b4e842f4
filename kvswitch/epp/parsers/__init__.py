"""Request-body parsers, one plugin per module, and the helper that picks one for a request.

Each module exports `TYPE` (the EndpointPickerConfig plugin type) and
`create(name, parameters, handle) -> Parser`. A parser claims paths through `matches()`;
the ext_proc stream asks the configured parsers in order and routes any request no parser
claims without reading its body (as `passthrough-parser` does explicitly).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvswitch.epp.contracts import Parser

__all__ = ["default_parsers", "needs_body", "select_parser"]


def select_parser(parsers: Sequence[Parser], path: str, content_type: str) -> Parser | None:
    """The first parser that claims `path` (query string ignored), or None."""
    bare = path.split("?", 1)[0]
    for parser in parsers:
        if parser.matches(bare, content_type):
            return parser
    return None


def needs_body(parser: Parser | None) -> bool:
    """Whether routing must wait for the body. Parsers may set `needs_body = False`."""
    return parser is not None and bool(getattr(parser, "needs_body", True))


def default_parsers() -> list[Parser]:
    """vllmgrpc, sglanggrpc, openai: what `kvswitch epp` uses when the config names no parsers."""
    from kvswitch.epp.parsers import openai, sglanggrpc, vllmgrpc

    return [vllmgrpc.create("vllmgrpc-parser", {}, None),
            sglanggrpc.create("sglanggrpc-parser", {}, None),
            openai.create("openai-parser", {}, None)]
