"""`SimEngine`: the simulated engine's state and its generate path, plus the in-process server.

Invariant: a generate request is answered with exactly the tokens its policy decided, cut at ``max_tokens``
or at the context length, each token labelled with the weight version current when it was produced; a
prompt that does not fit is rejected with vLLM's 400 message before any work. All engine state (weight
version, faults, scheduler, counters) lives on one `SimEngine`, which tests may read and change directly.
With ``settings.timing`` set, requests run through the step-loop timing model (``steps``: continuous
batching, finite KV blocks, preemption; see `simengine.timing`) instead of ``scheduler`` and the fixed delays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from durable_rollouts.simengine.clock import SimClock
from durable_rollouts.simengine.faults import Faults
from durable_rollouts.simengine.metrics import (
    Counters,
    EngineView,
    Load,
    PrefixCounts,
    TimingView,
    render_metrics,
)
from durable_rollouts.simengine.policies import PolicyError, PolicyRequest, make_policy
from durable_rollouts.simengine.protocol import GenerateIn
from durable_rollouts.simengine.scheduler import PrefixCache, Scheduler
from durable_rollouts.simengine.settings import SimSettings
from durable_rollouts.simengine.steploop import StepLoop
from durable_rollouts.simengine.timing import StepScheduler
from durable_rollouts.simengine.tokenizer import SimTokenizer

DECODE_CHUNK = 16
"""Tokens produced per pacing step: coarse enough that thousands of requests do not flood the event loop."""


class HTTPFault(Exception):
    """A request ends with this HTTP status and message (vLLM's error body)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class SimEngine:
    """One simulated engine replica."""

    def __init__(self, settings: SimSettings, clock: SimClock | None = None) -> None:
        """Load the tokenizer and the policy (raises TaskFileError for a bad task file).

        ``clock`` drives the timing model (default: the wall clock sped up ``settings.timing.time_scale``
        times); engines that share a `PacedClock` with their clients keep simulated time consistent on a
        loaded machine.
        """
        self.settings = settings
        self.tokenizer = SimTokenizer(settings.model_dir)
        self.policy = make_policy(settings, self.tokenizer)
        self.faults = Faults()
        self.scheduler = Scheduler(settings.max_num_seqs, settings.kv_capacity_tokens)
        self.prefix = PrefixCache(settings.block_size, settings.num_gpu_blocks)
        self.counters = Counters()
        self.weight_version = settings.weight_version
        self.started = int(time.time())
        self.steps: StepLoop | None = None
        """The step-loop timing model, when ``settings.timing`` is set; it then replaces ``scheduler``."""
        if settings.timing is not None:
            steps = StepScheduler(
                settings.timing, settings.num_gpu_blocks, settings.block_size, settings.max_num_seqs
            )
            self.steps = StepLoop(steps, settings.timing, lambda: self.weight_version, clock)

    @asynccontextmanager
    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
        """Serve HTTP until the block exits; yields the base URL (``port=0`` picks a free port)."""
        from durable_rollouts.simengine.app import build_app

        runner = web.AppRunner(
            build_app(self), handler_cancellation=True, shutdown_timeout=2.0, access_log=None
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound_port = runner.addresses[0][1]
            yield f"http://{host}:{bound_port}"
        finally:
            self.faults.release_for_shutdown()
            await runner.cleanup()
            if self.steps is not None:
                await self.steps.aclose()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model:
            valid = self.settings.model
            raise HTTPFault(
                404, f"The model `{model}` does not exist. Valid aliases: {valid}.", param="model"
            )

    def check_token_ids(self, ids: list[int]) -> None:
        if not ids or (min(ids) >= 0 and max(ids) < self.tokenizer.vocab_size):
            return
        bad = next((t for t in ids if not 0 <= t < self.tokenizer.vocab_size), None)
        if bad is not None:
            raise HTTPFault(400, f"Token id {bad} is out of vocabulary (size {self.tokenizer.vocab_size})")

    async def generate(self, req: GenerateIn) -> dict[str, Any]:
        """Serve one generate request; raises `HTTPFault` for what vLLM would answer with an error."""
        self.check_model(req.model)
        prompt = req.token_ids
        self.check_token_ids(prompt)
        self._check_fits(len(prompt))
        sp = req.sampling_params
        try:
            turn = self.policy.turn(PolicyRequest(prompt, req.request_id, sp.temperature, sp.seed))
        except PolicyError as e:
            raise HTTPFault(400, str(e)) from e
        room = self.settings.max_model_len - len(prompt)
        limit = min(sp.max_tokens or room, room)
        tokens, logprobs = turn.token_ids[:limit], turn.logprobs[:limit]
        finish = "length" if len(turn.token_ids) > limit else "stop"
        try:
            if self.steps is not None:
                spans = await self._generate_timed(req.request_id, prompt, tokens)
            else:
                async with self.scheduler.admit(len(prompt) + len(tokens)):
                    self.prefix.lookup(prompt)
                    await self._check_hang()
                    await _sleep_ms(self.settings.prefill_ms)
                    self.counters.prompt_tokens += len(prompt)
                    spans = await self._decode(len(tokens))
        except asyncio.CancelledError:
            self.counters.finished["abort"] += 1
            raise
        if self.steps is not None:  # the timing model's sampled tokens are counted step by step
            self.counters.prompt_tokens += len(prompt)
        self.counters.finished[finish] += 1
        content = [_logprob(t, lp) for t, lp in zip(tokens, logprobs, strict=True)]
        choice = {
            "index": 0,
            "token_ids": tokens,
            "finish_reason": finish,
            "stop_reason": None,
            "logprobs": {"content": content} if sp.logprobs is not None else None,
            "weight_versions": spans,
        }
        return {
            "request_id": f"generate-tokens-{req.request_id}",
            "model": self.settings.model,
            "created": int(time.time()),
            "output_mode": "tokens",
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(tokens),
                "total_tokens": len(prompt) + len(tokens),
            },
        }

    def metrics_text(self) -> str:
        load: Load = self.scheduler
        prefix: PrefixCounts = self.prefix
        preemptions, timing, counters = 0, None, self.counters
        if self.steps is not None:
            steps = self.steps.scheduler
            load, prefix, preemptions = steps, steps.pool, steps.stats.preemptions
            counters = dataclasses.replace(counters, generation_tokens=steps.stats.sampled_tokens)
            timing = TimingView(self.steps.busy_wall_s, steps.stats.busy_s, steps.stats.recomputed_tokens)
        view = EngineView(
            model=self.settings.model,
            scheduler=load,
            prefix=prefix,
            counters=counters,
            num_gpu_blocks=self.settings.num_gpu_blocks,
            block_size=self.settings.block_size,
            preemptions=preemptions,
            timing=timing,
        )
        return render_metrics(view)

    async def _check_hang(self) -> None:
        await self.faults.wait_while_hung()
        if self.faults.closing:
            raise HTTPFault(503, "The engine is shutting down")

    async def _generate_timed(
        self, request_id: str, prompt: list[int], output: list[int]
    ) -> list[dict[str, Any]]:
        """Run one request through the timing model; returns its weight-version spans."""
        assert self.steps is not None
        await self._check_hang()
        seq = await self.steps.generate(request_id, prompt, output)
        return seq.spans

    def _check_fits(self, n: int) -> None:
        limit = self.settings.max_model_len
        if n > limit:
            raise HTTPFault(
                400,
                f"The decoder prompt (length {n}) is longer than the maximum model length of {limit}. "
                "Make sure that `max_model_len` is no smaller than the number of text tokens.",
            )
        if n == limit:
            raise HTTPFault(
                400,
                f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) is "
                f"longer than the maximum model length of {limit}. Make sure that `max_model_len` is no "
                "smaller than the number of text tokens (prompt + requested output tokens).",
            )

    async def _decode(self, n: int) -> list[dict[str, Any]]:
        """Pace ``n`` tokens; returns the ``[start, end)`` weight-version spans they were produced under.

        The token counters move as the tokens are produced (as vLLM's do, step by step: a watchdog judges
        progress on them), prompt tokens once the prefill is done."""
        spans: list[dict[str, Any]] = []
        for start in range(0, n, DECODE_CHUNK):
            end = min(n, start + DECODE_CHUNK)
            version = self.weight_version
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = end
            else:
                spans.append({"version": version, "start": start, "end": end})
            await _sleep_ms(self.settings.decode_ms_per_token * (end - start))
            self.counters.generation_tokens += end - start
        return spans


def _logprob(token_id: int, logprob: float) -> dict[str, Any]:
    """One ``logprobs.content`` entry as vLLM writes it for ``logprobs=0`` (the sampled token, rank 1)."""
    top = {"token_id": token_id, "logprob": logprob, "rank": 1}
    return {**top, "top_logprobs": [top]}


async def _sleep_ms(ms: float) -> None:
    if ms > 0:
        await asyncio.sleep(ms / 1000)
