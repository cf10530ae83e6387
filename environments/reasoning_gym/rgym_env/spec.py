"""Task specs: a small TOML or JSON file naming reasoning-gym generators, seeds and sizes; its tasks.

The run's ``task_file`` is a spec, not a list of tasks: at submit (``load_tasks``) every generator named in
it is asked for ``size`` entries with its ``seed``, and each entry becomes one task holding everything
scoring needs: the entry's ``question``, ``answer`` and ``metadata`` (as JSON, the way the run store keeps
it) and the generator's ``name``, ``seed``, ``size`` and ``config``, from which a worker on any host
re-creates the dataset whose ``score_answer`` scores it. Nothing is read from the submitter's disk later.

Schema (TOML shown; a ``.json`` file holds the same object)::

    system_prompt = "default"   # a key of reasoning_gym.utils.SYSTEM_PROMPTS (default "default")
    order = "interleave"        # default: g1[0], g2[0], g3[0], g1[1], ...; "concat": g1, g2, ...

    [[generators]]
    name = "basic_arithmetic"   # a registered reasoning-gym dataset
    seed = 42
    size = 4                    # entries drawn, 1..100000
    config = { max_terms = 3 }  # optional: the dataset's own config fields

Invariant: a spec that loads yields tasks whose ids (``<name>-<seed>-<index>``) are unique; anything wrong
(unreadable file, unknown key, unknown generator, a config the generator rejects, an entry that is not
JSON) is one `TaskFileError` line naming the file and the field, e.g.
``spec.toml: field 'generators[1].seed': Input should be a valid integer``.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from durable_rollouts.errors import TaskFileError

MAX_SIZE = 100_000
"""Most entries one generator may contribute."""
MAX_TASKS = 1_000_000
"""Most tasks one spec may yield."""


class GeneratorSpec(BaseModel):
    """One generator of a spec: which dataset, its seed and size, its own config."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_]+$")
    """reasoning-gym's registered dataset name (``reasoning_gym.factory.DATASETS``)."""
    seed: int = Field(ge=0, le=2**63 - 1)
    size: int = Field(ge=1, le=MAX_SIZE)
    config: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments of ``reasoning_gym.create_dataset`` (the dataset's config fields)."""

    @field_validator("config")
    @classmethod
    def _no_seed_or_size(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in ("seed", "size"):
            if key in value:
                raise ValueError(f"set {key!r} beside 'config', not inside it")
        return value


class Spec(BaseModel):
    """A whole spec file."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    system_prompt: str = "default"
    order: Literal["interleave", "concat"] = "interleave"
    generators: list[GeneratorSpec] = Field(min_length=1, max_length=1000)


def read_spec(path: Path) -> Spec:
    """Parse and validate a spec file (``.json``: JSON; anything else: TOML).

    Raises:
        TaskFileError: one line naming the file and the field.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TaskFileError(f"{path}: cannot read task spec: {getattr(e, 'strerror', None) or e}") from None
    try:
        obj: Any = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise TaskFileError(f"{path}: not valid {kind} ({str(e).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise TaskFileError(f"{path}: a task spec must be an object with 'generators'")
    try:
        spec = Spec.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        raise TaskFileError(f"{path}: field {_field(err['loc'])!r}: {msg}") from None
    seen: dict[tuple[str, int], int] = {}
    for i, g in enumerate(spec.generators):
        if (g.name, g.seed) in seen:
            first = seen[(g.name, g.seed)]
            raise TaskFileError(
                f"{path}: field 'generators[{i}]': {g.name!r} with seed {g.seed} is already "
                f"generators[{first}] (their task ids would collide)"
            )
        seen[(g.name, g.seed)] = i
    if sum(g.size for g in spec.generators) > MAX_TASKS:
        raise TaskFileError(f"{path}: field 'generators': more than {MAX_TASKS} tasks in all")
    return spec


def generate(path: Path, spec: Spec) -> list[dict[str, Any]]:
    """The spec's tasks as JSON objects (the `rgym_env.RgTask` fields), in the spec's ``order``.

    Raises:
        TaskFileError: a generator is unknown, rejects its config or yields an entry that is not JSON.
    """
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if spec.system_prompt not in SYSTEM_PROMPTS:
        known = ", ".join(sorted(SYSTEM_PROMPTS))
        raise TaskFileError(f"{path}: field 'system_prompt': {spec.system_prompt!r} is not one of {known}")
    system = SYSTEM_PROMPTS[spec.system_prompt]
    per_generator = [_entries(path, i, g, system) for i, g in enumerate(spec.generators)]
    if spec.order == "concat":
        return [t for tasks in per_generator for t in tasks]
    longest = max(len(tasks) for tasks in per_generator)
    return [tasks[k] for k in range(longest) for tasks in per_generator if k < len(tasks)]


def _entries(path: Path, i: int, g: GeneratorSpec, system: str) -> list[dict[str, Any]]:
    from rgym_env.datasets import dataset

    where = f"{path}: field 'generators[{i}]"
    try:
        ds = dataset(g.name, g.seed, g.size, g.config)
    except Exception as e:  # reasoning-gym's own code rejected the generator or its config
        field = "name" if "not registered" in str(e) else "config"
        raise TaskFileError(f"{where}.{field}': {g.name!r}: {_one_line(e)}") from None
    out = []
    for index in range(g.size):
        try:
            entry = ds[index]
            # Through JSON, as the run store keeps it: the stored entry is the one score_answer sees.
            question, answer, metadata = json.loads(
                json.dumps([entry["question"], entry["answer"], entry.get("metadata", {})])
            )
        except Exception as e:  # the generator failed on this index, or its entry is not JSON
            raise TaskFileError(f"{where}': {g.name!r} entry {index}: {_one_line(e)}") from None
        out.append(
            {
                "id": f"{g.name}-{g.seed}-{index}",
                "generator": g.name,
                "seed": g.seed,
                "size": g.size,
                "config": g.config,
                "index": index,
                "system_prompt": system,
                "question": question,
                "answer": answer,
                "metadata": metadata,
            }
        )
    return out


def _field(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "spec"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:300]
