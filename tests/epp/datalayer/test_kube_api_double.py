"""The API server double on the wire, read with a plain HTTP client: the shapes discovery's tests
rely on are the API server's (lists, chunked watch streams, 410 and 403 Status bodies)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.support.kube_api import KubeApiDouble, pod

PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture
async def api() -> AsyncIterator[KubeApiDouble]:
    double = KubeApiDouble()
    await double.start()
    yield double
    await double.stop()


async def test_list_then_watch_on_the_wire(api: KubeApiDouble) -> None:
    api.put("pods", pod("a", "10.0.0.1"))
    base = f"http://127.0.0.1:{api.port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(base + PODS) as reply:
            assert reply.status == 200 and reply.content_type == "application/json"
            listed = await reply.json()
        assert listed["kind"] == "PodList" and listed["apiVersion"] == "v1"
        version = listed["metadata"]["resourceVersion"]
        assert [p["metadata"]["name"] for p in listed["items"]] == ["a"]
        params = {"watch": "true", "resourceVersion": version, "allowWatchBookmarks": "true"}
        async with http.get(base + PODS, params=params) as reply:
            assert reply.headers["Transfer-Encoding"] == "chunked"
            api.put("pods", pod("b", "10.0.0.2"))
            api.put("pods", pod("b", "10.0.0.2", ready=False))
            api.delete("pods", "a")
            api.bookmark()
            api.expire_watches()
            events = [json.loads(line) async for line in reply.content]
        assert [(e["type"], e["object"]["metadata"].get("name")) for e in events] == [
            ("ADDED", "b"), ("MODIFIED", "b"), ("DELETED", "a"), ("BOOKMARK", None)]
        versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
        assert versions == sorted(versions) and versions[0] > int(version)


async def test_expired_and_forbidden_status_bodies(api: KubeApiDouble) -> None:
    api.put("pods", pod("a", "10.0.0.1"))
    old = api.revision
    api.put("pods", pod("b", "10.0.0.2"))
    api.compact()
    base = f"http://127.0.0.1:{api.port}"
    async with aiohttp.ClientSession() as http:
        # A watch from a compacted resourceVersion: HTTP 200, one ERROR event, the end.
        params = {"watch": "1", "resourceVersion": str(old)}
        async with http.get(base + PODS, params=params) as reply:
            assert reply.status == 200
            (event,) = [json.loads(line) async for line in reply.content]
        assert event["type"] == "ERROR"
        assert event["object"] | {"message": ""} == {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "", "reason": "Expired", "code": 410}
        api.forbidden.add("pods")
        async with http.get(base + PODS) as reply:
            assert reply.status == 403
            status = await reply.json()
        assert (status["kind"], status["reason"], status["code"]) == ("Status", "Forbidden", 403)
        assert 'cannot list resource "pods" in API group "" in the namespace "default"' in (
            status["message"])


async def test_a_restart_keeps_the_port_and_refuses_while_stopped(api: KubeApiDouble) -> None:
    api.put("pods", pod("a", "10.0.0.1"))
    port = api.port
    await api.stop(keep_port=True)
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    # Held: a socket without SO_REUSEADDR (as a client's ephemeral port is) cannot take it.
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    assert await api.start() == port
    async with aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{port}{PODS}") as reply:
        assert [p["metadata"]["name"] for p in (await reply.json())["items"]] == ["a"]
