"""estimated-ttft-scorer: prefix-cache affinity and load in one number, the prefill work ahead.

A prefix hit on an overloaded replica is not a win: what a request waits for is the prefill
work queued ahead of it plus its own uncached prefill. Per endpoint e, in prompt tokens
(the prefill cost per token is the same on every replica and cancels out):

    P        = the prompt's tokens (token ids; else full blocks x block size)
    m(e)     = matched leading blocks / prompt blocks   (the prefix index's `PrefixMatch`)
    Wq(e)    = queued uncached prefill tokens the engine reports (waiting_tokens), or
               waiting(e) x P when the engine does not report tokens
    Ws(e)    = uncached prompt tokens the EPP routed to e that no report covers yet
               (`Endpoint.unreported_tokens`: a burst between two load reports)
    Wp(e)    = what is left to prefill of the uncached prompt tokens the EPP routed to e, by
               the KV events (`PrefixMatch.pending_prefill`: a chunk's stored blocks lower it;
               0 without the precise index): unlike Wq it counts requests the engine admitted
               that are still prefilling
    R(e)     = max(0, running(e) - unreported_requests(e) - unreported_ends(e) - C(e)): a
               request just sent is in Ws(e) until a report covers it, and may already show
               in running(e) (a report sampled within the proxy's hop of the send does not
               settle it); counted once. One that ended since the last report is no longer
               running (`Endpoint.unreported_ends`)
    C(e)     = when Wp(e) is the larger term, the requests in it the report shows running
               (at least prefilling(e) - unreported_requests(e) - waiting(e), from
               `PrefixMatch.prefilling`; else 0): charged as prefill, not as running too
    F        = the candidates' waiting(e) at quantile q = saturationQuantile (the
               floor(q x (N - 1))-th smallest of N, from 0): with q = 0 the least, requests
               every replica has waiting (0 unless the whole pool queues); with q = 0.75, 0
               unless about a quarter of the pool or more queues (3 of 8 replicas)
    c(e)     = 1 - m(e); 1 + m(e) when the longest match on any candidate is under
               cacheThreshold of the prompt, some candidate has no prefill ahead
               (min_e' max(Wq(e') + Ws(e'), Wp(e')) = 0) and the prefix is not spread enough
               (below): a short prefix is copied, not followed
    spread   = with hotPrefixShare h > 0: H replicas hold the longest match, H >= 2 and
               s x N <= h x H, where s is the prefix's share of the last hotPrefixWindow
               requests (counted by the hash of the match's last block) and N the candidates
    est(e)   = max(Wq(e) + Ws(e), Wp(e))
               + (uncachedWeight + saturationMissWeight x F) x c(e) x P
               + runningRequestTokens x R(e)
    score(e) = (min_e' est(e') + 1) / (est(e) + 1)     (1 for the least work; all 1 if equal;
                                                       +1 keeps an idle all-cached pool finite)

Why each term is there, and what it does to a hot prefix group, a new group, a saturated pool
and a short shared prefix: docs/architecture.md ("Cache against load").
Inputs: `state["prefix-index"]` (written by precise-prefix-cache-scorer or prefix-cache-scorer,
either must be configured), `Metrics.waiting_tokens/waiting/running`,
`Endpoint.unreported_tokens/unreported_requests` (a request leaves them when a report covers
it or it ends), `PrefixMatch.pending_prefill/prefilling` (likewise until it ends).
Parameters: runningRequestTokens (float >= 0, default 16): prefill-token equivalent of one
running request: its decode in each step ahead of a queued prefill (in the simulator's
Qwen3-32B step model one decoding sequence costs a step what 4-14 prefill tokens do, at 2k-12k
tokens of context; 16 is a few steps of it). uncachedWeight
(float >= 1, default 1): what a token of the request's own uncached prefill counts against a
queued one; 1 is the request's own TTFT alone, above 1 a cache miss also pays for the prefill
it spends, which later requests of the same prefix would otherwise get from the cache (keeps
prefix groups together at moderate load). saturationMissWeight (float >= 0, default 0): what
a token of the request's own uncached prefill counts, per request F counts; 1 charges the
miss for each of them once. saturationQuantile (float in [0, 1], default 0): the quantile of
the candidates' waiting counts F takes. cacheThreshold (float in [0, 1], default 0: off):
below this fraction of the prompt, the longest match anywhere is copied rather than followed
(c(e) above); SGLang's router has a cache threshold of the same default, 0.5, below which it
routes to the replica with the least cached (`--cache-threshold`). hotPrefixShare (float >= 0,
default 0: off, every short prefix is copied): the fraction of a replica's fair share of
requests that each holder of a short prefix would have to get from it alone for a copy beyond
a second holder (`spread` above). hotPrefixWindow (int in [1, 65536], default 256): the last
requests that share counts (the count table holds at most that many prefixes).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import ConfigError, CycleState, PluginHandle, param
from kvswitch.epp.plugins.prefix_index import STATE_KEY, PrefixMatch, prompt_tokens

TYPE = "estimated-ttft-scorer"
MAX_HOT_PREFIX_WINDOW = 65_536  # requests; the count table's memory bound


class RecentShares:
    """Each key's share of the last `window` keys seen (None counts toward the total only)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._recent: deque[Hashable | None] = deque()
        self._counts: Counter[Hashable] = Counter()

    def add(self, key: Hashable | None) -> float:
        """Record `key` and return its share of the window, itself included (0 for None)."""
        self._recent.append(key)
        if key is not None:
            self._counts[key] += 1
        if len(self._recent) > self.window:
            oldest = self._recent.popleft()
            if oldest is not None:
                self._counts[oldest] -= 1
                if not self._counts[oldest]:
                    del self._counts[oldest]
        return self._counts[key] / len(self._recent) if key is not None else 0.0


