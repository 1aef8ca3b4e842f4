"""The real endpoint picker as a fleet router: an EndpointPickerConfig's plugins, in virtual time.

`EppRouter` builds the EPP exactly as `kvswitch epp` does (`kvswitch.epp.config.build_router`:
the configured plugins, scheduler, data layer and flow-control gate) and drives its request path
without I/O:
- routing is `EppRouter.route` itself (flow control, preparers, `Scheduler.schedule`, the
  pre-request hooks that add speculative index entries, the in-flight count); a request that
  flow control queues is held and released when the gate lets it go (`pump` runs when a
  request finishes and on every refresh tick, as the gate's own ticker would);
- a request's end is `EppRouter.request_finished` with its outcome and duration, as kvswitch's
  gateway reports it: in its access-log entry, which Envoy sends with the others buffered since
  its last flush (every `log_flush` seconds, the bootstrap's interval), `kv_delay` later;
- KV events: every batch a replica publishes goes through the engine API's own encoding
  (`kvswitch.engine.kv_events`: protobuf `KvEventBatch` with its `EngineLoad` record), is
  decoded as the EPP decodes it (`KvEventBatchView`, `batch_from_proto`) and handed, `kv_delay`
  seconds after publication, to a `KvEventSubscriber.handle` of every KV-event plugin's index,
  whose load callback is the plugin's own (`Datalayer.push`); a load push (`load_push`, several
  EPPs) goes the same way as the stream's load-only record;
- polling: per endpoint, what `Refresher` does with a gRPC collector: GetLoads (running,
  waiting, KV usage, capacity, uncached waiting tokens) every refresh interval, or every second
  while pushed load records keep the endpoint live.
The data layer, gate and prefix index read the fleet's virtual clock. Not modelled: the
transport (Envoy, ext_proc, HTTP/2), load-only heartbeats (polls keep endpoints ready; load
pushes are modelled), engine restarts and resyncs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvswitch.bench.fleet.routers import FleetContext
from kvswitch.engine.base import EngineLoadSnapshot, KvEventBatchData, QueuedPrompt
from kvswitch.engine.kv_events import batch_events, load_record, queued_events
from kvswitch.envoy.bootstrap import ACCESS_LOG_FLUSH_SECONDS
from kvswitch.epp.config import build_router, load_documents, parse_config, parse_pool, static_pool
from kvswitch.epp.contracts import InferenceRequest, ParsedBody, RequestOutcome, RoutingDecision
from kvswitch.epp.datalayer import Metrics
from kvswitch.epp.kvindex.events import batch_from_proto
from kvswitch.epp.kvindex.subscriber import KvEventSubscriber
from kvswitch.epp.metrics import EppMetrics
from kvswitch.epp.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvswitch.protocol import common_pb2
from kvswitch.protocol.packed import KvEventBatchView

GENERATE_PATH = "/vllm.grpc.engine.VllmEngine/Generate"
PUSH_POLL_INTERVAL = 1.0  # Refresher's default


def _all_plugins(router: Any) -> list[Any]:
    """Every plugin instance of the router's scheduler, once each, in a stable order."""
    scheduler = router.scheduler
    found = [*scheduler.plugins, scheduler.handler]
    for profile in scheduler.profiles.values():
        found += [*profile.filters, *(s for s, _ in profile.scorers), profile.picker]
    unique: dict[int, Any] = {}
    for plugin in found:
        unique.setdefault(id(plugin), plugin)
    return list(unique.values())


