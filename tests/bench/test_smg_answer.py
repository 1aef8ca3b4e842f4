"""What `kvswitch bench` asks SMG for a multi-turn request's answer reaches the engine: a
`regex` matching only the answer, on /v1/completions, over either engine API (real SMG, real
simulated engines in echo mode, which would otherwise repeat the prompt)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.support.processes import free_port, kvswitch_argv, running
from tests.support.smg import answers, served_models, smg_binary


@pytest.mark.parametrize("api", ["vllm", "sglang"])
def test_smg_passes_a_literal_regex_to_the_engine(api: str, tmp_path: Path) -> None:
    smg = smg_binary()
    if smg is None:
        pytest.skip("smg is not installed")
    engine_port, smg_port = free_port(), free_port()
    engine = kvswitch_argv("engine", "--api", api, "--port", str(engine_port), "--profile",
                           "tiny", "--time-scale", "100", "--mode", "echo", "--grace-period", "1")
    gateway = [smg, "launch", "--host", "127.0.0.1", "--port", str(smg_port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--log-level", "warn", "--worker-urls", f"grpc://127.0.0.1:{engine_port}",
               *(["--backend", "sglang"] if api == "sglang" else [])]
    said = " alpha beta. gamma"  # four tokens
    with running(engine, engine_port, tmp_path / "engine.log"), \
            running(gateway, smg_port, tmp_path / "smg.log", timeout=60.0):
        deadline = time.monotonic() + 60
        while not answers(smg_port):  # ready once a one-token completion succeeds
            assert time.monotonic() < deadline, "SMG never served the engine's model"
            time.sleep(0.1)
        body = {"model": served_models(smg_port)[0], "prompt": "The quick brown fox",
                "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
                "regex": re.escape(said)}
        answer = httpx.post(f"http://127.0.0.1:{smg_port}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == said
