"""precise-prefix-cache-scorer: prefix affinity from the engines' own KV events (exact).

Formula: score(e) = matched_blocks(e) / total_blocks, where matched_blocks(e) is the number of
leading full blocks of the prompt that endpoint e holds *right now* according to its
`SubscribeKvEvents` stream (`kvswitch.epp.kvindex.KvBlockIndex`), and total_blocks the prompt's
full blocks (0 for every endpoint when the prompt has none).
Inputs: the prompt's token ids (`ParsedBody.prompt_token_ids`); text prompts are tokenized here
with the model's tokenizer (parameter `tokenizer`) so they match exactly too. A long text is
tokenized in a worker thread (`kvswitch.tokenization.offload`) as the request's
`RequestPreparer` step, so the event loop goes on routing other requests meanwhile; shorter
texts are tokenized inline in `produce`.
It is also the `DataProducer` of the request's `PrefixMatch` (`state["prefix-index"]`, the shape
the approximate `prefix-cache-scorer` reads), so either scorer can consume it.
Parameters (llm-d's type name):
  blockSize (int, default 16): the engines' KV block size (engines whose GetServerInfo reports
      another size are not indexed).
  tokenizer (str, default "bundled"): "bundled" (Qwen3), a tokenizer directory, or "none"
      (text prompts then score 0 everywhere).
  loadRecordTtl (duration, default 2.5s): how long a pushed `EngineLoad` record keeps the
      endpoint's metrics current (above the engines' 1 s heartbeat).
  speculativeTtl (duration, default 30s; 0 disables): how long the blocks of a request just
      routed to an endpoint count as held there before its KV events confirm them: at least
      as long as a prompt may wait in a saturated engine's queue, so that a repeat of it
      follows it there (it is cached by the time the repeat runs), as a router that records
      what it routed (SGLang's) would send it.
Speculative indexing (llm-d's): an engine reports BlockStored only after the request's prefill
step, so a second request with the same prefix arriving before that would score 0 everywhere
and could land anywhere. As a `PreRequest` hook this plugin therefore adds the prompt's block
hashes for the picked endpoint to the index as speculative entries (`KvBlockIndex.speculate`):
they count in matched_blocks(e) like real ones, become real when the engine's BlockStored
confirms them, and are dropped when the request fails or is cancelled (`ResponseComplete` not
ok: `KvBlockIndex.withdraw`; a success's BlockStored may still be on its way), when unconfirmed
after speculativeTtl (its events were lost), on AllBlocksCleared / a resync, or oldest first past
the index's bound on speculated blocks (`MAX_SPECULATED_BLOCKS`). The prompt's
leading blocks the endpoint already holds (matched_blocks) are not touched: only the rest is
speculated, so a hot prefix costs O(unique suffix blocks) per request.
Queued prompts (several EPPs): another EPP's speculative entries are not in this one's index,
so it asks every engine for the prompts of the requests it queues, announced on the engine's
load push a few ms after each arrival (`KvEventSubscriber.on_queued`; kvswitch's engine sends
them while two or more EPPs follow it). For each prompt not already held there in full (this
EPP's own requests are, speculatively), it does what `pre_request` does for its own: it
speculates the prompt's blocks on that engine and counts their prefill as in progress there, so
a prefix group's next request stays with its first whichever EPP routes it. A later push that
withdraws one (it left the engine before its prefill ended: a client's cancel while queued) ends
that count and drops its speculative blocks at once; the announced prefills are remembered for
this for prefillTtl, at most MAX_ANNOUNCED of them. Unwithdrawn, their blocks expire as
unconfirmed ones do.
Prefill in progress: the same hook counts the request's uncached prompt tokens in the index's
`pending_prefill` for the picked endpoint, less what the blocks the engine stores meanwhile say
is done (a long prompt is prefilled a chunk per step), until the engine stores the prompt's last
full block (`KvBlockIndex.await_prefill`), or prefillTtl (duration, default 30s; 0 disables)
passes; the `PrefixMatch` it produces carries `pending_prefill` (and `prefilling`, the requests
it counts) for estimated-ttft-scorer. As a `ResponseComplete` hook it stops counting a request
when the request ends (`KvBlockIndex.end_prefill`): a short answer can end before the KV-event
batch that stores its last block arrives (batches are coalesced over 50 ms), and its prefill
must not hold its endpoint back from the next request of the conversation meanwhile.
Lifecycle: the router calls `start()` (one HTTP/2 stream per endpoint of the datalayer) and
`stop()`; afterwards subscriptions follow the endpoint set as scheduling cycles see it change.
Push-based load: every `EngineLoad` record on a stream goes into the endpoint's metrics
(`Datalayer.push`, with the record's age: its arrival lag beyond the least lag any record of
that endpoint arrived with, from the batch timestamps, so engine and EPP clocks need not agree;
the datalayer then knows which routed requests it covers), so load scorers and flow control see the
engine's scheduler-step load and the refresher polls GetLoads only rarely while records flow.
"""

