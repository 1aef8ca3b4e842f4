"""The director: implements `request.Router` over the datalayer, flow control and scheduler.

route(request, subset):
  1. ready endpoints (healthy, fresh); none -> 503 "no ready endpoint"
  2. the proxy's subset hint; nothing ready in it -> 503 "no eligible endpoint in subset"
  3. flow control (priority from the request's InferenceObjective): may queue, or shed (429/503)
  4. the plugins' preparers (e.g. a long text prompt tokenized off the event loop); if they
     waited, the ready endpoints are read again
  5. one scheduling cycle -> the pick and fallbacks; the pick's in-flight count goes up, and
     the datalayer records the request's uncached prompt tokens (the prefix match's, when a
     prefix scorer ran) as sent there and not yet reported
request_finished(): releases the in-flight count and the request's unreported record (a load
  report that came before its end leaves nothing to release), records the outcome (status,
  duration and token usage by model, objective, fairness id and endpoint), lets plugins observe
  (the precise scorer stops counting its prefill in progress).
  A request whose ext_proc stream closed before its response ended (`seen_end` False), from a
  gateway that logs it to the EPP (`InferenceRequest.access_logged`), waits for its log entry:
  request_logged() finishes it then (kvswitch.epp.access_log). It waits at most
  `access_log_wait` seconds, and no longer than the gateway's access-log streams stay open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence

import grpc

from kvswitch.epp.access_log import LoggedEnd
from kvswitch.epp.contracts import InferenceRequest, RequestOutcome, RoutingDecision, response_ok
from kvswitch.epp.datalayer import Datalayer, Endpoint, Refresher
from kvswitch.epp.flowcontrol import FlowGate, Verdict
from kvswitch.epp.framework import CycleState, Lifecycle, Scheduler
from kvswitch.epp.metrics import EppMetrics
from kvswitch.epp.plugins.prefix_index import STATE_KEY as PREFIX_STATE_KEY
from kvswitch.epp.plugins.prefix_index import uncached_tokens

logger = logging.getLogger(__name__)

NO_READY = RoutingDecision(status=503, reason="no ready endpoint")
NO_SUBSET = RoutingDecision(status=503, reason="no eligible endpoint in subset")
FILTERED = RoutingDecision(status=503, reason="no endpoint passed the scheduling filters")
_GRPC_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def _status(request: InferenceRequest, outcome: RequestOutcome) -> str:
    """The `status` label: the gRPC status name for gRPC requests, else the HTTP status."""
    if request.protocol == "grpc" and outcome.grpc_status is not None:
        return _GRPC_STATUS_NAMES.get(outcome.grpc_status, str(outcome.grpc_status))
    if outcome.http_status is not None:
        return str(outcome.http_status)
    return "unknown"


def _in_subset(endpoints: Sequence[Endpoint], subset: Sequence[str]) -> list[Endpoint]:
    allowed = set(subset)
    # Hints may name `ip:port` or just the pod `ip`.
    return [e for e in endpoints
            if e.address in allowed or e.address.rpartition(":")[0] in allowed]


class EppRouter:
    """`request.Router` implementation; build it with `kvswitch.epp.config`."""

    def __init__(self, scheduler: Scheduler, datalayer: Datalayer, gate: FlowGate,
                 refresher: Refresher | None = None, objectives: Mapping[str, int] | None = None,
                 metrics: EppMetrics | None = None, gauge_interval: float = 1.0,
                 lag_interval: float = 0.05, access_log_wait: float = 3600.0) -> None:
        self.scheduler = scheduler
        self._preparers = tuple(scheduler.preparers)
        self.datalayer = datalayer
        self.gate = gate
        self.refresher = refresher
        self.objectives = dict(objectives or {})
        self.metrics = metrics or EppMetrics()
        self.gauge_interval = gauge_interval
        self.lag_interval = lag_interval
        self._lag_max = 0.0
        # Routed, unfinished requests: id -> (endpoint, its `Datalayer.record_sent` record).
        self._routed: dict[str, tuple[Endpoint, tuple[float, int]]] = {}
        self.access_log_wait = access_log_wait
        # Routed requests waiting for their access-log entry: id -> (request, since when).
        self._awaiting_log: dict[str, tuple[InferenceRequest, float]] = {}
        # Entries that came while their request's ext_proc stream was still open (possible when
        # the log and ext_proc streams ride different connections): used at its close.
        self._logged_early: dict[str, LoggedEnd] = {}
        self._access_log_streams = 0
        self._decisions: dict[tuple[Endpoint, ...], RoutingDecision] = {}
        self._gauges: asyncio.Task[None] | None = None
        self._lag: asyncio.Task[None] | None = None

    def _lifecycle_plugins(self) -> list[Lifecycle]:
        # Deduplicated: a plugin may be listed both as configured and as a shared object.
        seen: dict[int, Lifecycle] = {}
        for plugin in self.scheduler.plugins:
            if isinstance(plugin, Lifecycle):
                seen.setdefault(id(plugin), plugin)
        return list(seen.values())

    async def start(self) -> None:
        if self.refresher is not None:
            await self.refresher.start()
        for plugin in self._lifecycle_plugins():
            await plugin.start()
        await self.gate.start()
        self._gauges = asyncio.create_task(self._update_gauges(), name="epp-gauges")
        self._lag = asyncio.create_task(self._watch_lag(), name="epp-loop-lag")

    async def stop(self) -> None:
        for task in (self._gauges, self._lag):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._gauges = self._lag = None
        await self.gate.stop()
        for plugin in reversed(self._lifecycle_plugins()):
            try:
                await plugin.stop()
            except Exception:  # one plugin failing to stop must not keep the others running
                logger.exception("plugin %s failed to stop", getattr(plugin, "name", plugin))
        if self.refresher is not None:
            await self.refresher.stop()

    def _candidates(self, subset: Sequence[str] | None) -> list[Endpoint] | RoutingDecision:
        ready = self.datalayer.ready()
        if not ready:
            return NO_READY
        if subset is not None:
            ready = _in_subset(ready, subset)
            if not ready:
                return NO_SUBSET
        return ready

    async def route(self, request: InferenceRequest,
                    subset: Sequence[str] | None) -> RoutingDecision:
        ready = self.datalayer.ready()  # (what `_candidates` does, inline: one call less)
        candidates = ready if subset is None else _in_subset(ready, subset)
        if not candidates:
            return self._count(request, NO_SUBSET if ready else NO_READY)
        priority = self.objectives.get(request.objective, 0) if request.objective else 0
        if not self.gate.dispatches_now(priority, candidates):
            admitted = await self._admit(request, priority, candidates, subset)
            if isinstance(admitted, RoutingDecision):
                return self._count(request, admitted)
            candidates = admitted
        state: CycleState | None = None
        if self._preparers:  # (inline, not a helper coroutine: this runs for every request)
            state = {}
            waited = False
            for preparer in self._preparers:
                pending = preparer.prepare(request, state)
                if pending is not None:
                    await pending
                    waited = True
            if waited:  # the pool may have changed meanwhile
                again = self._candidates(subset)
                if isinstance(again, RoutingDecision):
                    return self._count(request, again)
                candidates = again
        if state is None:
            state = {}
        started = time.perf_counter()
        result = self.scheduler.schedule(request, candidates, state)
        self.metrics.scheduling_seconds.observe(time.perf_counter() - started)
        if not result.endpoints:
            return self._count(request, FILTERED)
        pick = result.endpoints[0]
        pick.in_flight += 1
        self._routed[request.request_id] = (pick, self.datalayer.record_sent(
            pick, uncached_tokens(request, state.get(PREFIX_STATE_KEY), pick.address)))
        decision = self._decisions.get(result.endpoints)
        if decision is None:
            decision = self._decision(result.endpoints)
        self.metrics.requests.inc((request.model, request.objective or "",
                                   request.fairness_id, pick.address, "200"))
        return decision

    async def _admit(self, request: InferenceRequest, priority: int,
                     candidates: list[Endpoint],
                     subset: Sequence[str] | None) -> list[Endpoint] | RoutingDecision:
        """Flow control when the request may queue or be shed: the candidates to schedule
        among once admitted (read again if it waited), or the rejection."""
        queued_at = time.perf_counter()
        admission = await self.gate.admit(request.fairness_id, priority, candidates)
        if admission.verdict is not Verdict.DISPATCH:
            return RoutingDecision(status=admission.status, reason=admission.reason)
        waited = time.perf_counter() - queued_at
        if waited > 0.0005:
            # It waited: the pool changed meanwhile.
            self.metrics.queue_wait_seconds.observe(waited)
            return self._candidates(subset)
        return candidates

    def _decision(self, endpoints: tuple[Endpoint, ...]) -> RoutingDecision:
        """The decision naming `endpoints`, kept per pick-and-fallbacks tuple: building a
        frozen RoutingDecision per request cost ~1 us."""
        if len(self._decisions) >= 4096:
            self._decisions.clear()  # bounded: large pools have many orderings
        decision = RoutingDecision(endpoints=tuple([e.address for e in endpoints]))
        self._decisions[endpoints] = decision
        # Every endpoint object picked comes here once, with the first tuple it heads: the
        # in-flight gauge reads its count from then on (setting the gauge on every route and
        # finish cost ~0.4 us per request).
        self.metrics.in_flight.show(endpoints[0])
        return decision

    def _count(self, request: InferenceRequest, decision: RoutingDecision) -> RoutingDecision:
        endpoint = decision.endpoints[0] if decision.endpoints else ""
        self.metrics.requests.inc((request.model, request.objective or "",
                                   request.fairness_id, endpoint, str(decision.status)))
        return decision

    def request_finished(self, request: InferenceRequest, outcome: RequestOutcome) -> None:
        if not outcome.seen_end and request.access_logged and request.request_id in self._routed:
            logged = self._logged_early.pop(request.request_id, None)
            if logged is None:  # its gateway will say how it ended: keep it in flight till then
                self._awaiting_log[request.request_id] = (request, time.monotonic())
                return
            outcome = self._logged_outcome(request, logged)
        self._finish(request, outcome)

    # -- access log -------------------------------------------------------------------------

    def request_logged(self, end: LoggedEnd) -> None:
        """The gateway's access-log entry of one request: finish it if it waits for this."""
        waiting = self._awaiting_log.pop(end.request_id, None)
        if waiting is not None:
            request = waiting[0]
            self._finish(request, self._logged_outcome(request, end))
        elif end.request_id in self._routed:  # its ext_proc stream has not closed yet
            if len(self._logged_early) >= 4096:
                self._logged_early.clear()  # bounded; only reordered streams ever land here
            self._logged_early[end.request_id] = end
        # else: not routed by this EPP (answered here, or another gateway's), or ended already

    def _logged_outcome(self, request: InferenceRequest, end: LoggedEnd) -> RequestOutcome:
        routed = self._routed.get(request.request_id)
        usage = end.usage
        return RequestOutcome(
            endpoint=routed[0].address if routed is not None else "",
            ok=response_ok(request.protocol == "grpc", end.grpc_status, end.http_status),
            grpc_status=end.grpc_status,
            http_status=end.http_status,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            cached_tokens=usage.get("cached_tokens"),
            duration=end.duration,
        )

    @property
    def access_log_streams(self) -> int:
        """The gateways' access-log streams open to this EPP."""
        return self._access_log_streams

    def access_log_opened(self) -> None:
        self._access_log_streams += 1

    def access_log_closed(self) -> None:
        """With the gateways' last log stream gone, no entry will come for the requests still
        waiting (their gateway went away or restarted): finish them as they are."""
        self._access_log_streams = max(0, self._access_log_streams - 1)
        if not self._access_log_streams:
            self.stop_waiting()

    def stop_waiting(self, older_than: float | None = None) -> None:
        """Finish (outcome unknown) the requests waiting for a log entry: all, or those waiting
        over `older_than` seconds."""
        now = time.monotonic()
        stale = []
        for request_id, (_, since) in self._awaiting_log.items():  # oldest first
            if older_than is not None and now - since <= older_than:
                break
            stale.append(request_id)
        if stale:
            logger.warning("%d requests ended without an access-log entry", len(stale))
        for request_id in stale:
            request, _ = self._awaiting_log.pop(request_id)
            routed = self._routed.get(request_id)
            self._finish(request, RequestOutcome(
                endpoint=routed[0].address if routed is not None else "", ok=False,
                seen_end=False))

    def _finish(self, request: InferenceRequest, outcome: RequestOutcome) -> None:
        routed = self._routed.pop(request.request_id, None)
        if routed is not None:  # once per routed request
            endpoint, sent = routed
            endpoint.in_flight = max(0, endpoint.in_flight - 1)
            # The gateway's duration (from the request's first byte, just before the EPP saw
            # its headers) dates the end: its log entry arrives up to a flush interval later.
            ended_at = (None if outcome.duration is None else min(
                (request.received_at or sent[0]) + outcome.duration, self.datalayer.clock()))
            self.datalayer.forget_sent(endpoint, sent, ended_at)
            self._record(request, outcome)
        if self.scheduler.response_complete:  # (none in the default profile)
            self.scheduler.finished(request, outcome)
        # A finished request may have made room for queued ones.
        self.gate.pump()

    def _record(self, request: InferenceRequest, outcome: RequestOutcome) -> None:
        m = self.metrics
        model, objective = request.model, request.objective or ""
        labels = (model, objective, request.fairness_id, outcome.endpoint)
        m.finished.inc((model, objective, request.fairness_id, outcome.endpoint,
                        "true" if outcome.ok else "false", _status(request, outcome)))
        if outcome.duration is not None:
            m.request_seconds.observe(outcome.duration, labels)
        elif request.received_at:
            m.request_seconds.observe(time.monotonic() - request.received_at, labels)
        prompt_tokens = outcome.prompt_tokens
        if prompt_tokens is None and outcome.ok and request.body.prompt_token_ids is not None:
            # No usage trailer (e.g. a real vLLM): a tokenized prompt's length is exact.
            prompt_tokens = len(request.body.prompt_token_ids)
        if prompt_tokens:
            m.prompt_tokens.inc(labels, prompt_tokens)
        if outcome.completion_tokens:
            m.completion_tokens.inc(labels, outcome.completion_tokens)
        if outcome.cached_tokens:
            m.cached_tokens.inc(labels, outcome.cached_tokens)

    def in_flight(self) -> dict[str, int]:
        return {e.address: e.in_flight for e in self.datalayer.all()}

    def update_gauges(self) -> None:
        ready = {e.address for e in self.datalayer.ready()}
        pool = self.datalayer.all()
        # Exactly the pool's endpoints have a readiness series: one that left the pool goes.
        self.metrics.endpoint_ready.track(pool, ready)
        # Every pool endpoint has an in-flight series from the first tick (at start), picked or
        # not; one that left the pool keeps it until its requests end.
        self.metrics.in_flight.track(pool)
        self.metrics.endpoint_requests.track(pool)
        self.metrics.ready_endpoints.set(len(ready))
        self.metrics.queue_size.clear()
        for (priority, flow), size in self.gate.queues.sizes().items():
            self.metrics.queue_size.labels(str(priority), flow).set(size)
        self.metrics.loop_lag_max_seconds.set(self._lag_max)
        self._lag_max = 0.0

    async def _watch_lag(self) -> None:
        """Event-loop lag: how late a `lag_interval` sleep wakes up (one timer, ~20 per s)."""
        observe = self.metrics.loop_lag_seconds.observe
        interval = self.lag_interval
        clock = time.perf_counter
        while True:
            due = clock() + interval
            await asyncio.sleep(interval)
            lag = max(0.0, clock() - due)
            observe(lag)
            self._lag_max = max(self._lag_max, lag)

    async def _update_gauges(self) -> None:
        while True:
            self.update_gauges()
            if self._awaiting_log:  # (a lost entry must not hold a request in flight forever)
                self.stop_waiting(self.access_log_wait)
            await asyncio.sleep(self.gauge_interval)
