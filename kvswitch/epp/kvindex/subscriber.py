"""Thin asyncio loops that feed a `KvBlockIndex` from the engines' `SubscribeKvEvents` streams.

The calls go over `kvswitch.protocol.h2client` (not grpc.aio: no poller thread, no future per
message). Each batch is decoded and applied straight from the connection's `data_received`
(the call's `on_message`), not in a task woken once per read.

`KvEventSubscriber` follows one endpoint over its pool's engine API (`api`, vLLM's or SGLang's;
its connection sends keepalive PINGs, so a silent engine's stream ends within two `KEEPALIVE`
intervals): it reads `GetServerInfo.block_size` (a vLLM engine whose block size differs from the
index's is never indexed: its blocks could not match; an SGLang engine's radix-cache pages are
regrouped into the index's blocks by a `PageRegrouper`, whatever its page size), opens the
stream at `SequenceTracker.resume_from()` (after an engine restart, seen as a new start time
from GetServerInfo's uptime, from an empty index), converts and applies every batch as the tracker
says, resubscribes at once on a gap, and after a dropped stream or a failed call with bounded
exponential backoff (reset once a stream delivers again); an error applying a batch (a bug) is
logged with its traceback, clears the endpoint's index and resubscribes from scratch, backing
off the same way. It keeps the latest
`EngineLoad` record as push-based load telemetry (`load`, and the `on_load` callback), and counts
the records by kind (`batch_loads`, `load_only_records`: the EPP's `kvswitch_epp_load_records`).
With an `on_queued` callback it asks the engine for the prompts of the requests it queues
(`kvswitch.protocol.headers.QUEUED_PROMPTS`) and hands each load push's, in the index's blocks
(an SGLang engine's are cut into them), with the ids of announced requests the push withdraws,
to the callback.

`KvEventSubscriptions` keeps one subscriber per endpoint of a changing endpoint set. With an
`UpstreamTls` the streams run over TLS (mTLS with a client certificate).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

from kvswitch.epp.kvindex.events import (
    EventBatch,
    KvEventBatchView,
    LoadRecord,
    QueuedPrompt,
    batch_from_proto,
)
from kvswitch.epp.kvindex.index import KvBlockIndex
from kvswitch.epp.kvindex.pages import PageRegrouper, whole_blocks
from kvswitch.epp.kvindex.stream import SequenceTracker, Verdict
from kvswitch.protocol import common_pb2
from kvswitch.protocol.engine_apis import engine_api
from kvswitch.protocol.h2client import H2Channel, StreamError
from kvswitch.protocol.headers import QUEUED_PROMPTS
from kvswitch.tls import UpstreamTls, h2_channel_tls

log = logging.getLogger(__name__)

# Seconds two estimates of an engine's start time (now - uptime) may differ by (clock jitter).
RESTART_TOLERANCE = 1.0

LoadCallback = Callable[[str, LoadRecord], None]
QueuedCallback = Callable[[str, tuple[QueuedPrompt, ...], tuple[str, ...]], None]
"""(address, prompts the engine queued, ids of announced requests withdrawn)."""

USER_AGENT = "kvswitch-epp"
KEEPALIVE = 5.0
"""Seconds between HTTP/2 PINGs on a KV-event connection: an engine that stops answering
(half-open TCP) has its stream ended within two intervals instead of never."""


class KvEventSubscriber:
    """Follows one endpoint's KV-event stream into `index` until `stop()`."""

    def __init__(self, address: str, index: KvBlockIndex, *, on_load: LoadCallback | None = None,
                 on_queued: QueuedCallback | None = None,
                 retry_delay: float = 0.1, max_retry_delay: float = 2.0,
                 rpc_timeout: float = 2.0, keepalive: float | None = KEEPALIVE,
                 api: str = "vllm", tls: UpstreamTls | None = None) -> None:
        self.address = address
        self.tls = tls
        """Call the engine over TLS; None: h2c."""
        self.keepalive = keepalive
        self.api = engine_api(api)
        self.pages = PageRegrouper(index.block_size) if api == "sglang" else None
        """SGLang: its pages regrouped into the index's blocks."""
        self.index = index
        self.on_load = on_load
        self.on_queued = on_queued
        self.retry_delay = retry_delay
        self.max_retry_delay = max_retry_delay
        self.rpc_timeout = rpc_timeout
        self.tracker = SequenceTracker()
        self.load: LoadRecord | None = None
        """The latest load record the engine pushed."""
        self.load_at = 0.0
        """time.monotonic() when `load` arrived."""
        self.batch_loads = 0
        """Load records received on event batches."""
        self.load_only_records = 0
        """Load records received alone (heartbeats, load pushes)."""
        self.connected = False
        self.compatible = True
        """False when the engine's block size differs from the index's (never indexed)."""
        self.streams_opened = 0
        self.engine_started_at: float | None = None
        """Wall time the engine started (GetServerInfo uptime), to notice a restart."""
        self._task: asyncio.Task[None] | None = None
        self._delivered = False  # the current stream has delivered a batch
        self._gap = False  # the current stream skipped a batch: resubscribe at once
        self._channel: H2Channel | None = None

    async def start(self) -> None:
        if self._task is None:
            self.index.add_endpoint(self.address)
            self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.address}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    async def _run(self) -> None:
        self._channel = channel = H2Channel.to(self.address, user_agent=USER_AGENT,
                                               keepalive=self.keepalive,
                                               **h2_channel_tls(self.tls))
        delay = self.retry_delay
        while True:
            self._delivered = False
            failed = False
            try:
                if await self._follow(channel):
                    delay = self.retry_delay  # a gap: resubscribe at once
                    continue
            except StreamError as exc:
                log.debug("kv events %s: %s", self.address, exc)
            except Exception:
                # A bug applying a batch: say so, drop what may now be wrong and start over
                # (backing off, since a bug tends to repeat) rather than leave a stale index.
                failed = True
                log.exception("kv events %s: applying a batch failed; its index is cleared "
                              "and the stream reopened in %.1f s", self.address, delay)
                self.tracker.forget()
                self._clear()
            self.connected = False
            if self._delivered and not failed:
                delay = self.retry_delay  # that stream worked: a fresh drop, not a retry
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_retry_delay)

    async def _follow(self, channel: H2Channel) -> bool:
        """One stream, until it ends (False) or skips a sequence number (True)."""
        api = self.api
        info = await channel.unary(api.path("GetServerInfo"), api.server_info_request,
                                   api.parse_server_info, timeout=self.rpc_timeout)
        block_size = api.kv_granularity(info)
        compatible = (self.pages is not None or not block_size
                      or block_size == self.index.block_size)
        if not compatible and self.compatible:
            log.warning("%s: block size %d != index block size %d; not indexed",
                        self.address, block_size, self.index.block_size)
        self.index.set_indexed(self.address, compatible)  # (clears it when not)
        self.compatible = compatible
        self._check_restart(time.time() - info.uptime_seconds)
        start = self.tracker.resume_from()
        request = common_pb2.SubscribeKvEventsRequest(
            start_sequence_number=start, load_records_before_first_batch=True)
        self._gap = False
        self.tracker.stream_opened(start)  # before the call: it may deliver as it starts
        metadata = ((QUEUED_PROMPTS, "1"),) if self.on_queued is not None else ()
        call = await channel.start(api.path("SubscribeKvEvents"), metadata,
                                   request.SerializeToString(), KvEventBatchView.FromString,
                                   on_message=self._receive)
        self.streams_opened += 1
        self.connected = True
        try:
            await call.ended()
        except StreamError:
            if not self._gap:
                raise  # (a gap ends the call as cancelled)
        finally:
            call.cancel()
        return self._gap

    def _receive(self, message: KvEventBatchView) -> bool:
        """One batch, as it arrives; False (end the stream) on a gap."""
        self._delivered = True
        if self.handle(batch_from_proto(message)) is Verdict.GAP:
            self._gap = True
            return False
        return True

    def _check_restart(self, started_at: float) -> None:
        """A new engine life numbers its batches afresh: start over, from an empty index."""
        previous, self.engine_started_at = self.engine_started_at, started_at
        if previous is not None and abs(started_at - previous) > RESTART_TOLERANCE:
            log.info("%s restarted: resynchronising its KV index", self.address)
            self.tracker.forget()
            self._clear()

    def handle(self, batch: EventBatch) -> Verdict:
        """Apply one batch as the tracker says (the loop's only effect on the index)."""
        if batch.load is not None:
            self.load = batch.load
            self.load_at = time.monotonic()
            if batch.load_only:
                self.load_only_records += 1
            else:
                self.batch_loads += 1
            if self.on_load is not None:
                self.on_load(self.address, batch.load)
        if (batch.queued or batch.withdrawn) and self.on_queued is not None and self.compatible:
            queued = batch.queued
            if self.pages is not None:
                size = self.index.block_size
                queued = tuple(QueuedPrompt(q.request_id, whole_blocks(q.blocks, size))
                               if all(q.blocks) else q for q in queued)
            self.on_queued(self.address, queued, batch.withdrawn)
        verdict = self.tracker.receive(batch)
        if verdict is Verdict.RESET:
            self._clear()
        if verdict in (Verdict.APPLY, Verdict.RESET) and self.compatible:
            events = batch.events if self.pages is None else self.pages.regroup(batch.events)
            self.index.apply(self.address, events)
        return verdict

    def _clear(self) -> None:
        self.index.clear(self.address)
        if self.pages is not None:
            self.pages.clear()


