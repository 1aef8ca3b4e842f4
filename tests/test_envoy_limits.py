"""The real Envoy with kvswitch's bootstrap against hostile HTTP/1.1 clients: a head sent a byte
at a time is cut off at the request-headers deadline (408), and heads over the size or field
limits are refused (431) before anything is routed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from kvswitch.envoy import EnvoyProcess, GatewayOptions, PoolTarget, build_bootstrap, render
from kvswitch.limits import HttpLimits
from tests.support.processes import free_port

LIMITS = HttpLimits(max_header_bytes=4096, max_headers=20, head_timeout=0.5)


@pytest.fixture(scope="module")
def envoy_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port, admin = free_port(), free_port()
    options = GatewayOptions(pool=PoolTarget((f"127.0.0.1:{free_port()}",), app_protocol="http"),
                             port=port, admin_port=admin, round_robin=True, http_limits=LIMITS)
    path = tmp_path_factory.mktemp("envoy") / "limits.yaml"
    path.write_text(render(build_bootstrap(options)))
    with EnvoyProcess(path, admin):
        yield port


def test_bootstrap_carries_the_limits() -> None:
    options = GatewayOptions(pool=PoolTarget(("127.0.0.1:1",)), http_limits=LIMITS)
    hcm = build_bootstrap(options)["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]
    assert hcm["request_headers_timeout"] == "0.5s"
    assert hcm["max_request_headers_kb"] == 4
    assert hcm["common_http_protocol_options"]["max_headers_count"] == 20
    assert hcm["request_timeout"] != "0s"


async def _status(reader: asyncio.StreamReader) -> int:
    line = await asyncio.wait_for(reader.readline(), 10)
    return int(line.split()[1])


async def test_a_head_sent_a_byte_at_a_time_is_cut_off(envoy_port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", envoy_port)
    head = b"GET / HTTP/1.1\r\nhost: x\r\n" + b"x-pad: " + b"p" * 400 + b"\r\n\r\n"
    answered = asyncio.ensure_future(_status(reader))
    started = time.monotonic()
    for byte in head:  # bounded: the head's 430 bytes, 20 ms apart, at most
        if answered.done():
            break
        writer.write(bytes([byte]))
        await asyncio.sleep(0.02)
    assert await answered == 408
    assert time.monotonic() - started < 5.0
    writer.close()


@pytest.mark.parametrize("extra", [
    b"x-big: " + b"v" * 5000 + b"\r\n",
    b"".join(b"x-h%d: 1\r\n" % i for i in range(25)),
])
async def test_heads_over_the_limits_are_431(envoy_port: int, extra: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", envoy_port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n" + extra + b"\r\n")
    assert await _status(reader) == 431
    writer.close()
