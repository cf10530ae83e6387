"""Codex CLI, unchanged, as the agent of Harbor task directories (``run.env = "codex"``).

A plug-in in its own distribution (``durable-rollouts-codex``) using the core's harness trait
(``environments.harness_trait``) and the harbor plug-in's tasks, image builds and verifier
(``harbor_env.harness_base.HarborHarness``, which both harness plug-ins subclass):

- Tasks: Harbor task directories, read at submit as the harbor plug-in reads them.
- Sandbox: the harbor plug-in's plan (its task image, limits, seed, /logs /tests /solution), with one
  layer more, ``/opt/codex`` copied from ``HARNESS_IMAGE`` (Codex's static binary, fetched on the host and
  built in offline by ``build_image.sh``), and the rollout's gateway folder mounted (no network).
- Harness: ``codex exec`` with the task's instruction (``Task id: <name>`` first), its own sandbox and
  approvals off (the container is the sandbox), configured by ``$CODEX_HOME/config.toml`` (`config_toml`):
  one model provider, the rollout's gateway at the loopback shim's URL, ``wire_api = "responses"``; hosted
  tools (web search) and sub-agents off, since only the tools Codex runs itself can be served.
- Kept: Codex's own session log (``SESSION_LOG``), copied out of ``$CODEX_HOME/sessions`` when it exits.
- Score: Harbor's verifier in the same container once the harness exits 0.
"""

from __future__ import annotations

import json
import shlex
from typing import ClassVar

from harbor_env.harness_base import HarborHarness, as_harbor, task_text

from durable_rollouts.environments.base import Task
from durable_rollouts.environments.harness_trait import HarnessCommand

__all__ = ["CODEX_VERSION", "HARNESS_IMAGE", "CodexEnvironment", "config_toml"]

CODEX_VERSION = "0.169.0"
HARNESS_IMAGE = f"dr-harness/codex:{CODEX_VERSION}"
"""The image /opt/codex is copied from (``environments/codex/build_image.sh``)."""
BINARY = "/opt/codex/bin/codex"
STATE = "/tmp/.dr-harness"
CODEX_HOME = f"{STATE}/codex"
SESSION_LOG = f"{STATE}/codex-session.jsonl"
"""Codex's own session log (its ``rollout-*.jsonl``), kept with the rollout (`RunStore.harness_files`)."""
CLIENT_TIMEOUT_S = 900
"""How long Codex waits on a model call's stream: longer than a call may wait on a worker's death, its
activity's retry and the engine (see the docs: "what survives which fault")."""
PROVIDER = "dr-gateway"


def config_toml(base_url: str, retries: int = 10) -> str:
    """Codex's ``config.toml``: the rollout's gateway as its one model provider (Responses API, the key in
    ``OPENAI_API_KEY``), approvals and its own sandbox off, hosted tools and sub-agents off. The model is
    named on the command line (``--model``)."""
    q = _toml
    return (
        f"model_provider = {q(PROVIDER)}\n"
        'approval_policy = "never"\n'
        'sandbox_mode = "danger-full-access"\n'
        'web_search = "disabled"\n'
        "check_for_update_on_startup = false\n"
        "\n[features]\ngoals = false\n"
        "\n[agents]\nenabled = false\n"
        "\n[analytics]\nenabled = false\n"
        f"\n[model_providers.{PROVIDER}]\n"
        'name = "durable-rollouts gateway"\n'
        f"base_url = {q(base_url)}\n"
        'env_key = "OPENAI_API_KEY"\n'
        'wire_api = "responses"\n'
        f"request_max_retries = {retries}\n"
        f"stream_max_retries = {retries}\n"
        f"stream_idle_timeout_ms = {CLIENT_TIMEOUT_S * 1000}\n"
    )


def _toml(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's for these characters)."""
    return json.dumps(value)


def command(workdir: str) -> str:
    """The harness's shell command: write the config, run ``codex exec`` on ``$DR_TASK`` in ``workdir``,
    keep its session log, exit with its code."""
    return (
        f'mkdir -p {CODEX_HOME} && printf "%s" "$DR_CODEX_CONFIG" > {CODEX_HOME}/config.toml && '
        f"cd {shlex.quote(workdir)} && "
        f"{BINARY} exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox "
        '--model "$DR_MODEL" "$DR_TASK"; '
        "rc=$?; "
        f"for f in {CODEX_HOME}/sessions/*/*/*/rollout-*.jsonl; do "
        f'[ -f "$f" ] && cp "$f" {SESSION_LOG}; done; '
        "exit $rc"
    )


class CodexEnvironment(HarborHarness):
    """Harbor tasks solved by Codex CLI through the rollout's gateway (see the module docstring)."""

    name: ClassVar[str] = "codex"
    env_version: ClassVar[str] = f"codex-{CODEX_VERSION}-harbor-v1"
    runtime_image: ClassVar[str] = HARNESS_IMAGE
    runtime_path: ClassVar[str] = "/opt/codex"
    image_prefix: ClassVar[str] = "dr-codex-env"

    port: ClassVar[int] = 8011

    def harness_command(self, task: Task) -> HarnessCommand:
        t = as_harbor(task)
        url = f"http://127.0.0.1:{self.port}/v1"
        env = {
            "CODEX_HOME": CODEX_HOME,
            "DR_TASK": task_text(t),
            "DR_CODEX_CONFIG": config_toml(url),
            "HOME": STATE,
            "NO_COLOR": "1",
            "PAGER": "cat",
        }
        return HarnessCommand(command=command(t.workdir), env=env, tcp_port=self.port, keep=(SESSION_LOG,))
