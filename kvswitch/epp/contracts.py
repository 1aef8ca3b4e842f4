"""The seams of the endpoint picker, between the request path and the scheduling side.

Request path (ext_proc stream -> parser -> `InferenceRequest`) and scheduling side (flow control,
filters/scorers/pickers, the data layer) meet only through the types here:

    parser.parse(headers, body) -> ParsedBody        (kvswitch.epp.parsers.*)
    router.route(InferenceRequest, subset) -> RoutingDecision
    router.request_finished(InferenceRequest, RequestOutcome)

`kvswitch.epp.config` builds an `EndpointPicker` (parsers + router) from an
EndpointPickerConfig and an InferencePool.

`ParsedBody`, `InferenceRequest` and `RequestOutcome` are read-only for plugins and the router,
but not frozen, because a frozen dataclass's __init__ stores each field through
object.__setattr__, a cost paid on every request. `unsafe_hash` keeps them hashable by value;
derive changed copies with `dataclasses.replace`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from kvswitch.limits import SAMPLING_DEFAULTS, SamplingCounts, SamplingLimits

RequestProtocol = Literal["grpc", "http"]


@dataclass(slots=True, unsafe_hash=True)  # read-only; not frozen: see the module docstring
class ParsedBody:
    """What a parser learned from one request body."""

    model: str | None = None
    """Model name (OpenAI `model`); gRPC requests carry none."""
    prompt_token_ids: Sequence[int] | None = None
    """Token ids when the request is tokenized (gRPC `tokenized`, OpenAI token prompts): a
    `PackedTokenIds` for gRPC (ints built only if read), else a tuple."""
    prompt_text: str | None = None
    """Prompt text when not tokenized (chat messages rendered or concatenated)."""
    stream: bool = False
    max_tokens: int | None = None
    request_id: str | None = None
    """The id the body carries (GenerateRequest.request_id), if any."""
    sampling: SamplingCounts | None = field(default=None, compare=False)
    """The counts the EPP bounds (`EndpointPicker.sampling_limits`); None: nothing to bound.
    Not part of the body's value (equality, hash): only checked once, before routing."""


@runtime_checkable
class Parser(Protocol):
    """Decodes request bodies of the paths it claims. One plugin per module in `epp/parsers/`."""

    name: str

    def matches(self, path: str, content_type: str) -> bool: ...

    def parse(self, path: str, headers: Mapping[str, str], body: bytes) -> ParsedBody:
        """Raise `InvalidRequest` (malformed) or `PayloadTooLarge`; never anything else."""
        ...


@dataclass(slots=True, unsafe_hash=True)  # read-only; not frozen: see the module docstring
class InferenceRequest:
    """One request as the scheduling side sees it."""

    request_id: str
    protocol: RequestProtocol
    path: str
    body: ParsedBody
    objective: str | None = None
    """`x-llm-d-inference-objective`, names an objective (with a priority) from config."""
    fairness_id: str = "default-flow"
    """`x-llm-d-inference-fairness-id`, the tenant."""
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    body_size: int = 0
    received_at: float = 0.0
    """time.monotonic() when the EPP saw the request headers."""
    access_logged: bool = False
    """The gateway said (in metadata a client cannot set) that it logs this request to the EPP:
    its log entry, not its ext_proc stream's close, says how it ended."""
    model: str = ""
    """The model it names: the body's (OpenAI `model`), else `x-gateway-model-name`; "" if
    neither (a gRPC call without the header). The `model` label of the EPP's metrics."""


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Where to send a request, or why not."""

    endpoints: tuple[str, ...] = ()
    """`ip:port` addresses, the pick first and fallbacks after it."""
    status: int = 200
    """200 to route; 503 when nothing is ready or eligible; 429 when flow control sheds."""
    reason: str = ""
    """For `x-llm-d-request-dropped-reason` when status != 200."""


@dataclass(slots=True, unsafe_hash=True)  # read-only; not frozen: see the module docstring
class RequestOutcome:
    """How a routed request ended, as the EPP saw it (response headers/trailers, or the
    gateway's access-log entry)."""

    endpoint: str
    ok: bool
    grpc_status: int | None = None
    http_status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    seen_end: bool = True
    """False: only the ext_proc stream's close was seen, not the response's end (a request
    whose gateway logs it to the EPP is finished by its log entry instead)."""
    duration: float | None = None
    """Seconds, as the gateway measured them (access log); None: the EPP's own clock."""


def response_ok(grpc: bool, grpc_status: int | None, http_status: int | None) -> bool:
    """Whether a response succeeded: gRPC by its grpc-status (the gateway may not show the EPP
    the response headers), HTTP by its status."""
    if grpc:
        return grpc_status == 0 and (http_status is None or http_status < 400)
    return http_status is not None and http_status < 400 and grpc_status in (None, 0)


@runtime_checkable
class Router(Protocol):
    async def start(self) -> None:
        """Start background work (endpoint refresh, KV-event subscriptions)."""

    async def stop(self) -> None: ...

    async def route(
        self, request: InferenceRequest, subset: Sequence[str] | None
    ) -> RoutingDecision:
        """Apply flow control and scheduling. `subset` is the proxy's hint (None: no hint)."""
        ...

    def request_finished(self, request: InferenceRequest, outcome: RequestOutcome) -> None:
        """The response ended (or the stream broke): release in-flight counts, record usage."""
        ...


@dataclass(frozen=True)
class EndpointPicker:
    """Everything the ext_proc server needs, built from config."""

    parsers: Sequence[Parser]
    router: Router
    max_body_bytes: int = 16 * 1024 * 1024
    sampling_limits: SamplingLimits = SAMPLING_DEFAULTS
    """Checked on every parsed body before it is routed (INVALID_ARGUMENT / 400)."""
    replica_name: str = ""
    """Signed on every routed request (`envoy.lb` metadata) when several EPPs share a gateway,
    so its access log sends this EPP the entries of its own requests; empty: not signed."""
