"""HTTP routes of the simulated engine (aiohttp), mapping requests onto one `SimEngine`.

Invariant: every route answers either its vLLM-shaped success body or vLLM's error body with the status
vLLM would use (400 bad request or context too long, 404 unknown model, 5xx injected faults); the only
exception is an injected connection drop, which answers nothing.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from durable_rollouts.simengine.engine import HTTPFault, SimEngine
from durable_rollouts.simengine.faults import FaultUpdate
from durable_rollouts.simengine.protocol import (
    DetokenizeIn,
    GenerateIn,
    ModeIn,
    TokenizeChatIn,
    TokenizePromptIn,
    WeightVersionIn,
    error_body,
)
from durable_rollouts.simengine.settings import Mode, ModeRule

_ENGINE = web.AppKey("engine", SimEngine)
_Body = TypeVar("_Body", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(engine: SimEngine) -> web.Application:
    app = web.Application(middlewares=[_errors])
    app[_ENGINE] = engine
    app.router.add_post("/inference/v1/generate", _generate)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/update_weight_version", _update_weight_version)
    app.router.add_get("/weight_info", _weight_info)
    app.router.add_get("/server_info", _server_info)
    app.router.add_get("/fault", _get_fault)
    app.router.add_post("/fault", _set_fault)
    app.router.add_post("/mode", _set_mode)
    return app


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except HTTPFault as e:
        return web.json_response(error_body(e.status, e.message, e.param), status=e.status)


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        data: Any = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPFault(400, f"request body is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise HTTPFault(400, "request body must be a JSON object")
    return data


def _validate(model: type[_Body], data: dict[str, Any]) -> _Body:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise HTTPFault(400, f"{where}: {err['msg']}") from e


async def _body(request: web.Request, model: type[_Body]) -> _Body:
    return _validate(model, await _json(request))


async def _generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[_ENGINE]
    status = engine.faults.take_failure()
    if status is not None:
        raise HTTPFault(status, "simengine fault: failing this request on purpose")
    reply = await engine.generate(await _body(request, GenerateIn))
    if engine.faults.take_drop() and request.transport is not None:
        request.transport.abort()
    return web.json_response(reply)


async def _tokenize(request: web.Request) -> web.StreamResponse:
    engine = request.app[_ENGINE]
    data = await _json(request)
    if "messages" in data:
        chat = _validate(TokenizeChatIn, data)
        engine.check_model(chat.model)
        messages = [m.model_dump() for m in chat.messages]
        text = engine.tokenizer.render_chat(messages, chat.add_generation_prompt)
        ids = engine.tokenizer.encode(text, add_special_tokens=chat.add_special_tokens)
    else:
        plain = _validate(TokenizePromptIn, data)
        engine.check_model(plain.model)
        ids = engine.tokenizer.encode(plain.prompt, add_special_tokens=plain.add_special_tokens)
    return web.json_response(
        {"tokens": ids, "count": len(ids), "max_model_len": engine.settings.max_model_len}
    )


async def _detokenize(request: web.Request) -> web.StreamResponse:
    engine = request.app[_ENGINE]
    body = await _body(request, DetokenizeIn)
    engine.check_model(body.model)
    engine.check_token_ids(body.tokens)
    return web.json_response({"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)})


async def _models(request: web.Request) -> web.StreamResponse:
    engine = request.app[_ENGINE]
    entry = {
        "id": engine.settings.model,
        "object": "model",
        "created": engine.started,
        "owned_by": "simengine",
        "root": str(engine.settings.model_dir),
        "parent": None,
        "max_model_len": engine.settings.max_model_len,
    }
    return web.json_response({"object": "list", "data": [entry]})


async def _health(request: web.Request) -> web.StreamResponse:
    if request.app[_ENGINE].faults.unhealthy:
        raise HTTPFault(503, "simengine fault: unhealthy on purpose")
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.StreamResponse:
    text = request.app[_ENGINE].metrics_text()
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def _update_weight_version(request: web.Request) -> web.StreamResponse:
    body = await _body(request, WeightVersionIn)
    request.app[_ENGINE].weight_version = body.new_version
    return web.json_response({"success": True, "new_version": body.new_version})


async def _weight_info(request: web.Request) -> web.StreamResponse:
    return web.json_response({"weight_version": request.app[_ENGINE].weight_version})


async def _server_info(request: web.Request) -> web.StreamResponse:
    """The subset of vLLM's dev-mode /server_info?config_format=json the pipeline reads."""
    settings = request.app[_ENGINE].settings
    model_config = {"model": settings.model, "max_model_len": settings.max_model_len,
                    "logprobs_mode": settings.logprob_mode}  # fmt: skip
    return web.json_response({"vllm_config": {"model_config": model_config}})


async def _get_fault(request: web.Request) -> web.StreamResponse:
    return web.json_response(request.app[_ENGINE].faults.snapshot())


async def _set_fault(request: web.Request) -> web.StreamResponse:
    faults = request.app[_ENGINE].faults
    faults.apply(await _body(request, FaultUpdate))
    return web.json_response(faults.snapshot())


async def _set_mode(request: web.Request) -> web.StreamResponse:
    settings = request.app[_ENGINE].settings
    body = await _body(request, ModeIn)
    try:
        mode = Mode(body.mode) if body.mode is not None else settings.mode
        rules = [ModeRule.parse(r) for r in body.rules] if body.rules is not None else settings.mode_rules
    except ValueError as e:
        raise HTTPFault(400, str(e).splitlines()[0]) from e
    settings.mode, settings.mode_rules = mode, rules
    return web.json_response(
        {"mode": settings.mode.value, "rules": [f"{r.on}:{r.prefix}={r.mode.value}" for r in rules]}
    )
