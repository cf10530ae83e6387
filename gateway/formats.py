"""How the gateway reads a model's answer: its tool calls and reasoning, in the model family's own format,
by vLLM's own parsers where the run names them (``[engine] tool_call_parser`` / ``reasoning_parser``, the
names ``vllm serve --tool-call-parser`` / ``--reasoning-parser`` take), else by the built-in parser of
``<tool_call>{"name", "arguments"}</tool_call>`` blocks (`gateway.chat.parse_answer`).

Invariants:
- vLLM is imported here only, and only when a run names a parser (`VllmParser`): the rest of the gateway,
  the worker and the config import without it. A named parser on a worker without vLLM, a tokenizer that
  does not load, or a parser vLLM will not build with it is a `ConfigError` (one line naming the setting)
  before anything is sampled.
- The parsed view is a function of what was sampled: the model's text (the sampled tokens detokenized
  once) and, for parsers that read token ids (gpt-oss's harmony), the sampled token ids. Nothing is
  re-tokenized into the stored sequence; the parser only reads.
- Tool call ids are ``call_<call index>_<k>`` whatever the parser makes up: an answer read twice is the
  same answer. What a parser cannot read stays in the content (vLLM's parsers return the text then).
- With a vLLM parser, an earlier answer is rendered into a later prompt as the OpenAI message the
  harness was given (content, tool calls, reasoning: `gateway.chat.rendered_answer`), as vLLM's own
  server renders a conversation its client sends back: templates that take tool calls and reasoning as
  fields (gpt-oss's refuses channel markup in the content) render it. The built-in parser keeps
  rendering the raw text the model wrote, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from durable_rollouts.errors import ConfigError
from durable_rollouts.gateway import chat

log = logging.getLogger(__name__)

HARMONY = ("openai", "openai_gptoss")
"""gpt-oss's tool-call and reasoning parser names: vLLM reads harmony channels from the token ids (its
``HarmonyParser``, which vLLM's server picks by the model's type)."""


@dataclass(frozen=True)
class Format:
    """The parsers a run names (``[engine]`` of its config) and the tokenizer they load."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    tokenizer: str | None = None
    """A model directory or hub id (``engine.tokenizer``, else ``engine.model``)."""

    @property
    def builtin(self) -> bool:
        """No vLLM parser named: the built-in Hermes-style parser, raw text rendered back."""
        return self.tool_call_parser is None and self.reasoning_parser is None

    @property
    def harmony(self) -> bool:
        return self.tool_call_parser in HARMONY or self.reasoning_parser in HARMONY

    def setting(self) -> str:
        """The settings that name the parsers, as a config states them (for error messages)."""
        named = [("tool_call_parser", self.tool_call_parser), ("reasoning_parser", self.reasoning_parser)]
        return " and ".join(f"engine.{k} = {v!r}" for k, v in named if v is not None)

    @classmethod
    def of_config(cls, config: dict[str, Any]) -> Format:
        """The format a run's stored config (``runs.config_json``, parsed) names; the built-in one for a
        config without the settings (a run started before they existed)."""
        engine = config.get("engine") or {}
        tool, reasoning = engine.get("tool_call_parser"), engine.get("reasoning_parser")
        if tool is None and reasoning is None:
            return cls()
        return cls(tool, reasoning, engine.get("tokenizer") or engine.get("model"))


class AnswerParser(Protocol):
    def parse(
        self, raw: str, token_ids: Sequence[int], tools: list[dict[str, Any]] | None, tool_choice: str,
        call_index: int,
    ) -> chat.Parsed:  # fmt: skip
        """The answer whose model text is ``raw`` (sampled as ``token_ids``, the turn's closing tokens
        left out), for a call that offered ``tools`` under ``tool_choice`` (``auto`` or ``none``)."""
        ...


class Builtin:
    """``<tool_call>{"name", "arguments"}</tool_call>`` blocks (`gateway.chat.parse_answer`); no reasoning."""

    def parse(
        self, raw: str, token_ids: Sequence[int], tools: list[dict[str, Any]] | None, tool_choice: str,
        call_index: int,
    ) -> chat.Parsed:  # fmt: skip
        if tool_choice == "none":
            return chat.Parsed(raw or None, [])
        return chat.parse_answer(raw, call_index)


