"""kvswitch's frontend against SMG on identical engine output: tool_calls and reasoning agree.

One echo engine serves both gateways; both render chat with `ECHO_TEMPLATE` (SMG through
`--chat-template`), so each user message is what the model "says". SMG runs with
`--tool-call-parser qwen --reasoning-parser qwen3`, kvswitch with `hermes` / `qwen3`. Compared:
content, reasoning_content, tool call names and arguments (as JSON values: SMG re-serialises
them compactly, kvswitch keeps the model's text), finish_reason; streamed answers are
accumulated first. The engine runs near real time: SMG's streamed parsing loses text when many
tokens arrive in one message. Anthropic's /v1/messages is compared the same way (blocks, tool
inputs, stop_reason), each output ending with a stop sequence since Messages require
max_tokens, with which the echo engine repeats instead of ending.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.frontend_stack import ECHO_TEMPLATE, echo_template_tokenizer
from tests.support.processes import free_port, kvswitch_argv, running
from tests.support.smg import smg_binary

SMG = smg_binary()
pytestmark = pytest.mark.skipif(SMG is None, reason="smg is not installed (the bench extra)")

TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}},
]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln", "n": [1, 2]}}\n' \
          '</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
SAYS = {
    "reasoning": "<think>Two and two.</think>It is 4.",
    "reasoning_unclosed": "<think>Still thinking about it",
    "reasoning_after_newline": "\n<think>\nA thought.\n</think>\n\nAn answer.",
    "no_opening_tag": "Some words</think>then more.",
    "plain": "Just an answer, with <b>markup</b>.",
    "call": WEATHER,
    "content_then_call": f"Let me look that up.\n{WEATHER}",
    "reasoning_then_call": f"<think>Needs the weather.</think>\n\n{WEATHER}",
    "two_calls": f"{WEATHER}\n{TIME}",
    "broken_call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
}
# Where SMG's streamed answer differs from its own non-streamed one (its streaming parser, and
# depending on how tokens are batched): the second call of a stream can come out as content; the
# text just before a call can lose its last token, and whitespace between reasoning and a call
# can become content, and leading whitespace of a thought is dropped. So SMG's streams are
# compared on calls always, on text (trimmed) only where the output has no call.
SMG_STREAM_CALLS_DIFFER = {"two_calls"}
HAS_CALLS = {"call", "content_then_call", "reasoning_then_call", "two_calls", "broken_call"}
# A stream commits to a call once its name is out, before the block turns out broken (both
# gateways): only the non-streamed answers are compared.
STREAM_COMMITS_EARLY = {"broken_call"}

def _wait(url: str) -> None:
    """Until a one-token chat answers 200 (SMG lists the model before its worker is ready)."""
    body = {"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.post(url + "/v1/chat/completions", json=body, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never answered")


@contextlib.contextmanager
def _gateways(logs: Path, reasoning: str, tools: tuple[str, str] = ("hermes", "qwen")
              ) -> Iterator[dict[str, str]]:
    """An echo engine, kvswitch's frontend and SMG over it, both parsing with `reasoning`;
    `tools`: the tool-call parser's name in kvswitch and in SMG."""
    tokenizer = echo_template_tokenizer(logs / "tokenizer")
    (logs / "echo.jinja").write_text(ECHO_TEMPLATE)
    engine, frontend, smg = free_port(), free_port(), free_port()
    with running(kvswitch_argv("engine", "--port", str(engine), "--mode", "echo", "--profile",
                               "tiny", "--time-scale", "0.5", "--max-model-len", "4096",
                               "--num-gpu-blocks", "1024", "--log-level", "WARNING"),
                 engine, logs / "engine.log", timeout=60), \
        running(kvswitch_argv("frontend", "--target", f"127.0.0.1:{engine}", "--port",
                              str(frontend), "--tokenizer", str(tokenizer),
                              "--tool-call-parser", tools[0], "--reasoning-parser", reasoning,
                              "--log-level", "warning"),
                frontend, logs / "frontend.log", timeout=60), \
        running([str(SMG), "launch", "--host", "127.0.0.1", "--port", str(smg),
                 "--prometheus-port", str(free_port()), "--log-level", "warn",
                 "--worker-urls", f"grpc://127.0.0.1:{engine}",
                 "--chat-template", str(logs / "echo.jinja"),
                 "--tool-call-parser", tools[1], "--reasoning-parser",
                 "passthrough" if reasoning == "none" else reasoning],
                smg, logs / "smg.log", timeout=90):
        urls = {"kvswitch": f"http://127.0.0.1:{frontend}", "smg": f"http://127.0.0.1:{smg}"}
        for url in urls.values():
            _wait(url)
        yield urls


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with _gateways(tmp_path_factory.mktemp("smg-peer"), "qwen3") as urls:
        yield urls


