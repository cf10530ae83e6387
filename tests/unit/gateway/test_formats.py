"""Answers read in a model family's own format by vLLM's own parsers (gateway/formats.py, gateway/turn.py,
config.models.EngineConfig's tool_call_parser/reasoning_parser/tokenizer), token-exact: for Qwen3 (hermes
tool calls, ``<think>`` reasoning), Llama 3.1 (JSON tool calls) and gpt-oss (harmony channels), with each
family's real tokenizer and chat template (tests/unit/gateway/families.py), a conversation through the
gateway stores exactly the sampled tokens, masks exactly them, and answers the parsed tool calls and
reasoning in OpenAI's shape. Also: the names vLLM knows, the one-line errors, vLLM imported lazily."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from durable_rollouts.config.load import load_config
from durable_rollouts.config.models import Config, EngineConfig
from durable_rollouts.config.vllm_names import VLLM_REASONING_PARSERS, VLLM_TOOL_CALL_PARSERS
from durable_rollouts.errors import ConfigError
from durable_rollouts.gateway import chat, formats
from durable_rollouts.gateway.turn import GatewayTurns
from durable_rollouts.store import RunStore
from tests import REPO_ROOT
from tests.unit.gateway.families import Family, FamilyEngine, gpt_oss, llama3, qwen3, vllm_tokenizer
from tests.unit.gateway.test_gateway import RID, call_input

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
LS = {
    "id": "call_0_0",
    "type": "function",
    "function": {"name": "bash", "arguments": '{"command": "ls -la"}'},
}
TASK: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": "Task id: t1. Which files are in the working directory?"},
]
FILES = "a.txt\nb.txt"

# What each family's model writes for the two turns (its own format), and what the gateway must answer.
ANSWERS: dict[str, tuple[str, str]] = {
    "qwen3": (
        "<think>\nThe user wants the files listed; I will run ls.\n</think>\n\nLet me look.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>',
        "<think>\nTwo files came back.\n</think>\n\nThere are two files: a.txt and b.txt.",
    ),
    "llama3": (
        '{"name": "bash", "parameters": {"command": "ls -la"}}',
        "There are two files: a.txt and b.txt.",
    ),
    "gpt-oss": (
        "<|channel|>analysis<|message|>The user wants the files listed; I will run ls.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.bash <|constrain|>json"
        '<|message|>{"command": "ls -la"}<|call|>',
        "<|channel|>analysis<|message|>Two files came back.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>There are two files: a.txt and b.txt.<|return|>",
    ),
}
EXPECTED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "qwen3": (
        {"content": "Let me look.", "reasoning": "The user wants the files listed; I will run ls."},
        {"content": "There are two files: a.txt and b.txt.", "reasoning": "Two files came back."},
    ),
    "llama3": ({"content": None, "reasoning": None}, {"content": "There are two files: a.txt and b.txt."}),
    "gpt-oss": (
        {"content": None, "reasoning": "The user wants the files listed; I will run ls."},
        {"content": "There are two files: a.txt and b.txt.", "reasoning": "Two files came back."},
    ),
}
OBSERVATION = {
    "qwen3": "\n<|im_start|>user\n<tool_response>\na.txt\nb.txt\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n",
    "llama3": '<|start_header_id|>ipython<|end_header_id|>\n\n"a.txt\\nb.txt"<|eot_id|>'
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gpt-oss": '<|start|>functions.bash to=assistant<|channel|>commentary<|message|>"a.txt\\nb.txt"<|end|>'
    "<|start|>assistant",
}
"""What the gateway appends after the first sampled answer: the template's tokens for the tool result and
the next generation prompt (Qwen3's also the newline its template puts after the <|im_end|> the model
sampled); nothing of the answer itself."""


@pytest.fixture(scope="module")
def vllm() -> None:
    pytest.importorskip("vllm.parser", reason="vLLM's parsers are what these tests exercise")


FAMILIES = {"qwen3": qwen3, "llama3": llama3, "gpt-oss": gpt_oss}


def run_store(tmp_path: Path, fmt: formats.Format) -> RunStore:
    """A store holding run ``run`` whose config names ``fmt`` (the gateway reads its format from there)."""
    store = RunStore(tmp_path / "home")
    engine = EngineConfig(
        tool_call_parser=fmt.tool_call_parser, reasoning_parser=fmt.reasoning_parser, tokenizer=fmt.tokenizer
    )
    store.register_run("run", Config(engine=engine).model_dump_json(), "hash")
    return store


def family_turns(store: RunStore, eng: FamilyEngine, load: bool = False) -> GatewayTurns:
    """The gateway's turns; with ``load``, the gateway loads the tokenizer itself (``engine.tokenizer``,
    through vLLM, as a worker does), else it is handed the family's (loaded once)."""
    family = eng.family
    if load and family.parser_tokenizer is None:
        return GatewayTurns(store, eng)
    tokenizer = family.parser_tokenizer or vllm_tokenizer(str(family.format.tokenizer))
    return GatewayTurns(store, eng, lambda fmt: formats.VllmParser(fmt, tokenizer))


