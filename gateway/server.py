"""The gateway's HTTP side: OpenAI-compatible ``POST /v1/chat/completions`` and ``POST /v1/responses`` on
one Unix socket per rollout, served by the worker of the sandbox host that runs the rollout's sandbox.

Invariants:
- Addressed per rollout: each rollout's socket lives in its own folder (``sandboxes.base.gateway_dir``),
  the only folder its sandbox mounts; a request must also carry the rollout's key (``Bearer``), so every
  call is attributed to its rollout and a sandbox reaches only its own gateway.
- Durable: a request is recorded in the store before the rollout's workflow is told (signal
  ``gateway_call`` with the call's index); the answer is whatever the workflow's model-call activity
  stored, read from the store. A request repeated by the harness's client (a retry after a timeout or a
  worker's death) is the same call: answered from the store, never sampled again.
- Checked before it is recorded (``gateway.options.request_options``): a field the gateway refuses, or a
  sampling setting other than the run's (read from the run's stored config), is a 400 naming the field,
  and nothing is recorded or signalled.
- Streamed from the store: with ``stream: true`` the call is made and its answer stored first, then the
  stored answer is sent as server-sent ``chat.completion.chunk`` events (``gateway.chat.stream_chunks``);
  a client that retries a broken stream is the same call again and gets the same chunks.
- One call path for both APIs: a Responses request is recorded as the chat call it converts to
  (``gateway.responses``) and answered by the same activity; its answer is the stored chat answer read as
  a ``response`` (``gateway.response_items``), streamed as Responses events from the store in the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Awaitable, Callable

from aiohttp import web

from durable_rollouts.config.models import SamplingConfig
from durable_rollouts.gateway import chat, response_items, responses
from durable_rollouts.gateway.options import BadChatRequest, RunSampling, error, request_options
from durable_rollouts.sandboxes.base import gateway_dir
from durable_rollouts.store import RunStore
from durable_rollouts.store.gateway_calls import CallInFlight, GatewayCall

log = logging.getLogger(__name__)

SOCKET_NAME = "gw.sock"
ANSWER_TIMEOUT_S = 900.0
"""Longest a request waits for its answer before a 503 (the harness's client then retries it)."""
POLL_S = (0.005, 0.25)
"""First and longest wait between two looks at the store for an answer written by another worker."""

Signal = Callable[[str, int], Awaitable[None]]
"""Tell rollout ``rollout_id``'s workflow that call ``index`` waits (idempotent on the index)."""


def gateway_key(rollout_id: str, secret: str = "") -> str:
    """The key a rollout's harness presents (its ``OPENAI_API_KEY``); ``secret`` is the deployment's."""
    return "dr-" + hashlib.sha256(f"{secret}\0gateway\0{rollout_id}".encode()).hexdigest()[:40]


class GatewayServer:
    """The gateways of one worker process: one aiohttp site per rollout whose harness it watches."""

    def __init__(self, store: RunStore, secret: str | None = None) -> None:
        self.store = store
        self.secret = secret if secret is not None else os.environ.get("DR_GATEWAY_SECRET", "")
        self._runners: dict[str, web.AppRunner] = {}
        self._events: dict[tuple[str, int], asyncio.Event] = {}
        self._sampling: dict[str, RunSampling | None] = {}
        """Run id -> its sampling settings (what a request may repeat but not change)."""

    async def run_sampling(self, rollout_id: str) -> RunSampling | None:
        """The sampling settings of the rollout's run, from its config in the store (read once per run: it
        is recorded before the run's first rollout starts, and never changes); None when the run is not in
        the store or its config has no readable ``[sampling]``."""
        parts = rollout_id.rsplit("/", 2)  # <run>/<group>/<i>: contracts.types.rollout_id
        run_id = parts[0] if len(parts) == 3 else rollout_id
        if run_id not in self._sampling:
            row = await asyncio.to_thread(self.store.get_run, run_id)
            known: RunSampling | None = None
            try:
                if row is not None:
                    cfg = SamplingConfig.model_validate(json.loads(row["config_json"]).get("sampling") or {})
                    known = RunSampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_tokens)
            except (ValueError, TypeError, AttributeError) as e:
                log.warning("gateway: run %s: its stored sampling settings are unreadable: %s", run_id, e)
            self._sampling[run_id] = known
        return self._sampling[run_id]

    def socket_path(self, rollout_id: str) -> str:
        return os.path.join(gateway_dir(rollout_id), SOCKET_NAME)

    async def serve(self, rollout_id: str, model: str, signal: Signal) -> str:
        """Listen on the rollout's socket (replacing a stale one a dead worker left); returns its path."""
        if rollout_id in self._runners:
            return self.socket_path(rollout_id)
        folder = gateway_dir(rollout_id)
        os.makedirs(folder, mode=0o755, exist_ok=True)
        os.chmod(folder, 0o755)
        path = self.socket_path(rollout_id)
        if os.path.exists(path):
            os.unlink(path)
        app = web.Application(client_max_size=64 << 20)
        handler = _Handler(self, rollout_id, model, signal)
        app.router.add_post("/v1/chat/completions", handler.chat)
        app.router.add_post("/v1/responses", handler.responses)
        app.router.add_get("/v1/models", handler.models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, path).start()
        os.chmod(path, 0o666)  # the sandbox's non-root user connects; only its own sandbox mounts it
        self._runners[rollout_id] = runner
        return path

    async def stop(self, rollout_id: str) -> None:
        runner = self._runners.pop(rollout_id, None)
        if runner is not None:
            await runner.cleanup()
        path = self.socket_path(rollout_id)
        if os.path.exists(path):
            os.unlink(path)

    async def aclose(self) -> None:
        for rid in list(self._runners):
            await self.stop(rid)

    def notify(self, rollout_id: str, index: int) -> None:
        """An answer was written by this process: wake its waiting request at once."""
        event = self._events.get((rollout_id, index))
        if event is not None:
            event.set()

    async def wait_answer(self, rollout_id: str, index: int, timeout_s: float) -> bool:
        """Wait until call ``index`` is answered (woken by `notify`, or seen in the store)."""
        event = self._events.setdefault((rollout_id, index), asyncio.Event())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pause = POLL_S[0]
        try:
            while True:
                if await asyncio.to_thread(self.store.call_status, rollout_id, index) is not None:
                    return True
                left = deadline - loop.time()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(event.wait(), timeout=min(pause, left))
                except TimeoutError:
                    pause = min(pause * 2, POLL_S[1])
        finally:
            self._events.pop((rollout_id, index), None)


