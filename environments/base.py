"""The environment interface: what a rollout environment implements.

An environment owns everything task-specific about a rollout; the pipeline owns everything else (the model
calls, the token bookkeeping, durability, sandboxes' lifecycle, records). A new environment subclasses
`Environment`, declares its task model, and is registered under the entry-point group
``environments`` of its own package (see ``environments.registry`` and the README, "Write your own
environment"); nothing in the core changes.

How the pipeline drives an environment, per rollout:

1. ``load_tasks(path)`` once per run, at submit: every task validated by ``task_model``; a bad file raises
   `TaskFileError` naming file, line and field. Tasks are stored with the run, so workers read them from
   the store, never from the submitter's files.
2. ``sandbox(task, default)``: ``None`` when the task needs no sandbox, else a `SandboxPlan` (image and
   limits for this task, files to copy in, setup commands). Called only when ``uses_sandbox`` is true.
3. ``prompt(task)``: the first prompt, as chat messages (rendered once through the engine's chat template)
   or as token ids. The context then only grows: model turns (loss mask 1) and observations (loss mask 0).
4. ``parse(ctx, text)`` after every model turn: the turn's text becomes an ``Action`` (a JSON object the
   pipeline records with the turn *before* it runs) or directly a `Step` (an error observation for the
   model, or the end of the rollout: ``done``, with a reward or to be scored by ``score``).
5. ``act(ctx, action)``: run the action (in the sandbox, for environments that have one) and return the
   `Step`: its observation, or the end of the rollout.
6. ``score(ctx, text)``: the reward of a rollout that is done without one, or truncated (when the run
   scores truncated rollouts). ``text`` is the last model turn, if any. A `Score` adds the verifier's
   other metrics, kept with the turn.
7. ``replay(ctx, action)``: a lost sandbox is replaced and the recorded actions of earlier turns replayed
   into the fresh one before the turn is retried (default: ``act`` again, its result ignored).

Invariants the pipeline relies on:
- ``parse`` is pure. ``act``, ``score`` and ``replay`` run inside activities: they may do I/O, and they may
  run more than once for one turn (activities are retried), so they must be safe to repeat.
- An environment failure (the verifier crashed, the task cannot be set up) is raised as
  `EnvironmentFailure`; a sandbox failure propagates as the sandbox's own error. Neither is ever a reward.
- Any other exception a hook raises (a bug: ``ZeroDivisionError`` in ``parse``, an action returned without
  an ``act``) is the environment's too: the pipeline calls every hook through `calling`, which turns it
  into `EnvironmentCodeError` (recorded ``environment: <Type>: <message>``, its last frames kept with the
  record and logged by the worker). It is not retried unless its type is in ``retryable_errors`` (or is a
  `RolloutError` subclass of the environment's own with ``retryable = True``).
- ``env_version`` and ``verifier_version`` change whenever behaviour or reward could change: every record
  carries them (``lineage``).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from durable_rollouts import errors
from durable_rollouts.contracts.types import TruncationReason
from durable_rollouts.errors import EnvironmentCodeError, RolloutError, TaskFileError
from durable_rollouts.sandboxes.base import ExecResult, ImageBuild, SandboxSpec

Message = dict[str, str]
"""One chat message: ``{"role": ..., "content": ...}``."""
Action = dict[str, Any]
"""What a model turn asks the environment to do (JSON; e.g. a tool call), recorded with the turn."""

END_MARKER = "<|end|>"
"""End-of-turn marker of the bundled policy's chat template; the text after it is not the model's."""


def until_end(text: str) -> str:
    """The model's turn up to its end-of-turn marker."""
    return text.split(END_MARKER, 1)[0]


class Task(BaseModel):
    """Base of every environment's task model: one line of a task file, with a unique ``id``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    """Unique in the file; the rollout's task id."""

    @field_validator("id")
    @classmethod
    def _id_is_one_token(cls, value: str) -> str:
        if value != value.strip() or any(c.isspace() for c in value):
            raise ValueError("must not contain whitespace")
        return value


