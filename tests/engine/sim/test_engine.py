"""SimEngine through the `Engine` contract: output, streaming, cancel/abort, validation, load."""

from __future__ import annotations

import asyncio
import math

import pytest

from kvswitch.engine.base import Engine, GenerationRequest, SamplingOptions
from kvswitch.engine.sim import SimEngine
from kvswitch.errors import InternalError, InvalidRequest, Unavailable

from .conftest import collect, final_delta, make_engine, request, tokens_of

PROMPT = list(range(2000, 2040))


def test_satisfies_the_engine_protocol_and_describes_the_model() -> None:
    e = make_engine()
    assert isinstance(e, Engine)
    card = e.model
    assert (card.block_size, card.num_gpu_blocks, card.max_num_seqs) == (16, 64, 4)
    assert card.max_model_len == 1024 and card.vocab_size >= 151_643
    assert 151645 in card.eos_token_ids and card.served_model_name == "Qwen/Qwen3-0.6B"


async def test_echo_returns_the_prompt_then_eos(engine: SimEngine) -> None:
    updates = await collect(engine.generate(request("r", PROMPT)))
    out = tokens_of(updates)
    assert out[:-1] == PROMPT and out[-1] == engine.model.eos_token_ids[0]
    last = final_delta(updates)
    assert (last.finish_reason, last.matched_stop) == ("stop", None)
    assert updates[-1].finished and not any(u.finished for u in updates[:-1])
    assert updates[0].prompt_tokens == 40


async def test_echo_cycles_up_to_max_tokens(engine: SimEngine) -> None:
    updates = await collect(engine.generate(request("r", [7, 8, 9], max_tokens=7)))
    assert tokens_of(updates) == [7, 8, 9, 7, 8, 9, 7]
    assert final_delta(updates).finish_reason == "length"


async def test_ignore_eos_runs_to_the_context_limit() -> None:
    e = make_engine(max_model_len=64)
    await e.start()
    updates = await collect(e.generate(request("r", [7] * 10, ignore_eos=True)))
    await e.stop()
    assert len(tokens_of(updates)) == 54 and final_delta(updates).finish_reason == "length"


async def test_second_identical_prompt_reports_cached_tokens(engine: SimEngine) -> None:
    first = await collect(engine.generate(request("a", PROMPT, max_tokens=2)))
    second = await collect(engine.generate(request("b", PROMPT, max_tokens=2)))
    assert first[0].cached_tokens == 0 and second[0].cached_tokens == 32
    assert engine.load().cache_hit_rate == pytest.approx(32 / 80)


async def test_random_mode_is_deterministic_by_seed() -> None:
    outs = []
    for _ in range(2):
        e = make_engine(mode="random")
        await e.start()
        a = tokens_of(await collect(e.generate(request("a", PROMPT, max_tokens=20, seed=42))))
        b = tokens_of(await collect(e.generate(request("b", PROMPT, max_tokens=20, seed=43))))
        g = tokens_of(
            await collect(e.generate(request("g", PROMPT, max_tokens=20, temperature=0.0)))
        )
        outs.append((a, b, g))
        await e.stop()
    assert outs[0] == outs[1]
    a, b, _ = outs[0]
    assert a != b and len(a) == 20 and all(0 <= t < 151_643 for t in a)


async def test_random_mode_without_max_tokens_ends_with_eos() -> None:
    e = make_engine(mode="random", mean_output_len=8)
    await e.start()
    lengths = []
    for i in range(40):
        updates = await collect(e.generate(request(f"r{i}", PROMPT)))
        out = tokens_of(updates)
        assert out[-1] == e.model.eos_token_ids[0] and final_delta(updates).finish_reason == "stop"
        lengths.append(len(out))
    await e.stop()
    assert 3 < sum(lengths) / len(lengths) < 20  # geometric, mean 8


async def test_stop_token_ids_and_min_tokens(engine: SimEngine) -> None:
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    updates = await collect(
        engine.generate(request("a", prompt, max_tokens=50, stop_token_ids=(12,)))
    )
    assert tokens_of(updates) == [10, 11, 12]
    assert (final_delta(updates).finish_reason, final_delta(updates).matched_stop) == ("stop", 12)
    # min_tokens=5 ignores the 12 at output 3; the next one (output 11) stops.
    updates = await collect(
        engine.generate(request("b", prompt, max_tokens=50, stop_token_ids=(12,), min_tokens=5))
    )
    assert len(tokens_of(updates)) == 11 and tokens_of(updates)[-1] == 12


async def test_stop_strings_end_at_the_completing_token(engine: SimEngine) -> None:
    tok = engine.tokenizer
    prompt = tok.encode("Hello there, world. The END is near, friend.")
    updates = await collect(
        engine.generate(request("a", prompt, max_tokens=100, stop=("END", "zzz")))
    )
    text = tok.decode(tokens_of(updates))
    assert text.endswith("END") and "near" not in text
    assert (final_delta(updates).finish_reason, final_delta(updates).matched_stop) == (
        "stop",
        "END",
    )


