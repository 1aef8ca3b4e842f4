"""Every fuzz target, briefly, under both engines: hypothesis (`KVSWITCH_FUZZ_EXAMPLES`, default
150 inputs each) and atheris (`KVSWITCH_ATHERIS_RUNS`, default 2,000 inputs each, from the kept
corpus, in a process of its own); then every kept input (tests/fuzz/corpus/<target>/: seeds,
coverage the long runs found, and each crash once found) replayed as a regression case."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings

from kvswitch.protocol import vllm_engine_pb2 as vllm_pb
from kvswitch.protocol.sglang import sglang_scheduler_pb2 as sglang_pb
from tests.fuzz.engine_targets import ENGINE_SGLANG, ENGINE_VLLM
from tests.fuzz.output_targets import MODEL_OUTPUT
from tests.fuzz.targets import CONFIG, OPENAI, TARGETS, Target

EXAMPLES = int(os.environ.get("KVSWITCH_FUZZ_EXAMPLES", "150"))
ATHERIS_RUNS = int(os.environ.get("KVSWITCH_ATHERIS_RUNS", "2000"))
CORPUS = Path(__file__).parent / "corpus"
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target", TARGETS.values(), ids=TARGETS.keys())
def test_fuzz(target: Target) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(target.inputs)
    def run(value: object) -> None:
        target.check(value)

    run()


@pytest.fixture(scope="module")
def atheris_runs(tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, tuple[int | None, str]]:
    """Every target under atheris once: name -> (exit code, its log); no code if it never ran."""
    if importlib.util.find_spec("atheris") is None:
        pytest.skip("atheris is not installed (no wheel for this Python or platform)")
    work = tmp_path_factory.mktemp("atheris")
    run = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.atheris_main", "--each", str(ATHERIS_RUNS), str(work)],
        cwd=REPO, capture_output=True, text=True, timeout=840, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    codes = dict(line.split(" exit ") for line in run.stdout.splitlines() if " exit " in line)
    return {name: (int(codes[name]), (work / name / "log").read_text(errors="replace")[-4000:])
            if name in codes else (None, run.stderr[-4000:]) for name in TARGETS}


@pytest.mark.timeout(900)  # the first test runs every target (about 30 s on an idle machine)
@pytest.mark.parametrize("name", TARGETS.keys())
def test_atheris(name: str, atheris_runs: dict[str, tuple[int | None, str]]) -> None:
    code, log = atheris_runs[name]
    assert code == 0, log


@pytest.mark.parametrize("name", TARGETS.keys())
def test_corpus_replays(name: str) -> None:
    target = TARGETS[name]
    files = sorted((CORPUS / name).iterdir())
    assert files, f"no corpus for {name}"
    for path in files:
        target.check(target.codec.decode(path.read_bytes()))


def test_a_yaml_escape_past_unicode_is_a_config_error() -> None:
    # Found by the epp-config target: pyyaml raised a bare ValueError for it.
    CONFIG.check('apiVersion: x\nkind: Other\nschedulingProfiles:\n- "\\U10010000": null\n')


def test_a_yaml_escape_past_a_c_int_is_a_config_error() -> None:
    # Found by atheris on the epp-config target: pyyaml raised a bare OverflowError for it.
    CONFIG.check('apiVersion: x\nkind: Other\nschedulingProfiles:\n- "\\UFFFFFFFF": null\n')


@pytest.mark.parametrize("schema", ["[" * 100_000, '{"a": ' * 50_000])
def test_a_deeply_nested_json_schema_is_invalid_argument_at_the_engine(schema: str) -> None:
    # json.loads raised RecursionError inside the backend's request checks (the first step of
    # generate), which both servicers answered INTERNAL.
    ids = [1, 2, 3, 4]
    ENGINE_VLLM.check(vllm_pb.GenerateRequest(
        tokenized=vllm_pb.TokenizedInput(input_ids=ids),
        sampling_params=vllm_pb.SamplingParams(max_tokens=4, json_schema=schema),
    ).SerializeToString())
    ENGINE_SGLANG.check(sglang_pb.GenerateRequest(
        tokenized=sglang_pb.TokenizedInput(input_ids=ids),
        sampling_params=sglang_pb.SamplingParams(max_new_tokens=4, json_schema=schema),
    ).SerializeToString())


def test_deeply_nested_kv_transfer_params_json_is_invalid_argument_at_the_engine() -> None:
    # json.loads raised RecursionError out of the vLLM servicer's checks: grpcio's UNKNOWN.
    ENGINE_VLLM.check(vllm_pb.GenerateRequest(
        tokenized=vllm_pb.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=vllm_pb.SamplingParams(max_tokens=4),
        kv_transfer_params_json="[" * 100_000).SerializeToString())


def test_deeply_nested_tool_call_arguments_in_a_chat_are_not_a_server_error() -> None:
    # json.loads of a past tool call's arguments (for the chat template) raised RecursionError:
    # a 500. Now the template gets the text, as for any arguments that are not JSON.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    body = {"model": "m", "messages": [{"role": "assistant", "content": None,
                                        "tool_calls": [call]}]}
    OPENAI.check((orjson.dumps(body), "/v1/chat/completions"))


_DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("output", [
    '<tool_call>{"name": "f", "arguments": ' + _DEEP + "}</tool_call>",
    '{"name": "f", "parameters": ' + _DEEP + "}",
    '[{"name": "f", "parameters": ' + _DEEP + "}]",
])
def test_model_output_nested_past_the_recursion_limit_is_not_an_error(output: str) -> None:
    # Found by the model-output target: json.loads in the tool-call parsers raised
    # RecursionError out of the response (a 500, or a stream cut short).
    MODEL_OUTPUT.check((output, 7))
