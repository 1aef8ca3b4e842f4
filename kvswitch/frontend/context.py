"""Per-request identity: the request id and the gRPC metadata passed on to the target.

The EPP reads the objective, fairness id and SLO headers from gRPC metadata exactly as it reads
them from HTTP headers, so the frontend forwards them (older `x-gateway-*` names under their
current names), and names the served model in `x-gateway-model-name` (the EPP's `model` label).
With `--user-as-fairness-id` the OpenAI `user` field names the tenant when the client sent no
fairness header.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvswitch.protocol import headers as h

__all__ = ["RequestContext", "new_request_context"]

_FORWARDED = tuple((name, tuple(alias for alias, current in h.ALIASES.items() if current == name))
                   for name in (h.OBJECTIVE, h.FAIRNESS_ID, h.SLO_TTFT_MS, h.SLO_TPOT_MS))
"""(header, its older names) forwarded as gRPC metadata."""
# Request ids: 64 random bits per process + a counter (32 hex digits, like a uuid4's), with no
# urandom syscall per request. Workers are spawned, so each draws its own random half.
_PROCESS_ID = os.urandom(8).hex()
_COUNTER = itertools.count()


@dataclass(frozen=True, slots=True)
class RequestContext:
    request_id: str
    """The engine request id (x-request-id when the client sent one)."""
    metadata: tuple[tuple[str, str], ...]
    created: int


def new_request_context(headers: Mapping[str, str], *, prefix: str, user: str | None,
                        user_as_fairness_id: bool, body_request_id: str | None = None,
                        model: str = "") -> RequestContext:
    """`headers`: the request's HTTP headers (any case); `model`: the served model's name, sent
    as `x-gateway-model-name` (the gRPC request has no field for it)."""
    headers = {name.lower(): value for name, value in headers.items()}  # one pass, then O(1)
    client_id = body_request_id or headers.get(h.REQUEST_ID)
    request_id = f"{prefix}-{client_id or _PROCESS_ID + format(next(_COUNTER), '016x')}"
    metadata: list[tuple[str, str]] = [(h.REQUEST_ID, client_id or request_id)]
    if model and model.isascii() and model.isprintable():  # (what gRPC metadata may carry)
        metadata.append((h.MODEL_NAME, model))
    for name, aliases in _FORWARDED:
        value = headers.get(name)
        if value is None:
            value = next((headers[alias] for alias in aliases if alias in headers), None)
        if value is not None:
            metadata.append((name, value))
    if user_as_fairness_id and user and not any(k == h.FAIRNESS_ID for k, _ in metadata):
        metadata.append((h.FAIRNESS_ID, user))
    return RequestContext(request_id, tuple(metadata), int(time.time()))
