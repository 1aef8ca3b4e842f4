"""Running Generate calls and turning their token ids into per-choice text deltas.

Shared by chat and completions. One `ChoiceState` per output choice holds its incremental
detokenizer and stop-string matcher. Engine semantics (vLLM's servicer): stream=true sends DELTA
`chunk`s per index and then a `complete` that repeats the last delta; stream=false sends one
`complete` per index with every token. So a `complete`'s ids are used only when no chunk came
for that index. A stop string found here (the engine may not detokenize) finishes the choice;
once every choice is finished the call is cancelled so the engine stops generating.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio

from kvswitch.frontend.engine_client import EngineClient, Metadata, error_from_rpc
from kvswitch.frontend.serving_models import ServedModel
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.h2client import StreamError
from kvswitch.tokenization.detokenizer import StopStringMatcher, new_detokenizer

__all__ = ["ChoiceDelta", "Generation", "TokenLogprobs", "Usage", "prime"]


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of the tokens behind one delta, as the engine reported them."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    """Per token, the top alternatives as (token id, logprob)."""


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the choice (vLLM's `stop_reason`)."""
    logprobs: TokenLogprobs | None = None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"prompt_tokens": self.prompt_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "completion_tokens": self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(slots=True)
class _Choice:
    index: int
    detokenizer: object
    stop: StopStringMatcher | None
    seen_chunk: bool = False
    done: bool = False
    tokens: int = 0
    pending: list[int] | None = None
    """Token ids of this batch not yet detokenized (choices without stop strings/logprobs)."""


@dataclass
class _Prompt:
    """One Generate call (completions may send several prompts, each with n choices)."""

    request: pb.GenerateRequest
    first_index: int
    usage: Usage = field(default_factory=Usage)
    completes: int = 0
    """`complete` messages the engine sent: once it has sent one per choice it is done."""


_NO_LOGPROBS = pb.OutputLogProbs()


def _logprobs(proto: pb.OutputLogProbs) -> TokenLogprobs | None:
    if not proto.token_ids:
        return None
    top = [list(zip(t.token_ids, t.values)) for t in proto.top_logprobs]
    return TokenLogprobs(list(proto.token_ids), list(proto.token_logprobs), top)


