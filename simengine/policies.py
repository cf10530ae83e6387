"""Policies of the simulated engine: a prompt (token ids) in, one whole turn (token ids + logprobs) out.

Invariant: a policy decides the complete turn, ending with the end token, before any of it is sent; the
server only cuts it short (``max_tokens``, context length) and paces it. Policies own no I/O.

- `ScriptedPolicy`: for coding tasks, and for any environment through a transcripts file. It reads the task
  id from the ``Task id: <id>`` line of the first user message and the turn number from the
  ``<|assistant|>`` markers already in the context, and plays the scripted turn of its mode, each token
  with logprob `SCRIPTED_LOGPROB`: the task's transcript in that mode (`load_transcripts`) when the
  transcripts file names the task, else the coding script (see `simengine.scripts`). Past the last turn
  of a script the last turn repeats.
- `RandomPolicy`: random bytes then the end token, logprobs near ``-log(256)``; seeded requests (and
  temperature 0) are reproducible. Its turn length is uniform, or heavy-tailed (`heavy_tail_length`:
  a function of the request id alone, so every policy compared on one workload sees the same lengths).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from durable_rollouts.errors import TaskFileError
from durable_rollouts.simengine.scripts import ScriptedTask, load_scripted_tasks, script
from durable_rollouts.simengine.settings import Mode, PolicyName, SimSettings
from durable_rollouts.simengine.tokenizer import ASSISTANT, SimTokenizer

SCRIPTED_LOGPROB = -0.01
"""Logprob reported for every scripted token."""
_TASK_ID = re.compile(r"Task id: (\S+?)(?=\s|<\||$)")


class PolicyError(Exception):
    """The request cannot be served by this policy; the server answers HTTP 400 with the message."""


@dataclass(frozen=True)
class PolicyRequest:
    """What a policy sees of one generate request."""

    prompt_ids: list[int]
    request_id: str
    temperature: float
    seed: int | None


@dataclass(frozen=True)
class Turn:
    """One whole model turn, ending with the end token."""

    token_ids: list[int]
    logprobs: list[float]


class Policy(Protocol):
    def turn(self, req: PolicyRequest) -> Turn: ...


class Transcript(BaseModel):
    """One line of a transcripts file: the model turns of one task in one mode."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    task_id: str = Field(min_length=1)
    """The task's id, as the environment writes it in the ``Task id: <id>`` line of the prompt."""
    mode: Mode = Field(strict=False)
    """The scripted mode these turns are played in."""
    turns: list[str] = Field(min_length=1)
    """The text of each model turn in order (without the end token); the last one repeats."""


Transcripts = dict[tuple[str, Mode], list[str]]
"""(task id, mode) -> the model turns of that task in that mode."""


def load_transcripts(path: str | Path) -> Transcripts:
    """Read a transcripts file (JSONL, one `Transcript` per line, each (task id, mode) at most once).

    Raises:
        TaskFileError: one line naming the file, the line and the field at fault.
    """
    from durable_rollouts.environments.tasks import json_objects

    p = Path(path)
    out: Transcripts = {}
    for n, obj in json_objects(p):
        try:
            t = Transcript.model_validate(obj)
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0]) if err["loc"] else "transcript"
            raise TaskFileError(f"{p}:{n}: field {field!r}: {err['msg']}") from None
        if (t.task_id, t.mode) in out:
            raise TaskFileError(
                f"{p}:{n}: field 'mode': task {t.task_id!r} already has a {t.mode} transcript"
            )
        out[(t.task_id, t.mode)] = list(t.turns)
    if not out:
        raise TaskFileError(f"{p}: no transcripts")
    return out