class EstimatedTtftScorer:
    def __init__(self, name: str, running_tokens: float = 16.0,
                 uncached_weight: float = 1.0, saturation_miss_weight: float = 0.0,
                 saturation_quantile: float = 0.0, cache_threshold: float = 0.0,
                 hot_prefix_share: float = 0.0, hot_prefix_window: int = 256) -> None:
        self.name = name
        self.running_tokens = running_tokens
        self.uncached_weight = uncached_weight
        self.saturation_miss_weight = saturation_miss_weight
        self.saturation_quantile = saturation_quantile
        self.cache_threshold = cache_threshold
        self.hot_prefix_share = hot_prefix_share
        # Counted on the scorer instance: one EPP's requests, its configured profile.
        self.recent_prefixes = RecentShares(hot_prefix_window) if hot_prefix_share else None

    def score(self, request: InferenceRequest, state: CycleState,
              endpoints: Sequence[Endpoint]) -> list[float]:
        match: PrefixMatch | None = state.get(STATE_KEY)
        prompt = prompt_tokens(request, match)
        blocks = len(match.hashes) if match is not None else 0
        matched = match.matched if match is not None and blocks else {}
        pending = match.pending_prefill if match is not None else None
        prefilling = match.prefilling if match is not None else None
        running_tokens = self.running_tokens
        own = self.uncached_weight * prompt
        if self.saturation_miss_weight:
            # F of the module docstring: the requests a repeated prefill delays when the pool
            # queues.
            waiting = sorted([e.metrics.waiting for e in endpoints])
            pool_waiting = waiting[int(self.saturation_quantile * (len(waiting) - 1))]
            own += self.saturation_miss_weight * pool_waiting * prompt
        queues = []
        runs = []
        # est(e) of the module docstring, inline (a helper call per endpoint cost ~0.3 us).
        for e in endpoints:
            m = e.metrics
            queued = (m.waiting_tokens if m.waiting_tokens else m.waiting * prompt) \
                + e.unreported_tokens
            running = m.running - e.unreported_requests - e.unreported_ends
            if pending:
                in_progress = pending.get(e.address, 0)
                if in_progress > queued:
                    queued = in_progress
                    if prefilling:
                        charged = (prefilling.get(e.address, 0) - e.unreported_requests
                                   - m.waiting)
                        if charged > 0:
                            running -= charged
            queues.append(queued)
            runs.append(running_tokens * running if running > 0 else 0.0)
        # The cached fraction lowers c(e) (followed), or raises it (copied: a short prefix
        # while some replica has no prefill ahead, and it is not spread enough).
        longest = max(matched.values()) if matched else 0
        short = bool(self.cache_threshold and longest
                     and longest < self.cache_threshold * blocks)
        copy = short and min(queues) <= 0
        if self.recent_prefixes is not None:
            key = match.hashes[longest - 1] if short and match is not None else None
            share = self.recent_prefixes.add(key)
            if copy:
                holders = sum(1 for held in matched.values() if held == longest)
                copy = holders < 2 or share * len(endpoints) > self.hot_prefix_share * holders
        follow = -1.0 if copy else 1.0
        work = []
        for e, queued, run in zip(endpoints, queues, runs, strict=True):
            held = matched.get(e.address, 0) if matched else 0
            work.append(queued + (1.0 - follow * held / blocks if held else 1.0) * own + run)
        least = min(work) + 1.0
        return [least / (w + 1.0) for w in work]


def create(name: str, parameters: Mapping[str, Any],
           handle: PluginHandle) -> EstimatedTtftScorer:
    running_tokens = param(parameters, "runningRequestTokens", float, 16.0)
    if running_tokens < 0:
        raise ConfigError(f"parameters.runningRequestTokens: must be >= 0, got {running_tokens}")
    uncached_weight = param(parameters, "uncachedWeight", float, 1.0)
    if uncached_weight < 1:
        raise ConfigError(f"parameters.uncachedWeight: must be >= 1, got {uncached_weight}")
    saturation = param(parameters, "saturationMissWeight", float, 0.0)
    if saturation < 0:
        raise ConfigError(f"parameters.saturationMissWeight: must be >= 0, got {saturation}")
    quantile = param(parameters, "saturationQuantile", float, 0.0)
    if not 0 <= quantile <= 1:
        raise ConfigError(f"parameters.saturationQuantile: must be in [0, 1], got {quantile}")
    threshold = param(parameters, "cacheThreshold", float, 0.0)
    if not 0 <= threshold <= 1:
        raise ConfigError(f"parameters.cacheThreshold: must be in [0, 1], got {threshold}")
    hot_share = param(parameters, "hotPrefixShare", float, 0.0)
    if hot_share < 0:
        raise ConfigError(f"parameters.hotPrefixShare: must be >= 0, got {hot_share}")
    hot_window = param(parameters, "hotPrefixWindow", int, 256)
    if not 1 <= hot_window <= MAX_HOT_PREFIX_WINDOW:
        raise ConfigError(f"parameters.hotPrefixWindow: must be in [1, {MAX_HOT_PREFIX_WINDOW}],"
                          f" got {hot_window}")
    return EstimatedTtftScorer(name, running_tokens, uncached_weight, saturation, quantile,
                               threshold, hot_share, hot_window)
