"""One gateway call as a model turn of its rollout (no Temporal): the harness's request rendered through
the engine's chat template, checked against the rollout's stored tokens, sampled token-in/token-out, stored
as segments, parsed and answered in OpenAI's shape.

Invariants:
- Idempotent on (rollout id, call index): the added context (segment ``c<index>.ctx``, or ``prompt`` for
  the first call), the sampled tokens (``t<index>.model``) and the answer are each written once; a retried
  call finds them, so an answered call is never sampled again.
- Loss mask by kind: sampled tokens are ``model`` segments (1); everything the harness added (its prompt,
  tool results, the template's tokens around them, the end of an assistant turn the model did not sample)
  is a ``prompt``/``observation``/``context`` segment (0).
- No sampled token is re-tokenized: a call that extends the previous one (`gateway.chat.extends`) appends
  only the template's tokens for the new messages; otherwise (a rewrite) a ``context`` segment starts a new
  sequence, its meta saying at which message and why, and later calls sample on that sequence only.
- One render of the conversation per call where it can be proven append-only with it: the template's
  render of the new conversation must start with its render of the previous call's (kept by digest,
  `Renders`), then the tokens the model sampled for the previous answer and the template's closing of it;
  what follows is appended. Where that does not hold (another worker rendered the previous call, the
  template re-tokenizes the answer otherwise, or changes earlier turns), the previous conversation closed
  is rendered too and the render must extend it, as a second render (`GatewayTurns._extension`).
- Limits answer as an OpenAI server would: no room left in the rollout's token budget or call count is a
  ``length`` finish with no content; a context the engine cannot take is a 400 ``context_length_exceeded``.
- The request's options (``gateway.options.Options``, recorded with the call) shape the sample without
  changing its logprobs' meaning: ``max_tokens`` lowers the call's cap (never raises it); ``stop`` goes to
  the engine, which stops on it itself, and the tokens it returned are stored as returned (the answer is
  cut before the stop string, the next call extends the stored tokens); ``tool_choice: none`` renders no
  tools and parses no tool call (a change of the tools offered starts a new sequence); a ``seed`` is
  recorded in the sample's meta (``request``), the rollout's own seed samples. An engine that refuses
  ``stop`` gets the call a stored 400 naming it.
- The answer is read in the run's format (``gateway.formats``: the parsers its ``[engine]`` names, else
  the built-in one), loaded before the call samples (a parser that cannot load fails the call, nothing
  sampled); with a vLLM parser, later prompts render the answer as the message the harness was given
  (``detail["rendered"]``), and the template's closing of it must be what the model sampled, or what the
  probe of the template's closing says follows it; otherwise a new sequence starts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from durable_rollouts.contracts.harness import GatewayCallInput, GatewayCallResult
from durable_rollouts.contracts.types import SamplingParams, TruncationReason
from durable_rollouts.errors import EngineBadRequest, EnvironmentFailure
from durable_rollouts.gateway import chat, formats
from durable_rollouts.gateway.options import Options, error
from durable_rollouts.store import RunStore, Segment, model_segment
from durable_rollouts.store.gateway_calls import GatewayCall
from durable_rollouts.turns.budget import turn_budget
from durable_rollouts.turns.clock import StoreClock
from durable_rollouts.turns.engine import Engine as TurnEngine
from durable_rollouts.turns.engine import Sampled
from durable_rollouts.turns.model import ModelTurns, call_model, sampled_segment


class Engine(TurnEngine, Protocol):
    """What a gateway call needs of an engine: a turn's, chat renders with tools and closed conversations,
    and samples that end at stop strings (``engines.client.EngineClient`` is one)."""

    async def tokenize_chat(
        self, base_url: str, model: str, messages: list[dict[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...  # fmt: skip

    async def generate(
        self, base_url: str, model: str, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
        request_id: str, stop: list[str] | None = None,
    ) -> Sampled: ...  # fmt: skip


class _Stopping:
    """An engine whose samples end at the request's stop strings (``turns.model.call_model``, the one
    sampling path of every model turn, passes none)."""

    def __init__(self, engine: Engine, stop: list[str]) -> None:
        self.engine, self.stop = engine, stop

    async def generate(
        self, base_url: str, model: str, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
        request_id: str,
    ) -> Sampled:  # fmt: skip
        return await self.engine.generate(
            base_url, model, prompt_ids, sampling, max_tokens, request_id, stop=self.stop
        )

    async def tokenize_chat(self, base_url: str, model: str, messages: list[dict[str, str]]) -> list[int]:
        return await self.engine.tokenize_chat(base_url, model, messages)

    async def detokenize(self, base_url: str, model: str, token_ids: list[int]) -> str:
        return await self.engine.detokenize(base_url, model, token_ids)

    async def logprob_mode(self, base_url: str) -> str | None:
        return await self.engine.logprob_mode(base_url)


def ctx_segment(index: int) -> str:
    """Name of the segment holding what the harness added before call ``index``."""
    return "prompt" if index == 0 else f"c{index:05d}.ctx"


log = logging.getLogger(__name__)

Answer = tuple[dict[str, Any], str | dict[str, Any]]
"""An answered call's message as the harness was given it, and how later prompts render it."""
Earlier = tuple[GatewayCall | None, list[tuple[int, Answer]]]
"""The call before a call (None: the first, or not recorded), and (index, `Answer`) of every answered call
before it."""