class VllmParser:
    """vLLM's parsers for a `Format`, composed as ``vllm serve`` composes them (``ParserManager``), with
    the served model's tokenizer.

    Raises (on construction):
        ConfigError: vLLM is not importable, the tokenizer does not load, or vLLM refuses the parsers with
            it; one line naming the setting.
    """

    def __init__(self, fmt: Format, tokenizer: Any = None) -> None:
        self.format = fmt
        try:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            from vllm.parser import ParserManager
        except ImportError as e:
            raise ConfigError(
                f"{fmt.setting()}: the gateway parses with vLLM's parsers, and vLLM is not importable on "
                f"this worker ({type(e).__name__}: {e}); install it, or leave the setting out"
            ) from None
        self._request_cls = ChatCompletionRequest
        if tokenizer is None:
            tokenizer = _load_tokenizer(fmt)
        self.tokenizer = tokenizer
        try:
            parser_cls = ParserManager.get_parser(
                tool_parser_name=fmt.tool_call_parser, reasoning_parser_name=fmt.reasoning_parser,
                enable_auto_tools=True, model_name=fmt.tokenizer, is_harmony=fmt.harmony, tokenizer=tokenizer,
            )  # fmt: skip
        except (TypeError, ValueError, KeyError, ImportError) as e:
            raise ConfigError(f"{fmt.setting()}: vLLM cannot build the parser: {_line(e)}") from None
        if parser_cls is None:
            raise ConfigError(f"{fmt.setting()}: vLLM builds no parser for these names")
        self._parser_cls = parser_cls

    def parse(
        self, raw: str, token_ids: Sequence[int], tools: list[dict[str, Any]] | None, tool_choice: str,
        call_index: int,
    ) -> chat.Parsed:  # fmt: skip
        request = self._request(tools, tool_choice)
        parser = self._parser_cls(self.tokenizer, request.tools)  # a parser holds state: one per answer
        try:
            reasoning, content, calls = parser.parse(
                raw, request, enable_auto_tools=True, model_output_token_ids=list(token_ids)
            )
        except Exception as e:  # a parser's own failure: the harness gets what the model wrote
            log.warning("gateway: %s could not parse an answer (%s): it stays content", self.format, _line(e))
            return chat.Parsed(raw or None, [])
        if tool_choice == "none":
            calls = None  # harmony reads calls whatever the request says; none were offered
        tool_calls = [
            {
                "id": f"call_{call_index}_{k}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for k, c in enumerate(calls or [])
        ]
        return chat.Parsed(content or None, tool_calls, reasoning or None)

    def _request(self, tools: list[dict[str, Any]] | None, tool_choice: str) -> Any:
        """The chat request a parser reads (the tools offered, tool_choice); tools vLLM's request model
        refuses are left out (a parser that reads the schemas then sees none)."""
        messages = [{"role": "user", "content": ""}]
        try:
            return self._request_cls(model="m", messages=messages, tools=tools, tool_choice=tool_choice)
        except ValueError as e:
            log.warning("gateway: the tools offered are not vLLM's shape (%s): parsed without them", _line(e))
            return self._request_cls(model="m", messages=messages)


def _load_tokenizer(fmt: Format) -> Any:
    """The served model's tokenizer as vLLM's server loads it (``vllm.tokenizers.get_tokenizer``)."""
    source = fmt.tokenizer
    if not source:
        raise ConfigError(f"{fmt.setting()}: no tokenizer to load: set engine.tokenizer")
    try:
        from vllm.tokenizers import get_tokenizer

        return get_tokenizer(source)
    except Exception as e:  # a missing directory, an id not in the hub's cache offline, a broken file
        raise ConfigError(
            f"engine.tokenizer {source!r}: the parsers of {fmt.setting()} cannot load it: {_line(e)}"
        ) from None


def load_parser(fmt: Format) -> AnswerParser:
    """The parser of a run's format: the built-in one, or vLLM's (loaded here: slow, call it off the event
    loop)."""
    return Builtin() if fmt.builtin else VllmParser(fmt)


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
