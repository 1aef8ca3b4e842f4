"""session-affinity-scorer: keep a session on the endpoint that served it before.

Formula: score(e) = 1 if e is the session's endpoint else 0.
Inputs: the request header `headerName` (default `x-session-token`), holding the endpoint's
`ip:port` either plainly or base64-encoded (upstream encodes it). The scorer also remembers, per
token, where the last request of the session went, so clients may send any stable token.
Parameters: headerName (str), maxSessions (int, default 100000; oldest forgotten first).
"""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import CycleState, PluginHandle, ProfileResult, param
from kvswitch.protocol.headers import SESSION_TOKEN

TYPE = "session-affinity-scorer"


def _decode(token: str) -> str:
    try:
        return base64.b64decode(token, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return token


class SessionAffinityScorer:
    def __init__(self, name: str, header: str, max_sessions: int) -> None:
        self.name = name
        self.header = header
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def score(self, request: InferenceRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> list[float]:
        token = request.headers.get(self.header)
        if not token:
            return [0.0] * len(endpoints)
        target = self._sessions.get(token) or _decode(token)
        return [1.0 if e.address == target else 0.0 for e in endpoints]

    def pre_request(self, request: InferenceRequest, state: CycleState,
                    result: ProfileResult) -> None:
        token = request.headers.get(self.header)
        if token:
            self._sessions[token] = result.endpoints[0].address
            self._sessions.move_to_end(token)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)


def create(name: str, parameters: Mapping[str, Any],
           handle: PluginHandle) -> SessionAffinityScorer:
    return SessionAffinityScorer(name, param(parameters, "headerName", str, SESSION_TOKEN),
                                 param(parameters, "maxSessions", int, 100_000))