ANSWERS_CACHE = 1024
"""Rollouts whose earlier answers a worker keeps, to read only the previous call for the next one."""
RENDER_CACHE = 4096
"""Calls whose render (its length and digest, not the tokens) a worker keeps for the next call's check."""


class Renders:
    """The template's render of recent calls' conversations (with the generation prompt), kept as length
    and digest under (rollout id, call index, request key): a call's render is a pure function of its
    request and the answers before it, so a kept one stands for the render until evicted."""

    def __init__(self, size: int = RENDER_CACHE) -> None:
        self.size = size
        self._kept: OrderedDict[tuple[str, int, str], tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def keep(self, key: tuple[str, int, str], tokens: list[int]) -> None:
        with self._lock:
            self._kept[key] = (len(tokens), _digest(tokens))
            self._kept.move_to_end(key)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)

    def extension(
        self, key: tuple[str, int, str], full: list[int], answered: list[int], tail: list[int]
    ) -> list[int] | None:
        """The tokens to append after a call's stored answer (``answered``: the tokens it sampled) for
        the template's render ``full`` of the next conversation: ``tail`` (the template's closing the
        model did not sample) and what ``full`` adds after it; None when call ``key``'s render is not kept,
        or ``full`` is not that render, then ``answered`` and ``tail``, then more."""
        with self._lock:
            kept = self._kept.get(key)
        if kept is None:
            return None
        n, digest = kept
        end = n + len(answered) + len(tail)
        if len(full) < end or full[n:end] != [*answered, *tail] or _digest(full[:n]) != digest:
            return None
        return [*tail, *full[end:]]


def _digest(tokens: list[int]) -> bytes:
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).digest()


