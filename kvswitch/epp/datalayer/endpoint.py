"""Endpoint state: what the EPP knows about one model-server replica.

`Endpoint` is the one mutable record per replica: its address, protocol, the latest metrics
snapshot (polled by a collector, or pushed on the engine's KV-event stream), and the EPP's own
in-flight count. `Datalayer` holds them and answers "which endpoints are ready now": healthy, and
refreshed within the staleness window.

Push-based telemetry: an engine with a KV-event stream pushes an `EngineLoad` record with every
event batch and a heartbeat when quiet (every 1 s). While records keep coming (`live_until`, the
last push plus a TTL above the heartbeat period) the latest record *is* the engine's current
load, so the endpoint counts as fresh however long ago that record arrived; the refresher then
polls only for health, rarely.

Sent, unreported load: a report lags what the EPP has just sent (a burst routed between two
reports would otherwise see the same load and pile onto one replica). Each routed request is
recorded on its endpoint (`Datalayer.record_sent`: its send time and its uncached prompt tokens)
and stays in the endpoint's account (`unreported_requests`, `unreported_tokens`) until a report
that covers it arrives: one the engine sampled at least `transit` seconds (the proxy's hop to
the engine) after the request was sent. A pushed record's sampling time is its arrival minus
its age (the engine's batch timestamp against the wall clock, capped at the record TTL); a
polled one's is when the poll started, or until the request ends (`Datalayer.forget_sent`:
a finished request is no load, and the next report may be up to a KV-event window away). Load
scorers add the account to the reported load. Symmetrically, a request that ends after a report
covered it is counted in `unreported_ends` until a report sampled after its end arrives: the
last report still shows it running (an engine idle after it sends its next record only with
its heartbeat, 1 s later), and load scorers take it off the reported running count. An end is
dated when it happened (the gateway's access log reports it up to a flush interval later), so
an end that a report sampled since already leaves out is not taken off a second time.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

AppProtocol = Literal["http", "kubernetes.io/h2c"]
H2C: AppProtocol = "kubernetes.io/h2c"
HTTP: AppProtocol = "http"


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """An endpoint as discovery reports it."""

    address: str
    """`ip:port`, exactly what goes into `x-gateway-destination-endpoint`."""
    app_protocol: AppProtocol = HTTP
    """`http` (Prometheus `/metrics`) or `kubernetes.io/h2c` (a gRPC engine API)."""
    api: str = "vllm"
    """h2c: the engine API the pool speaks, "vllm" or "sglang" (`kvswitch.protocol.engine_apis`)."""


@dataclass(frozen=True, slots=True)
class Metrics:
    """One successful refresh of an endpoint's load (GetLoads or `/metrics`)."""

    running: int = 0
    """Requests the engine is running (vllm:num_requests_running)."""
    waiting: int = 0
    """Requests in the engine's waiting queue (vllm:num_requests_waiting)."""
    kv_usage: float = 0.0
    """KV-cache utilisation in [0, 1] (vllm:kv_cache_usage_perc)."""
    max_tokens: int = 0
    """KV capacity in tokens (GetLoads max_total_num_tokens, or num_gpu_blocks x block_size)."""
    block_size: int = 0
    """The engine's KV block size; 0 when unknown."""
    updated_at: float = 0.0
    """Datalayer clock (monotonic seconds) of the refresh."""
    waiting_tokens: int = 0
    """Prompt tokens of waiting requests not served from the prefix cache (queued prefill work;
    GetLoads num_waiting_uncached_tokens / EngineLoad waiting_uncached_tokens); 0 if unknown."""


class Endpoint:
    """One replica. Mutated only by the datalayer (metrics, health) and the router (in-flight)."""

    __slots__ = ("address", "api", "app_protocol", "ended", "failures", "healthy", "in_flight",
                 "live_until", "metrics", "sampled_at", "sent", "unreported_ends",
                 "unreported_requests", "unreported_tokens")

    def __init__(self, spec: EndpointSpec) -> None:
        self.address = spec.address
        self.app_protocol: AppProtocol = spec.app_protocol
        self.api = spec.api
        self.metrics = Metrics()
        # Not ready until a collector has succeeded once.
        self.healthy = False
        self.in_flight = 0
        self.failures = 0
        # Datalayer clock until which pushed load records keep the metrics current (0: no push).
        self.live_until = 0.0
        # (datalayer clock at send, uncached prompt tokens) of requests no report covers yet,
        # oldest first.
        self.sent: deque[tuple[float, int]] = deque()
        self.unreported_requests = 0
        """len(sent): requests sent here that no load report covers yet."""
        self.unreported_tokens = 0
        """Uncached prompt tokens of `sent`: prefill work the engine's load does not show yet."""
        # Datalayer clock at the end of requests a report counted and no later report covers,
        # in order.
        self.ended: deque[float] = deque()
        self.sampled_at = float("-inf")
        """Datalayer clock when the engine sampled its latest report."""
        self.unreported_ends = 0
        """len(ended): requests the last report may still count as running, ended since."""

    def fresh(self, now: float, staleness: float) -> bool:
        """Metrics current at `now`: pushed records still flowing, or refreshed recently."""
        return self.live_until >= now or self.metrics.updated_at >= now - staleness

    def __repr__(self) -> str:
        m = self.metrics
        return (f"Endpoint({self.address}, healthy={self.healthy}, running={m.running}, "
                f"waiting={m.waiting}, kv={m.kv_usage:.2f}, in_flight={self.in_flight}, "
                f"unreported={len(self.sent)}/{self.unreported_tokens})")


TRANSIT_SECONDS = 0.005
"""Default `Datalayer.transit`: Envoy's hop to an engine on a local network is ~1 ms."""