async def ask(store: RunStore, turns: GatewayTurns, messages: list[dict[str, Any]]) -> dict[str, Any]:
    call = store.open_call(RID, chat.request_key(messages, [BASH]), {"messages": messages, "tools": [BASH]})
    await turns.answer(call_input(call.index))
    stored = store.get_call(RID, call.index)
    assert stored is not None and stored.status == 200 and stored.response is not None, stored
    return stored.response


def loss_mask(store: RunStore) -> list[int]:
    """The record's loss mask (records/export.py): 1 on the tokens of ``model`` segments."""
    return [1 if s.kind == "model" else 0 for s in store.segments(RID) for _ in s.token_ids]


@pytest.mark.parametrize("name", list(FAMILIES))
async def test_a_conversation_in_the_familys_format_is_token_exact(
    vllm: None, tmp_path: Path, name: str
) -> None:
    family: Family = FAMILIES[name]()
    eng = FamilyEngine(family, list(ANSWERS[name]))
    store = run_store(tmp_path, family.format)
    turns = family_turns(store, eng, load=True)

    first = await ask(store, turns, TASK)
    choice = first["choices"][0]
    message = choice["message"]
    want = EXPECTED[name][0]
    assert message["tool_calls"] == [LS] and choice["finish_reason"] == "tool_calls"
    assert (message["content"] or "").strip() == (want["content"] or "")
    assert (message.get("reasoning_content") or "").strip() == (want["reasoning"] or "")
    # The harness sends its history back as OpenAI clients do (no reasoning, its own call id) + the result.
    echoed = {"role": "assistant", "content": message["content"], "tool_calls": [{**LS, "id": "x1"}]}
    second = await ask(
        store, turns, [*TASK, echoed, {"role": "tool", "tool_call_id": "x1", "content": FILES}]
    )
    message2 = second["choices"][0]["message"]
    want2 = EXPECTED[name][1]
    assert "tool_calls" not in message2 and second["choices"][0]["finish_reason"] == "stop"
    assert message2["content"].strip() == want2["content"]
    assert (message2.get("reasoning_content") or "").strip() == (want2.get("reasoning") or "")

    # Stored: the prompt, the sampled tokens as sampled, the template's tokens for the tool result, the
    # second sample; the second call's prompt is the first call's tokens extended, nothing re-tokenized.
    segs = store.segments(RID)
    assert [s.kind for s in segs] == ["prompt", "model", "observation", "model"]
    assert [segs[1].token_ids, segs[3].token_ids] == eng.returned
    assert eng.returned[0][: len(family.encode(ANSWERS[name][0]))] == family.encode(ANSWERS[name][0])
    assert eng.prompts[0] == segs[0].token_ids == family.encode(family.render(TASK, [BASH], True))
    assert eng.prompts[1] == [t for s in segs[:3] for t in s.token_ids]
    assert family.decode(segs[2].token_ids) == OBSERVATION[name]
    tokens = store.token_ids(RID)
    assert tokens == [*eng.prompts[1], *eng.returned[1]]
    mask = loss_mask(store)
    sampled_at = {*range(segs[1].start, segs[1].end), *range(segs[3].start, segs[3].end)}
    assert len(mask) == len(tokens) and {i for i, m in enumerate(mask) if m} == sampled_at
    assert all(
        s.logprobs is not None and len(s.logprobs) == len(s.token_ids) for s in segs if s.kind == "model"
    )
    # A later prompt renders the answer as the harness was given it (vLLM's server renders what it is sent).
    detail = store.get_call(RID, 0).detail  # type: ignore[union-attr]
    assert detail is not None and detail["rendered"] == chat.rendered_answer(message)


async def test_a_block_the_parser_cannot_read_stays_content(vllm: None, tmp_path: Path) -> None:
    family = qwen3()
    broken = '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": \n</tool_call>'
    eng = FamilyEngine(family, [broken])
    store = run_store(tmp_path, family.format)
    out = await ask(store, family_turns(store, eng), TASK)
    message = out["choices"][0]["message"]
    assert "tool_calls" not in message and out["choices"][0]["finish_reason"] == "stop"
    assert (
        message["reasoning_content"].strip() == "hm" and '"arguments": \n</tool_call>' in message["content"]
    )
    assert store.segments(RID)[1].token_ids == eng.returned[0]


async def test_tool_choice_none_keeps_the_reasoning_and_parses_no_call(vllm: None, tmp_path: Path) -> None:
    family = qwen3()
    eng = FamilyEngine(family, [ANSWERS["qwen3"][0]])
    store = run_store(tmp_path, family.format)
    body = {"messages": TASK, "tools": [BASH], "options": {"tool_choice": "none"}}
    call = store.open_call(RID, "k", body)
    await family_turns(store, eng).answer(call_input(call.index))
    message = store.get_call(RID, 0).response["choices"][0]["message"]  # type: ignore[index,union-attr]
    assert "tool_calls" not in message and message["reasoning_content"].strip().startswith("The user wants")


