"""The frontend in front of an SGLang gRPC engine (`kvswitch engine --api sglang`), the API
found from the target's answers, reached with the openai SDK; and the request translation."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvswitch.frontend import sglang_client
from kvswitch.protocol import vllm_engine_pb2 as pb
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as spb
from tests.support.frontend_stack import engine_argv, frontend_argv, wait_ready
from tests.support.processes import free_port, running

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    logs = tmp_path_factory.mktemp("sglang-frontend")
    engine_port, frontend_port = free_port(), free_port()
    with running(engine_argv(engine_port, "--api", "sglang", "--time-scale", "1000"),
                 engine_port, logs / "engine.log", timeout=60), \
            running(frontend_argv(frontend_port, f"127.0.0.1:{engine_port}"), frontend_port,
                    logs / "frontend.log", timeout=60):
        base = f"http://127.0.0.1:{frontend_port}"
        wait_ready(base)
        yield openai.OpenAI(base_url=base + "/v1", api_key="-", timeout=30)


def test_completions_unary_streamed_and_n(client: openai.OpenAI) -> None:
    answer = client.completions.create(model="Qwen/Qwen3-0.6B", prompt=PROMPT, max_tokens=9)
    assert answer.choices[0].text == PROMPT and answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 9
    text, usage = "", None
    for event in client.completions.create(model="Qwen/Qwen3-0.6B", prompt=PROMPT,
                                           max_tokens=5, stream=True,
                                           stream_options={"include_usage": True}):
        text += "".join(c.text for c in event.choices)
        usage = event.usage or usage
    assert text == "The quick brown fox jumps"
    assert usage is not None and usage.completion_tokens == 5 and usage.prompt_tokens == 9
    both = client.completions.create(model="Qwen/Qwen3-0.6B", prompt=PROMPT, max_tokens=3, n=2)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == ["The quick brown"] * 2


def test_logprobs_stop_chat_and_embeddings(client: openai.OpenAI) -> None:
    answer = client.completions.create(model="Qwen/Qwen3-0.6B", prompt=PROMPT, max_tokens=4,
                                       logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == 4
    stopped = client.completions.create(model="Qwen/Qwen3-0.6B", prompt=PROMPT, max_tokens=20,
                                        stop=[" fox"])
    assert stopped.choices[0].text == "The quick brown"
    assert stopped.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model="Qwen/Qwen3-0.6B", max_tokens=3,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    embedded = client.embeddings.create(model="Qwen/Qwen3-0.6B", input=["one", "two three"])
    assert len(embedded.data) == 2 and embedded.data[0].embedding
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="Qwen/Qwen3-0.6B", prompt=PROMPT, max_tokens=5000)


def test_request_translation_uses_sglang_defaults_and_names() -> None:
    request = pb.GenerateRequest(
        request_id="r", stream=True, tokenized=pb.TokenizedInput(input_ids=[1, 2]),
        sampling_params=pb.SamplingParams(max_tokens=7, min_tokens=2, logprobs=3,
                                          include_stop_str_in_output=True,
                                          choice=pb.ChoiceConstraint(choices=["a.b", "c"]),
                                          logit_bias={5: -1.0}))
    out = sglang_client.generate_request(request)
    p = out.sampling_params
    assert list(out.tokenized.input_ids) == [1, 2] and out.stream
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.n) == (1.0, 1.0, -1, 1.0, 1)
    assert (p.max_new_tokens, p.min_new_tokens, p.no_stop_trim) == (7, 2, True)
    assert out.return_logprob and out.top_logprobs_num == 3 and out.logprob_start_len == -1
    assert p.regex == r"(?:a\.b)|(?:c)" and dict(p.logit_bias) == {"5": -1.0}
    unset = sglang_client.generate_request(pb.GenerateRequest(request_id="u"))
    assert not unset.sampling_params.HasField("max_new_tokens") and not unset.return_logprob


def test_response_translation_counts_each_chunk() -> None:
    chunk = sglang_client.generate_response(spb.GenerateResponse(chunk=spb.GenerateStreamChunk(
        token_ids=[7, 8], prompt_tokens=4, completion_tokens=10, cached_tokens=2, index=1,
        output_logprobs=spb.OutputLogProbs(token_logprobs=[-0.5, -1.0], token_ids=[7, 8]))))
    assert chunk.chunk.completion_tokens == 2 and chunk.chunk.index == 1
    assert list(chunk.chunk.output_logprobs.token_ids) == [7, 8]
    done = sglang_client.generate_response(spb.GenerateResponse(complete=spb.GenerateComplete(
        output_ids=[8], finish_reason="stop", completion_tokens=10, matched_token_id=8)))
    assert done.complete.completion_tokens == 1 and done.complete.matched_token_id == 8