async def test_n_sequences_share_the_prompt_blocks() -> None:
    e = make_engine(mode="random")
    await e.start()
    updates = await collect(e.generate(request("a", PROMPT, n=3, max_tokens=6, temperature=1.0)))
    await e.stop()
    outs = [tokens_of(updates, i) for i in range(3)]
    assert all(len(o) == 6 for o in outs) and len({tuple(o) for o in outs}) == 3
    assert sorted(d.index for u in updates for d in u.sequences if d.finish_reason) == [0, 1, 2]
    # Children 1 and 2 hit the 2 full prompt blocks child 0 had just allocated.
    assert e.counters().prefix_cache_hits == 64


async def test_logprobs_are_shaped_like_vllms(engine: SimEngine) -> None:
    updates = await collect(
        engine.generate(request("a", PROMPT[:5], max_tokens=4, logprobs=3, prompt_logprobs=1))
    )
    lps = [lp for u in updates for d in u.sequences for lp in d.logprobs or []]
    assert [lp.token_id for lp in lps] == tokens_of(updates)
    assert all(len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.logprob < 0 for lp in lps)
    assert all(lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] for lp in lps)
    plp = updates[0].prompt_logprobs
    assert plp is not None and plp[0] is None and len(plp) == 5
    assert all(u.prompt_logprobs is None for u in updates[1:])


async def test_slow_consumer_gets_merged_deltas() -> None:
    e = make_engine(time_scale=1e9)
    await e.start()
    it = e.generate(request("a", [3] * 8, max_tokens=40))
    first = await it.__anext__()
    for _ in range(200):  # let the scheduler run ahead
        await asyncio.sleep(0)
    rest = await collect(it)
    await e.stop()
    merged = [first, *rest]
    assert len(tokens_of(merged)) == 40
    assert len(merged) < 40  # some updates carried several tokens


async def test_closing_the_stream_frees_the_request_at_once(engine: SimEngine) -> None:
    it = engine.generate(request("a", PROMPT, max_tokens=500))
    await it.__anext__()
    assert engine.has_request("a") and engine.load().used_blocks > 0
    await it.aclose()  # type: ignore[attr-defined]
    assert not engine.has_request("a")
    load = engine.load()
    assert (load.running, load.waiting, load.used_blocks) == (0, 0, 0)
    assert engine.counters().requests_finished == {"abort": 1}


async def test_cancelling_the_consumer_frees_the_request(engine: SimEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(request("a", PROMPT, max_tokens=900)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not engine.has_request("a") and engine.load().used_blocks == 0


async def test_abort_ends_with_finish_reason_abort(engine: SimEngine) -> None:
    it = engine.generate(request("a", PROMPT, max_tokens=500))
    first = await it.__anext__()
    await engine.abort(["a", "unknown"])
    assert engine.load().used_blocks == 0 and engine.load().running == 0
    rest = await collect(it)
    assert rest[-1].finished and final_delta([first, *rest]).finish_reason == "abort"
    assert len(tokens_of([first, *rest])) < 500


async def test_queue_is_visible_in_load() -> None:
    e = make_engine(time_scale=1.0)  # real-time tiny steps: the state holds while we look
    await e.start()
    its = [e.generate(request(f"r{i}", [i + 1] * 8, max_tokens=500)) for i in range(6)]
    await its[0].__anext__()
    for it in its[1:]:
        asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0.005)
    load = e.load()
    assert (load.running, load.waiting, load.max_running) == (4, 2, 4)
    await e.stop()
    for it in its:
        await it.aclose()  # type: ignore[attr-defined]


async def test_queue_time_and_token_times_are_simulated_seconds() -> None:
    e = make_engine()  # time_scale 1e6: only simulated time can tell these apart
    await e.start()
    # Submitted in one tick: the first four fill max_num_seqs, the last two wait for them.
    runs = await asyncio.gather(*(collect(e.generate(request(f"r{i}", [i + 1] * 8,
                                                             max_tokens=5)))
                                  for i in range(6)))
    await e.stop()
    queued = [r[0].queue_seconds for r in runs]
    assert queued[:4] == [0.0] * 4
    assert queued[4] == queued[5] and queued[4] is not None and queued[4] > 0
    # They started when the first four had finished: at the (simulated) time of their last token.
    first_batch_end = max(u.time for r in runs[:4] for u in r if u.time is not None)
    first_token = min(u.time for u in runs[4] if u.time is not None)
    assert first_batch_end < first_token
    assert all(u.queue_seconds is None for r in runs for u in r[1:])
    times = [u.time for u in runs[0] if u.time is not None]
    assert len(times) == len(runs[0]) and times == sorted(times)


async def test_validation_names_the_problem(engine: SimEngine) -> None:
    cases = [
        (request("a", []), "empty"),
        (request("a", [10**7]), "vocabulary"),
        (request("a", [-1]), "vocabulary"),
        (request("a", [1], n=0), "n must be"),
        (request("a", [1] * 1000, max_tokens=100), "context length"),
        (request("a", [1] * 10, min_tokens=2000), "context length"),
        (request("a", [1], logprobs=50), "logprobs"),
    ]
    for req, words in cases:
        with pytest.raises(InvalidRequest, match=words):
            engine.generate(req)
    it = engine.generate(request("dup", [1, 2], max_tokens=50))
    await it.__anext__()
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.generate(request("dup", [1, 2]))
    await it.aclose()  # type: ignore[attr-defined]


async def test_generate_before_start_is_unavailable() -> None:
    with pytest.raises(Unavailable):
        make_engine().generate(request("a", [1]))


@pytest.mark.parametrize("kind", ["internal", "unavailable", "abort"])
async def test_injected_failures(kind: str) -> None:
    e = make_engine(failure_rate=1.0, failure_kind=kind)
    await e.start()
    it = e.generate(request("a", PROMPT, max_tokens=50))
    if kind == "abort":
        updates = await collect(it)
        assert final_delta(updates).finish_reason == "abort" and len(tokens_of(updates)) == 1
    else:
        with pytest.raises(InternalError if kind == "internal" else Unavailable):
            await it.__anext__()
    assert e.load().used_blocks == 0
    await e.stop()


async def test_embed_is_a_deterministic_unit_vector(engine: SimEngine) -> None:
    a = await engine.embed("e1", [1, 2, 3])
    b = await engine.embed("e2", [1, 2, 3])
    c = await engine.embed("e3", [1, 2, 4])
    assert a == b and a != c and len(a) == 1024
    assert math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-9)
    with pytest.raises(InvalidRequest):
        await engine.embed("e4", [])