def _ask(url: str, says: str, stream: bool) -> dict[str, Any]:
    """The parsed answer: content, reasoning, calls as (name, JSON value), finish_reason."""
    body = {"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": says}],
            "tools": TOOLS, "stream": stream}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    if not stream:
        choice = reply.json()["choices"][0]
        message = choice["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]),
                  c["id"].startswith("call_")) for c in message.get("tool_calls") or []]
        return {"content": message.get("content") or None,
                "reasoning": message.get("reasoning_content") or None,
                "calls": calls, "finish": choice["finish_reason"]}
    content, reasoning, finish = "", "", None
    pieces: dict[int, list[Any]] = {}
    for line in reply.text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or ():
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or ():
                entry = pieces.setdefault(call["index"], ["", "", False])
                entry[0] += call["function"].get("name") or ""
                entry[1] += call["function"].get("arguments") or ""
                entry[2] = entry[2] or str(call.get("id", "")).startswith("call_")
            finish = choice.get("finish_reason") or finish
    calls = [(name, json.loads(args), has_id) for name, args, has_id in
             (pieces[i] for i in sorted(pieces))]
    return {"content": content or None, "reasoning": reasoning or None, "calls": calls,
            "finish": finish}


@pytest.mark.parametrize("case", sorted(SAYS))
def test_kvswitch_and_smg_agree(gateways: dict[str, str], case: str) -> None:
    says = SAYS[case]
    ours = _ask(gateways["kvswitch"], says, stream=False)
    assert ours == _ask(gateways["smg"], says, stream=False)
    if case in STREAM_COMMITS_EARLY:
        return
    assert _ask(gateways["kvswitch"], says, stream=True) == ours
    theirs = _ask(gateways["smg"], says, stream=True)
    assert _trimmed(theirs["reasoning"]) == _trimmed(ours["reasoning"])
    if case not in SMG_STREAM_CALLS_DIFFER:
        assert (theirs["calls"], theirs["finish"]) == (ours["calls"], ours["finish"])
    if case not in HAS_CALLS:
        assert _trimmed(theirs["content"]) == _trimmed(ours["content"])


def _trimmed(text: str | None) -> str | None:
    # SMG's stream drops whitespace its non-streamed answer keeps before a thought.
    return text.strip() if text else text


def test_the_cases_exercise_both_parsers(gateways: dict[str, str]) -> None:
    answers = {case: _ask(gateways["kvswitch"], SAYS[case], stream=False) for case in
               ("reasoning_then_call", "two_calls", "no_opening_tag")}
    assert answers["reasoning_then_call"]["reasoning"] == "Needs the weather."
    assert answers["reasoning_then_call"]["finish"] == "tool_calls"
    assert [name for name, _, _ in answers["two_calls"]["calls"]] == ["get_weather", "get_time"]
    assert answers["no_opening_tag"]["content"] == SAYS["no_opening_tag"]


MESSAGE_CASES = ["reasoning", "content_then_call", "reasoning_then_call", "two_calls", "plain"]


