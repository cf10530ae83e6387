"""The codex plug-in's side of the gateway (environments/codex/codex_env): Codex's config.toml names the
rollout's gateway as its one Responses provider with hosted tools, sub-agents and its own sandbox off; the
task image gets /opt/codex from the harness image; the scripted turns are Codex's own tool calls."""

from __future__ import annotations

import base64
import json
import sys
import tomllib

from durable_rollouts.gateway import chat
from durable_rollouts.sandboxes.base import SandboxSpec
from tests import REPO_ROOT

for _p in (REPO_ROOT / "environments" / "codex", REPO_ROOT / "environments" / "harbor"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from codex_env import HARNESS_IMAGE, SESSION_LOG, CodexEnvironment, config_toml  # noqa: E402
from codex_env.transcripts import DONE, turns  # noqa: E402
from harbor_env.tasks import load_dataset  # noqa: E402

EXAMPLES = REPO_ROOT / "environments" / "harbor" / "examples"


def test_the_config_points_codex_at_the_gateway_and_nothing_else() -> None:
    cfg = tomllib.loads(config_toml("http://127.0.0.1:8011/v1", retries=3))
    provider = cfg["model_providers"][cfg["model_provider"]]
    assert provider["base_url"] == "http://127.0.0.1:8011/v1" and provider["wire_api"] == "responses"
    assert provider["env_key"] == "OPENAI_API_KEY" and provider["request_max_retries"] == 3
    assert provider["stream_idle_timeout_ms"] >= 900_000
    assert cfg["web_search"] == "disabled" and cfg["agents"] == {"enabled": False}
    assert cfg["sandbox_mode"] == "danger-full-access" and cfg["approval_policy"] == "never"
    assert "model" not in cfg  # named on the command line, from DR_MODEL
    odd = tomllib.loads(config_toml('http://h/"v1"\\'))["model_providers"]["dr-gateway"]["base_url"]
    assert odd == 'http://h/"v1"\\'


def test_the_task_image_gets_codex_and_the_command_keeps_its_session_log() -> None:
    env = CodexEnvironment()
    task = load_dataset(EXAMPLES / "fix-inventory-totals")[0]
    plan = env.sandbox(task, SandboxSpec(image="unused"))
    assert plan.spec.gateway and plan.image_build is not None and plan.spec.image == plan.image_build.tag
    dockerfile = base64.b64decode(plan.image_build.context["Dockerfile"]).decode()
    assert dockerfile.rstrip().endswith(f"COPY --from={HARNESS_IMAGE} /opt/codex /opt/codex")
    cmd = env.harness_command(task)
    assert cmd.keep == (SESSION_LOG,) and cmd.tcp_port == 8011
    assert "--dangerously-bypass-approvals-and-sandbox" in cmd.command and '"$DR_TASK"' in cmd.command
    assert cmd.env["DR_TASK"].startswith(f"Task id: {task.id}\n")
    assert "http://127.0.0.1:8011/v1" in cmd.env["DR_CODEX_CONFIG"]


def test_the_scripted_turns_are_codex_tool_calls_then_a_plain_answer() -> None:
    for task in load_dataset(EXAMPLES):
        played = turns(task, "reference")
        assert played[-1] == DONE
        for text in played[:-1]:
            parsed = chat.parse_answer(text, 0)  # as the gateway reads it (the built-in format)
            assert parsed.content is None and len(parsed.tool_calls) == 1, text[:80]
            fn = parsed.tool_calls[0]["function"]
            assert fn["name"] == "exec_command" and set(json.loads(fn["arguments"])) == {
                "cmd",
                "yield_time_ms",
            }