def test_streamed_reasoning_comes_before_the_content() -> None:
    parsed = chat.Parsed("The answer.", [], "x" * 20)
    body = chat.completion(RID, 0, "m", parsed, "stop", 3, 4)
    deltas = [c["choices"][0]["delta"] for c in chat.stream_chunks(body, False)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "x" * 20
    kinds = [k for d in deltas for k in d if k in ("reasoning_content", "content") and d[k]]
    assert kinds == ["reasoning_content", "reasoning_content", "content"]


def test_the_parser_names_are_the_ones_vllm_knows(vllm: None) -> None:
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    assert list(VLLM_TOOL_CALL_PARSERS) == ToolParserManager.list_registered()
    assert list(VLLM_REASONING_PARSERS) == ReasoningParserManager.list_registered()


def test_a_name_vllm_does_not_know_is_a_one_line_config_error() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["engine.tool_call_parser=hermez"])
    text = str(e.value)
    assert "\n" not in text and "engine.tool_call_parser" in text and "'hermez'" in text
    assert "known: " in text and "hermes" in text and "llama3_json" in text
    with pytest.raises(ConfigError, match=r"engine\.reasoning_parser: .*not a reasoning parser.*qwen3"):
        load_config(None, ["engine.reasoning_parser=qwen4"])
    cfg = load_config(None, ["engine.tool_call_parser=hermes", "engine.reasoning_parser=qwen3"])
    assert formats.Format.of_config(json.loads(cfg.model_dump_json())) == formats.Format(
        "hermes", "qwen3", "tiny"
    )
    assert formats.Format.of_config(json.loads(Config().model_dump_json())).builtin  # the default: built-in
    assert formats.Format.of_config({"engine": {"model": "m"}}) == formats.Format()  # a run from before


def test_a_parser_without_vllm_is_a_one_line_error_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "vllm.parser", None)  # import vllm.parser now raises ImportError
    with pytest.raises(ConfigError) as e:
        formats.VllmParser(formats.Format("hermes", "qwen3", "Qwen/Qwen3-8B"))
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith("engine.tool_call_parser = 'hermes' and engine.reasoning_parser = 'qwen3': ")
    assert "vLLM is not importable" in text


async def test_a_parser_that_cannot_load_fails_the_call_before_it_samples(vllm: None, tmp_path: Path) -> None:
    fmt = formats.Format("hermes", None, str(tmp_path / "no-such-model"))
    store = run_store(tmp_path, fmt)
    eng = FamilyEngine(qwen3(), ["never sampled"])
    turns = GatewayTurns(store, eng)
    store.open_call(RID, "k", {"messages": TASK, "tools": [BASH]})
    with pytest.raises(ConfigError) as e:
        await turns.answer(call_input(0))
    assert str(e.value).startswith(f"engine.tokenizer '{tmp_path / 'no-such-model'}': ")
    assert "\n" not in str(e.value) and eng.prompts == [] and store.segments(RID) == []
    folder = str(qwen3().format.tokenizer)  # a tokenizer without the parser's marker token
    with pytest.raises(ConfigError) as refused:
        formats.VllmParser(formats.Format("llama3_json", None, folder), vllm_tokenizer(folder))
    text = str(refused.value)
    assert text.startswith("engine.tool_call_parser = 'llama3_json': vLLM cannot build the parser: ")
    assert "<|python_tag|>" in text and "\n" not in text


def test_the_gateway_and_the_config_import_without_vllm() -> None:
    """Workers without vLLM run the core: nothing the gateway or the config imports at module level pulls
    vLLM in (it is imported only when a run names a parser)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'): raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import durable_rollouts.config.models, durable_rollouts.gateway.formats\n"
        "import durable_rollouts.gateway.turn, durable_rollouts.gateway.server\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm']\n"
        "from durable_rollouts.gateway.formats import Format, load_parser\n"
        "assert load_parser(Format()).parse('x', [], None, 'auto', 0).content == 'x'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_qwen3_coder_xml_calls_are_read_with_qwens_tokenizer(vllm: None) -> None:
    family = qwen3()  # Qwen3-Coder's vocabulary is Qwen3's (its <tool_call> tokens included)
    fmt = formats.Format("qwen3_coder", None, family.format.tokenizer)
    parser = formats.VllmParser(fmt, vllm_tokenizer(str(family.format.tokenizer)))
    raw = (
        "Let me look.\n<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n"
        "</tool_call>"
    )
    parsed = parser.parse(raw, family.encode(raw), [BASH], "auto", 0)
    assert parsed.tool_calls == [LS] and (parsed.content or "").strip() == "Let me look."