class Prompt(BaseModel):
    """The first prompt of a rollout: chat messages, or token ids that are used as they are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    messages: list[Message] | None = None
    token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> Prompt:
        if (self.messages is None) == (self.token_ids is None):
            raise ValueError("a prompt is either messages or token_ids")
        return self


class SandboxPlan(BaseModel):
    """The sandbox one task needs: image and limits, files laid out before the first turn, setup."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: SandboxSpec
    """Image (local tag, never pulled) and limits of this task's sandbox."""
    image_build: ImageBuild | None = None
    """How to build ``spec.image`` when the sandbox host's daemon does not have it: built there, once per
    tag and host (``sandboxes.images``); a failed build fails the rollout (environment). None: the image
    must exist."""
    files: dict[str, str] = Field(default_factory=dict)
    """Relative path -> content, written into the workdir before the setup commands."""
    setup: list[str] = Field(default_factory=list)
    """Shell commands run in the workdir once the files are in; one that fails fails the rollout
    (environment). Like every side effect they may run again on a retry: keep them idempotent."""
    setup_timeout_s: float = Field(600.0, gt=0)
    """Time limit of each setup command."""
    timeout_s: float | None = Field(None, gt=0)
    """This task's wall-clock limit of the rollout, counted from its sandbox's creation (e.g. a Harbor
    task's agent timeout); reaching it truncates the rollout (``timeout``), as ``rollout.timeout_s`` does,
    which still applies when shorter. None: only the run's limit."""


