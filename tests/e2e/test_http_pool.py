"""An HTTP pool (`appProtocol: http`, OpenAI-compatible model servers) through the real Envoy
and EPP: the openai-parser routes the JSON body, and the EPP learns how each request ended from
the response headers Envoy sends it (HTTP pools have no access-log path)."""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvswitch.envoy import GatewayOptions, PoolTarget, build_bootstrap, render
from kvswitch.launcher import envoy_spec, epp_spec, write_pool_file
from kvswitch.supervisor import Supervisor
from tests.support.processes import free_port

CONFIG = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [{"name": "openai-parser", "type": "openai-parser"},
                {"name": "queue-scorer", "type": "queue-scorer"},
                {"name": "max-score-picker", "type": "max-score-picker"}],
    "schedulingProfiles": [{"name": "default", "plugins": [
        {"pluginRef": "queue-scorer", "weight": 1}, {"pluginRef": "max-score-picker"}]}],
    "requestHandler": {"parsers": [{"pluginRef": "openai-parser"}]},
}

VLLM_METRICS = b"""\
vllm:num_requests_running{model_name="m"} 0
vllm:num_requests_waiting{model_name="m"} 0
vllm:kv_cache_usage_perc{model_name="m"} 0.1
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1
"""


class _ModelServer(http.server.BaseHTTPRequestHandler):
    """A minimal OpenAI-compatible server: vLLM's /metrics names, a fixed completion."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._reply(200, VLLM_METRICS, "text/plain")

    def do_POST(self) -> None:
        request = json.loads(self._body())
        if request.get("model") != "m":
            self._reply(404, b'{"error": {"message": "no such model"}}', "application/json")
            return
        body = {"object": "text_completion", "model": "m",
                "choices": [{"index": 0, "text": " world", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        self._reply(200, json.dumps(body).encode(), "application/json")

    def _body(self) -> bytes:
        if self.headers.get("content-length") is not None:
            return self.rfile.read(int(self.headers["content-length"]))
        # Envoy forwards the body the EPP echoed in full-duplex mode chunked.
        chunks = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        self.rfile.readline()
        return b"".join(chunks)

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """(Envoy's public port, the EPP's metrics port) over one HTTP model server."""
    tmp = tmp_path_factory.mktemp("http-pool")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ModelServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    pool = write_pool_file(tmp / "pool.yaml", [address], app_protocol="http")
    config = tmp / "epp.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    epp_port, metrics_port, port, admin = free_port(), free_port(), free_port(), free_port()
    supervisor = Supervisor(tmp)
    try:
        supervisor.start(epp_spec(config, pool, epp_port, metrics_port, want_ready=1))
        envoy_config = tmp / "envoy.yaml"
        envoy_config.write_text(render(build_bootstrap(GatewayOptions(
            pool=PoolTarget((address,), "http"), epps=(f"127.0.0.1:{epp_port}",), port=port,
            admin_port=admin))))
        supervisor.start(envoy_spec(envoy_config, admin))
        yield port, metrics_port
    finally:
        supervisor.stop_all()
        server.shutdown()
        server.server_close()


def _post(port: int, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
        headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _finished(metrics_port: int, model: str, status: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvswitch_epp_requests_finished_total"
               and s.labels.get("status") == status and s.labels.get("model") == model)


@pytest.mark.parametrize(("model", "status"), [("m", "200"), ("other", "404")])
def test_the_epp_records_how_each_http_request_ended(gateway: tuple[int, int], model: str,
                                                     status: str) -> None:
    port, metrics_port = gateway
    before = _finished(metrics_port, model, status)
    code, reply = _post(port, {"model": model, "prompt": "hello", "max_tokens": 1})
    assert code == int(status), reply
    # Envoy shows the EPP no response message: the status comes with the access-log entry.
    deadline = time.monotonic() + 10
    while _finished(metrics_port, model, status) < before + 1:
        assert time.monotonic() < deadline, "the EPP never recorded the request's status"
        time.sleep(0.05)


def test_a_malformed_body_is_a_400_from_the_epp(gateway: tuple[int, int]) -> None:
    port, _ = gateway
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b"{oops",
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=20)
    assert info.value.code == 400
    assert "error" in json.loads(info.value.read())