class _Handler:
    def __init__(self, server: GatewayServer, rollout_id: str, model: str, signal: Signal) -> None:
        self.server, self.rollout_id, self.model, self.signal = server, rollout_id, model, signal
        self.key = gateway_key(rollout_id, server.secret)

    async def models(self, request: web.Request) -> web.StreamResponse:
        if (denied := self._denied(request)) is not None:
            return denied
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    def _denied(self, request: web.Request) -> web.StreamResponse | None:
        if request.headers.get("Authorization", "") != f"Bearer {self.key}":
            body = error("invalid API key for this rollout's gateway", "authentication_error")
            return web.json_response(body, status=401)
        return None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            body = await request.json()
            messages, tools = chat.request_messages(body)
            options = request_options(body, await self.server.run_sampling(self.rollout_id))
        except BadChatRequest as e:
            return web.json_response(e.body(), status=400)
        except ValueError as e:
            return web.json_response(error(str(e)), status=400)
        recorded: dict[str, object] = {"messages": messages, "tools": tools}
        if options.recorded():
            recorded["options"] = options.recorded()
        call = await self._call(chat.request_key(messages, tools, options), recorded)
        if isinstance(call, web.StreamResponse):
            return call
        if options.stream and call.status == 200 and call.response is not None:
            return await self._stream(request, call.response, options.include_usage)
        return web.Response(
            status=call.status or 500, text=json.dumps(call.response), content_type="application/json"
        )

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``: the request as the chat call it converts to, the answer as a response."""
        if (denied := self._denied(request)) is not None:
            return denied
        try:
            body = await request.json()
            asked = responses.request_call(body, await self.server.run_sampling(self.rollout_id))
        except BadChatRequest as e:
            return web.json_response(e.body(), status=400)
        except ValueError as e:
            return web.json_response(error(str(e)), status=400)
        call = await self._call(asked.key(), asked.recorded())
        if isinstance(call, web.StreamResponse):
            return call
        if call.status != 200 or call.response is None:
            return web.Response(
                status=call.status or 500, text=json.dumps(call.response), content_type="application/json"
            )
        custom = set(call.request.get("custom_tools") or ())
        answer = response_items.response_object(call.response, self.rollout_id, call.index, custom)
        if not asked.options.stream:
            return web.json_response(answer)
        return await self._send(
            request, [response_items.sse(e) for e in response_items.stream_events(answer)]
        )

    async def _call(self, key: str, recorded: dict[str, object]) -> GatewayCall | web.StreamResponse:
        """The call a checked request is, answered: recorded before the workflow is signalled, waited for,
        read from the store (a repeated request finds it answered); or the error response."""
        store, rid = self.server.store, self.rollout_id
        try:
            call = await asyncio.to_thread(store.open_call, rid, key, recorded)
        except CallInFlight as e:
            return web.json_response(error(str(e), "conflict_error"), status=409)
        if call.answered:
            return call
        try:
            await self.signal(rid, call.index)
        except Exception as e:  # the rollout's workflow is gone or the server unreachable: retry later
            log.warning("gateway %s: call %d: cannot reach the rollout's workflow: %s", rid, call.index, e)
            return web.json_response(error(f"rollout unreachable: {e}", "server_error"), status=503)
        if not await self.server.wait_answer(rid, call.index, ANSWER_TIMEOUT_S):
            return web.json_response(error("no answer yet; retry", "server_error"), status=503)
        answered = await asyncio.to_thread(store.get_call, rid, call.index)
        assert answered is not None
        return answered

    async def _stream(self, request: web.Request, answer: dict, include_usage: bool) -> web.StreamResponse:
        """The stored answer as server-sent ``chat.completion.chunk`` events, then ``[DONE]``."""
        events = [
            b"data: " + json.dumps(c).encode() + b"\n\n" for c in chat.stream_chunks(answer, include_usage)
        ]
        return await self._send(request, [*events, b"data: [DONE]\n\n"])

    async def _send(self, request: web.Request, events: list[bytes]) -> web.StreamResponse:
        """Server-sent events computed from the stored answer; a client gone mid-stream ends it (its retry
        is answered from the store again, with the same events)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            for event in events:
                await resp.write(event)
            await resp.write_eof()
        except ConnectionError as e:
            log.info("gateway %s: the client left its stream: %s", self.rollout_id, e)
        return resp
