"""Codex CLI 0.169.0, unchanged (the pinned binary environments/codex/fetch_codex.sh fetches), against a
rollout's real gateway socket through the loopback shim (gateway/shim.py), configured by the codex
plug-in's ``config.toml``: its Responses requests are recorded and answered token-exactly, its tool call
runs, and its own session log agrees with the gateway's calls."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from durable_rollouts.gateway.server import gateway_key
from durable_rollouts.sandboxes.base import GATEWAY_ROOT_ENV
from durable_rollouts.store import RunStore
from tests import REPO_ROOT
from tests.unit.gateway.test_gateway import RID, ScriptedEngine, answering_gateway

CODEX = REPO_ROOT / "environments" / "codex"
HARBOR = REPO_ROOT / "environments" / "harbor"
SHIM = REPO_ROOT / "gateway" / "shim.py"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def codex_bin() -> Path:
    """The pinned Codex binary (fetched once at setup; reused)."""
    done = subprocess.run(
        ["bash", str(CODEX / "fetch_codex.sh")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for p in (str(CODEX), str(HARBOR)):
        if p not in sys.path:
            sys.path.insert(0, p)
    return Path(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_codex_runs_a_task_through_the_gateway(
    codex_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from codex_env import config_toml
    from codex_env.transcripts import DONE, exec_command

    monkeypatch.setenv(GATEWAY_ROOT_ENV, str(tmp_path / "gw"))
    store = RunStore(tmp_path / "store")
    engine = ScriptedEngine([exec_command("printf hi > out.txt && ls"), DONE])
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    port = free_port()
    (home / "config.toml").write_text(config_toml(f"http://127.0.0.1:{port}/v1", retries=2))
    async with answering_gateway(store, engine) as (_, path, signals):
        shim = subprocess.Popen([sys.executable, str(SHIM), str(port), path])
        try:
            for _ in range(100):
                try:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            env = {
                "PATH": os.environ["PATH"], "HOME": str(tmp_path), "CODEX_HOME": str(home),
                "OPENAI_API_KEY": gateway_key(RID, "s"), "NO_COLOR": "1",
            }  # fmt: skip
            proc = await asyncio.create_subprocess_exec(
                str(codex_bin), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                "--model", "tiny", "Task id: t1\n\nWrite hi to out.txt.",
                cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(proc.communicate(), 240)
        finally:
            shim.terminate()
            shim.wait(10)
    log = out.decode(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    assert (work / "out.txt").read_text() == "hi"
    # Two calls, each recorded once, signalled once, sampled once; the second extends the first's tokens.
    calls = store.gateway_calls(RID)
    assert [c.request.get("api") for c in calls] == ["responses", "responses"] and signals == [0, 1]
    assert len(engine.prompts) == 2 and all(c.status == 200 for c in calls)
    segs = store.segments(RID)
    assert [s.kind for s in segs] == ["prompt", "model", "observation", "model"], log[-2000:]
    assert engine.prompts[1] == [t for s in segs[:3] for t in s.token_ids]
    assert [s.token_ids for s in segs if s.kind == "model"] == engine.returned
    first = calls[0].request["messages"]
    assert first[-1] == {"role": "user", "content": "Task id: t1\n\nWrite hi to out.txt."}
    # Codex's own session log holds the gateway's answers as it was given them, once each, in order.
    (session,) = list((home / "sessions").rglob("rollout-*.jsonl"))
    items = [json.loads(line) for line in session.read_text().splitlines()]
    got = [i["payload"] for i in items if i.get("type") == "response_item"]
    calls_seen = [
        (p["call_id"], p["name"], json.loads(p["arguments"])) for p in got if p["type"] == "function_call"
    ]
    answered = calls[0].response["choices"][0]["message"]["tool_calls"]  # type: ignore[index]
    assert calls_seen == [
        (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answered
    ]
    said = [p["content"][0]["text"] for p in got if p["type"] == "message" and p["role"] == "assistant"]
    assert said == [calls[1].response["choices"][0]["message"]["content"]] == [DONE]  # type: ignore[index]
    outputs = [p for p in got if p["type"] == "function_call_output"]
    tool_msg = calls[1].request["messages"][-1]
    assert len(outputs) == 1 and tool_msg["role"] == "tool" and tool_msg["tool_call_id"] == answered[0]["id"]
    assert "out.txt" in tool_msg["content"]
