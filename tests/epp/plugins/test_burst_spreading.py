"""A burst routed between two load reports spreads over the replicas (the real plugins).

Every prompt shares its first 512 tokens (as every request of Mooncake's conversation trace
does), held by five of eight replicas; the rest of each prompt is its own. Twenty requests
arrive with no load report in between. Without the EPP's record of what it just sent, every
request sees the same scores and the burst piles onto a few replicas: the five holders under
the weighted profile, the three empty ones under the default (which copies a short prefix).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from kvswitch.epp.config import build_endpoint_picker, static_pool
from kvswitch.epp.contracts import InferenceRequest, ParsedBody
from kvswitch.epp.datalayer import Metrics
from kvswitch.epp.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvswitch.epp.router import EppRouter
from kvswitch.launcher import DEFAULT_EPP_CONFIG
from tests.support.kvblocks import stored

CONFIGS = Path(__file__).parents[3] / "kvswitch" / "bench" / "configs"
REPLICAS = 8
HOLDERS = 5
BURST = 20
SHARED = list(range(100_000, 100_512))  # 32 blocks of 16
TAIL = 1536


def prompt(n: int) -> tuple[int, ...]:
    return (*SHARED, *range(n * TAIL, (n + 1) * TAIL))


async def route_burst(config: object, *, record_sent: bool = True) -> Counter[str]:
    addresses = [f"127.0.0.1:{20000 + i}" for i in range(REPLICAS)]  # nothing is contacted
    router = build_endpoint_picker(config, static_pool(addresses)).router  # type: ignore[arg-type]
    assert isinstance(router, EppRouter)
    datalayer = router.datalayer
    datalayer.set_endpoints(router.refresher.discovery.endpoints)  # type: ignore[union-attr]
    datalayer.staleness = 1e9
    for address in addresses:  # one report each, all idle, before the burst
        datalayer.update(address, Metrics(max_tokens=500_000, block_size=16,
                                          updated_at=datalayer.clock()))
    scorer = next(p for p in router.scheduler.plugins if isinstance(p, PrecisePrefixCacheScorer))
    if not record_sent:  # neither the unreported account nor the prefill in progress
        datalayer.record_sent = lambda endpoint, tokens: None  # type: ignore[method-assign]
        scorer.prefill_ttl = 0.0
    scorer._handle = None  # no KV-event subscriptions: the test feeds the index itself
    for address in addresses[:HOLDERS]:
        scorer.index.apply(address, [stored(SHARED)])
    picks: Counter[str] = Counter()
    for n in range(BURST):
        decision = await router.route(
            InferenceRequest(f"r{n}", "grpc", "/x", ParsedBody(prompt_token_ids=prompt(n))), None)
        assert decision.status == 200
        picks[decision.endpoints[0]] += 1
    return picks


@pytest.mark.parametrize("config", ["default", "kvswitch.yaml", "kvswitch-weighted.yaml",
                                    "kvswitch-estimated-ttft.yaml"])
async def test_a_burst_spreads_over_every_replica(config: str) -> None:
    source = DEFAULT_EPP_CONFIG if config == "default" else CONFIGS / config
    picks = await route_burst(source)
    assert len(picks) == REPLICAS, picks  # the empty replicas get their share too
    assert max(picks.values()) <= -(-BURST // REPLICAS) + 1, picks


@pytest.mark.parametrize(("config", "herd"), [
    # The default copies a prefix under half the prompt: it herds onto the replicas without it.
    ("default", range(HOLDERS, REPLICAS)),
    ("kvswitch-weighted.yaml", range(HOLDERS)),  # the holders outscore the empty replicas
])
async def test_without_the_sent_record_the_burst_herds(config: str, herd: range) -> None:
    # The control: what the test above would see if the EPP forgot what it had just sent.
    source = DEFAULT_EPP_CONFIG if config == "default" else CONFIGS / config
    picks = await route_burst(source, record_sent=False)
    assert set(picks) <= {f"127.0.0.1:{20000 + i}" for i in herd}, picks
