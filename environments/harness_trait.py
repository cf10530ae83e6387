"""The harness trait: environments whose agent is a program of the user's own (mini-swe-agent, terminus-2,
OpenHands, ...), run unchanged in the rollout's sandbox, every model call of which goes through the
rollout's gateway (``gateway/``) as a durable, token-exact model call.

How the pipeline drives a `HarnessEnvironment`, per rollout:

1. ``sandbox(task, default)``: as for any environment; the pipeline turns the plan's ``spec.gateway`` on
   (the rollout's gateway folder, read-only, is the only thing outside the container it can reach).
2. ``harness(task)``: the `HarnessCommand` (a shell command, extra environment, the loopback port of the
   TCP shim): started once in the sandbox's working directory, with ``OPENAI_BASE_URL``,
   ``OPENAI_API_KEY`` (the rollout's key), ``DR_GATEWAY_SOCKET`` and ``DR_MODEL`` set.
3. Each model call the harness makes is one ``gateway_call`` activity of the rollout (its tokens, logprobs,
   policy versions stored as segments; loss mask 1 exactly on sampled tokens).
4. When the harness exits, the files its command names in ``keep`` are stored with the rollout
   (``RunStore.harness_files``). When it exits 0, ``score(ctx, None)`` scores the container (e.g. a Harbor
   task's verifier).
   A harness that exits non-zero, or never called the model, fails the rollout as ``environment:`` with its
   last output lines. A limit (``rollout.max_turns`` calls, ``rollout.max_total_tokens``, the engine's
   context length, the wall-clock limits) is answered as an OpenAI server would, then the harness is
   stopped and the rollout ends ``truncated`` with its reason.

``prompt`` and ``parse`` are not used (the harness writes its own prompts and reads its own answers).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from durable_rollouts.environments.base import Environment, Prompt, Step, Task, TurnContext

__all__ = ["HarnessCommand", "HarnessEnvironment"]


@dataclass(frozen=True)
class HarnessCommand:
    """What an environment's harness is: a shell command run in the sandbox's working directory."""

    command: str
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables (the gateway's are added: ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``...)."""
    tcp_port: int | None = 8011
    """Loopback port of the TCP shim (``http://127.0.0.1:PORT/v1``); None: the harness speaks to the Unix
    socket ``DR_GATEWAY_SOCKET`` itself."""
    keep: tuple[str, ...] = ()
    """Files the harness leaves in the sandbox (absolute, or relative to the workdir) kept with the rollout
    once it exits, whatever its exit code (e.g. the harness's own trajectory): `RunStore.harness_files`."""


class HarnessEnvironment(Environment):
    """Base of environments whose agent is a harness program (see the module docstring)."""

    harness: ClassVar[bool] = True
    uses_sandbox: ClassVar[bool] = True

    @abstractmethod
    def harness_command(self, task: Task) -> HarnessCommand:
        """The harness to run in ``task``'s sandbox."""

    def prompt(self, task: Task) -> Prompt:
        """Not used: the harness writes its own prompts."""
        return Prompt(messages=[{"role": "user", "content": task.id}])

    def parse(self, ctx: TurnContext, text: str) -> Step:
        """Not used: the harness reads its own answers."""
        return Step(done=True)