class Generation:
    """Generate calls for one HTTP request, consumed as a stream of `ChoiceDelta`s."""

    def __init__(self, client: EngineClient, model: ServedModel,
                 requests: Sequence[pb.GenerateRequest], metadata: Metadata, *, n: int) -> None:
        self._client = client
        self._metadata = metadata
        self._n = n
        self._prompts = [_Prompt(r, i * n) for i, r in enumerate(requests)]
        params = requests[0].sampling_params
        self._logprobs = params.HasField("logprobs")
        stops = list(params.stop)
        self._choices: dict[int, _Choice] = {}
        for index in range(len(requests) * n):
            detok = new_detokenizer(model.tokenizer.tokenizer, model.decode_table,
                                    skip_special_tokens=params.skip_special_tokens)
            matcher = (StopStringMatcher(stops, include_stop_str_in_output=
                                         params.include_stop_str_in_output) if stops else None)
            self._choices[index] = _Choice(index, detok, matcher)
        self._open = len(self._choices)

    @property
    def finished(self) -> bool:
        """Every choice has finished: the deltas still to come are already here."""
        return self._open == 0

    @property
    def usage(self) -> Usage:
        total = Usage()
        for prompt in self._prompts:
            total.prompt_tokens += prompt.usage.prompt_tokens
            total.cached_tokens += prompt.usage.cached_tokens
        total.completion_tokens = sum(c.tokens for c in self._choices.values())
        return total

    def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """The deltas of every choice (one Generate's own iterator: no extra hop per event)."""
        if len(self._prompts) == 1:
            return self._run(self._prompts[0])
        return self._merged()

    async def _merged(self) -> AsyncIterator[ChoiceDelta]:
        queue: asyncio.Queue[ChoiceDelta | BaseException | None] = asyncio.Queue()

        async def pump(prompt: _Prompt) -> None:
            try:
                async for delta in self._run(prompt):
                    queue.put_nowait(delta)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(exc)
                return
            queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(p)) for p in self._prompts]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def _run(self, prompt: _Prompt) -> AsyncIterator[ChoiceDelta]:
        stream = await self._client.generate(prompt.request, self._metadata)
        try:
            while True:
                batch = await stream.read_batch()
                if not batch:
                    break
                deltas = self._on_batch(prompt, batch)
                if len(deltas) == 1:
                    yield next(iter(deltas.values()))
                else:
                    for delta in deltas.values():
                        yield delta
                if self._open == 0:
                    break  # every choice finished (maybe on a stop string found here)
        except (grpc.aio.AioRpcError, StreamError) as exc:
            raise error_from_rpc(exc) from exc
        finally:
            # On a live call (client gone, stop string found here) cancelling makes the engine
            # abort the request now; one that completed every choice just ends (no RST_STREAM).
            if prompt.completes < self._n:
                stream.cancel()

    def _on_batch(self, prompt: _Prompt, batch: list[pb.GenerateResponse]
                  ) -> dict[int, ChoiceDelta]:
        """The deltas of responses that had already arrived together, one per choice: what
        the engine sent in several messages goes out as one event (no waiting for more)."""
        choices, base, usage = self._choices, prompt.first_index, prompt.usage
        logprobs = self._logprobs  # else the engine sends none: skip looking (≈1 µs a message)
        out: dict[int, ChoiceDelta] = {}
        waiting: list[_Choice] = []
        for message in batch:
            delta: ChoiceDelta | None
            if message.HasField("chunk"):
                chunk = message.chunk
                usage.prompt_tokens = chunk.prompt_tokens
                usage.cached_tokens = chunk.cached_tokens
                choice = choices[base + chunk.index]
                if choice.done:
                    continue
                choice.seen_chunk = True
                if choice.stop is None and not (logprobs and chunk.output_logprobs.token_ids):
                    # Detokenized once for the whole batch: same text, fewer calls.
                    if choice.pending is None:
                        choice.pending = list(chunk.token_ids)
                        waiting.append(choice)
                    else:
                        choice.pending.extend(chunk.token_ids)
                    continue
                self._flush(choice, out)
                delta = self._on_tokens(choice, chunk.token_ids, chunk.output_logprobs)
            else:
                complete = message.complete
                prompt.completes += 1
                usage.prompt_tokens = complete.prompt_tokens
                usage.cached_tokens = complete.cached_tokens
                choice = choices[base + complete.index]
                if choice.done:
                    continue
                self._flush(choice, out)
                delta = None
                if not choice.seen_chunk and complete.output_ids:
                    delta = self._on_tokens(choice, complete.output_ids,
                                            complete.output_logprobs)
                if not choice.done:
                    delta = self._on_complete(choice, complete, delta)
            if delta is not None:
                earlier = out.get(choice.index)
                out[choice.index] = delta if earlier is None else _merge(earlier, delta)
        for choice in waiting:
            self._flush(choice, out)
        return out

    def _flush(self, choice: _Choice, out: dict[int, ChoiceDelta]) -> None:
        ids = choice.pending
        if ids is None:
            return
        choice.pending = None
        delta = self._on_tokens(choice, ids, _NO_LOGPROBS)
        if delta is not None:
            earlier = out.get(choice.index)
            out[choice.index] = delta if earlier is None else _merge(earlier, delta)

    def _on_tokens(self, choice: _Choice, ids: Sequence[int],
                   logprobs: pb.OutputLogProbs) -> ChoiceDelta | None:
        choice.tokens += len(ids)
        text = choice.detokenizer.push(ids)  # type: ignore[attr-defined]
        stop = choice.stop
        if stop is not None:
            text = stop.feed(text)
            if stop.matched is not None:
                self._close(choice)
                return ChoiceDelta(choice.index, text, "stop", stop.matched,
                                   _logprobs(logprobs))
        if not text and not logprobs.token_ids:
            return None
        return ChoiceDelta(choice.index, text, None, None, _logprobs(logprobs))

    def _on_complete(self, choice: _Choice, complete: pb.GenerateComplete,
                     pending: ChoiceDelta | None) -> ChoiceDelta:
        text = choice.detokenizer.flush()  # type: ignore[attr-defined]
        reason: str = complete.finish_reason or "stop"
        stop_reason: str | int | None = None
        which = complete.WhichOneof("matched_stop")
        if which == "matched_token_id":
            stop_reason = complete.matched_token_id
        elif which == "matched_stop_str":
            stop_reason = complete.matched_stop_str
        stop = choice.stop
        if stop is not None:
            text = stop.feed(text)
            if stop.matched is not None:
                reason, stop_reason = "stop", stop.matched
            else:
                text += stop.finish()
        self._close(choice)
        if pending is not None:
            pending.text += text
            pending.finish_reason, pending.stop_reason = reason, stop_reason
            return pending
        return ChoiceDelta(choice.index, text, reason, stop_reason)

    def _close(self, choice: _Choice) -> None:
        if not choice.done:
            choice.done = True
            self._open -= 1



def _merge(earlier: ChoiceDelta, later: ChoiceDelta) -> ChoiceDelta:
    """One delta for two consecutive ones of a choice (`earlier` has no finish_reason)."""
    earlier.text += later.text
    earlier.finish_reason, earlier.stop_reason = later.finish_reason, later.stop_reason
    if later.logprobs is not None:
        if earlier.logprobs is None:
            earlier.logprobs = later.logprobs
        else:
            earlier.logprobs.token_ids += later.logprobs.token_ids
            earlier.logprobs.logprobs += later.logprobs.logprobs
            earlier.logprobs.top += later.logprobs.top
    return earlier


async def prime(deltas: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
    """Wait for the first delta before a stream's 200 goes out, so that failures the target
    reports at once (503 down, 429 shed, 400 refused) keep their HTTP status. Returns an
    iterator over every delta, the first included."""
    try:
        first = await anext(deltas)
    except StopAsyncIteration:
        return _chain(None, deltas)
    except BaseException:
        await deltas.aclose()  # type: ignore[attr-defined]
        raise
    return _chain(first, deltas)


async def _chain(first: ChoiceDelta | None, rest: AsyncIterator[ChoiceDelta]
                 ) -> AsyncIterator[ChoiceDelta]:
    try:
        if first is not None:
            yield first
            async for delta in rest:
                yield delta
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
