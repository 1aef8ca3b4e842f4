"""The data layer and the KV-event subscriber against a real `kvswitch engine` that dies."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from kvswitch.epp.datalayer import H2C, Datalayer, EndpointSpec, Refresher, StaticDiscovery
from kvswitch.epp.kvindex import KvBlockIndex, KvEventSubscriber, LoadRecord
from tests.support.processes import Process, free_port, kvswitch_argv, wait_for_port
from tests.support.waiting import until


@pytest.mark.timeout(90)
async def test_a_killed_engine_is_not_ready_at_once_and_comes_back(tmp_path: Path) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    argv = kvswitch_argv("engine", "--port", str(port), "--profile", "tiny", "--time-scale", "20",
                         "--mode", "random", "--seed", "1", "--log-level", "WARNING")
    engine = Process(argv, tmp_path / "engine.log")
    datalayer = Datalayer()
    refresher = Refresher(datalayer, StaticDiscovery([EndpointSpec(address, H2C)]))

    def pushed(endpoint: str, load: LoadRecord) -> None:  # as the precise-prefix scorer does
        datalayer.push(endpoint, running=load.running, waiting=load.waiting,
                       kv_usage=load.token_usage, waiting_tokens=load.waiting_uncached_tokens,
                       ttl=2.5)

    subscriber = KvEventSubscriber(address, KvBlockIndex(16), on_load=pushed)
    try:
        wait_for_port(port, 30, engine.proc)
        await refresher.start()
        await subscriber.start()

        def ready() -> bool:
            return [e.address for e in datalayer.ready()] == [address]

        await until(lambda: ready() and subscriber.load is not None, timeout=10.0)
        engine.signal(signal.SIGKILL)
        killed = time.monotonic()
        await until(lambda: not ready(), timeout=2.0)
        assert time.monotonic() - killed < 0.5  # not at the next health poll (1 s) or TTL
        await until(lambda: not subscriber.connected, timeout=2.0)
        engine.stop()

        engine = Process(argv, tmp_path / "engine2.log")
        wait_for_port(port, 30, engine.proc)
        await until(ready, timeout=10.0)
        await until(lambda: subscriber.connected and subscriber.streams_opened >= 2, timeout=10.0)
    finally:
        await subscriber.stop()
        await refresher.stop()
        engine.stop()
