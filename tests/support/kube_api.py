"""A Kubernetes API server test double: list and watch over loopback HTTP, as the real one.

`KubeApiDouble` serves namespaced collections (`/api/v1/namespaces/NS/pods`,
`/apis/GROUP/VERSION/namespaces/NS/PLURAL`) on 127.0.0.1:
- list: `{"kind": "...List", "metadata": {"resourceVersion": "N"}, "items": [...]}`, honouring
  `fieldSelector=metadata.name=X` and equality `labelSelector`s;
- watch (`?watch=true&resourceVersion=N`): a chunked stream of one JSON event per line
  (ADDED / MODIFIED / DELETED after N from the history, then live; BOOKMARK on `bookmark()` to
  watches that sent `allowWatchBookmarks=true`), ended by `timeoutSeconds` or `expire_watches()`;
  a resourceVersion older than the last `compact()` gets the ERROR event with a 410 Status
  (`reason: Expired`), as the API server sends it;
- `forbid(plural)`: 403 with a Status naming the resource; `drop_connections()` aborts every
  open watch; `stop(keep_port=True)` / `start()` restart the server on the same port (state
  kept);
- `requests` records (method, path, query) of every request, for assertions.
Objects get `metadata.resourceVersion` and `uid` from one counter, as etcd's revision.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

_KINDS = {"pods": ("Pod", "v1"), "inferencepools": ("InferencePool", ""),
          "inferenceobjectives": ("InferenceObjective", "")}


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


@dataclass
class _Watch:
    plural: str
    namespace: str
    selector: dict[str, str]
    name: str | None
    bookmarks: bool
    queue: asyncio.Queue[dict[str, Any] | bytes | None] = field(default_factory=asyncio.Queue)
    transport: asyncio.Transport | None = None


def _flag(query: Mapping[str, str], name: str) -> bool:
    """A boolean query parameter as the API server parses it (Go's strconv.ParseBool)."""
    return query.get(name, "") in ("1", "t", "T", "TRUE", "true", "True")


def _labels(text: str) -> dict[str, str]:
    out = {}
    for term in filter(None, text.split(",")):
        key, _, value = term.partition("=")
        out[key.strip()] = value.strip().lstrip("=")
    return out


class KubeApiDouble:
    def __init__(self) -> None:
        self._revision = itertools.count(1000)
        self.revision = 0
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._history: list[tuple[int, str, str, dict[str, Any]]] = []
        self.compacted = 0
        self.forbidden: set[str] = set()
        self.missing: set[str] = set()
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._watches: list[_Watch] = []
        self._stopped = False
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._reserved: socket.socket | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> int:
        self._stopped = False
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/{plural}", self._collection)
        app.router.add_get("/apis/{group}/{version}/namespaces/{ns}/{plural}", self._collection)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True,
                           reuse_port=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        return self.port

    async def stop(self, *, keep_port: bool = False) -> None:
        """The API server goes away: open watches are cut, new connections refused.

        keep_port: the port stays bound, not listening, until `start()`. Otherwise a client
        reconnecting meanwhile may get it as its own ephemeral port (a self-connect), whose
        TIME_WAIT keeps the restart from binding it for a minute."""
        self._stopped = True
        self.drop_connections()
        if self._runner is not None:
            if keep_port:
                # Bound beside the listener before it closes (SO_REUSEPORT on both): no gap.
                self._reserved = socket.socket()
                self._reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                self._reserved.bind(("127.0.0.1", self.port))
            await self._runner.cleanup()
            self._runner = None
        if not keep_port and self._reserved is not None:
            self._reserved.close()
            self._reserved = None

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "double",
            "clusters": [{"name": "double",
                          "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "epp", "user": {"token": "test-token"}}],
            "contexts": [{"name": "double", "context": {"cluster": "double", "user": "epp"}}],
        }))
        return path

    # -- state changes -------------------------------------------------------------------------

    def put(self, plural: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create or replace an object (ADDED or MODIFIED)."""
        stored: dict[str, Any] = copy.deepcopy(dict(obj))
        meta = stored.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        key = (plural, meta["namespace"], meta["name"])
        kind = "MODIFIED" if key in self._objects else "ADDED"
        self.revision = next(self._revision)
        meta["resourceVersion"] = str(self.revision)
        meta.setdefault("uid", f"uid-{meta['name']}-{self.revision}")
        self._objects[key] = stored
        self._emit(kind, plural, stored)
        return stored

    def delete(self, plural: str, name: str, namespace: str = "default") -> None:
        obj = self._objects.pop((plural, namespace, name))
        self.revision = next(self._revision)
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.revision)
        self._emit("DELETED", plural, obj)

    def compact(self) -> None:
        """Forget the history: watches from an older resourceVersion get 410 Gone."""
        self.compacted = self.revision
        self._history.clear()

    def bookmark(self) -> None:
        for watch in self._watches:
            if watch.bookmarks:
                kind, api = self._kind(watch.plural)
                watch.queue.put_nowait({"type": "BOOKMARK", "object": {
                    "kind": kind, "apiVersion": api,
                    "metadata": {"resourceVersion": str(self.revision)}}})

    def expire_watches(self) -> None:
        """End every watch stream cleanly, as timeoutSeconds does."""
        for watch in self._watches:
            watch.queue.put_nowait(None)

    def drop_connections(self) -> None:
        """Abort every watch's TCP connection mid-stream."""
        for watch in list(self._watches):
            if watch.transport is not None:
                watch.transport.abort()
            watch.queue.put_nowait(None)

    def send_raw(self, plural: str, line: bytes) -> None:
        """Write `line` as it is to every watch of `plural` (a malformed event)."""
        for watch in self._watches:
            if watch.plural == plural:
                watch.queue.put_nowait(line)

    def watchers(self, plural: str) -> int:
        return sum(1 for w in self._watches if w.plural == plural)

    def _emit(self, kind: str, plural: str, obj: dict[str, Any]) -> None:
        self._history.append((self.revision, kind, plural, obj))
        for watch in self._watches:
            if self._selected(watch.plural, watch.namespace, watch.selector, watch.name,
                              plural, obj):
                watch.queue.put_nowait({"type": kind, "object": obj})

    @staticmethod
    def _kind(plural: str) -> tuple[str, str]:
        return _KINDS.get(plural, (plural.rstrip("s").title(), ""))

    @staticmethod
    def _selected(plural: str, namespace: str, selector: Mapping[str, str], name: str | None,
                  obj_plural: str, obj: Mapping[str, Any]) -> bool:
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        return (obj_plural == plural and meta["namespace"] == namespace
                and (name is None or meta["name"] == name)
                and all(labels.get(k) == v for k, v in selector.items()))

    # -- HTTP ----------------------------------------------------------------------------------

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        plural, namespace = request.match_info["plural"], request.match_info["ns"]
        query = dict(request.query)
        self.requests.append((request.method, request.path, query))
        if plural in self.forbidden:
            group = request.match_info.get("group", "")
            return web.json_response(status(
                403, "Forbidden",
                f'{plural}{"." + group if group else ""} is forbidden: User '
                f'"system:serviceaccount:{namespace}:epp" cannot '
                f'{"watch" if _flag(query, "watch") else "list"} resource "{plural}" '
                f'in API group "{group}" in the namespace "{namespace}"'), status=403)
        if plural in self.missing:
            return web.json_response(status(404, "NotFound", "the server could not find the "
                                            "requested resource"), status=404)
        selector = _labels(query.get("labelSelector", ""))
        name = None
        if query.get("fieldSelector", "").startswith("metadata.name="):
            name = query["fieldSelector"].removeprefix("metadata.name=")
        if _flag(query, "watch"):
            return await self._watch(request, plural, namespace, selector, name, query)
        kind, api = self._kind(plural)
        items = [o for (p, _, _), o in sorted(self._objects.items())
                 if self._selected(plural, namespace, selector, name, p, o)]
        return web.json_response({"kind": f"{kind}List", "apiVersion": api or "v1",
                                  "metadata": {"resourceVersion": str(self.revision)},
                                  "items": items})

    async def _watch(self, request: web.Request, plural: str, namespace: str,
                     selector: dict[str, str], name: str | None,
                     query: Mapping[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        since = int(query.get("resourceVersion") or self.revision)
        if since < self.compacted:
            await self._send(response, {"type": "ERROR", "object": status(
                410, "Expired", f"too old resource version: {since} ({self.compacted})")})
            return response
        watch = _Watch(plural, namespace, selector, name,
                       _flag(query, "allowWatchBookmarks"))
        watch.transport = request.transport  # type: ignore[assignment]
        for revision, kind, obj_plural, obj in self._history:
            if revision > since and self._selected(plural, namespace, selector, name,
                                                   obj_plural, obj):
                watch.queue.put_nowait({"type": kind, "object": obj})
        self._watches.append(watch)
        if self._stopped:  # stop() ran while this watch was being set up: it ends at once
            watch.queue.put_nowait(None)
        timeout = float(query.get("timeoutSeconds") or 0) or None
        try:
            async with asyncio.timeout(timeout):
                while (event := await watch.queue.get()) is not None:
                    await self._send(response, event)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self._watches.remove(watch)
        return response

    @staticmethod
    async def _send(response: web.StreamResponse, event: Mapping[str, Any] | bytes) -> None:
        await response.write(event if isinstance(event, bytes)
                             else json.dumps(event).encode() + b"\n")


def pod(name: str, ip: str | None, *, ready: bool = True, labels: Mapping[str, str] | None = None,
        terminating: bool = False, namespace: str = "default") -> dict[str, Any]:
    """A Pod object as the API server returns it (the fields discovery reads, and a few more)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": dict(labels or {"app": "qwen3"})}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        meta["deletionGracePeriodSeconds"] = 30
    status_: dict[str, Any] = {"phase": "Running" if ip else "Pending", "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"},
        {"type": "ContainersReady", "status": "True" if ready else "False"}]}
    if ip:
        status_["podIP"] = ip
        status_["podIPs"] = [{"ip": ip}]
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta,
            "spec": {"containers": [{"name": "engine", "image": "kvswitch"}]},
            "status": status_}


def inference_pool(name: str, *, ports: tuple[int, ...] = (8000,),
                   labels: Mapping[str, str] | None = None, app_protocol: str = "kubernetes.io/h2c",
                   namespace: str = "default") -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": dict(labels or {"app": "qwen3"})},
                     "targetPorts": [{"number": p} for p in ports],
                     "appProtocol": app_protocol,
                     "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}}}}


def inference_objective(name: str, priority: int, pool: str,
                        namespace: str = "default") -> dict[str, Any]:
    return {"apiVersion": "llm-d.ai/v1alpha2", "kind": "InferenceObjective",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"priority": priority,
                     "poolRef": {"group": "inference.networking.k8s.io", "name": pool}}}


class ThreadedKubeApi:
    """The double on its own event loop in a thread, for tests driving processes synchronously:
    `call(fn, *args)` runs `fn` (a double method, sync or async) on that loop and returns."""

    def __init__(self) -> None:
        import threading

        self.double = KubeApiDouble()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="kube-api-double")
        self._thread.start()

    def call(self, fn: Any, *args: Any) -> Any:
        async def run() -> Any:
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def start(self) -> int:
        return int(self.call(self.double.start))

    def close(self) -> None:
        self.call(self.double.stop)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