class ScriptedPolicy:
    """Plays the transcript, or else the coding script, of the task named in the conversation."""

    def __init__(
        self,
        tasks: list[ScriptedTask],
        tokenizer: SimTokenizer,
        settings: SimSettings,
        transcripts: Transcripts | None = None,
    ) -> None:
        self._tasks = {t.id: t for t in tasks}
        self._transcripts = transcripts or {}
        self._transcript_ids = {task_id for task_id, _ in self._transcripts}
        self._tok = tokenizer
        self._settings = settings
        self._assistant_id = tokenizer.encode(ASSISTANT)[0]
        self._cache: dict[tuple[str, Mode], list[list[int]]] = {}

    def turn(self, req: PolicyRequest) -> Turn:
        ids = req.prompt_ids
        first_reply = ids.index(self._assistant_id) if self._assistant_id in ids else len(ids)
        match = _TASK_ID.search(self._tok.decode(ids[:first_reply], skip_special_tokens=False))
        if match is None:
            raise PolicyError("scripted policy: no 'Task id: <id>' line before the first assistant turn")
        task_id = match.group(1)
        if task_id not in self._transcript_ids and task_id not in self._tasks:
            raise PolicyError(f"scripted policy: unknown task id {task_id[:80]!r}")
        done = ids.count(self._assistant_id) - (1 if ids and ids[-1] == self._assistant_id else 0)
        steps = self._steps(task_id, self._settings.mode_for(task_id, req.request_id))
        token_ids = steps[min(done, len(steps) - 1)]
        return Turn(token_ids, [SCRIPTED_LOGPROB] * len(token_ids))

    def _steps(self, task_id: str, mode: Mode) -> list[list[int]]:
        key = (task_id, mode)
        if key not in self._cache:
            if task_id in self._transcript_ids:
                texts = self._transcripts.get(key)
                if texts is None:
                    raise PolicyError(f"scripted policy: task {task_id[:80]!r} has no {mode} transcript")
            else:
                texts = script(self._tasks[task_id], mode)
            self._cache[key] = [[*self._tok.encode(text), self._tok.eos_id] for text in texts]
        return self._cache[key]


class RandomPolicy:
    """Random byte tokens, then the end token."""

    def __init__(self, tokenizer: SimTokenizer, settings: SimSettings) -> None:
        self._eos = tokenizer.eos_id
        self._settings = settings

    def turn(self, req: PolicyRequest) -> Turn:
        rng = random.Random(_seed(req))
        s = self._settings
        if s.random_length == "heavy_tail":
            # randbytes: long turns at scale cost a fraction of per-token randrange calls.
            token_ids = [*rng.randbytes(heavy_tail_length(req.request_id, s)), self._eos]
        else:
            n = rng.randint(s.random_min_tokens, s.random_max_tokens)
            token_ids = [rng.randrange(256) for _ in range(n)] + [self._eos]
        logprobs = [-math.log(256) + rng.uniform(-0.5, 0.5) for _ in token_ids]
        return Turn(token_ids, logprobs)


def heavy_tail_length(request_id: str, settings: SimSettings) -> int:
    """Turn length (before the end token) drawn from the request id: log-normal around the median, and
    ``random_tail_factor`` times that for a ``random_tail_fraction`` of requests (or of rollouts, keyed on the
    request id up to its last "/", when ``random_tail_key`` is "rollout"; or of tasks, keyed on the request
    id less its last two parts, when it is "task"); times the task's length scale when
    ``random_task_sigma`` > 0."""
    s = settings
    rollout = request_id.rpartition("/")[0] or request_id
    task = rollout.rpartition("/")[0] or rollout
    key = {"request": request_id, "rollout": rollout, "task": task}[s.random_tail_key]
    tail = _unit(f"tail:{key}") < s.random_tail_fraction
    jitter = random.Random(_unit(f"length:{request_id}")).lognormvariate(0.0, s.random_length_sigma)
    if s.random_task_sigma > 0:
        jitter *= random.Random(_unit(f"task-scale:{task}")).lognormvariate(0.0, s.random_task_sigma)
    return max(1, round(s.random_median_tokens * jitter * (s.random_tail_factor if tail else 1.0)))


def _unit(text: str) -> float:
    """A uniform draw in [0, 1) fixed by ``text``."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0**64


def make_policy(settings: SimSettings, tokenizer: SimTokenizer) -> Policy:
    """The policy ``settings`` names (reads the task and transcripts files for ``scripted``; raises
    TaskFileError)."""
    if settings.policy == PolicyName.RANDOM:
        return RandomPolicy(tokenizer, settings)
    tasks = load_scripted_tasks(settings.tasks) if settings.tasks is not None else []
    transcripts = load_transcripts(settings.transcripts) if settings.transcripts is not None else None
    return ScriptedPolicy(tasks, tokenizer, settings, transcripts)


def _seed(req: PolicyRequest) -> int | None:
    """Seeded or greedy requests are reproducible from the prompt; others draw fresh randomness."""
    if req.seed is None and req.temperature > 0:
        return None
    h = hashlib.sha256(f"{req.seed}:{req.temperature}:".encode())
    h.update(",".join(map(str, req.prompt_ids)).encode())
    return int.from_bytes(h.digest()[:8], "big")
