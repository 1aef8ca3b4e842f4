"""max-score-picker: the endpoint with the highest total score (the default picker).

Rule: the endpoints whose total lies within `tieTolerance` of the best are tied; among them the
one holding the most leading blocks of this request's prompt wins (the prefix producer's
`PrefixMatch` in the cycle state; a tie the scorers left stays where the cache already is instead
of copying the prefix elsewhere), then the one with the fewest requests in flight from this EPP,
then one at random (a burst of equally scored requests then spreads instead of landing where the
random draw happens to repeat).
A new prefix (a prompt no endpoint holds a block of: a new prefix group's or conversation's
first request) brings the requests that will follow it, so with `newPrefixTolerance` t > 0 it
goes, among the endpoints whose total is within t of the best, to the one this picker sent the
fewest blocks of its last NEW_PREFIX_WINDOW new prefixes (each weighs its prompt's full
blocks: prompts of many lengths balance by size, prompts of one length by number), then the
highest total, then at random: new groups spread evenly instead of following the load of the
moment (SGLang's router likewise sends a prompt it holds too little of to the worker whose
cache is smallest). Only while some
endpoint has nothing waiting (its last report shows no waiting request and nothing sent since):
when every endpoint queues, the wait ahead decides, and the scores alone place it.
Fallbacks follow in score order (equal scores in random order), up to `maxNumOfEndpoints` in all.
Parameters: maxNumOfEndpoints (int >= 1, default 1, as upstream); tieTolerance (float >= 0,
default 0: only equal totals tie); newPrefixTolerance (float >= 0, default 0: off).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any

from kvswitch.epp.contracts import InferenceRequest
from kvswitch.epp.datalayer import Endpoint
from kvswitch.epp.framework import ConfigError, CycleState, PluginHandle, max_endpoints_param, param
from kvswitch.epp.plugins.prefix_index import STATE_KEY, PrefixMatch

TYPE = "max-score-picker"
NEW_PREFIX_WINDOW = 1024  # the new prefixes whose placements are counted (memory bound)


class MaxScorePicker:
    def __init__(self, name: str, max_endpoints: int = 1, rng: random.Random | None = None,
                 tie_tolerance: float = 0.0, new_prefix_tolerance: float = 0.0) -> None:
        self.name = name
        self.max_endpoints = max_endpoints
        self.tie_tolerance = tie_tolerance
        self.new_prefix_tolerance = new_prefix_tolerance
        self.rng = rng or random.Random()  # public: a simulation seeds it so a run repeats
        # The endpoints the last NEW_PREFIX_WINDOW new prefixes went to with their blocks, and
        # each endpoint's sum of them.
        self._new_prefixes: deque[tuple[str, int]] = deque()
        self._new_prefix_counts: Counter[str] = Counter()

    def _new_prefix_pick(self, endpoints: Sequence[Endpoint], scores: Sequence[float],
                         blocks: int) -> int:
        """Within newPrefixTolerance of the best total: the endpoint sent the fewest blocks of
        recent new prefixes, then the highest total, then at random; `blocks` (the prompt's)
        added to its count."""
        floor = max(scores) - self.new_prefix_tolerance
        counts = self._new_prefix_counts
        near = [i for i, s in enumerate(scores) if s >= floor]
        fewest = min([counts[endpoints[i].address] for i in near])
        near = [i for i in near if counts[endpoints[i].address] == fewest]
        best = max([scores[i] for i in near])
        near = [i for i in near if scores[i] == best]
        first = near[0] if len(near) == 1 else self.rng.choice(near)
        address = endpoints[first].address
        self._new_prefixes.append((address, blocks))
        counts[address] += blocks
        if len(self._new_prefixes) > NEW_PREFIX_WINDOW:
            oldest, weight = self._new_prefixes.popleft()
            counts[oldest] -= weight
            if not counts[oldest]:
                del counts[oldest]
        return first

    def _tied_pick(self, endpoints: Sequence[Endpoint], ties: list[int],
                   state: CycleState) -> int:
        """The tied position holding the most leading blocks of the prompt, then with the
        fewest in flight, at random among equals."""
        match: PrefixMatch | None = state.get(STATE_KEY)
        if match is not None and match.matched:
            held = match.matched
            most = max([held.get(endpoints[i].address, 0) for i in ties])
            if most:
                ties = [i for i in ties if held.get(endpoints[i].address, 0) == most]
                if len(ties) == 1:
                    return ties[0]
        least = min([endpoints[i].in_flight for i in ties])
        fewest = [i for i in ties if endpoints[i].in_flight == least]
        return fewest[0] if len(fewest) == 1 else self.rng.choice(fewest)

    def pick(self, request: InferenceRequest, state: CycleState,
             endpoints: Sequence[Endpoint], scores: Sequence[float]) -> tuple[Endpoint, ...]:
        if not endpoints:
            return ()
        n = self.max_endpoints
        if self.new_prefix_tolerance:
            match: PrefixMatch | None = state.get(STATE_KEY)
            if match is not None and match.hashes and not match.matched and any(
                    not e.metrics.waiting and not e.unreported_tokens for e in endpoints):
                return self._with_fallbacks(endpoints, scores, self._new_prefix_pick(
                    endpoints, scores, len(match.hashes)))
        if n == 1 and not self.tie_tolerance:
            best = max(scores)
            ties = [i for i, s in enumerate(scores) if s == best]
            if len(ties) == 1:
                return (endpoints[ties[0]],)
            return (endpoints[self._tied_pick(endpoints, ties, state)],)
        # Sorting the floats themselves and finding each winner by value costs ~1 us less
        # than sorting positions by key. With the top n + 1 distinct and no near tie at the
        # top, each of the top n occurs once, so `index` finds the one endpoint holding it.
        top = sorted(scores, reverse=True)[: n + 1]
        if len(set(top)) == len(top) and (len(top) == 1
                                          or top[0] - top[1] > self.tie_tolerance):
            index = scores.index
            return tuple([endpoints[index(s)] for s in top[:n]])
        floor = top[0] - self.tie_tolerance
        ties = [i for i, s in enumerate(scores) if s >= floor]
        first = ties[0] if len(ties) == 1 else self._tied_pick(endpoints, ties, state)
        return self._with_fallbacks(endpoints, scores, first)

    def _with_fallbacks(self, endpoints: Sequence[Endpoint], scores: Sequence[float],
                        first: int) -> tuple[Endpoint, ...]:
        """`first`, then fallbacks in score order, equal scores in random order."""
        n = self.max_endpoints
        if n == 1:
            return (endpoints[first],)
        rnd = self.rng.random
        order = sorted((i for i in range(len(endpoints)) if i != first),
                       key=lambda i: (scores[i], rnd()), reverse=True)
        return (endpoints[first], *[endpoints[i] for i in order[: n - 1]])


def create(name: str, parameters: Mapping[str, Any], handle: PluginHandle) -> MaxScorePicker:
    n = max_endpoints_param(parameters)
    tolerance = param(parameters, "tieTolerance", float, 0.0)
    if tolerance < 0:
        raise ConfigError(f"parameters.tieTolerance: must be >= 0, got {tolerance}")
    new_prefix = param(parameters, "newPrefixTolerance", float, 0.0)
    if new_prefix < 0:
        raise ConfigError(f"parameters.newPrefixTolerance: must be >= 0, got {new_prefix}")
    return MaxScorePicker(name, n, tie_tolerance=tolerance, new_prefix_tolerance=new_prefix)
