"""The rollout reference (contracts/ref.py): every activity input of a rollout carries it, and an input
a 0.2.0 workflow scheduled (its ids as fields of its own, already in history when the workers were
upgraded) still decodes, its ids gathered into the reference."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio.contrib.pydantic import pydantic_data_converter

from durable_rollouts.contracts.activity_io import (
    EnvStepInput,
    FinalizeRolloutInput,
    GenerateInput,
    PrepareInput,
)
from durable_rollouts.contracts.sandbox import SandboxStepInput
from durable_rollouts.contracts.types import EnvTraits, RolloutRef
from tests.workflows.fakes import rollout_input

HISTORIES = Path(__file__).parents[2] / "histories" / "0.2.0"
KINDS = {
    "prepare_rollout": PrepareInput,
    "generate_turn": GenerateInput,
    "env_step": EnvStepInput,
    "finalize_rollout": FinalizeRolloutInput,
    "sandbox_create": SandboxStepInput,
    "sandbox_recover": SandboxStepInput,
}


def _scheduled(kind: str) -> list[dict]:
    """The inputs of every ``kind`` activity the committed 0.2.0 histories scheduled, as JSON objects."""
    out = []
    for path in sorted(HISTORIES.glob("*.json")):
        for e in json.loads(path.read_text())["events"]:
            attrs = e.get("activityTaskScheduledEventAttributes") or e.get("markerRecordedEventAttributes")
            if not attrs or attrs.get("activityType", {}).get("name") != kind:
                continue
            for p in attrs["input"]["payloads"]:
                out.append(pydantic_data_converter.payload_converter.from_payloads([_payload(p)])[0])
    return out


def _payload(p: dict):  # type: ignore[no-untyped-def]
    from google.protobuf.json_format import ParseDict
    from temporalio.api.common.v1 import Payload

    return ParseDict(p, Payload())


def test_every_rollout_activity_input_of_the_0_2_0_histories_decodes_with_its_reference() -> None:
    seen = 0
    for kind, model in KINDS.items():
        for raw in _scheduled(kind):
            inp = model.model_validate(raw)
            assert inp.ref.rollout_id == raw["rollout_id"]
            assert inp.ref.model == raw.get("model", inp.ref.model)
            run, group, index = raw["rollout_id"].rsplit("/", 2)
            assert (inp.ref.run_id, inp.ref.group_id, inp.ref.sample_index) == (run, group, int(index))
            if "task_id" in raw:
                assert (inp.ref.task_id, inp.ref.env) == (raw["task_id"], raw["env"])
            seen += 1
    assert seen >= 10, "the 0.2.0 histories schedule rollout activities"


def test_a_0_2_0_generate_input_takes_its_task_and_env_from_its_nested_step() -> None:
    step = {"run_id": "r", "rollout_id": "r/g000003/1r2", "task_id": "t9", "env": "math", "turn": 0,
            "last_turn": False, "engine_url": "http://e", "model": "m"}  # fmt: skip
    raw = {"rollout_id": "r/g000003/1r2", "turn": 0, "engine_url": "http://e", "model": "m", "max_tokens": 4,
           "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": None,
                        "logprob_mode": "raw"}, "env_after": step}  # fmt: skip
    inp = GenerateInput.model_validate(raw)
    want = RolloutRef(run_id="r", group_id="g000003", rollout_id="r/g000003/1r2", task_id="t9",
                      sample_index=1, env="math", model="m")  # fmt: skip
    assert inp.ref == want and inp.env_after is not None and inp.env_after.ref == want


def test_the_reference_is_the_members_ids_and_new_inputs_round_trip() -> None:
    m = rollout_input("u").model_copy(update={"env": EnvTraits(name="math")})
    ref = m.ref()
    assert (ref.run_id, ref.rollout_id, ref.task_id, ref.sample_index, ref.env, ref.model) == (
        m.run_id, m.rollout_id, m.task_id, m.sample_index, "math", m.engine.model,
    )  # fmt: skip
    inp = EnvStepInput(ref=ref, turn=2, last_turn=True, engine_url="http://e")
    assert EnvStepInput.model_validate_json(inp.model_dump_json()) == inp
    assert (inp.rollout_id, inp.run_id, inp.sample_index) == (m.rollout_id, m.run_id, m.sample_index)


def test_a_generate_input_sends_the_reference_once() -> None:
    """Its prepare and inline step are of the same rollout: they leave theirs out and take it back when
    decoded, so history holds the ids once per model call (as many bytes as 0.2.0's flat fields)."""
    ref = rollout_input("u").ref()
    sampling = rollout_input("u").sampling
    inp = GenerateInput(
        ref=ref, turn=0, engine_url="http://e", sampling=sampling, max_tokens=8,
        env_after=EnvStepInput(ref=ref, turn=0, last_turn=False, engine_url="http://e"),
        prepare=PrepareInput(ref=ref, engine_url="http://e"),
    )  # fmt: skip
    [payload] = pydantic_data_converter.payload_converter.to_payloads([inp])
    assert payload.data.decode().count(ref.rollout_id) == 1
    [back] = pydantic_data_converter.payload_converter.from_payloads([payload], [GenerateInput])
    assert back == inp and back.env_after.ref == back.prepare.ref == ref
