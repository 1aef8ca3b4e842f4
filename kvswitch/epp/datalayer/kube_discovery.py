"""Discovery from the Kubernetes API: an InferencePool, its pods and InferenceObjectives.

`KubernetesDiscovery(pool_name, namespace, client_factory)` implements `Discovery`: `watch()`
yields the pool's endpoint set (`kube_state.PoolView`) as soon as the first lists are in (or the
first attempt failed), then after every change. Three reflectors, one per kind, each run
list-then-watch with kubernetes_asyncio:
- list (the result replaces that kind wholesale), then watch from the list's resourceVersion
  with bookmarks; every event and bookmark advances the resourceVersion, so a watch that ends
  (server timeout, dropped connection, API server restart) resumes where it stopped;
- `410 Gone` (the resourceVersion was compacted away): relist at once; the relist replaces
  the kind, so nothing is lost or counted twice;
- unreachable API server or other errors: retry with exponential backoff (`backoff_initial`
  doubling to `backoff_max`), keeping the last known endpoints;
- `403 Forbidden`: logged with the API server's message and `ready` turns False until a read
  succeeds; `404` for InferenceObjectives (CRD not installed) counts as none.
`ready` (see `add_health_listener`) is True while every kind has been listed, none is
forbidden and the pool exists and parses. Credentials that do not load are retried with the same
backoff (an empty first set is yielded meanwhile, so the EPP starts, not ready).
InferenceObjective priorities go to `on_objectives`.
Pods are watched namespace-wide and matched to the selector here, so a selector change needs no
new watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvswitch.epp.datalayer.endpoint import EndpointSpec
from kvswitch.epp.datalayer.kube_state import BOOKMARK, PoolView

log = logging.getLogger(__name__)

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
OBJECTIVE_GROUP, OBJECTIVE_VERSION, OBJECTIVE_PLURAL = "llm-d.ai", "v1alpha2", "inferenceobjectives"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
MAX_OBJECTS = 20_000
"""Most objects of one kind a list may return; more is refused with an error."""


class KubeApiError(Exception):
    """An API call failed with an HTTP status (0: no response)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status


def default_namespace() -> str:
    """POD_NAMESPACE, else the service account's namespace, else `default`."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    with contextlib.suppress(OSError):
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    return "default"


async def api_client(kubeconfig: str | None = None) -> Any:
    """A kubernetes_asyncio ApiClient: `kubeconfig` if given, else in-cluster, else ~/.kube."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    if kubeconfig:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            await config.load_kube_config(client_configuration=configuration)
    return client.ApiClient(configuration=configuration)


def _status_message(body: bytes) -> str:
    try:
        status = json.loads(body)
    except ValueError:
        return body[:200].decode("utf-8", "replace")
    return str(status.get("message", "")) if isinstance(status, dict) else ""


class _Kind:
    """One watched kind: how to list/watch it and where its objects go."""

    def __init__(self, name: str, call: Callable[..., Awaitable[Any]], args: Sequence[Any],
                 replace: Callable[[list[Any]], None], apply: Callable[[str, Any], None],
                 absent_ok: bool = False, **params: Any) -> None:
        self.name, self.call, self.args, self.params = name, call, tuple(args), params
        self.replace, self.apply, self.absent_ok = replace, apply, absent_ok
        self.synced = False
        self.problem = ""