def settle(endpoint: Endpoint, sampled_at: float, transit: float) -> None:
    """A report the engine sampled at `sampled_at` arrived: drop from the unreported account
    the requests sent `transit` or more before it (they had reached the engine), and the ends
    at or before it."""
    endpoint.sampled_at = max(endpoint.sampled_at, sampled_at)
    sent = endpoint.sent
    cutoff = sampled_at - transit
    while sent and sent[0][0] <= cutoff:
        endpoint.unreported_tokens -= sent.popleft()[1]
    endpoint.unreported_requests = len(sent)
    ended = endpoint.ended
    if ended:
        while ended and ended[0] <= sampled_at:
            ended.popleft()
        endpoint.unreported_ends = len(ended)


class Datalayer:
    """The set of endpoints and their freshness.

    An endpoint is ready when it is healthy and its last successful refresh is at most
    `staleness` seconds old. Failing or stale endpoints come back on their next good refresh.
    """

    def __init__(self, staleness: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 transit: float = TRANSIT_SECONDS) -> None:
        self.staleness = staleness
        self.clock = clock
        self.transit = transit
        """Seconds from the EPP's pick to the request reaching the engine: a report sampled
        sooner after a send does not count as covering it."""
        self._endpoints: dict[str, Endpoint] = {}
        self._listeners: list[Callable[[str], None]] = []
        self.version = 0
        """Goes up whenever the endpoint set changes, so followers of the set (the precise
        scorer's subscriptions) compare one int per request instead of the set."""

    def set_endpoints(self, specs: Iterable[EndpointSpec]) -> tuple[list[Endpoint], list[str]]:
        """Replace the endpoint set; returns (added endpoints, removed addresses)."""
        wanted = {s.address: s for s in specs}
        removed = [a for a in self._endpoints if a not in wanted]
        for address in removed:
            del self._endpoints[address]
            for listener in self._listeners:
                listener(address)
        added = []
        for address, spec in wanted.items():
            if address not in self._endpoints:
                endpoint = Endpoint(spec)
                self._endpoints[address] = endpoint
                added.append(endpoint)
        if added or removed:
            self.version += 1
        return added, removed

    def on_removed(self, listener: Callable[[str], None]) -> None:
        """Call `listener(address)` when an endpoint leaves the pool (index clean-up)."""
        self._listeners.append(listener)

    def get(self, address: str) -> Endpoint | None:
        return self._endpoints.get(address)

    def all(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def update(self, address: str, metrics: Metrics) -> None:
        """Record a successful refresh."""
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            endpoint.metrics = metrics
            endpoint.healthy = True
            endpoint.failures = 0
            settle(endpoint, metrics.updated_at, self.transit)  # the poll started then

    def record_sent(self, endpoint: Endpoint, uncached_tokens: int) -> tuple[float, int]:
        """The EPP routed a request with this much prefill work to `endpoint` just now; the
        record, for `forget_sent` when the request ends."""
        record = (self.clock(), uncached_tokens)
        endpoint.sent.append(record)
        endpoint.unreported_requests += 1
        endpoint.unreported_tokens += uncached_tokens
        return record

    def forget_sent(self, endpoint: Endpoint, record: tuple[float, int],
                    ended_at: float | None = None) -> None:
        """The request `record_sent` recorded has ended (at `ended_at` on the datalayer clock;
        None: now): drop it from the unreported account if no report has covered it yet (an
        equal record is as good as its own: equal records share a send time, so a report
        covers all of them or none), else count its end until a report sampled after it
        arrives, unless one has already."""
        sent = endpoint.sent
        if sent and record in sent:
            sent.remove(record)
            endpoint.unreported_requests = len(sent)
            endpoint.unreported_tokens -= record[1]
            return
        if ended_at is None:
            ended_at = self.clock()
        if ended_at <= endpoint.sampled_at:
            return  # the latest report no longer counts it
        ended = endpoint.ended
        if ended and ended[-1] > ended_at:
            bisect.insort(ended, ended_at)  # (ends reported late may come out of order)
        else:
            ended.append(ended_at)
        endpoint.unreported_ends = len(ended)

    def push(self, address: str, *, running: int, waiting: int, kv_usage: float,
             waiting_tokens: int | None, ttl: float, age: float = 0.0) -> None:
        """Record a pushed load record (KV-event stream) the engine sampled `age` seconds ago
        (clamped to [0, ttl]). Health stays the collector's call."""
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            return
        now = self.clock()
        settle(endpoint, now - (age if 0.0 <= age <= ttl else min(max(age, 0.0), ttl)),
               self.transit)
        old = endpoint.metrics
        if not 0.0 <= kv_usage <= 1.0:  # (min/max calls cost ~0.35 us per record)
            kv_usage = min(max(kv_usage, 0.0), 1.0)
        # Positional: runs once per KV-event batch, and a frozen dataclass binds them faster.
        endpoint.metrics = Metrics(
            running, waiting, kv_usage, old.max_tokens, old.block_size, now,
            old.waiting_tokens if waiting_tokens is None else waiting_tokens)
        endpoint.live_until = now + ttl

    def mark_failed(self, address: str) -> None:
        """Record a failed refresh or health check: the endpoint is not ready until it recovers."""
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            endpoint.healthy = False
            endpoint.failures += 1

    def ready(self) -> list[Endpoint]:
        """Endpoints eligible for scheduling now."""
        now = self.clock()
        oldest = now - self.staleness
        # `Endpoint.fresh` inlined: one call less per endpoint and request.
        return [e for e in self._endpoints.values()
                if e.healthy and (e.live_until >= now or e.metrics.updated_at >= oldest)]
