"""Token-in/token-out client for vLLM's HTTP API (and any engine that speaks the same subset).

Invariants:
- Prompts go out as token ids and sampled tokens come back as token ids with their logprobs: the client
  never tokenizes model output or re-tokenizes a conversation. The only text it tokenizes is new text the
  environment adds (the rendered first prompt, observations), through the engine's own /tokenize.
- Every failure is classified once, here: retryable (transport, timeout, 5xx, unparseable reply),
  non-retryable (4xx), or context length exceeded (a truncation, not a failure).
- Every call is watched for a stalled engine (``engines.watchdog``): a call outstanding on an engine that
  answers nothing, or generates nothing, for the stall timeout fails as EngineStalled within seconds.

Endpoints used: ``POST /inference/v1/generate`` (token ids in, token ids + logprobs + weight-version spans
out; vLLM needs ``--enable-scale-out``), ``POST /tokenize``, ``POST /detokenize``, ``GET /v1/models``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import httpx

from durable_rollouts.contracts.types import SamplingParams, TruncationReason
from durable_rollouts.engines.pool import EngineTransport, ShardedTransport
from durable_rollouts.engines.watchdog import Watchdog
from durable_rollouts.errors import ContextLengthExceeded, EngineBadReply, EngineBadRequest, EngineUnavailable
from durable_rollouts.turns.budget import turn_budget

_CONTEXT_MARKERS = ("maximum context length", "maximum model length", "max_model_len", "context length")


@dataclass
class Generation:
    """What one model call produced."""

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[str | None]
    finish_reason: str
    model_s: float
    queue_s: float


KEEPALIVE = httpx.Limits(max_connections=None, max_keepalive_connections=1024, keepalive_expiry=4.0)
"""Connections to the engines: as many kept open as calls were in flight (httpx keeps 20 by default, so a
worker with more model calls in flight than that closed and reopened a connection for most of them:
measured 613 connects for 512 calls at 32 in flight); idle ones are dropped after 4 s, before vLLM's
server closes them at 5 s (uvicorn's keep-alive timeout), so a call never lands on a closing one."""


def served_logprobs_mode(server_info: Any) -> str | None:
    """The logprobs mode in vLLM's ``/server_info?config_format=json`` answer (None when it names none)."""
    try:
        mode = server_info["vllm_config"]["model_config"]["logprobs_mode"]
    except (KeyError, TypeError):
        return None
    return mode if isinstance(mode, str) else None


class EngineClient:
    """Async HTTP client for a fleet of engine replicas; one per worker process."""

    def __init__(self, timeout_s: float = 120.0, stall_timeout_s: float | None = None) -> None:
        """``stall_timeout_s``: of calls made where ``engines.watchdog.stall_timeout`` is unset (None:
        those calls are not watched)."""
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            limits=KEEPALIVE,
            transport=EngineTransport(
                ShardedTransport(KEEPALIVE), keepalive_expiry=KEEPALIVE.keepalive_expiry or 4.0
            ),
        )
        self._max_len: dict[str, int] = {}
        self.watchdog = Watchdog(stall_timeout_s)

    async def aclose(self) -> None:
        await self.watchdog.aclose()
        await self._http.aclose()

    async def _post(self, base_url: str, path: str, body: dict[str, Any], model_call: bool = False) -> Any:
        url = f"{base_url}{path}"
        try:
            resp = await self.watchdog.watch(base_url, self._http.post(url, json=body), model_call=model_call)
        except httpx.TimeoutException as e:
            raise EngineUnavailable(f"{url}: timed out ({type(e).__name__})") from e
        except httpx.TransportError as e:
            raise EngineUnavailable(f"{url}: {type(e).__name__}: {e}") from e
        return _classify(url, resp)

    async def logprob_mode(self, base_url: str) -> str | None:
        """The logprobs mode the engine really serves, from vLLM's dev-mode ``/server_info`` (its whole
        config); None when the engine does not expose it (not in dev mode).

        Raises:
            EngineUnavailable: transport error, timeout or 5xx.
        """
        url = f"{base_url}/server_info"
        try:
            get = self._http.get(url, params={"config_format": "json"}, timeout=30.0)
            resp = await self.watchdog.watch(base_url, get)
        except httpx.TransportError as e:
            raise EngineUnavailable(f"{url}: {type(e).__name__}: {e}") from e
        if resp.status_code in (404, 405):
            return None
        return served_logprobs_mode(_classify(url, resp))

    async def max_model_len(self, base_url: str, model: str) -> int:
        """The engine's context length, read once per replica from /v1/models."""
        if base_url not in self._max_len:
            try:
                resp = await self.watchdog.watch(base_url, self._http.get(f"{base_url}/v1/models"))
            except httpx.TransportError as e:
                raise EngineUnavailable(f"{base_url}/v1/models: {type(e).__name__}: {e}") from e
            data = _classify(f"{base_url}/v1/models", resp)
            try:
                entry = next(m for m in data["data"] if m["id"] == model)
                self._max_len[base_url] = int(entry["max_model_len"])
            except (KeyError, TypeError, ValueError, StopIteration) as e:
                raise EngineBadReply(f"{base_url}/v1/models: no max_model_len for model {model!r}") from e
        return self._max_len[base_url]

    async def tokenize_chat(
        self,
        base_url: str,
        model: str,
        messages: list[dict[str, str]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Render messages (and the tools a harness declares) through the model's chat template once and
        return the token ids; with the generation prompt unless told otherwise (a closed conversation)."""
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        if tools:
            body["tools"] = tools
        return _tokens(base_url, await self._post(base_url, "/tokenize", body))

    async def tokenize_text(self, base_url: str, model: str, text: str) -> list[int]:
        """Token ids of new text (special-token markers included), without adding a BOS."""
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        return _tokens(base_url, await self._post(base_url, "/tokenize", body))

    async def detokenize(self, base_url: str, model: str, token_ids: list[int]) -> str:
        data = await self._post(base_url, "/detokenize", {"model": model, "tokens": token_ids})
        if not isinstance(data, dict) or not isinstance(data.get("prompt"), str):
            raise EngineBadReply(f"{base_url}/detokenize: reply has no 'prompt' text")
        return data["prompt"]

    async def generate(
        self,
        base_url: str,
        model: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        request_id: str,
        stop: list[str] | None = None,
    ) -> Generation:
        """Sample up to max_tokens after prompt_ids, at most what the engine's window leaves
        (``turns.budget``); raises ContextLengthExceeded, without a request, if the prompt fills it.

        ``stop``: strings the engine ends the sample at (vLLM checks them on its detokenized text, so the
        request asks it to detokenize; it returns the tokens up to the one that completes the string, their
        logprobs with them). An engine that cannot (a ``--tokens-only`` vLLM) refuses: EngineBadRequest."""
        limit = await self.max_model_len(base_url, model)
        budget = turn_budget(len(prompt_ids), 0, max_tokens, limit)
        if budget.truncated == TruncationReason.CONTEXT_LENGTH:
            raise ContextLengthExceeded(f"prompt of {len(prompt_ids)} tokens leaves no room in {limit}")
        if budget.truncated is not None:
            raise EngineBadRequest(f"{base_url}: max_tokens {max_tokens}: a model call samples at least 1")
        params: dict[str, Any] = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": max(sampling.top_k, 0),
            "max_tokens": budget.max_tokens,
            "logprobs": 0,
            "detokenize": False,
        }
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        if sampling.min_tokens:
            params["min_tokens"] = min(sampling.min_tokens, params["max_tokens"])
        if stop:
            params.update(stop=stop, detokenize=True)
        body = {
            "model": model,
            "request_id": request_id,
            "token_ids": prompt_ids,
            "sampling_params": params,
            "output_mode": "tokens",
        }
        t0 = time.monotonic()
        data = await self._post(base_url, "/inference/v1/generate", body, model_call=True)
        elapsed = time.monotonic() - t0
        return _parse_generation(base_url, data, elapsed)


def _classify(url: str, resp: httpx.Response) -> Any:
    """Map an HTTP reply to its JSON body or to the right error class."""
    if resp.status_code >= 500:
        raise EngineUnavailable(f"{url}: HTTP {resp.status_code}: {resp.text[:200]}")
    if resp.status_code >= 400:
        text = resp.text[:300]
        if resp.status_code == 400 and any(m in text.lower() for m in _CONTEXT_MARKERS):
            raise ContextLengthExceeded(f"{url}: {text}")
        raise EngineBadRequest(f"{url}: HTTP {resp.status_code}: {text}")
    try:
        return resp.json()
    except ValueError as e:
        raise EngineBadReply(f"{url}: reply is not JSON: {resp.text[:120]!r}") from e


_LOGPROB, _TOKEN_ID = itemgetter("logprob"), itemgetter("token_id")


def _tokens(base_url: str, data: Any) -> list[int]:
    toks = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(toks, list) or not all(map(int.__instancecheck__, toks)):
        raise EngineBadReply(f"{base_url}/tokenize: reply has no integer 'tokens' list")
    return toks


def _parse_generation(base_url: str, data: Any, elapsed: float) -> Generation:
    url = f"{base_url}/inference/v1/generate"
    try:
        choice = data["choices"][0]
        token_ids = list(map(int, choice["token_ids"]))  # map, not a Python loop per token
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = list(map(float, map(_LOGPROB, content)))
        ids_from_logprobs = list(map(int, map(_TOKEN_ID, content)))
        finish = str(choice.get("finish_reason") or "stop")
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise EngineBadReply(f"{url}: malformed reply ({type(e).__name__}: {e})") from e
    if ids_from_logprobs != token_ids:
        raise EngineBadReply(f"{url}: {len(logprobs)} logprobs do not match {len(token_ids)} sampled tokens")
    versions = _expand_spans(choice.get("weight_versions"), len(token_ids))
    metrics = data.get("metrics") or {}
    queue_s = float(metrics.get("queued_time") or 0.0) if isinstance(metrics, dict) else 0.0
    return Generation(token_ids, logprobs, versions, finish, elapsed, queue_s)


def _expand_spans(spans: Any, n: int) -> list[str | None]:
    """Per-token versions from the engine's ``[start, end) sampled by version V`` spans."""
    out: list[str | None] = [None] * n
    for span in spans or []:
        start, end = max(int(span["start"]), 0), min(int(span["end"]), n)
        out[start:end] = [str(span["version"])] * (end - start)
    return out