class KubernetesDiscovery:
    """Endpoints of InferencePool `pool_name` in `namespace` (see the module docstring)."""

    def __init__(self, pool_name: str, namespace: str,
                 client_factory: Callable[[], Awaitable[Any]], *,
                 watch_timeout: int = 300, backoff_initial: float = 0.1,
                 backoff_max: float = 5.0, watch_objectives: bool = True) -> None:
        self.pool_name, self.namespace = pool_name, namespace
        self.client_factory = client_factory
        self.watch_timeout = watch_timeout
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.watch_objectives = watch_objectives
        self.view = PoolView(pool_name)
        self.on_objectives: Callable[[Mapping[str, int]], None] | None = None
        """Called with the pool's objective priorities whenever they change."""
        self.ready = False
        self.problem = "not listed yet"
        self._listeners: list[Callable[[bool, str], None]] = []
        self._changed = asyncio.Event()
        self._kinds: list[_Kind] = []
        self.relists = 0
        """Lists made after the first of each kind (410 Gone, reconnects), for tests."""

    def add_health_listener(self, listener: Callable[[bool, str], None]) -> None:
        """Call `listener(ready, problem)` whenever readiness changes (and once now)."""
        self._listeners.append(listener)
        listener(self.ready, self.problem)

    async def _connect(self) -> AsyncIterator[Any]:
        """Yield None after each failure to load credentials (retried with backoff), then the
        ApiClient."""
        delay = self.backoff_initial
        while True:
            try:
                api = await self.client_factory()
            except Exception as exc:  # noqa: BLE001 - any config error: say so and retry
                self._set_health(False, f"cannot load Kubernetes credentials: {exc}")
                yield None
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff_max)
            else:
                yield api
                return

    async def watch(self) -> AsyncIterator[Sequence[EndpointSpec]]:
        from kubernetes_asyncio import client as k8s

        last: tuple[EndpointSpec, ...] | None = None
        api = None
        async for api in self._connect():
            if api is None and last is None:
                last = ()
                yield last  # (the EPP starts, not ready, while credentials are retried)
        assert api is not None
        core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
        view = self.view
        self._kinds = [
            _Kind("InferencePool", custom.list_namespaced_custom_object,
                  (POOL_GROUP, POOL_VERSION, self.namespace, POOL_PLURAL),
                  view.replace_pools, view.apply_pool,
                  field_selector=f"metadata.name={self.pool_name}"),
            _Kind("Pod", core.list_namespaced_pod, (self.namespace,),
                  view.replace_pods, view.apply_pod),
        ]
        if self.watch_objectives:
            self._kinds.append(_Kind(
                "InferenceObjective", custom.list_namespaced_custom_object,
                (OBJECTIVE_GROUP, OBJECTIVE_VERSION, self.namespace, OBJECTIVE_PLURAL),
                view.replace_objectives, view.apply_objective, absent_ok=True))
        tasks = [asyncio.create_task(self._reflect(kind), name=f"kube-{kind.name}")
                 for kind in self._kinds]
        try:
            while not all(k.synced or k.problem for k in self._kinds):
                await self._next_change()
            priorities = view.priorities()
            self._publish_objectives(priorities)
            if last is None or view.endpoints() != last:
                last = view.endpoints()
                log.info("pool %s/%s: %d endpoints", self.namespace, self.pool_name, len(last))
                yield last
            while True:
                await self._next_change()
                if (now := view.priorities()) != priorities:
                    priorities = now
                    self._publish_objectives(now)
                if (endpoints := view.endpoints()) != last:
                    last = endpoints
                    log.info("pool %s/%s: %d endpoints", self.namespace, self.pool_name,
                             len(endpoints))
                    yield endpoints
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await api.close()

    async def _next_change(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    def _publish_objectives(self, priorities: Mapping[str, int]) -> None:
        if self.on_objectives is not None:
            self.on_objectives(dict(priorities))

    def _update_health(self) -> None:
        problems = [f"{k.name}: {k.problem}" for k in self._kinds if k.problem]
        problems += [f"{k.name}: not listed yet" for k in self._kinds
                     if not k.synced and not k.problem]
        if not problems and self.view.pool_error:
            problems.append(self.view.pool_error)
        if not problems and self.view.target is None:
            problems.append(f"InferencePool {self.namespace}/{self.pool_name} not found")
        listing = all(k.synced or not k.problem for k in self._kinds) and any(
            not k.synced for k in self._kinds)
        self._set_health(not problems, "; ".join(problems), quiet=listing)
        self._changed.set()

    def _set_health(self, ready: bool, problem: str, *, quiet: bool = False) -> None:
        if (ready, problem) == (self.ready, self.problem):
            return
        self.ready, self.problem = ready, problem
        if ready:
            log.info("pool %s/%s: discovery ready", self.namespace, self.pool_name)
        elif quiet:  # still listing: not a problem yet
            log.debug("pool %s/%s: listing", self.namespace, self.pool_name)
        else:
            log.error("pool %s/%s: discovery not ready: %s", self.namespace, self.pool_name,
                      problem)
        for listener in self._listeners:
            listener(ready, problem)

    async def _reflect(self, kind: _Kind) -> None:
        """List-then-watch `kind` forever (see the module docstring)."""
        version: str | None = None
        delay = self.backoff_initial
        while True:
            try:
                if version is None:
                    version = await self._list(kind)
                version = await self._watch(kind, version)
                delay = self.backoff_initial
                continue
            except KubeApiError as exc:
                if exc.status == 410:
                    log.info("%s: resourceVersion %s expired; relisting", kind.name, version)
                    version = None
                    continue
                if exc.status == 404 and kind.absent_ok:
                    kind.replace([])
                    kind.synced, kind.problem = True, ""
                elif exc.status == 403:
                    kind.problem = f"forbidden: {exc}"
                else:
                    kind.problem = f"API error {exc}" if not kind.synced else ""
                    log.warning("%s: %s; retrying in %.1fs", kind.name, exc, delay)
            except (TimeoutError, OSError) as exc:
                # The API server went away: keep what is known, resume from `version`.
                log.warning("%s: API server unreachable (%s); retrying in %.1fs", kind.name,
                            exc or type(exc).__name__, delay)
                if not kind.synced:
                    kind.problem = f"API server unreachable: {exc or type(exc).__name__}"
            except Exception as exc:
                # A malformed answer must not end discovery: relist, as after 410.
                log.exception("%s: unexpected answer from the API server; relisting in %.1fs",
                              kind.name, delay)
                version = None
                if not kind.synced:
                    kind.problem = f"unexpected answer: {exc}"
            self._update_health()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_max)

    async def _list(self, kind: _Kind) -> str:
        import aiohttp

        try:
            response = await kind.call(*kind.args, **kind.params, _preload_content=False)
        except aiohttp.ClientError as exc:
            raise OSError(str(exc)) from exc
        try:
            body = await response.read()
        except aiohttp.ClientError as exc:
            raise OSError(str(exc)) from exc
        finally:
            response.release()
        if response.status != 200:
            raise KubeApiError(response.status, _status_message(body))
        try:
            listed = json.loads(body)
            items, version = listed["items"] or [], str(listed["metadata"]["resourceVersion"])
        except (ValueError, KeyError, TypeError) as exc:
            raise KubeApiError(0, f"malformed {kind.name} list: {exc}") from exc
        if not isinstance(items, list) or len(items) > MAX_OBJECTS:
            raise KubeApiError(0, f"{kind.name} list: expected at most {MAX_OBJECTS} items")
        if kind.synced:
            self.relists += 1
        kind.replace(items)
        kind.synced, kind.problem = True, ""
        self._update_health()
        return version

    async def _watch(self, kind: _Kind, version: str) -> str:
        """Follow `kind` from `version` until the stream ends; the last resourceVersion seen."""
        import aiohttp
        from kubernetes_asyncio.client.exceptions import ApiException
        from kubernetes_asyncio.watch import Watch

        watch = Watch(return_type="object")
        stream = watch.stream(kind.call, *kind.args, **kind.params, resource_version=version,
                              allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout,
                              _request_timeout=self.watch_timeout + 30)
        try:
            async with watch:
                async for event in stream:
                    obj = event["raw_object"]
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if event["type"] != BOOKMARK:
                        kind.apply(event["type"], obj)
                        self._update_health()
        except ApiException as exc:
            raise KubeApiError(exc.status or 0, str(exc.reason)) from exc
        except aiohttp.ClientError as exc:
            raise OSError(str(exc)) from exc
        return version