class GatewayTurns:
    """The gateway calls a worker answers: the store, the engine, and what it learnt of templates."""

    def __init__(
        self,
        store: RunStore,
        engine: Engine,
        parsers: Callable[[formats.Format], formats.AnswerParser] = formats.load_parser,
    ) -> None:
        self.store = store
        self.engine = engine
        self.load_parser = parsers
        """A run's format -> its answer parser (called once per format, off the event loop)."""
        self._formats: dict[str, formats.Format] = {}
        self._parsers: dict[formats.Format, formats.AnswerParser] = {}
        self.checks = ModelTurns(store, engine)
        """The checks every model turn makes: the logprobs mode served, a published policy version."""
        self._closing: dict[tuple[str, str], list[int]] = {}
        """(engine, model) -> the tokens the chat template closes an assistant turn with."""
        self.renders = Renders()
        """The renders of the calls this worker answered, for the next call's one-render check."""
        self._answers: OrderedDict[str, tuple[int, list[tuple[int, Answer]]]] = OrderedDict()
        """Rollout id -> (n, the answers of its calls before n) as last read (`ANSWERS_CACHE`)."""
        self._lock = threading.Lock()

    async def answer(
        self, inp: GatewayCallInput, attempt: int = 1, queued_s: float = 0.0
    ) -> GatewayCallResult:
        rid, idx = inp.ref.rollout_id, inp.index
        state = await asyncio.to_thread(self._read, rid, idx)  # one trip to the store thread, not five
        if state is None:
            raise EnvironmentFailure(f"rollout {rid}: gateway call {idx} was never recorded")
        call, tokens, earlier, ctx_seg, seg = state  # earlier: (the previous call, the answers before)
        if call.answered:
            return _result(call, attempt)
        if inp.limit is not None:
            return await self._limit(call, inp.limit, len(tokens), attempt)
        t0 = time.monotonic()
        fmt = await self._format(inp.ref.run_id)
        parser = await self._parser(fmt)  # before sampling: a parser that cannot load costs no sample
        options = Options.of_request(call.request)
        ctx, tokens = await self._context(inp, call, options, tokens, earlier, ctx_seg)
        seq_start = int(ctx.meta.get("sequence_start", 0))
        budget = turn_budget(len(tokens), inp.max_total_tokens, inp.max_tokens)  # over every sequence
        if budget.truncated is not None:
            return await self._limit(call, budget.truncated, len(tokens), attempt)
        unsaved = None
        if seg is None:
            cap = (
                budget.max_tokens
                if options.max_tokens is None
                else min(budget.max_tokens, options.max_tokens)
            )
            try:
                sampled = await self._sample(inp, tokens, seq_start, cap, options, attempt, queued_s, t0)
            except EngineBadRequest as e:
                if not options.stop:
                    raise
                why = f"the engine refused a sample ending at stop strings ({e}); leave 'stop' out"
                refusal = error(why, code="unsupported_value", param="stop")
                refused = {"refused": "stop", "start": len(tokens), "end": len(tokens)}
                stored = await asyncio.to_thread(self.store.answer_call, rid, idx, 400, refusal, refused)
                return _result(stored, attempt)
            if sampled == TruncationReason.CONTEXT_LENGTH:  # the engine's window is full
                refusal = error("context length exceeded", code="context_length_exceeded")
                at: dict[str, Any] = {"limit": sampled.value, "start": len(tokens), "end": len(tokens)}
                stored = await asyncio.to_thread(self.store.answer_call, rid, idx, 400, refusal, at)
                return _result(stored, attempt)
            if isinstance(sampled, TruncationReason):
                return await self._limit(call, sampled, len(tokens), attempt)
            seg = unsaved = sampled
        model = inp.ref.model
        closing = await self._closing_tokens(inp.engine_url, model)
        k = _sampled_closing(seg.token_ids, closing)
        written = seg.token_ids[: len(seg.token_ids) - k]
        if unsaved is None:
            raw = await self.engine.detokenize(inp.engine_url, model, written)
        else:  # the sample is stored while its text is read: neither waits for the other
            put: Segment
            put, raw = await asyncio.gather(
                asyncio.to_thread(self.store.put_segment, rid, unsaved),
                self.engine.detokenize(inp.engine_url, model, written),
            )
            seg = put
            if seg.token_ids != unsaved.token_ids:  # another attempt's sample was stored first: its text
                k = _sampled_closing(seg.token_ids, closing)
                written = seg.token_ids[: len(seg.token_ids) - k]
                raw = await self.engine.detokenize(inp.engine_url, model, written)
        finish = str(seg.meta.get("finish_reason") or "stop")  # the engine's: stop or length, as OpenAI's
        shown, stopped = chat.cut_at_stop(raw, options.stop)  # the answer ends before a stop string
        if stopped:
            finish = "stop"
        offered = options.offered(chat.request_messages(call.request)[1])
        if fmt.builtin:  # a regular expression over the answer: less than a trip to a thread
            parsed = parser.parse(shown, written, offered, options.tool_choice, idx)
        else:
            parsed = await asyncio.to_thread(parser.parse, shown, written, offered, options.tool_choice, idx)
        body = chat.completion(rid, idx, model, parsed, finish, seg.start - seq_start, len(seg.token_ids))
        versions = [v for v in seg.policy_versions or [] if v is not None]
        detail = {
            "raw": raw, "closing": closing[k:],
            "sequence_start": seq_start,
            "start": seg.start, "end": seg.end, "finish_reason": seg.meta.get("finish_reason"),
            "version": versions[-1] if versions else None, "rewrite": "rewrite" in ctx.meta,
        }  # fmt: skip
        if not fmt.builtin:  # later prompts render the answer as the harness was given it
            detail["rendered"] = chat.rendered_answer(body["choices"][0]["message"])
        stored = await asyncio.to_thread(self.store.answer_call, rid, idx, 200, body, detail)
        return _result(stored, attempt)

    def _read(
        self, rid: str, idx: int
    ) -> tuple[GatewayCall, list[int], Earlier, Segment | None, Segment | None] | None:
        """What a call's answer starts from, read at once: the call, the rollout's tokens, the previous
        call and the answers before this one, and its context and sampled segments where an earlier
        attempt stored them (None: the call was never recorded)."""
        call = self.store.get_call(rid, idx)
        if call is None or call.answered:
            return None if call is None else (call, [], (None, []), None, None)
        return (
            call,
            self.store.token_ids(rid),
            self._earlier(rid, idx),
            self.store.get_segment(rid, ctx_segment(idx)),
            self.store.get_segment(rid, model_segment(idx)),
        )

    def _earlier(self, rid: str, idx: int) -> Earlier:
        """Call ``idx - 1`` and the answers of the calls before ``idx``: the previous call read alone where
        this worker kept the answers before it (answers never change once written), else every call."""
        with self._lock:
            kept = self._answers.get(rid)
        prev: GatewayCall | None = None
        if idx == 0:
            answers: list[tuple[int, Answer]] = []
        elif kept is not None and kept[0] == idx - 1 and (prev := self.store.get_call(rid, idx - 1)):
            answers = [*kept[1], *_answers([prev])]
        else:
            calls = self.store.gateway_calls(rid, idx)
            prev = next((c for c in reversed(calls) if c.index == idx - 1), None)
            answers = _answers(calls)
        with self._lock:
            self._answers[rid] = (idx, answers)
            self._answers.move_to_end(rid)
            while len(self._answers) > ANSWERS_CACHE:
                self._answers.popitem(last=False)
        return prev, answers

    async def _sample(
        self,
        inp: GatewayCallInput,
        tokens: list[int],
        seq_start: int,
        max_tokens: int,
        options: Options,
        attempt: int,
        queued_s: float,
        t0: float,
    ) -> Segment | TruncationReason:
        """Sample on the call's sequence (``turns.model.call_model``: the turn's budget, the engine's window)
        under the checks of every model turn (the logprobs mode the run declares, a published policy
        version): the segment to store (the caller stores it), its tokens as the engine returned them
        (ended at a stop string by the engine itself); or the limit that left nothing."""
        rid, url, timed = inp.ref.rollout_id, inp.engine_url, StoreClock()
        served = await self.checks.served_mode(url, inp.sampling.logprob_mode)
        engine: TurnEngine = _Stopping(self.engine, list(options.stop)) if options.stop else self.engine
        # the budget counts every sequence (the caller's); the call samples on its own sequence
        gen = await call_model(
            engine, url, inp.ref.model, tokens[seq_start:], inp.sampling, max_tokens, 0,
            f"{rid}/gw{inp.index}/{attempt}",
        )  # fmt: skip
        if isinstance(gen, TruncationReason):
            return gen
        await self.checks.refuse_unknown_versions(url, gen.policy_versions, timed)
        asked = {"request": options.recorded()} if options.recorded() else {}  # seed, stop, max_tokens asked
        seg = sampled_segment(
            gen, name=model_segment(inp.index), turn=inp.index, start=len(tokens), engine_url=url,
            served=served, attempt=attempt, queued_s=queued_s, transfer_s=timed.seconds,
            gateway_call=inp.index, gateway_s=time.monotonic() - t0 - gen.model_s, **asked,
        )  # fmt: skip
        return seg

    async def _limit(
        self, call: GatewayCall, reason: TruncationReason, at: int, attempt: int
    ) -> GatewayCallResult:
        """Answer a call that a limit leaves nothing: a ``length`` finish with no content (no sampling)."""
        body = chat.completion(call.rollout_id, call.index, "", chat.Parsed(None, []), "length", at, 0)
        detail = {"limit": reason.value, "start": at, "end": at, "finish_reason": "length"}
        stored = await asyncio.to_thread(
            self.store.answer_call, call.rollout_id, call.index, 200, body, detail
        )
        return _result(stored, attempt)

    async def _context(
        self,
        inp: GatewayCallInput,
        call: GatewayCall,
        options: Options,
        tokens: list[int],
        earlier: Earlier,
        seg: Segment | None,
    ) -> tuple[Segment, list[int]]:
        """The segment of what the harness added before this call (stored once), and the rollout's tokens
        with it (``tokens`` as read, with the ``earlier`` call and answers, and the segment if stored). The
        conversation as the template renders it is recomputed (pure, from the request and the earlier
        answers)."""
        rid, idx = inp.ref.rollout_id, inp.index
        messages, asked = chat.request_messages(call.request)
        tools = options.offered(asked)
        if seg is not None:
            return seg, tokens
        prev, answers = earlier
        canon = chat.canonical(messages, [a for _, a in answers])
        url, model = inp.engine_url, inp.ref.model
        start, full = len(tokens), None
        meta: dict[str, Any] = {"gateway_call": idx}
        if prev is None:
            kind, ids = "prompt", await self.engine.tokenize_chat(url, model, canon, tools)
            meta["sequence_start"], full = 0, ids
        else:
            before = [a for i, a in answers if i < prev.index]
            added, why, at, full = await self._extension(inp, canon, tools, prev, before, tokens)
            meta["sequence_start"] = (prev.detail or {}).get("sequence_start", 0)
            kind, ids = "observation", added or []
            if added is None:  # a rewrite: a new sequence, rendered whole, sampled on alone
                if full is None:
                    full = await self.engine.tokenize_chat(url, model, canon, tools)
                kind, ids = "context", full
                meta.update(sequence_start=start, rewrite={"call": idx, "at_message": at, "why": why})
        seg = Segment(name=ctx_segment(idx), kind=kind, turn=None, start=start, token_ids=ids, meta=meta)
        seg = await asyncio.to_thread(self.store.put_segment, rid, seg)
        if full is not None:
            self.renders.keep((rid, idx, call.request_key), full)
        return seg, [*tokens, *seg.token_ids]

    async def _extension(
        self,
        inp: GatewayCallInput,
        canon: list[dict[str, Any]],
        tools: Any,
        prev: GatewayCall,
        answered_before: list[Answer],
        tokens: list[int],
    ) -> tuple[list[int] | None, str, int | None, list[int] | None]:
        """The tokens to append after the previous call's sampled tokens, or None with why and where not;
        and the template's render of ``canon`` where it was made."""
        url, model = inp.engine_url, inp.ref.model
        detail = prev.detail or {}
        if "raw" not in detail:
            why = detail.get("limit") or detail.get("refused")
            return None, f"call {prev.index} ended without an answer to extend ({why})", None, None
        before_tools = Options.of_request(prev.request).offered(prev.request.get("tools"))
        if before_tools != tools:
            why = "the tools offered differ from the previous call's (rendered in the prompt)"
            return None, why, None, None
        sent = detail.get("messages")  # rows written before the conversation was recomputed instead
        if sent is None:
            sent = chat.canonical(chat.request_messages(prev.request)[0], answered_before)
        before = [*sent, detail.get("rendered") or {"role": "assistant", "content": detail["raw"]}]
        at = chat.extends(canon, before)
        if at is not None:
            return None, f"message {at} differs from what the previous call sent and was answered", at, None
        full = await self.engine.tokenize_chat(url, model, canon, tools)
        tail = detail.get("closing", [])
        sampled = tokens[int(detail["start"]) : int(detail["end"])]
        added = self.renders.extension(
            (inp.ref.rollout_id, prev.index, prev.request_key), full, sampled, tail
        )
        if added is not None:
            return added, "", None, full
        prefix = await self.engine.tokenize_chat(url, model, before, tools, add_generation_prompt=False)
        delta = chat.template_delta(full, prefix)
        if delta is None:
            why = "the chat template's render of the new messages does not extend the old one"
            return None, why, None, full
        closing = await self._closing_tokens(url, model)
        if closing and prefix[-len(closing) :] != closing:  # the template closes this answer otherwise
            if not sampled or sampled[-1] != prefix[-1]:
                why = "the chat template closes the answer with a token the model did not sample"
                return None, why, None, full
            tail = []  # the model sampled the template's last token of it (gpt-oss's <|call|>)
        return [*tail, *delta], "", None, full

    async def _closing_tokens(self, url: str, model: str) -> list[int]:
        """The tokens the chat template puts after an assistant message's content (e.g. the end marker):
        what two closed conversations that differ only in their last answer's text end with alike."""
        key = (url, model)
        if key not in self._closing:
            probe = [{"role": "user", "content": "x"}]
            a, b = [
                await self.engine.tokenize_chat(
                    url, model, [*probe, {"role": "assistant", "content": text}], add_generation_prompt=False
                )
                for text in ("a", "b")
            ]
            n = 0
            while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
                n += 1
            self._closing[key] = a[len(a) - n :] if n else []
        return self._closing[key]

    async def _format(self, run_id: str) -> formats.Format:
        """The format the run's stored config names (read once per run; the built-in one for a run not in
        the store or whose config cannot be read)."""
        if run_id not in self._formats:
            row = await asyncio.to_thread(self.store.get_run, run_id)
            fmt = formats.Format()
            try:
                if row is not None:
                    fmt = formats.Format.of_config(json.loads(row["config_json"]))
            except (ValueError, TypeError, AttributeError) as e:
                log.warning("gateway: run %s: its stored config is unreadable: %s", run_id, e)
            self._formats[run_id] = fmt
        return self._formats[run_id]

    async def _parser(self, fmt: formats.Format) -> formats.AnswerParser:
        """The parser of ``fmt``, loaded once (in a thread: vLLM's import and a tokenizer take seconds).

        Raises:
            ConfigError: it cannot load (``gateway.formats.VllmParser``); one line naming the setting.
        """
        if fmt not in self._parsers:
            self._parsers[fmt] = await asyncio.to_thread(self.load_parser, fmt)
        return self._parsers[fmt]