class _Stream:
    """One replica's SubscribeKvEvents encoding state (event ids, load samples)."""

    def __init__(self) -> None:
        self.next_event_id = 1
        self.sample = 0
        self.first = True
        self.last_sequence = 0
        """What a load-only record repeats (0 before any batch: the EPP asks for load records
        before the first batch)."""

    def encode(self, batch: KvEventBatchData, block_size: int) -> bytes:
        events = batch_events(batch, block_size, self.next_event_id)
        self.next_event_id += len(events)
        self.sample += 1
        message = common_pb2.KvEventBatch(
            sequence_number=batch.sequence_number, timestamp=batch.timestamp, events=events,
            dp_rank=0)
        if batch.load is not None:
            message.load.CopyFrom(load_record(batch.load, self.sample, load_only=False,
                                              full=self.first))
        self.first = False
        self.last_sequence = batch.sequence_number
        return message.SerializeToString()

    def encode_load_only(self, load: EngineLoadSnapshot, timestamp: float,
                         queued: tuple[QueuedPrompt, ...], block_size: int) -> bytes:
        """`KvEventStream`'s load push (with the queued prompts it asks for)."""
        self.sample += 1
        message = common_pb2.KvEventBatch(sequence_number=self.last_sequence,
                                          timestamp=timestamp, dp_rank=0,
                                          events=queued_events(queued, block_size))
        message.load.CopyFrom(load_record(load, self.sample, load_only=True, full=False))
        return message.SerializeToString()


