"""Who a rollout is: the one reference every activity input of a rollout carries.

Invariants:
- Built once per member, from its workflow input (``RolloutInput.ref``), never field by field at a call
  site; the activity inputs of a rollout (prepare, generate, env step, sandbox, finalize) carry it whole.
- Sent once per input: a nested input of the same rollout (a generate input's prepare and inline step)
  is sent without it and takes its parent's when decoded.
- Inputs of 0.2.0 workflows (scheduled before their workers were upgraded, so already in history) carry
  the same ids as fields of their own: ``legacy_ref`` gathers them into the reference when such an input is
  decoded, so a new worker runs an old workflow's pending activity (docs/upgrades.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer, model_validator


class RolloutRef(BaseModel):
    """The identity of one rollout (one member attempt of a group) as its activities need it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    group_id: str
    rollout_id: str
    """``<run>/<group>/<i>`` (or ``<i>r<n>`` for a slot's later attempt): the key of its every write."""
    task_id: str
    sample_index: int
    env: str
    """The environment's registered name (``run.env``)."""
    model: str
    """The engine's model name (``engine.model``)."""


_FLAT = ("run_id", "group_id", "rollout_id", "task_id", "sample_index", "env", "model")


def _split(rollout_id: str) -> tuple[str, str, int]:
    """(run, group, sample index) of ``<run>/<group>/<i>[r<n>]``; ('', '', 0) for an id of another shape."""
    parts = rollout_id.rsplit("/", 2)
    if len(parts) != 3:
        return "", "", 0
    index = parts[2].partition("r")[0]
    return parts[0], parts[1], int(index) if index.isdigit() else 0


def legacy_ref(data: Any, *nested: str) -> Any:
    """``data`` (an activity input being decoded) with the flat ids of a 0.2.0 input gathered into ``ref``.

    A 0.2.0 input names its run, group and sample index only in its rollout id (parsed here) unless it
    carries them; a generate input names its task and environment only in its nested inputs (``nested``),
    and not at all when it has none: its model call reads neither, and they read as ''. New-shaped data
    (with ``ref``) and anything that is not a mapping pass unchanged."""
    if not isinstance(data, dict) or "ref" in data or "rollout_id" not in data:
        return data
    out = dict(data)
    flat = {k: out.pop(k) for k in _FLAT if k in out}
    for key in nested:
        inner = out.get(key)
        if isinstance(inner, dict):
            src = inner.get("ref", inner)
            src = src.model_dump() if isinstance(src, BaseModel) else src
            for k in ("run_id", "task_id", "env"):
                if k not in flat and isinstance(src, dict) and k in src:
                    flat[k] = src[k]
        elif isinstance(inner, BaseModel) and hasattr(inner, "ref"):
            for k in ("run_id", "task_id", "env"):
                flat.setdefault(k, getattr(inner.ref, k))
    run, group, index = _split(str(flat["rollout_id"]))
    flat.setdefault("run_id", run)
    flat.setdefault("group_id", group)
    flat.setdefault("sample_index", index)
    flat.setdefault("task_id", "")
    flat.setdefault("env", "")
    flat.setdefault("model", "")
    out["ref"] = flat
    return out


class OfRollout(BaseModel):
    """An activity input of one rollout: it carries the rollout's ``ref``; a 0.2.0-shaped one is accepted."""

    model_config = ConfigDict(extra="forbid")
    _nested: ClassVar[tuple[str, ...]] = ()
    """Nested inputs a 0.2.0 input of this kind names its task and environment in (``legacy_ref``)."""

    @model_validator(mode="before")
    @classmethod
    def _gather_ref(cls, data: Any) -> Any:
        data = legacy_ref(data, *cls._nested)
        if not (cls._nested and isinstance(data, dict) and "ref" in data):
            return data
        out = dict(data)
        for key in cls._nested:  # a nested input of the same rollout is sent without its reference
            inner = out.get(key)
            if isinstance(inner, dict) and "ref" not in inner and "rollout_id" not in inner:
                out[key] = {**inner, "ref": out["ref"]}
        return out

    @model_serializer(mode="wrap")
    def _ref_once(self, handler: SerializerFunctionWrapHandler) -> Any:
        """The reference is sent once per input: a nested input of the same rollout (a generate input's
        prepare and inline step) leaves its own out and takes its parent's when decoded."""
        out = handler(self)
        for key in self._nested:
            inner = out.get(key) if isinstance(out, dict) else None
            if isinstance(inner, dict) and inner.get("ref") == out.get("ref"):
                inner.pop("ref")
        return out

    # The reference's ids, read through the input (``inp.rollout_id`` is ``inp.ref.rollout_id``).
    @property
    def _ref(self) -> RolloutRef:
        ref: RolloutRef = self.ref  # type: ignore[attr-defined]  # every subclass declares it
        return ref

    @property
    def run_id(self) -> str:
        return self._ref.run_id

    @property
    def group_id(self) -> str:
        return self._ref.group_id

    @property
    def rollout_id(self) -> str:
        """The key of everything the activity writes."""
        return self._ref.rollout_id

    @property
    def task_id(self) -> str:
        return self._ref.task_id

    @property
    def sample_index(self) -> int:
        return self._ref.sample_index

    @property
    def env(self) -> str:
        return self._ref.env

    @property
    def model(self) -> str:
        return self._ref.model