from __future__ import annotations

import asyncio
import operator
from collections import OrderedDict
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest, RequestOutcome
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import (
    ConfigError,
    CycleState,
    PluginHandle,
    ProfileResult,
    duration,
    param,
)
from kvswitch.epp.kvindex.events import LoadRecord, QueuedPrompt
from kvswitch.epp.kvindex.hashing import chained_packed_hashes
from kvswitch.epp.kvindex.index import KvBlockIndex, PrefillTicket, Speculation
from kvswitch.epp.kvindex.subscriber import KvEventSubscriber, KvEventSubscriptions
from kvswitch.epp.plugins.prefix_index import STATE_KEY, PrefixMatch, uncached_tokens
from kvswitch.tokenization import TokenizerBundle, load_tokenizer
from kvswitch.tokenization.offload import encode_off_loop, needs_offload

TYPE = "precise-prefix-cache-scorer"
MAX_ANNOUNCED = 65_536  # other EPPs' announced prefills remembered, to end them if withdrawn
_address = operator.attrgetter("address")

TOKENS_KEY = "precise-prefix-cache-scorer/tokens"
"""CycleState key of the token ids `prepare` computed for a text prompt."""


class PrecisePrefixCacheScorer:
    def __init__(self, name: str, index: KvBlockIndex, handle: PluginHandle | None = None,
                 tokenizer: TokenizerBundle | None = None, load_ttl: float = 2.5,
                 speculative_ttl: float = 30.0, prefill_ttl: float = 30.0) -> None:
        self.name = name
        self.index = index
        self.prefill_ttl = prefill_ttl
        self._pending = index.pending
        self._prefilling = index.prefilling
        # request id -> the ticket of the prefill it awaits on its endpoint and the blocks it
        # speculated there, until it ends.
        self._awaited: dict[str, tuple[PrefillTicket | None, Speculation | None]] = {}
        # (endpoint, request id) -> the same for a prefill another EPP routed there, as
        # announced, until a push withdraws it or the ticket's ttl passes.
        self._announced: OrderedDict[tuple[str, str],
                                     tuple[PrefillTicket, Speculation | None]] = OrderedDict()
        self.tokenizer = tokenizer
        self.load_ttl = load_ttl
        self.speculative_ttl = speculative_ttl
        self.subscriptions = KvEventSubscriptions(
            index, on_load=self._pushed_load, on_queued=self._queued, api_of=self._api_of,
            tls=handle.engine_tls if handle is not None else None)
        self._handle = handle
        self._following: frozenset[str] = frozenset()
        # The datalayer version `_following` was last checked against (-1: never).
        self._checked_version = -1
        self._sync: asyncio.Task[None] | None = None
        # endpoint -> least (datalayer clock - record timestamp) seen: the engine clock's offset.
        self._clock_offsets: dict[str, float] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    def _pool(self) -> frozenset[str]:
        if self._handle is None:
            return frozenset()
        return frozenset(map(_address, self._handle.datalayer.all()))

    def _api_of(self, address: str) -> str:
        """The endpoint's engine API (an SGLang pool's pages are regrouped into blocks)."""
        endpoint = self._handle.datalayer.get(address) if self._handle is not None else None
        return getattr(endpoint, "api", "vllm")

    def _follow_pool(self) -> None:
        """Start/stop subscriptions when the pool changed. `produce` calls it only when the
        datalayer's version moved (building the pool's frozenset per request cost ~1-2 us)."""
        if self._handle is None:
            return
        version = self._handle.datalayer.version
        pool = self._pool()
        if pool == self._following:
            self._checked_version = version
            return
        if self._sync is not None and not self._sync.done():
            return  # look again next request, once this sync is done
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # scheduling outside an event loop (tests): nothing to follow
        self._following = pool
        self._checked_version = version
        self._sync = loop.create_task(
            self.subscriptions.set_endpoints(pool), name="kv-events-follow")

    def _pushed_load(self, address: str, load: LoadRecord) -> None:
        if self._handle is None:
            return
        datalayer = self._handle.datalayer
        age = 0.0
        if load.timestamp:
            # The record's age tells the datalayer which routed requests it covers. The engine
            # stamps with its own clock: its offset from ours is taken as the least lag any
            # record of this endpoint arrived with (the fastest delivery counts as instant).
            lag = datalayer.clock() - load.timestamp
            offset = self._clock_offsets.get(address)
            if offset is None or lag < offset:
                offset = self._clock_offsets[address] = lag
            age = lag - offset
        datalayer.push(
            address, running=load.running, waiting=load.waiting, kv_usage=load.token_usage,
            waiting_tokens=load.waiting_uncached_tokens, ttl=self.load_ttl, age=age)

    def _queued(self, address: str, prompts: tuple[QueuedPrompt, ...],
                withdrawn: tuple[str, ...] = ()) -> None:
        """Requests queued on `address` (see the module docstring): speculate the blocks of
        each prompt not held there in full, and count the rest of its prefill there; stop
        counting the withdrawn ones."""
        index = self.index
        announced = self._announced
        for request_id in withdrawn:
            ticket, speculation = announced.pop((address, request_id), (None, None))
            index.end_prefill(ticket)
            index.withdraw(speculation)
        if self.speculative_ttl <= 0:
            return
        now = index.clock()
        while announced and (len(announced) >= MAX_ANNOUNCED
                             or next(iter(announced.values()))[0].until <= now):
            announced.popitem(last=False)  # the oldest: expired in the index too, or over bound
        for prompt in prompts:
            if not all(prompt.blocks):
                continue  # a block sent unpacked (kvswitch.protocol.packed) cannot be hashed
            hashes = chained_packed_hashes(prompt.blocks)
            held = index.match_held(hashes, (address,)).get(address, 0)
            if held >= len(hashes):
                continue
            speculation = index.speculate(address, hashes, self.speculative_ttl, held=held)
            if self.prefill_ttl > 0:
                ticket = index.await_prefill(address, hashes,
                                             (len(hashes) - held) * index.block_size,
                                             self.prefill_ttl, held)
                if ticket is not None:
                    announced[(address, prompt.request_id)] = (ticket, speculation)

    def feed_externally(self, addresses: Sequence[str]) -> dict[str, KvEventSubscriber]:
        """Per address, a subscriber the caller hands decoded batches to itself (a harness
        without I/O, such as the fleet simulator): the plugin then opens no stream for these
        endpoints, and their load records reach the datalayer as a stream's would."""
        self._following = frozenset(addresses)
        if self._handle is not None:
            self._checked_version = self._handle.datalayer.version
        subscribers = {}
        for address in addresses:
            self.index.add_endpoint(address)
            subscribers[address] = KvEventSubscriber(address, self.index,
                                                     on_load=self._pushed_load,
                                                     on_queued=self._queued)
        return subscribers

    async def start(self) -> None:
        self._following = self._pool()
        await self.subscriptions.set_endpoints(self._following)

    async def stop(self) -> None:
        if self._sync is not None:
            await asyncio.gather(self._sync, return_exceptions=True)
        await self.subscriptions.stop()

    # -- scheduling ----------------------------------------------------------------------------

    def prepare(self, request: InferenceRequest,
                state: CycleState) -> Coroutine[Any, Any, None] | None:
        """A long text prompt: tokenize it in a worker thread (None for anything else)."""
        body = request.body
        text = body.prompt_text
        if (body.prompt_token_ids is not None or self.tokenizer is None or not text
                or not needs_offload(text) or TOKENS_KEY in state):
            return None
        return self._tokenize_off_loop(self.tokenizer, text, state)

    @staticmethod
    async def _tokenize_off_loop(tokenizer: TokenizerBundle, text: str,
                                 state: CycleState) -> None:
        state[TOKENS_KEY] = await encode_off_loop(tokenizer, text)

    def _token_ids(self, request: InferenceRequest, state: CycleState) -> Sequence[int] | None:
        body = request.body
        if body.prompt_token_ids is not None:
            return body.prompt_token_ids
        prepared: Sequence[int] | None = state.get(TOKENS_KEY)
        if prepared is not None:
            return prepared
        if body.prompt_text and self.tokenizer is not None:
            return self.tokenizer.encode(body.prompt_text)
        return None

    def produce(self, request: InferenceRequest, state: CycleState,
                endpoints: Sequence[Endpoint]) -> None:
        handle = self._handle
        if handle is not None and handle.datalayer.version != self._checked_version:
            self._follow_pool()
        tokens: Sequence[int] | None = request.body.prompt_token_ids  # usual: no call
        if tokens is None:
            tokens = self._token_ids(request, state)
        hashes = self.index.block_hashes(tokens) if tokens else []
        matched = self.index.match_held(hashes, map(_address, endpoints)) if hashes else {}
        # The prompt's length as its full blocks: counting a packed prompt's tokens walks its
        # bytes (~1.5 us per 1k tokens), and a partial last block is a few tokens of prefill.
        size = self.index.block_size
        state[STATE_KEY] = PrefixMatch(hashes, matched, size, self._pending, len(hashes) * size,
                                       self._prefilling)

    def score(self, request: InferenceRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> list[float]:
        match: PrefixMatch | None = state.get(STATE_KEY)
        if match is None or not match.matched:
            return [0.0] * len(endpoints)  # (a new prefix: no endpoint holds its first block)
        total = len(match.hashes)
        matched = match.matched
        return [matched.get(e.address, 0) / total for e in endpoints]

    def pre_request(self, request: InferenceRequest, state: CycleState,
                    result: ProfileResult) -> None:
        """The picked endpoint will store the prompt's blocks: hold them there speculatively,
        and count its uncached tokens as prefill in progress there until its last is stored."""
        match: PrefixMatch | None = state.get(STATE_KEY)
        if match is None or not match.hashes:
            return
        address = result.endpoints[0].address
        held = match.matched.get(address, 0)
        speculation = ticket = None
        if self.speculative_ttl > 0:
            speculation = self.index.speculate(address, match.hashes, self.speculative_ttl,
                                               held=held)
        if held < len(match.hashes) and self.prefill_ttl > 0:
            ticket = self.index.await_prefill(address, match.hashes,
                                              uncached_tokens(request, match, address),
                                              self.prefill_ttl, held)
        if ticket is not None or speculation is not None:
            self._awaited[request.request_id] = (ticket, speculation)

    def response_complete(self, request: InferenceRequest, outcome: RequestOutcome) -> None:
        """The request ended: its prefill is no longer in progress; if it failed, its
        blocks are not coming either (a success's BlockStored may still be on its way)."""
        ticket, speculation = self._awaited.pop(request.request_id, (None, None))
        self.index.end_prefill(ticket)
        if not outcome.ok:
            self.index.withdraw(speculation)


def create(name: str, parameters: Mapping[str, Any],
           handle: PluginHandle) -> PrecisePrefixCacheScorer:
    block_size = param(parameters, "blockSize", int, 16)
    if block_size < 1:
        raise ConfigError(f"parameters.blockSize: must be >= 1, got {block_size}")
    source = param(parameters, "tokenizer", str, "bundled")
    tokenizer = None
    if source != "none":
        try:
            tokenizer = load_tokenizer(None if source == "bundled" else source)
        except Exception as exc:
            raise ConfigError(f"parameters.tokenizer: {exc}") from exc
    ttl = duration(parameters.get("loadRecordTtl", 2.5), "parameters.loadRecordTtl")
    speculative_ttl = duration(parameters.get("speculativeTtl", 30.0),
                               "parameters.speculativeTtl")
    prefill_ttl = duration(parameters.get("prefillTtl", 30.0), "parameters.prefillTtl")
    index = handle.shared("precise-prefix-index", lambda: KvBlockIndex(block_size))
    if index.block_size != block_size:
        raise ConfigError("parameters.blockSize: every precise-prefix-cache-scorer must share "
                          "one block size")
    return PrecisePrefixCacheScorer(name, index, handle, tokenizer, ttl, speculative_ttl,
                                    prefill_ttl)