class EppRouter:
    """An EndpointPickerConfig (path, YAML text, or mapping; None: all defaults) as a router."""

    kv_subscribers = 1

    def __init__(self, config: Path | str | Mapping[str, Any] | None, name: str = "epp",
                 kv_delay: float = 0.002, seed: int = 0,
                 log_flush: float = ACCESS_LOG_FLUSH_SECONDS) -> None:
        self.config = config
        self.name = name
        self.kv_delay = kv_delay
        self.seed = seed
        self.log_flush = log_flush
        """Seconds between the gateway's access-log flushes (0: each end reported at once)."""

    def setup(self, ctx: FleetContext) -> None:
        self.ctx = ctx
        self.addresses = [r.address for r in ctx.replicas]
        self._by_address = {a: i for i, a in enumerate(self.addresses)}
        spec = parse_config(load_documents(self.config, "config")
                            if self.config is not None else [])
        pool = parse_pool(load_documents(static_pool(self.addresses), "pool"))
        router, _ = build_router(spec, pool, EppMetrics())
        self.router = router
        # Pickers draw from their own unseeded Random (`rng`): seed them, so a run repeats.
        for k, plugin in enumerate(_all_plugins(router)):
            if isinstance(getattr(plugin, "rng", None), random.Random):
                plugin.rng = random.Random(self.seed * 1_000 + k)
        dl = router.datalayer
        dl.clock = router.gate.clock = ctx.now
        dl.set_endpoints(pool.endpoints)
        self.interval = router.refresher.interval if router.refresher is not None else 0.05
        self.subscribers: list[dict[str, KvEventSubscriber]] = []
        seen: set[int] = set()
        for plugin in router.scheduler.plugins:
            if not isinstance(plugin, PrecisePrefixCacheScorer) or id(plugin.index) in seen:
                continue
            seen.add(id(plugin.index))
            plugin.index.clock = ctx.now
            self.subscribers.append(plugin.feed_externally(self.addresses))
        self._streams = [_Stream() for _ in self.addresses]
        self._last_poll = [float("-inf")] * len(self.addresses)
        self._requests: dict[int, InferenceRequest] = {}
        self._held: list[tuple[Any, Coroutine[Any, Any, RoutingDecision], Any]] = []
        self._logged: list[tuple[InferenceRequest, RequestOutcome]] = []
        self.rejected = 0
        now = ctx.now()
        for i in range(len(self.addresses)):
            self._tick(i, now)

    # -- the data layer -------------------------------------------------------------------------
    def _poll(self, i: int, now: float) -> None:
        load = self.ctx.replicas[i].load(now)
        self.router.datalayer.update(self.addresses[i], Metrics(
            running=load.running, waiting=load.waiting, kv_usage=load.token_usage,
            max_tokens=load.total_tokens, block_size=load.block_size, updated_at=now,
            waiting_tokens=load.waiting_uncached_tokens))

    def _tick(self, i: int, now: float) -> None:
        endpoint = self.router.datalayer.get(self.addresses[i])
        assert endpoint is not None
        pushed = endpoint.healthy and endpoint.live_until >= now
        if not pushed or now - self._last_poll[i] >= PUSH_POLL_INTERVAL:
            self._last_poll[i] = now
            self._poll(i, now)
        wake = now + self.interval
        if pushed:
            wake = max(wake, min(self._last_poll[i] + PUSH_POLL_INTERVAL, endpoint.live_until))
        if i == 0 and self._held:
            self.router.gate.pump()  # (the gate's ticker: expire queued requests)
            self._resume_held()
        self.ctx.call_at(wake, lambda: self._tick(i, self.ctx.now()))

    def kv_batch(self, replica: int, batch: KvEventBatchData, now: float) -> None:
        if not self.subscribers:
            return
        data = self._streams[replica].encode(batch, self.ctx.profile.block_size)
        self.ctx.call_at(now + self.kv_delay, lambda: self._deliver(replica, data))

    def load_push(self, replica: int, load: EngineLoadSnapshot, now: float,
                  queued: tuple[QueuedPrompt, ...] = ()) -> None:
        if not self.subscribers:
            return
        data = self._streams[replica].encode_load_only(load, now, queued,
                                                       self.ctx.profile.block_size)
        self.ctx.call_at(now + self.kv_delay, lambda: self._deliver(replica, data))

    def _deliver(self, replica: int, data: bytes) -> None:
        event_batch = batch_from_proto(KvEventBatchView.FromString(data))
        address = self.addresses[replica]
        for subs in self.subscribers:
            subs[address].handle(event_batch)

    # -- requests -------------------------------------------------------------------------------
    def route(self, request: Any, now: float) -> int | None:
        body = ParsedBody(prompt_token_ids=tuple(request.prompt_ids),
                          max_tokens=request.max_tokens, request_id=str(request.index))
        inference = InferenceRequest(str(request.index), "grpc", GENERATE_PATH, body,
                                     received_at=now)
        self._requests[request.index] = inference
        coro = self.router.route(inference, None)
        return self._step(request, coro, None)

    def _step(self, request: Any, coro: Coroutine[Any, Any, RoutingDecision],
              dispatch_later: bool | None) -> int | None:
        """Run the routing coroutine until it ends or waits on flow control."""
        try:
            waited_on = coro.send(None)
        except StopIteration as stop:
            decision: RoutingDecision = stop.value
        else:
            self._held.append((request, coro, waited_on))
            return None
        if not decision.endpoints:
            self._requests.pop(request.index, None)
            self.rejected += 1
            self.ctx.reject(request, f"{decision.status} {decision.reason}")
            return None
        replica = self._by_address[decision.endpoints[0]]
        if dispatch_later:
            self.ctx.dispatch(request, replica)
            return None
        return replica

    def _resume_held(self) -> None:
        held, self._held = self._held, []
        for request, coro, future in held:
            if future is not None and hasattr(future, "done") and not future.done():
                self._held.append((request, coro, future))
            else:
                self._step(request, coro, True)

    def first_token(self, request: Any, replica: int, now: float) -> None:
        pass

    def finished(self, request: Any, replica: int, now: float) -> None:
        inference = self._requests.pop(request.index)
        outcome = RequestOutcome(
            endpoint=self.addresses[replica], ok=True, grpc_status=0,
            prompt_tokens=len(request.prompt_ids), completion_tokens=request.max_tokens,
            duration=now - inference.received_at)
        if self.log_flush <= 0:
            self._report_ends([(inference, outcome)])
            return
        if not self._logged:  # Envoy's flush timer is periodic: the next tick after `now`
            flush = math.floor(now / self.log_flush + 1.0) * self.log_flush
            self.ctx.call_at(flush, self._flush_log)
        self._logged.append((inference, outcome))

    def _flush_log(self) -> None:
        logged, self._logged = self._logged, []
        self.ctx.call_at(self.ctx.now() + self.kv_delay, lambda: self._report_ends(logged))

    def _report_ends(self, ends: list[tuple[InferenceRequest, RequestOutcome]]) -> None:
        for inference, outcome in ends:
            self.router.request_finished(inference, outcome)
        if self._held:
            self._resume_held()

    def in_flight(self) -> Sequence[int]:
        return [e.in_flight for e in self.router.datalayer.all()]