class Step(BaseModel):
    """What the environment made of one model turn."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    observation: str | None = None
    """Text appended to the context as an ``observation_role`` message (loss mask 0); None = nothing."""
    done: bool = False
    """The rollout is complete: ``reward`` holds its reward, or ``score`` is called when it is None."""
    reward: float | None = None
    truncated: TruncationReason | None = None
    """The step hit a limit (e.g. ``command_timeout``): the rollout ends truncated after the observation."""


class Score(BaseModel):
    """What ``score`` may return instead of a bare reward: the reward and the verifier's other metrics
    (kept with the scored turn, exported as its ``metrics``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reward: float
    metrics: dict[str, float] = Field(default_factory=dict)


class Sandbox(Protocol):
    """The rollout's sandbox, as an environment sees it (bound to its container; paths relative)."""

    async def exec(
        self, cmd: str, timeout_s: float | None = None, once_key: str | None = None, user: str | None = None
    ) -> ExecResult:
        """Run ``cmd`` in the working directory (as ``user`` when given: one of the sandbox spec's
        ``exec_users``; else as the spec's ``user``). With ``once_key`` (letters, digits, ``._-``), at most
        once per key in this sandbox: a retried step whose worker died mid-command gets the first run's result
        (``replayed``), waiting for it to end, instead of running it again. A key's scope is its part before
        the first dot; a claim forgets every other scope's keys, so key a step's commands by its turn
        (``turn-N``, ``score-N.prepare``); a replay into a fresh sandbox passes none."""
        ...

    async def write_file(self, path: str, content: bytes | str) -> None: ...

    async def read_file(self, path: str, max_bytes: int = 1 << 20) -> bytes: ...


class Sandboxes(Protocol):
    """More sandboxes of one rollout besides its own (e.g. a verifier's own container), each by a name.

    ``open`` makes (or, by the same rollout and name, finds again: a retried step reattaches) the sandbox of
    ``plan`` (its image built as the rollout's own, its files and setup laid out once per container), on
    the rollout's host; it is removed with the rollout's own sandbox (its destroy step, or the reaper).
    ``base_spec``: the spec the rollout's own sandbox was made with (the run's defaults and the task's)."""

    async def open(self, name: str, plan: SandboxPlan) -> Sandbox: ...

    async def base_spec(self) -> SandboxSpec: ...


@dataclass(frozen=True)
class TurnContext:
    """What ``parse``, ``act``, ``score`` and ``replay`` get besides the turn's text or action."""

    task: Task
    rollout_id: str
    turn: int
    """Number of the model turn being stepped (0-based)."""
    last_turn: bool
    """No model turn follows this one (``rollout.max_turns``): say ``done`` or the rollout truncates."""
    sandbox: Sandbox | None = None
    """The rollout's sandbox; None when the task has none."""
    sandboxes: Sandboxes | None = None
    """Further sandboxes of the rollout (``score`` of an environment whose verifier runs apart); None where
    the worker offers none."""


class Environment(ABC):
    """Base class of every environment (see the module docstring for how the pipeline drives it)."""

    name: ClassVar[str]
    """Registry name (``run.env``); also the entry point's name."""
    env_version: ClassVar[str]
    """Version of the behaviour (prompt, actions, observations, turn rules)."""
    verifier_version: ClassVar[str]
    """Version of the reward."""
    task_model: ClassVar[type[Task]] = Task
    """The pydantic model of one task (a subclass of `Task`)."""
    uses_sandbox: ClassVar[bool] = False
    """Whether ``sandbox`` may return a plan; environments without sandboxes never touch Docker."""
    inline_steps: ClassVar[bool] = False
    """Its steps are cheap and need no sandbox: the pipeline runs them inside the model call's activity
    (one activity per turn instead of two)."""
    harness: ClassVar[bool] = False
    """Its agent is a harness program run in the sandbox, its model calls served by the rollout's gateway
    (``environments.harness_trait.HarnessEnvironment``); the turn hooks are then not used."""
    observation_role: ClassVar[str] = "user"
    """Chat role of observation messages (``tool`` for tool results)."""
    retryable_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    """Exception types of this environment's own code that are transient (a remote verifier's timeout):
    a hook that raises one is retried like infrastructure trouble. Any other exception its hooks raise
    fails the rollout at once, recorded ``environment: <Type>: <message>``."""

    def load_tasks(self, path: str | Path) -> list[Task]:
        """Read and validate a JSONL task file (one task per line, ids unique).

        Raises:
            TaskFileError: one line naming the file, the line and the field at fault.
        """
        from durable_rollouts.environments.tasks import json_objects

        p = Path(path)
        tasks: list[Task] = []
        seen: set[str] = set()
        for n, obj in json_objects(p):
            task = self.validate_task(obj, where=f"{p}:{n}")
            if task.id in seen:
                raise self.duplicate_id(f"{p}:{n}", task.id)
            seen.add(task.id)
            tasks.append(task)
        if not tasks:
            raise TaskFileError(f"{p}: no tasks")
        return tasks

    def duplicate_id(self, where: str, task_id: str) -> TaskFileError:
        """The error for a task id seen before in the file."""
        return TaskFileError(f"{where}: field 'id': duplicate task id {task_id!r}")

    def validate_task(self, obj: dict[str, Any], where: str = "task") -> Task:
        """One task from its JSON object; a bad one raises `TaskFileError` naming ``where`` and the field."""
        try:
            return self.task_model.model_validate(obj)
        except ValidationError as e:
            raise TaskFileError(f"{where}: {_first_error(e)}") from None

    @abstractmethod
    def prompt(self, task: Task) -> Prompt:
        """The rollout's first prompt."""

    def sandbox(self, task: Task, default: SandboxSpec) -> SandboxPlan | None:
        """The sandbox ``task`` needs (``default`` is the run's ``[sandbox]`` section), or None."""
        return None

    @abstractmethod
    def parse(self, ctx: TurnContext, text: str) -> Action | Step:
        """The model's turn ``text`` (detokenized, end marker included) as an action to run, or a `Step`."""

    async def act(self, ctx: TurnContext, action: Action) -> Step:
        """Run ``action`` and say what came of it. Environments whose ``parse`` never returns an action
        need not implement it."""
        raise NotImplementedError(f"environment {self.name} has no actions")

    async def score(self, ctx: TurnContext, text: str | None) -> float | Score | None:
        """The reward of the rollout as it stands (``text``: its last model turn); None = unscorable; a
        `Score` carries the verifier's other metrics too."""
        return None

    async def replay(self, ctx: TurnContext, action: Action) -> None:
        """Redo a recorded action in a fresh sandbox (its output is not compared): ``act`` again."""
        await self.act(ctx, action)


log = logging.getLogger(__name__)


@contextmanager
def calling(env: Environment, hook: str, where: str = "") -> Iterator[None]:
    """The boundary of every call the pipeline makes to an environment's ``hook``::

        with calling(env, "parse", rollout_id):
            parsed = env.parse(ctx, text)

    An exception of the environment's own code leaves as `EnvironmentCodeError` (its type, message, the
    hook and the traceback's last frames; logged with them, naming ``where``); the project's own errors
    raised inside (a sandbox call's `SandboxError`, a `TaskFileError`, an `EnvironmentFailure`) pass
    unchanged, with their own kind.
    """
    try:
        yield
    except Exception as e:
        if isinstance(e, RolloutError) and type(e).__module__ == errors.__name__:
            raise
        own_flag = isinstance(e, RolloutError) and e.retryable
        retryable = own_flag or isinstance(e, env.retryable_errors)
        failure = EnvironmentCodeError.from_exception(e, hook, retryable=retryable)
        log.warning(
            "environment %s: %s raised %s%s%s\n  %s", env.name, hook, failure,
            f" ({where})" if where else "", " (retryable)" if retryable else "", "\n  ".join(failure.frames),
        )  # fmt: skip
        raise failure from e


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = err["loc"]
    field = str(loc[0]) if loc else "task"
    where = f" at {'/'.join(str(x) for x in loc[1:])!r}" if len(loc) > 1 else ""
    msg = err["msg"].removeprefix("Value error, ")
    return f"field {field!r}{where}: {msg}"
