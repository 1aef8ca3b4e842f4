"""The frontend's HTTP routes (starlette), thin: read the body, call the serving object, reply.

Bodies are read with a size limit (413 beyond it) and decoded with orjson (400 when not JSON).
A client that disconnects while its request is being served cancels the handler, which
cancels the Generate call (streams watch for the disconnect themselves, in `SSEResponse`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvswitch.errors import InternalError, InvalidRequest, KvswitchError, PayloadTooLarge
from kvswitch.frontend.engine_client import EngineClient
from kvswitch.frontend.metrics import CONTENT_TYPE_LATEST, FrontendMetrics
from kvswitch.frontend.serving_chat import ChatServing
from kvswitch.frontend.serving_completions import CompletionServing
from kvswitch.frontend.serving_embeddings import EmbeddingServing
from kvswitch.frontend.serving_models import ModelRegistry
from kvswitch.frontend.sse import SSEResponse, error_response

__all__ = ["FrontendSettings", "build_app"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class FrontendSettings:
    target: str
    served_model_names: tuple[str, ...] = ()
    tokenizer_dir: str | None = None
    user_as_fairness_id: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def _read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes is over the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    try:
        return orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


async def _until_disconnect(work: Awaitable[Any], request: Request) -> Any:
    """Await `work` in this task; cancel it if the client disconnects first."""
    task = asyncio.current_task()
    assert task is not None

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    finally:
        watcher.cancel()


Handler = Callable[[Any, Mapping[str, str]], Awaitable[Any]]


class _FastPost:
    """ASGI: the POST routes are called straight, without Starlette's router and its two
    middlewares wrapping every `send` (one per SSE event); everything else goes to Starlette."""

    def __init__(self, app: Starlette, routes: dict[str, Callable[[Request], Awaitable[Any]]]
                 ) -> None:
        self._app, self._routes = app, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            await self._app(scope, receive, send)
            return
        response = await route(Request(scope, receive))
        await response(scope, receive, send)


def build_app(settings: FrontendSettings) -> _FastPost:
    client = EngineClient(settings.target)
    models = ModelRegistry(client, served_model_names=settings.served_model_names,
                           tokenizer_dir=settings.tokenizer_dir)
    metrics = FrontendMetrics()
    fairness = settings.user_as_fairness_id
    chat = ChatServing(client, models, user_as_fairness_id=fairness, metrics=metrics)
    completions = CompletionServing(client, models, user_as_fairness_id=fairness,
                                    metrics=metrics)
    embeddings = EmbeddingServing(client, models, user_as_fairness_id=fairness)

    def endpoint(name: str, handler: Handler) -> Callable[[Request], Awaitable[Any]]:
        async def route(request: Request) -> Any:
            started = time.monotonic()
            status = 200
            try:
                body = await _read_json(request, settings.max_body_bytes)
                result = await _until_disconnect(handler(body, request.headers), request)
            except KvswitchError as error:
                status = error.http_status
                return error_response(error)
            except asyncio.CancelledError:
                status = 499
                raise
            except Exception as exc:
                logger.exception("%s failed", name)
                status = 500
                return error_response(InternalError(f"internal error: {exc}"))
            finally:
                metrics.request(name, status, time.monotonic() - started)
            if isinstance(result, dict):
                return _json(result)
            metrics.first_token(time.monotonic() - started)
            return SSEResponse(result)
        return route

    async def list_models(request: Request) -> Response:
        try:
            model = await models.get()
        except KvswitchError as error:
            return error_response(error)
        return _json({"object": "list", "data": [
            {**model.card(), "id": name, "root": model.name} for name in model.names]})

    async def health(request: Request) -> Response:
        try:
            await models.get()
        except KvswitchError as error:
            return error_response(error)
        return Response(status_code=200)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Load the model now so the first request does not pay for it; a target that is not up
        # yet is retried on demand.
        try:
            await models.get()
        except KvswitchError as error:
            logger.warning("target %s not ready yet: %s", settings.target, error.message)
        yield
        await client.close()

    posts = {"/v1/chat/completions": endpoint("chat", chat.create),
             "/v1/completions": endpoint("completions", completions.create),
             "/v1/embeddings": endpoint("embeddings", embeddings.create)}
    routes = [
        *(Route(path, handler, methods=["POST"]) for path, handler in posts.items()),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    return _FastPost(Starlette(routes=routes, lifespan=lifespan), posts)