class KvEventSubscriptions:
    """One `KvEventSubscriber` per endpoint of a set that changes (discovery)."""

    def __init__(self, index: KvBlockIndex, *, on_load: LoadCallback | None = None,
                 on_queued: QueuedCallback | None = None,
                 api_of: Callable[[str], str] | None = None, tls: UpstreamTls | None = None,
                 **subscriber_options: float) -> None:
        self.index = index
        self.on_load = on_load
        self.on_queued = on_queued
        self.tls = tls
        self.api_of = api_of
        """address -> the engine API it speaks (None: every endpoint speaks vLLM's)."""
        self._options = subscriber_options
        self.subscribers: dict[str, KvEventSubscriber] = {}

    async def set_endpoints(self, addresses: Iterable[str]) -> None:
        wanted = set(addresses)
        for address in [a for a in self.subscribers if a not in wanted]:
            await self.subscribers.pop(address).stop()
            self.index.remove_endpoint(address)
        for address in wanted - self.subscribers.keys():
            subscriber = KvEventSubscriber(address, self.index, on_load=self.on_load,
                                           on_queued=self.on_queued,
                                           api=self.api_of(address) if self.api_of else "vllm",
                                           tls=self.tls, **self._options)  # type: ignore[arg-type]
            self.subscribers[address] = subscriber
            await subscriber.start()

    def loads(self) -> dict[str, LoadRecord]:
        return {a: s.load for a, s in self.subscribers.items() if s.load is not None}

    async def stop(self) -> None:
        for subscriber in self.subscribers.values():
            await subscriber.stop()
        self.subscribers.clear()
