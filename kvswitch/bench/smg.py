"""SMG (Shepherd Model Gateway, PyPI `smg`) as a bench target: a peer gateway to measure against.

`smg launch --worker-urls grpc://<engine>... --policy cache_aware|round_robin` routes OpenAI
HTTP requests to the engines over the vLLM gRPC API, or SGLang's (`--backend sglang`, for a
pool started with `--api sglang`); it fetches the tokenizer from the engines with GetTokenizer. The
bench sends `/v1/completions` with the prompt as text (the workload's text tokenizes back to exactly
its token ids), streamed (`stream: true`, the SSE stream is timed) or not (one JSON response; TTFT
then comes from the engines' request logs). The target is unavailable (with the reason) when `smg`
or `httpx` is not installed or SMG does not come up.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvswitch.bench.client import RequestResult
from kvswitch.bench.contracts import RunContext, TargetUnavailable
from kvswitch.bench.workloads import BenchRequest
from kvswitch.launcher import free_port
from kvswitch.supervisor import Child, ChildSpec


def _ready(port: int) -> Any:
    url = f"http://127.0.0.1:{port}/v1/completions"

    def probe() -> bool:
        # Ready when a one-token completion succeeds (the workers are registered and healthy).
        body = json.dumps({"model": "default", "prompt": "ready", "max_tokens": 1}).encode()
        models = f"http://127.0.0.1:{port}/v1/models"
        try:
            with urllib.request.urlopen(models, timeout=2) as response:
                data = json.loads(response.read())["data"]
            if not data:
                return False
            body = json.dumps({"model": data[0]["id"], "prompt": "ready", "max_tokens": 1}).encode()
            request = urllib.request.Request(url, body, {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=5) as response:
                return int(response.status) == 200
        except (urllib.error.URLError, OSError, KeyError, ValueError):
            return False

    return probe


@dataclass
class SmgTarget:
    name: str
    policy: str
    text_prompts: bool = True
    _child: Child | None = None
    _port: int = 0
    _model: str = ""
    _client: Any = None
    _extra: dict[str, Any] = field(default_factory=dict)

    async def start(self, ctx: RunContext) -> None:
        beside = Path(sys.executable).parent / "smg"  # the venv's, even when not on PATH
        smg = str(beside) if beside.exists() else shutil.which("smg")
        if smg is None:
            raise TargetUnavailable("the `smg` executable is not installed (pip install smg)")
        try:
            import httpx
        except ImportError as exc:
            raise TargetUnavailable("httpx is needed for the OpenAI HTTP client") from exc
        self._port = free_port()
        # Its Prometheus listener defaults to 0.0.0.0:29000: one per run, on a free port.
        argv = [smg, "launch", "--host", "127.0.0.1", "--port", str(self._port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--policy", self.policy, "--log-level", "warn",
                "--worker-urls", *(f"grpc://{a}" for a in ctx.pool.addresses)]
        if ctx.pool.api == "sglang":
            argv += ["--backend", "sglang"]
        spec = ChildSpec(f"smg-{self.name}", argv, ready=_ready(self._port), stop_timeout=10.0)
        try:
            self._child = await asyncio.to_thread(ctx.supervisor.start, spec, 120.0)
        except (RuntimeError, TimeoutError) as exc:
            raise TargetUnavailable(f"smg did not come up: {str(exc)[:300]}") from exc
        self._model = await asyncio.to_thread(self._model_id)
        self._client = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{self._port}", timeout=None,
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512))

    def _model_id(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self._port}/v1/models") as response:
            return str(json.loads(response.read())["data"][0]["id"])

    def choose(self, request: BenchRequest) -> tuple[str, str]:
        return f"127.0.0.1:{self._port}", ""

    def addresses(self) -> list[str]:
        return []  # OpenAI HTTP (`send_request`), no gRPC channels

    def first_token(self, request: BenchRequest) -> None:
        pass

    def finished(self, request: BenchRequest, result: RequestResult) -> None:
        pass

    async def send_request(self, request: BenchRequest, text: str, time_scale: float,
                           timeout: float, stream: bool = True,
                           answer: str | None = None) -> RequestResult:
        """One /v1/completions; never raises. An `answer` is asked for as a regex matching only
        it (SGLang's structured-output parameter)."""
        body: dict[str, Any] = {"model": self._model, "prompt": text,
                                "max_tokens": request.max_tokens, "ignore_eos": True,
                                "temperature": 0.0, "stream": stream}
        if answer:
            body["regex"] = re.escape(answer)
        if stream:
            body["stream_options"] = {"include_usage": True}
        base: dict[str, Any] = {"index": request.index, "stage": request.stage, "qps": request.qps}
        if not stream:
            return await self._send_whole(body, base, time_scale, timeout)
        started = time.perf_counter()
        first: float | None = None
        usage: dict[str, Any] = {}
        chunks = 0
        try:
            async with asyncio.timeout(timeout):
                async with self._client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        detail = (await response.aread())[:200].decode(errors="replace")
                        return RequestResult(ok=False, error=f"HTTP {response.status_code}: "
                                             f"{detail}", **base)
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            usage = event["usage"]
                        if any(c.get("text") for c in event.get("choices", ())):
                            chunks += 1
                            if first is None:
                                first = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - every failure is a result
            return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}"[:200], **base)
        end = time.perf_counter()
        if first is None:
            return RequestResult(ok=False, error="no output", **base)
        tokens = int(usage.get("completion_tokens") or chunks)
        details = usage.get("prompt_tokens_details") or {}
        ttft, e2e = (first - started) * time_scale, (end - started) * time_scale
        return RequestResult(ok=True, ttft=ttft, e2e=e2e,
                             itl=(e2e - ttft) / (tokens - 1) if tokens > 1 else None,
                             output_tokens=tokens, prompt_tokens=int(usage.get("prompt_tokens", 0)),
                             cached_tokens=int(details.get("cached_tokens") or 0), **base)

    async def _send_whole(self, body: dict[str, Any], base: dict[str, Any], time_scale: float,
                          timeout: float) -> RequestResult:
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                response = await self._client.post("/v1/completions", json=body)
            if response.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: "
                                     f"{response.text[:200]}", **base)
            usage = response.json().get("usage") or {}
        except Exception as exc:  # noqa: BLE001 - every failure is a result
            return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}"[:200], **base)
        tokens = int(usage.get("completion_tokens") or 0)
        if not tokens:
            return RequestResult(ok=False, error="no output", **base)
        details = usage.get("prompt_tokens_details") or {}
        return RequestResult(ok=True, e2e=(time.perf_counter() - started) * time_scale,
                             output_tokens=tokens, prompt_tokens=int(usage.get("prompt_tokens", 0)),
                             cached_tokens=int(details.get("cached_tokens") or 0), **base)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._child is not None:
            await asyncio.to_thread(self._child.stop)
            self._child = None
