"""Environments whose every model turn is one tool call run in the rollout's sandbox.

`ToolCallEnvironment` holds the ``parse``, ``act`` and ``replay`` hooks that such environments share (the
bundled coding environment and the swe and harbor plug-ins): one call per turn in the format of
`environments.tool_calls`; ``bash`` runs in the sandbox once per turn (a retried step whose worker died
mid-command
gets the first run's result, through the sandbox's ``once_key``), ``write_file`` and ``read_file`` go
through the sandbox's checked file API, ``submit`` ends the rollout to be scored by the subclass's
``score``. A subclass supplies the task model, ``prompt``, ``sandbox`` and ``score``.

Observations, the same in every such environment:

- ``bash``: the command's output, then ``[exit code N]`` (or ``[timed out]``: the rollout ends truncated,
  ``command_timeout``).
- ``write_file``: ``wrote N bytes to PATH``. ``read_file``: the file's text, at most ``read_limit`` bytes.
- A path the sandbox rejects: ``error: ...``; a malformed call: the parser's one-line message.
"""

from __future__ import annotations

from typing import ClassVar

from durable_rollouts.contracts.types import TruncationReason
from durable_rollouts.environments.base import Action, Environment, Sandbox, Step, TurnContext, until_end
from durable_rollouts.environments.tool_calls import ToolCallError, parse_tool_call
from durable_rollouts.errors import EnvironmentFailure, SandboxFileError, SandboxPathError

READ_LIMIT = 16384
"""Most bytes ``read_file`` shows the model."""

CHANGES_SANDBOX = ("bash", "write_file")
"""The tools a replay into a fresh sandbox redoes (reading changes nothing)."""


def format_exec(exit_code: int, output: str, timed_out: bool) -> str:
    """Observation text of a bash call."""
    status = "timed out" if timed_out else f"exit code {exit_code}"
    return f"{output}\n[{status}]" if output else f"[{status}]"


class ToolCallEnvironment(Environment):
    """An environment whose turns are tool calls run in its sandbox (see the module docstring)."""

    uses_sandbox: ClassVar[bool] = True
    observation_role: ClassVar[str] = "tool"
    read_limit: ClassVar[int] = READ_LIMIT

    def parse(self, ctx: TurnContext, text: str) -> Action | Step:
        """One tool call per turn; a malformed call becomes an error observation for the model."""
        call = parse_tool_call(until_end(text))
        if isinstance(call, ToolCallError):
            return Step(observation=call.message)
        if call.name == "submit":
            return Step(done=True)  # scored by `score`
        return call.model_dump(mode="json")

    async def act(self, ctx: TurnContext, action: Action) -> Step:
        return await self.run_tool_call(ctx, action, once_key=f"turn-{ctx.turn}")

    async def replay(self, ctx: TurnContext, action: Action) -> None:
        if action.get("name") in CHANGES_SANDBOX:  # into a fresh sandbox: every such action runs again
            await self.run_tool_call(ctx, action, once_key=None)

    async def run_tool_call(self, ctx: TurnContext, action: Action, once_key: str | None) -> Step:
        """Run one parsed tool call in the rollout's sandbox; its result is the observation."""
        box = self.sandbox_of(ctx)
        name, args = action["name"], action.get("arguments", {})
        if name == "bash":
            res = await box.exec(args["cmd"], once_key=once_key)
            reason = TruncationReason.COMMAND_TIMEOUT if res.timed_out else None
            return Step(observation=format_exec(res.exit_code, res.output, res.timed_out), truncated=reason)
        try:
            if name == "write_file":
                await box.write_file(args["path"], args["content"])
                obs = f"wrote {len(args['content'].encode())} bytes to {args['path']}"
            elif name == "read_file":
                obs = (await box.read_file(args["path"], self.read_limit)).decode("utf-8", errors="replace")
            else:
                raise EnvironmentFailure(f"rollout {ctx.rollout_id}: unknown action {name!r}")
        except (SandboxPathError, SandboxFileError) as e:
            obs = f"error: {e}"
        return Step(observation=obs)

    def sandbox_of(self, ctx: TurnContext) -> Sandbox:
        """The rollout's sandbox; a declared-sandbox environment asked to act without one is told so."""
        if ctx.sandbox is None:
            raise EnvironmentFailure(f"rollout {ctx.rollout_id}: the {self.name} environment needs a sandbox")
        return ctx.sandbox


__all__ = ["CHANGES_SANDBOX", "READ_LIMIT", "ToolCallEnvironment", "format_exec"]