def _ask_messages(url: str, says: str, thinking: bool, stream: bool) -> dict[str, Any]:
    """The answer's blocks as (type, text or (name, input)) and its stop reason."""
    body: dict[str, Any] = {
        "model": "Qwen/Qwen3-0.6B", "max_tokens": 1100, "stream": stream,
        "messages": [{"role": "user", "content": says + "<end>"}], "stop_sequences": ["<end>"],
        "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                  for t in TOOLS]}
    if thinking:
        body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    reply = httpx.post(url + "/v1/messages", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    if not stream:
        message = reply.json()
        blocks, stop = message["content"], message["stop_reason"]
    else:
        blocks, stop, partial = [], None, ""
        for line in reply.text.splitlines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["type"] == "content_block_start":
                blocks.append(dict(event["content_block"]))
                partial = ""
            elif event["type"] == "content_block_delta":
                delta, block = event["delta"], blocks[-1]
                if delta["type"] == "text_delta":
                    block["text"] += delta["text"]
                elif delta["type"] == "thinking_delta":
                    block["thinking"] += delta["thinking"]
                elif delta["type"] == "input_json_delta":
                    partial += delta["partial_json"]
                    block["input"] = json.loads(partial) if partial.rstrip().endswith("}") \
                        else block["input"]
            elif event["type"] == "message_delta":
                stop = event["delta"]["stop_reason"]
    shaped = []
    for block in blocks:
        if block["type"] == "text":
            shaped.append(("text", block["text"]))
        elif block["type"] == "thinking":
            shaped.append(("thinking", block["thinking"]))
        else:
            shaped.append(("tool_use", (block["name"], block["input"])))
    return {"blocks": shaped, "stop": stop}


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("case", MESSAGE_CASES)
def test_messages_agree(gateways: dict[str, str], case: str, thinking: bool) -> None:
    says = SAYS[case]
    ours = _ask_messages(gateways["kvswitch"], says, thinking, stream=False)
    assert ours == _ask_messages(gateways["smg"], says, thinking, stream=False)
    assert _ask_messages(gateways["kvswitch"], says, thinking, stream=True) == ours
    theirs = _ask_messages(gateways["smg"], says, thinking, stream=True)
    assert theirs["stop"] == ours["stop"]
    if case in HAS_CALLS:  # SMG's streamed text before a call may lose a token (see above)
        assert [b for b in theirs["blocks"] if b[0] == "tool_use"] == \
            [b for b in ours["blocks"] if b[0] == "tool_use"]
    else:
        assert theirs == ours


def test_deepseek_r1_reasoning_agrees(tmp_path: Path) -> None:
    """`deepseek_r1`: the output starts in reasoning (the template opened <think>)."""
    cases = ["I reason</think>An answer.", "<think>I reason</think>An answer.",
             "All thought, no end", f"Needs weather.</think>\n\n{WEATHER}"]
    with _gateways(tmp_path, "deepseek_r1") as urls:
        for says in cases:
            ours = _ask(urls["kvswitch"], says, stream=False)
            assert ours["reasoning"] is not None
            assert ours == _ask(urls["smg"], says, stream=False)
            assert _ask(urls["kvswitch"], says, stream=True) == ours
            theirs = _ask(urls["smg"], says, stream=True)
            assert (_trimmed(theirs["reasoning"]), theirs["calls"]) == \
                (_trimmed(ours["reasoning"]), ours["calls"])


def test_llama3_json_tool_calls_agree(tmp_path: Path) -> None:
    """`llama3_json` (SMG: `llama`): an output opening with `{` is `;`-separated calls. SMG's
    stream also finds a call in plain text that names a tool, so it is compared on calls."""
    calls = ['{"name": "get_weather", "parameters": {"city": "Köln", "n": [1, 2]}}',
             ('{"name": "get_weather", "parameters": {"city": "Köln"}}; '
              '{"name": "get_time", "parameters": {}}')]
    text = ['Plain text {"name": "get_time"}', '{"answer": 42}']
    with _gateways(tmp_path, "none", ("llama3_json", "llama")) as urls:
        for says in calls + text:
            ours = _ask(urls["kvswitch"], says, stream=False)
            assert bool(ours["calls"]) == (says in calls)
            assert ours == _ask(urls["smg"], says, stream=False)
            assert _ask(urls["kvswitch"], says, stream=True) == ours
            if says in calls:
                theirs = _ask(urls["smg"], says, stream=True)
                assert (theirs["calls"], theirs["finish"]) == (ours["calls"], ours["finish"])
