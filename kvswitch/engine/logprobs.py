"""The logprob messages of both engine APIs, built from the contract's `TokenLogprob`s.

vLLM's and SGLang's protos declare `OutputLogProbs` and `InputLogProbs` alike (SGLang's output
message has one more field, left empty), so one builder fills either, given the message class:
- output: one value and token id per generated token; when `num_top` > 0, each token's first
  `num_top` alternatives as a `TopLogProbs`.
- input: every prompt position from `start` on, each with a `value` (absent where the engine
  gives none: the prompt's first token) and its first `num_top` alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from kvswitch.engine.base import TokenLogprob
from kvswitch.protocol import vllm_engine_pb2
from kvswitch.protocol.sglang import sglang_scheduler_pb2

OutputMessage = TypeVar("OutputMessage", vllm_engine_pb2.OutputLogProbs,
                        sglang_scheduler_pb2.OutputLogProbs)
InputMessage = TypeVar("InputMessage", vllm_engine_pb2.InputLogProbs,
                       sglang_scheduler_pb2.InputLogProbs)


def output_logprobs(message: type[OutputMessage], items: Sequence[TokenLogprob] | None,
                    num_top: int | None) -> OutputMessage | None:
    """The generated tokens' logprobs, or None when there are none."""
    if not items:
        return None
    proto = message(token_logprobs=[lp.logprob for lp in items],
                    token_ids=[lp.token_id for lp in items])
    if num_top is not None and num_top > 0:
        for lp in items:
            alts = lp.top[:num_top]
            proto.top_logprobs.add(values=[v for _, v in alts], token_ids=[t for t, _ in alts])
    return proto


def input_logprobs(message: type[InputMessage], items: Sequence[TokenLogprob | None] | None,
                   prompt_ids: Sequence[int], num_top: int | None, start: int = 0
                   ) -> InputMessage | None:
    """The prompt's logprobs from position `start` on, or None when there are none."""
    if not items:
        return None
    top_n = num_top if num_top is not None and num_top > 0 else 0
    proto = message()
    for token_id, lp in list(zip(prompt_ids, items, strict=False))[max(start, 0):]:
        entry = proto.token_logprobs.add()
        top = proto.top_logprobs.add()
        if lp is not None:
            entry.value = lp.logprob
            top.token_ids.extend(alt_id for alt_id, _ in lp.top[:top_n])
            top.values.extend(alt_value for _, alt_value in lp.top[:top_n])
        proto.token_ids.append(token_id)
    return proto