async def test_counters_and_health(engine: SimEngine) -> None:
    assert engine.is_healthy()
    await collect(engine.generate(request("a", PROMPT, max_tokens=3)))
    await collect(engine.generate(request("b", PROMPT)))
    c = engine.counters()
    assert (c.prompt_tokens, c.generation_tokens) == (80, 3 + 41)
    assert c.requests_finished == {"length": 1, "stop": 1}
    assert engine.load().gen_throughput > 0
    await engine.stop()
    assert not engine.is_healthy()


async def test_a_non_incremental_request_gets_one_merged_update_with_exact_timings() -> None:
    """A non-streamed request is woken once, at its end: all tokens in one update, which still
    says when the first token was produced (TTFT stays exact)."""
    e = make_engine(time_scale=50.0)
    await e.start()
    try:
        streamed = await collect(e.generate(request("s", PROMPT, max_tokens=12)))
        merged = await collect(e.generate(
            GenerationRequest("m", PROMPT, SamplingOptions(max_tokens=12), incremental=False)))
    finally:
        await e.stop()
    assert len(merged) == 1 and merged[0].finished
    assert tokens_of(merged) == tokens_of(streamed)
    assert final_delta(merged).finish_reason == "length"
    only = merged[0]
    assert only.first_token_time is not None and only.time is not None
    assert only.first_token_time < only.time  # 11 decode steps after the first token
    # The streamed request's first update carries its own first-token time, later ones none.
    assert streamed[0].first_token_time == streamed[0].time
    assert all(u.first_token_time is None for u in streamed[1:])


async def test_a_non_incremental_request_still_ends_at_an_abort() -> None:
    e = make_engine(time_scale=1.0)  # ~1,000 tokens of 1-3 ms: seconds, aborted long before
    await e.start()
    try:
        gen = e.generate(GenerationRequest("m", PROMPT, SamplingOptions(ignore_eos=True),
                                           incremental=False))
        pending = asyncio.ensure_future(collect(gen))
        await asyncio.sleep(0.05)
        assert not pending.done()  # generating, but nothing delivered yet
        await e.abort(["m"])
        updates = await asyncio.wait_for(pending, 5)
    finally:
        await e.stop()
    assert updates[-1].finished and final_delta(updates).finish_reason == "abort"


async def test_the_last_update_counts_the_requests_preemptions() -> None:
    # tiny: 64 blocks of 16; 4 x (100 prompt + 300 output) tokens need 100 blocks: preemption.
    e = make_engine()
    await e.start()
    try:
        prompt = PROMPT * 3  # 120 tokens
        runs = await asyncio.gather(*(collect(e.generate(request(f"p{i}", [i + 1, *prompt[1:]],
                                                                 max_tokens=300)))
                                      for i in range(4)))
    finally:
        await e.stop()
    finals = [updates[-1] for updates in runs]
    assert all(u.finished and u.num_preemptions is not None for u in finals)
    assert all(u.num_preemptions is None for updates in runs for u in updates[:-1])
    assert sum(u.num_preemptions or 0 for u in finals) == e.scheduler.preemptions > 0
