"""Flow control, sans-IO: admission, per-flow queues, priority then fairness, shedding.

Model (after upstream's flow control, kept small):
- A flow is (priority, fairness_id). Priority comes from the request's InferenceObjective
  (default 0); priority < 0 means sheddable.
- Saturation (upstream "saturation detection"): the pool is saturated when EVERY eligible
  endpoint has waiting >= queueDepthThreshold or kv_usage >= kvCacheUtilThreshold. For
  shedding sheddable requests only, an endpoint whose metrics are older than
  metricsStalenessThreshold (upstream's 200 ms) also counts as saturated: shed when unsure.
  Readiness has its own, longer threshold (`dataLayer.stalenessThreshold`), so slow refreshes
  under CPU contention never turn into 503s for everyone.
- admit(): not saturated and nothing queued -> dispatch at once. Saturated and sheddable ->
  reject 429. Otherwise queue in the flow's FIFO (bounded: full -> 429); with queueing off
  (upstream's legacy admission, flowControl feature gate unset) dispatch instead.
- release(slack): dispatch up to `slack` queued items, highest priority first; within a priority,
  flows take turns (round-robin), or each flow takes `weight` turns in a row (weighted).
  The caller computes slack from endpoint headroom (see `headroom`).
- expire(now): items queued longer than maxWait leave with 503.
Nothing here does I/O or reads a clock; the asyncio wrapper (`gate.py`) drives it.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvswitch.epp.datalayer import Endpoint


@dataclass(frozen=True, slots=True)
class SaturationConfig:
    """When the pool counts as saturated (upstream `saturationDetector`)."""

    queue_depth_threshold: int = 5
    """An endpoint with this many waiting requests is saturated (upstream default 5)."""
    kv_cache_util_threshold: float = 0.8
    """An endpoint with this KV usage is saturated (upstream default 0.8)."""
    metrics_staleness: float = 0.2
    """Seconds after which an endpoint's metrics are stale: it then counts as saturated when
    deciding whether to shed a sheddable request (and only then; readiness uses
    `dataLayer.stalenessThreshold`)."""


@dataclass(frozen=True, slots=True)
class FlowControlConfig:
    """Per-flow queue limits and the fairness policy."""

    max_queued_per_flow: int = 1000
    """Requests one flow may have queued; more are rejected with 429."""
    max_wait: float = 30.0
    """Seconds a request may wait in a queue before it is rejected with 503."""
    fairness: str = "round-robin"
    """"round-robin" or "weighted" between the flows of one priority."""
    fairness_weights: Mapping[str, int] = field(default_factory=dict)
    """fairness_id -> consecutive turns (weighted fairness); absent ids weigh 1."""


def endpoint_saturated(e: Endpoint, cfg: SaturationConfig, now: float | None = None) -> bool:
    """By load; with `now`, stale metrics (older than metrics_staleness) count as saturated."""
    m = e.metrics
    if m.waiting >= cfg.queue_depth_threshold or m.kv_usage >= cfg.kv_cache_util_threshold:
        return True
    return now is not None and not e.fresh(now, cfg.metrics_staleness)


def is_saturated(endpoints: Sequence[Endpoint], cfg: SaturationConfig,
                 now: float | None = None) -> bool:
    """Every endpoint saturated (see `endpoint_saturated`; pass `now` when deciding to shed)."""
    # A loop, not all(<generator>), with `endpoint_saturated` inlined: asked on every
    # request, usually answered by the first endpoint.
    queue_depth, kv_usage = cfg.queue_depth_threshold, cfg.kv_cache_util_threshold
    for e in endpoints:
        m = e.metrics
        if (m.waiting < queue_depth and m.kv_usage < kv_usage
                and (now is None or e.fresh(now, cfg.metrics_staleness))):
            return False
    return True


def headroom(endpoints: Sequence[Endpoint], cfg: SaturationConfig) -> int:
    """Requests the pool can take before saturating: queue slots left on unsaturated endpoints."""
    return sum(cfg.queue_depth_threshold - e.metrics.waiting
               for e in endpoints if not endpoint_saturated(e, cfg))


class Verdict(enum.Enum):
    DISPATCH = "dispatch"
    QUEUED = "queued"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class Admission:
    """What flow control decided about one request."""

    verdict: Verdict
    status: int = 200
    """429 or 503 when rejected."""
    reason: str = ""
    """For `x-llm-d-request-dropped-reason`."""


DISPATCH = Admission(Verdict.DISPATCH)
QUEUED = Admission(Verdict.QUEUED)
SHED = Admission(Verdict.REJECTED, 429, "pool saturated: sheddable request shed")
QUEUE_FULL = Admission(Verdict.REJECTED, 429, "flow control queue full")
EXPIRED = Admission(Verdict.REJECTED, 503, "flow control queue wait exceeded maxWait")


@dataclass(slots=True)
class _Item:
    key: int
    enqueued_at: float


class _Band:
    """The flows of one priority, taking turns."""

    def __init__(self) -> None:
        self.flows: OrderedDict[str, deque[_Item]] = OrderedDict()
        self.turns = 0

    def pop(self, weights: Mapping[str, int]) -> _Item:
        flow_id, queue = next(iter(self.flows.items()))
        item = queue.popleft()
        self.turns += 1
        if not queue:
            del self.flows[flow_id]
            self.turns = 0
        elif self.turns >= weights.get(flow_id, 1):
            self.flows.move_to_end(flow_id)
            self.turns = 0
        return item


class FlowQueues:
    def __init__(self, config: FlowControlConfig | None = None, queueing: bool = True) -> None:
        self.config = config or FlowControlConfig()
        # Without queueing (upstream's flowControl feature gate off) only shedding applies.
        self.queueing = queueing
        weighted = self.config.fairness == "weighted"
        self._weights: Mapping[str, int] = self.config.fairness_weights if weighted else {}
        self._bands: dict[int, _Band] = {}
        self._where: dict[int, tuple[int, str]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def admit(self, key: int, flow_id: str, priority: int, saturated: bool,
              now: float) -> Admission:
        if not saturated and not self._where:
            return DISPATCH
        if saturated and priority < 0:
            return SHED
        if not self.queueing:
            return DISPATCH
        band = self._bands.setdefault(priority, _Band())
        queue = band.flows.setdefault(flow_id, deque())
        if len(queue) >= self.config.max_queued_per_flow:
            if not queue:
                del band.flows[flow_id]
            return QUEUE_FULL
        queue.append(_Item(key, now))
        self._where[key] = (priority, flow_id)
        return QUEUED

    def release(self, slack: int) -> list[int]:
        """Up to `slack` queued keys to dispatch now, by priority then fairness."""
        out: list[int] = []
        for priority in sorted(self._bands, reverse=True):
            band = self._bands[priority]
            while band.flows and len(out) < slack:
                item = band.pop(self._weights)
                del self._where[item.key]
                out.append(item.key)
            if not band.flows:
                del self._bands[priority]
            if len(out) >= slack:
                break
        return out

    def expire(self, now: float) -> list[int]:
        """Keys that waited longer than max_wait (removed from their queues)."""
        deadline = now - self.config.max_wait
        out: list[int] = []
        for band in self._bands.values():
            for queue in band.flows.values():
                while queue and queue[0].enqueued_at < deadline:
                    key = queue.popleft().key
                    del self._where[key]
                    out.append(key)
        self._prune()
        return out

    def remove(self, key: int) -> None:
        """Forget a queued key (its request was cancelled)."""
        where = self._where.pop(key, None)
        if where is None:
            return
        band = self._bands[where[0]]
        queue = band.flows[where[1]]
        for item in queue:
            if item.key == key:
                queue.remove(item)
                break
        self._prune()

    def _prune(self) -> None:
        for priority in list(self._bands):
            band = self._bands[priority]
            for flow_id in [f for f, q in band.flows.items() if not q]:
                del band.flows[flow_id]
            if not band.flows:
                del self._bands[priority]

    def sizes(self) -> dict[tuple[int, str], int]:
        """(priority, fairness_id) -> queued requests."""
        return {(p, f): len(q) for p, band in self._bands.items() for f, q in band.flows.items()}
