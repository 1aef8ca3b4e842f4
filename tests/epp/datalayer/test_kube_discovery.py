"""Kubernetes discovery: the real kubernetes_asyncio client against the API server double.

Every case issue 18 lists: pods becoming ready, unready, terminating, deleted; the pool's selector
and target ports changing; the pool deleted; bookmarks; watch expiry (410 Gone -> relist);
the API server restarting mid-watch; RBAC forbidding a read; InferenceObjective priorities.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from kvswitch.epp.datalayer import H2C, HTTP
from kvswitch.epp.datalayer.kube_discovery import KubernetesDiscovery, api_client
from tests.support.kube_api import KubeApiDouble, inference_objective, inference_pool, pod
from tests.support.waiting import until

POOL = "qwen3"
WATCHED = ("pods", "inferencepools", "inferenceobjectives")


class Follower:
    """Runs `discovery.watch()` and keeps every endpoint set it yields."""

    def __init__(self, discovery: KubernetesDiscovery) -> None:
        self.discovery = discovery
        self.sets: list[tuple[str, ...]] = []
        self.protocols: dict[str, str] = {}
        self.priorities: list[dict[str, int]] = []
        self.health: list[tuple[bool, str]] = []
        discovery.on_objectives = lambda p: self.priorities.append(dict(p))
        discovery.add_health_listener(lambda ready, problem: self.health.append((ready, problem)))
        self.task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        async for specs in self.discovery.watch():
            self.protocols.update({s.address: s.app_protocol for s in specs})
            self.sets.append(tuple(s.address for s in specs))

    @property
    def current(self) -> tuple[str, ...] | None:
        return self.sets[-1] if self.sets else None

    async def until_set(self, *addresses: str) -> None:
        await until(lambda: self.current == tuple(addresses))

    async def close(self) -> None:
        self.task.cancel()
        # A watch that swallowed its cancel would otherwise hang teardown until pytest's timeout.
        done, _ = await asyncio.wait({self.task}, timeout=10)
        assert done, "discovery.watch() still running 10 s after its cancel"
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@pytest.fixture
async def api() -> AsyncIterator[KubeApiDouble]:
    double = KubeApiDouble()
    await double.start()
    yield double
    await double.stop()


@pytest.fixture
async def follow(api: KubeApiDouble, tmp_path: Path) -> AsyncIterator[Callable[..., Follower]]:
    kubeconfig = api.kubeconfig(tmp_path)
    followers: list[Follower] = []

    def start(**kwargs: Any) -> Follower:
        discovery = KubernetesDiscovery(POOL, "default", lambda: api_client(str(kubeconfig)),
                                        backoff_initial=0.01, backoff_max=0.05, **kwargs)
        followers.append(Follower(discovery))
        return followers[-1]

    yield start
    for follower in followers:
        await follower.close()


def _seed(api: KubeApiDouble) -> None:
    api.put("inferencepools", inference_pool(POOL, ports=(8000,)))
    api.put("pods", pod("a", "10.0.0.1"))
    api.put("pods", pod("b", "10.0.0.2"))
    api.put("pods", pod("pending", None, ready=False))
    api.put("pods", pod("unready", "10.0.0.3", ready=False))
    api.put("pods", pod("other", "10.0.0.9", labels={"app": "llama"}))
    api.put("pods", pod("elsewhere", "10.0.1.1", namespace="team-b"))


async def test_lists_ready_selected_pods_at_each_target_port(api: KubeApiDouble,
                                                              follow: Callable[..., Follower]):
    _seed(api)
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    assert f.protocols["10.0.0.1:8000"] == H2C
    await until(lambda: f.discovery.ready and api.watchers("pods") == 1)
    pod_requests = [q for _, path, q in api.requests if path.endswith("/pods")]
    # A list, then a watch from the list's resourceVersion with bookmarks.
    assert "watch" not in pod_requests[0]
    assert pod_requests[1]["watch"] in ("true", "True")
    assert pod_requests[1]["allowWatchBookmarks"] in ("true", "True")
    assert pod_requests[1]["resourceVersion"] == str(api.revision)
    # The pool is read by name, in its namespace.
    pool_request = next(q for _, path, q in api.requests if path.endswith("/inferencepools"))
    assert pool_request["fieldSelector"] == f"metadata.name={POOL}"


async def test_pods_becoming_ready_unready_terminating_and_deleted(
        api: KubeApiDouble, follow: Callable[..., Follower]):
    _seed(api)
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    api.put("pods", pod("unready", "10.0.0.3"))  # becomes Ready
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
    api.put("pods", pod("a", "10.0.0.1", ready=False))  # fails its readiness probe
    await f.until_set("10.0.0.2:8000", "10.0.0.3:8000")
    api.put("pods", pod("b", "10.0.0.2", terminating=True))  # deleted: drains first
    await f.until_set("10.0.0.3:8000")
    api.delete("pods", "b")
    api.delete("pods", "unready")
    await f.until_set()
    api.put("pods", pod("pending", "10.0.0.4"))  # scheduled, got an IP, Ready
    await f.until_set("10.0.0.4:8000")
    # Each change produced exactly one new set: no duplicates, none lost.
    assert len(f.sets) == len(set(f.sets)) == 6


async def test_selector_target_ports_and_protocol_changes(api: KubeApiDouble,
                                                          follow: Callable[..., Follower]):
    _seed(api)
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    api.put("inferencepools", inference_pool(POOL, ports=(8000, 8001)))
    await f.until_set("10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001")
    api.put("inferencepools", inference_pool(POOL, ports=(9000,), labels={"app": "llama"},
                                             app_protocol=HTTP))
    await f.until_set("10.0.0.9:9000")
    assert f.protocols["10.0.0.9:9000"] == HTTP


async def test_pool_deleted_and_recreated(api: KubeApiDouble, follow: Callable[..., Follower]):
    _seed(api)
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    await until(lambda: f.discovery.ready)
    api.delete("inferencepools", POOL)
    await f.until_set()
    await until(lambda: not f.discovery.ready)
    assert "not found" in f.discovery.problem
    api.put("inferencepools", inference_pool(POOL))
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    await until(lambda: f.discovery.ready)


async def test_another_pool_is_ignored(api: KubeApiDouble, follow: Callable[..., Follower]):
    _seed(api)
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    api.put("inferencepools", inference_pool("llama", labels={"app": "llama"}))
    api.put("pods", pod("c", "10.0.0.5"))  # an event after it, to know it was seen
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.5:8000")


async def test_expired_watch_relists_without_losing_or_duplicating(
        api: KubeApiDouble, follow: Callable[..., Follower]):
    _seed(api)
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    await until(lambda: api.watchers("pods") == 1)
    # While the watch is away, pods change and the history they were in is compacted.
    api.drop_connections()
    api.delete("pods", "a")
    api.put("pods", pod("c", "10.0.0.5"))
    api.put("pods", pod("b", "10.0.0.2", ready=False))
    api.compact()
    await f.until_set("10.0.0.5:8000")
    assert f.discovery.relists >= 1
    assert all(len(s) == len(set(s)) for s in f.sets)
    # The relisted watch goes on from the new resourceVersion.
    api.put("pods", pod("d", "10.0.0.6"))
    await f.until_set("10.0.0.5:8000", "10.0.0.6:8000")


async def test_ended_watch_resumes_from_its_resource_version(
        api: KubeApiDouble, follow: Callable[..., Follower]):
    _seed(api)
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    await until(lambda: api.watchers("pods") == 1)
    api.expire_watches()  # timeoutSeconds elapsed
    api.put("pods", pod("c", "10.0.0.5"))  # made before the new watch starts
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.5:8000")
    assert f.discovery.relists == 0
    watches = [q for _, path, q in api.requests if path.endswith("/pods") and "watch" in q]
    assert len(watches) >= 2 and int(watches[1]["resourceVersion"]) < int(api.revision)


async def test_bookmarks_keep_the_resource_version_current(
        api: KubeApiDouble, follow: Callable[..., Follower]):
    _seed(api)
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    # Every kind watches: one still listing when the history is compacted would relist.
    await until(lambda: all(api.watchers(p) == 1 for p in WATCHED))
    # Changes the pool's pod watch does not see (another namespace) advance the revision.
    for i in range(3):
        api.put("pods", pod(f"x{i}", f"10.0.2.{i}", namespace="team-b"))
    api.bookmark()
    seen = len(api.requests)
    api.compact()
    api.expire_watches()
    await until(lambda: any(path.endswith("/pods") and "watch" in q
                            for _, path, q in api.requests[seen:]))
    resumed = next(q for _, path, q in api.requests[seen:]
                   if path.endswith("/pods") and "watch" in q)
    # Resumed from the bookmark's resourceVersion: no 410, no relist.
    assert resumed["resourceVersion"] == str(api.revision)
    assert f.discovery.relists == 0


async def test_malformed_event_relists(api: KubeApiDouble, follow: Callable[..., Follower]):
    _seed(api)
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    await until(lambda: api.watchers("pods") == 1)
    api.send_raw("pods", b'{"type": "ADDED", "object": [1, 2]}\n')
    api.send_raw("pods", b"not json\n")
    api.put("pods", pod("c", "10.0.0.5"))
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.5:8000")
    await until(lambda: f.discovery.relists >= 1 and f.discovery.ready)


async def test_api_server_restart_mid_watch(api: KubeApiDouble, follow: Callable[..., Follower]):
    _seed(api)
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    await until(lambda: api.watchers("pods") == 1)
    await api.stop(keep_port=True)
    api.put("pods", pod("c", "10.0.0.5"))
    api.delete("pods", "a")
    # While it is gone, the last known endpoints stay.
    assert f.current == ("10.0.0.1:8000", "10.0.0.2:8000")
    await api.start()
    await f.until_set("10.0.0.2:8000", "10.0.0.5:8000")
    assert f.discovery.ready


async def test_forbidden_read_is_not_ready_with_a_clear_error(
        api: KubeApiDouble, follow: Callable[..., Follower]):
    _seed(api)
    api.forbidden.add("pods")
    f = follow()
    await until(lambda: f.current == ())
    await until(lambda: "forbidden" in f.discovery.problem)
    assert not f.discovery.ready
    assert 'cannot list resource "pods"' in f.discovery.problem
    assert f.health and f.health[-1][0] is False
    # RBAC fixed: the next retry lists and the pool becomes ready.
    api.forbidden.clear()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    await until(lambda: f.discovery.ready)
    assert f.health[-1] == (True, "")


async def test_forbidden_mid_run_keeps_endpoints_and_turns_not_ready(
        api: KubeApiDouble, follow: Callable[..., Follower]):
    _seed(api)
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    await until(lambda: f.discovery.ready and api.watchers("inferencepools") == 1)
    api.forbidden.add("inferencepools")
    api.drop_connections()
    await until(lambda: not f.discovery.ready)
    assert "InferencePool: forbidden" in f.discovery.problem
    assert f.current == ("10.0.0.1:8000", "10.0.0.2:8000")


async def test_objectives_set_priorities(api: KubeApiDouble, follow: Callable[..., Follower]):
    _seed(api)
    api.put("inferenceobjectives", inference_objective("batch", -1, POOL))
    api.put("inferenceobjectives", inference_objective("other-pool", 7, "llama"))
    f = follow()
    await until(lambda: f.priorities[-1:] == [{"batch": -1}])
    api.put("inferenceobjectives", inference_objective("interactive", 5, POOL))
    await until(lambda: f.priorities[-1] == {"batch": -1, "interactive": 5})
    api.delete("inferenceobjectives", "batch")
    await until(lambda: f.priorities[-1] == {"interactive": 5})


async def test_credentials_that_do_not_load_are_retried_not_ready(
        api: KubeApiDouble, tmp_path: Path) -> None:
    _seed(api)
    kubeconfig = tmp_path / "late-kubeconfig"
    discovery = KubernetesDiscovery(POOL, "default", lambda: api_client(str(kubeconfig)),
                                    backoff_initial=0.01, backoff_max=0.05)
    f = Follower(discovery)
    try:
        # The EPP gets an (empty) first set so it can start, and says why it is not ready.
        await until(lambda: f.current == ())
        assert not discovery.ready and "cannot load Kubernetes credentials" in discovery.problem
        api.kubeconfig(tmp_path).rename(kubeconfig)  # mounted late, e.g. a projected volume
        await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
        await until(lambda: discovery.ready)
    finally:
        await f.close()


async def test_missing_objective_crd_counts_as_none(api: KubeApiDouble,
                                                    follow: Callable[..., Follower]):
    _seed(api)
    api.missing.add("inferenceobjectives")
    f = follow()
    await f.until_set("10.0.0.1:8000", "10.0.0.2:8000")
    await until(lambda: f.discovery.ready)