def sequence_starts(segs: list[Segment]) -> list[dict[str, Any]]:
    """Where a rewritten history started a new token sequence (the record's ``sequences``; empty when the
    harness never rewrote its history)."""
    return [
        {"start": s.start, **s.meta["rewrite"]} for s in segs if s.kind == "context" and "rewrite" in s.meta
    ]


def _answers(calls: list[GatewayCall]) -> list[tuple[int, Answer]]:
    """The answered calls' (index, `Answer`)."""
    return [
        (c.index, (c.response["choices"][0]["message"], c.detail.get("rendered") or c.detail["raw"]))
        for c in calls
        if c.status == 200 and c.detail and "raw" in c.detail and c.response
    ]


def _sampled_closing(sampled: list[int], closing: list[int]) -> int:
    """How many of the template's closing tokens the model sampled at the end of its turn (e.g. its EOS)."""
    for k in range(min(len(closing), len(sampled)), 0, -1):
        if sampled[-k:] == closing[:k]:
            return k
    return 0


def _result(call: GatewayCall, attempt: int) -> GatewayCallResult:
    """What the workflow learns of an answered call (from its stored detail: the same on every retry)."""
    d = call.detail or {}
    limit = d.get("limit")
    return GatewayCallResult(
        index=call.index,
        start=int(d.get("start", 0)),
        end=int(d.get("end", 0)),
        finish_reason=str(d.get("finish_reason") or "stop"),
        policy_version=d.get("version"),
        truncated_reason=TruncationReason(limit) if limit else None,
        rewrite=bool(d.get("rewrite")),
        attempt=attempt,
    )
