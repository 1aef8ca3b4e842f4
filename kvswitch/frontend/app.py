"""The frontend's routes, thin: decode the body, call the serving object, reply.

Served by `http_server.Server`: bodies arrive whole (the server refuses those over the limit
with 413) and are decoded with orjson (400 when not JSON). A client that disconnects while its
request is being served cancels the task serving it, which cancels the Generate call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from kvswitch.errors import InternalError, InvalidRequest, KvswitchError, NotFound
from kvswitch.frontend.engine_client import EngineClient
from kvswitch.frontend.http_server import HttpRequest, Reply, StreamReply
from kvswitch.frontend.metrics import CONTENT_TYPE_LATEST, FrontendMetrics
from kvswitch.frontend.serving_chat import ChatServing
from kvswitch.frontend.serving_completions import CompletionServing
from kvswitch.frontend.serving_embeddings import EmbeddingServing
from kvswitch.frontend.serving_models import ModelRegistry
from kvswitch.frontend.sse import error_reply, sse_reply
from kvswitch.tls import UpstreamTls

__all__ = ["Frontend", "FrontendSettings", "build_app"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class FrontendSettings:
    target: str
    served_model_names: tuple[str, ...] = ()
    tokenizer_dir: str | None = None
    user_as_fairness_id: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    target_tls: UpstreamTls | None = None
    """Call the target over TLS; None: h2c."""


Handler = Callable[[Any, Mapping[str, str]], Awaitable[Any]]
Route = Callable[[HttpRequest], Awaitable[Reply | StreamReply]]


def _json(body: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(body))


def _decode(request: HttpRequest) -> Any:
    try:
        return orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


class Frontend:
    """The OpenAI API of one worker process (an `http_server.App`)."""

    def __init__(self, settings: FrontendSettings) -> None:
        self.settings = settings
        self._client = EngineClient(settings.target, settings.target_tls)
        self.models = ModelRegistry(self._client, served_model_names=settings.served_model_names,
                                    tokenizer_dir=settings.tokenizer_dir)
        self.metrics = FrontendMetrics()
        fairness = settings.user_as_fairness_id
        chat = ChatServing(self._client, self.models, user_as_fairness_id=fairness,
                           metrics=self.metrics)
        completions = CompletionServing(self._client, self.models, user_as_fairness_id=fairness,
                                        metrics=self.metrics)
        embeddings = EmbeddingServing(self._client, self.models, user_as_fairness_id=fairness)
        self._routes: dict[tuple[str, str], Route] = {
            ("POST", "/v1/chat/completions"): self._endpoint("chat", chat.create),
            ("POST", "/v1/completions"): self._endpoint("completions", completions.create),
            ("POST", "/v1/embeddings"): self._endpoint("embeddings", embeddings.create),
            ("GET", "/v1/models"): self._list_models,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._prometheus,
        }
        self._paths = {path for _, path in self._routes}

    async def startup(self) -> None:
        # Load the model now so the first request does not pay for it; a target that is not up
        # yet is retried on demand.
        try:
            await self.models.get()
        except KvswitchError as error:
            logger.warning("target %s not ready yet: %s", self.settings.target, error.message)

    async def shutdown(self) -> None:
        await self._client.close()

    def handle(self, request: HttpRequest) -> Awaitable[Reply | StreamReply]:
        method = "GET" if request.method == "HEAD" else request.method  # server drops the body
        route = self._routes.get((method, request.path))
        if route is None:
            return self._no_route(request)
        return route(request)

    def refuse(self, error: KvswitchError) -> Reply:
        return error_reply(error)

    async def _no_route(self, request: HttpRequest) -> Reply:
        if request.path in self._paths:
            return Reply(405, b"Method Not Allowed", b"text/plain; charset=utf-8")
        return error_reply(NotFound(f"no route for {request.method} {request.path}"))

    def _endpoint(self, name: str, handler: Handler) -> Route:
        metrics = self.metrics

        async def route(request: HttpRequest) -> Reply | StreamReply:
            started = time.monotonic()
            status = 200
            try:
                result = await handler(_decode(request), request.headers)
            except KvswitchError as error:
                status = error.http_status
                return error_reply(error)
            except asyncio.CancelledError:
                status = 499
                raise
            except Exception as exc:
                logger.exception("%s failed", name)
                status = 500
                return error_reply(InternalError(f"internal error: {exc}"))
            finally:
                metrics.request(name, status, time.monotonic() - started)
            if isinstance(result, dict):
                return _json(result)
            metrics.first_token(time.monotonic() - started)
            return sse_reply(result)
        return route

    async def _list_models(self, request: HttpRequest) -> Reply:
        try:
            model = await self.models.get()
        except KvswitchError as error:
            return error_reply(error)
        return _json({"object": "list", "data": [
            {**model.card(), "id": name, "root": model.name} for name in model.names]})

    async def _health(self, request: HttpRequest) -> Reply:
        try:
            await self.models.get()
        except KvswitchError as error:
            return error_reply(error)
        return Reply(200, b"", b"text/plain; charset=utf-8")

    async def _prometheus(self, request: HttpRequest) -> Reply:
        return Reply(200, self.metrics.render(), CONTENT_TYPE_LATEST.encode())


def build_app(settings: FrontendSettings) -> Frontend:
    return Frontend(settings)
