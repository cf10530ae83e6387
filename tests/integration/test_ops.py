"""Operating a run (issue 11) on the real Temporal dev server with simulated engines: ``rollouts stuck``
lists exactly the rollouts of a frozen (SIGSTOPped) engine within 30 s and the web UI's "stuck" URL shows
them (headless Chromium, screenshot kept); ``cancel``, ``retry`` and ``terminate`` (a rollout and a group)
on a live run keep the books whole and are logged."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from temporalio.client import Client

from durable_rollouts.cli import ops
from durable_rollouts.config.models import Config
from durable_rollouts.sandboxes import DockerBackend
from durable_rollouts.simengine import Mode, SimEngine, SimSettings
from durable_rollouts.stack import procs
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.workflows.rollout import RolloutWorkflow
from tests import REPO_ROOT
from tests.integration.support import (
    CODING_TASKS,
    assert_no_containers,
    coding_config,
    export,
    make_config,
    start_run,
    worker,
)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def sim_engine(home: Path, name: str, turn_ms: float) -> tuple[int, str]:
    """A simulated engine in its own process (so it can be frozen): random policy, ``turn_ms`` a call."""
    port = procs.free_port()
    argv = [sys.executable, "-m", "durable_rollouts.simengine", "--port", str(port), "--policy", "random",
            "--prefill-ms", str(turn_ms)]  # fmt: skip
    pid = procs.spawn(name, argv, home)
    url = f"http://127.0.0.1:{port}"
    procs.wait_until(lambda: procs.http_ok(f"{url}/health"), 60, name, pid=pid)
    return pid, url


def acted_config(
    url: str, task_queue: str, tmp: Path, groups: int, size: int, turns: int, local: bool = False,
    inline: bool = False,
) -> Config:  # fmt: skip
    """A run for operators to act on: every group in flight, rollouts of ``turns`` turns (~0.5 s each)
    that never end early."""
    return make_config(
        [url],
        task_queue,
        run={
            "num_groups": groups,
            "group_size": size,
            "max_inflight_groups": groups,
            "task_file": never_tasks(tmp),
        },
        rollout={"max_turns": turns, "max_total_tokens": 8192, "local_model_calls": local},
        group={"inline_rollouts": inline},
    )


def never_tasks(tmp: Path) -> str:
    """Math tasks whose answer no policy gives: no rollout ends early with the right answer."""
    path = tmp / "never.jsonl"
    rows = [json.dumps({"id": f"never-{i}", "prompt": f"{i}+1=", "answer": "never"}) for i in range(4)]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def cli(client: Client, home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real ``rollouts`` command against the test's server and store."""
    address = client.service_client.config.target_host
    argv = [sys.executable, "-m", "durable_rollouts.cli.rollouts", *args]
    if args[0] in ("stuck", "cancel", "retry", "terminate", "top", "status"):
        argv += ["--address", address]
    env = {**os.environ, "ROLLOUTS_HOME": str(home)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)


def read_until(proc: subprocess.Popen[str], text: str, timeout: float) -> str:
    """What ``proc`` printed until ``text`` appeared (fails after ``timeout`` seconds). Reads the pipe's
    descriptor unbuffered, so a later ``communicate()`` gets exactly the rest."""
    assert proc.stdout is not None
    fd, out = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and text.encode() not in out:
        if select.select([fd], [], [], 0.5)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk
    got = out.decode(errors="replace")
    assert text in got, f"no {text!r} within {timeout} s: {got[-2000:]}"
    return got


async def wait_for(pred, timeout: float, what: str, every: float = 0.3):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = await pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(every)


async def running_rollouts(client: Client, run_id: str) -> list[str]:
    q = f'WorkflowType = "RolloutWorkflow" AND RolloutRun = "{run_id}" AND ExecutionStatus = "Running"'
    return sorted([w.id async for w in client.list_workflows(q)])


def chromium_dump(url: str, tmp: Path, shot: Path) -> str:
    """The web UI page's DOM after the single-page app rendered (and a screenshot of it)."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={tmp / 'chromium-profile'}", "--window-size=1600,1000",
             "--virtual-time-budget=20000"]  # fmt: skip
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", url], capture_output=True, timeout=120)
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    return dom.stdout


@pytest.mark.timeout(300)
async def test_stuck_lists_exactly_the_rollouts_of_a_frozen_engine_and_the_web_ui_shows_them(
    client: Client, temporal_ui: str, task_queue: str, tmp_path: Path
) -> None:
    run_id = "stuck-run"
    frozen_pid, frozen = sim_engine(tmp_path, "sim-frozen", 1000)
    live_pid, live = sim_engine(tmp_path, "sim-live", 1000)
    try:
        cfg = make_config(
            [frozen, live],
            task_queue,
            run={
                "num_groups": 4,
                "group_size": 2,
                "max_inflight_groups": 4,
                "task_file": never_tasks(tmp_path),
            },
            rollout={"max_turns": 24, "max_total_tokens": 4096},
            engine={"stall_timeout_s": 0},  # unwatched: the stall watchdog would fail them over in 10 s
        )
        async with worker(client, task_queue, tmp_path) as store:
            handle = await start_run(client, cfg, run_id)

            async def all_turning() -> list[str] | None:
                ids = await running_rollouts(client, run_id)
                ok = len(ids) == 8 and all(store.get_segment(r, "t00000.model") for r in ids)
                return ids if ok else None

            ids = await wait_for(all_turning, 90, "all eight rollouts past their first turn")
            engines = {
                r: (await client.get_workflow_handle(r).query(RolloutWorkflow.state))["engine"] for r in ids
            }
            expected = sorted(r for r, e in engines.items() if e == frozen)
            assert expected and len(expected) < 8, engines  # both replicas hold rollouts
            os.kill(frozen_pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                await asyncio.sleep(20)
                listed: list[str] = []
                while time.monotonic() - frozen_at < 30:
                    res = await asyncio.to_thread(cli, client, tmp_path, "stuck", run_id, "--for", "20s")
                    assert res.returncode == 0, res.stderr
                    listed = sorted(line.split()[0] for line in res.stdout.splitlines() if line.strip())
                    if listed == expected:
                        break
                    await asyncio.sleep(0.5)
                took = time.monotonic() - frozen_at
                print(f"stuck listed {len(listed)} rollouts {took:.1f} s after the freeze:\n{res.stdout}")
                assert listed == expected, (listed, expected)
                assert took < 30
                for line in res.stdout.splitlines():  # the pending model call, its attempt and heartbeat
                    assert "phase=generate" in line and f"engine={frozen}" in line, line
                    assert "pending=generate_turn attempt=1/" in line, line

                url_res = await asyncio.to_thread(
                    cli, client, tmp_path, "stuck", run_id, "--for", "20s", "--url", "--ui", temporal_ui
                )
                url = url_res.stdout.strip()
                assert url.startswith(f"{temporal_ui}/namespaces/default/workflows?query="), url_res
                shot = tmp_path / "stuck-web-ui.png"
                dom = await asyncio.to_thread(chromium_dump, url, tmp_path, shot)
                print(f"web UI: {url}\nscreenshot: {shot}")
                assert all(r in dom for r in expected), dom[-3000:]
                assert not any(r in dom for r in ids if r not in expected)
                assert shot.exists() and shot.stat().st_size > 0
            finally:
                os.kill(frozen_pid, signal.SIGCONT)
            result = await asyncio.wait_for(handle.result(), timeout=200)
        rollouts, groups = export(store, run_id)
        assert result.done and len(groups) == 4 and len(rollouts) == 8
        assert len({r["rollout_id"] for r in rollouts}) == 8
    finally:
        os.kill(frozen_pid, signal.SIGCONT)
        procs.stop_pid(frozen_pid)
        procs.stop_pid(live_pid)


@pytest.mark.timeout(300)
async def test_cancel_retry_and_terminate_on_a_live_run_keep_the_books_whole(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    run_id = "acted"
    async with SimEngine(SimSettings(policy="random", prefill_ms=500)).serve(port=0) as url:
        cfg = acted_config(url, task_queue, tmp_path, 4, 3, 60)  # ~30 s each: the actions land first
        async with worker(client, task_queue, tmp_path) as store:
            handle = await start_run(client, cfg, run_id)

            async def all_running() -> bool:
                ids = await running_rollouts(client, run_id)
                return len(ids) == 12 and all(store.get_segment(r, "t00000.model") for r in ids)

            await wait_for(all_running, 90, "all twelve rollouts past their first turn")
            r = lambda g, i: f"{run_id}/g{g:06d}/{i}"  # noqa: E731
            acts = [("cancel", r(0, 0)), ("retry", r(0, 1)), ("terminate", r(1, 0)),
                    ("terminate", f"{run_id}/g000002")]  # fmt: skip
            # at once, as operators would: each waits for its record (a cancel lands once the model call
            # has stopped, up to a heartbeat interval later)
            done = await asyncio.gather(*(asyncio.to_thread(cli, client, tmp_path, *a) for a in acts))
            for args, res in zip(acts, done, strict=True):
                assert res.returncode == 0, (args, res.stdout, res.stderr)
            print("\n".join(res.stdout.strip() for res in done))
            bad = await asyncio.to_thread(cli, client, tmp_path, "cancel", f"{run_id}/g000009/0")
            assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
            gone = await asyncio.to_thread(cli, client, tmp_path, "stuck", "no-such-run")
            assert gone.returncode == 2 and "no run" in gone.stderr, gone.stderr
            top = subprocess.Popen(  # the live view, for a few refreshes, then Ctrl-C
                [sys.executable, "-m", "durable_rollouts.cli.rollouts", "top", run_id, "--interval", "0.5",
                 "--address", client.service_client.config.target_host],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
            )  # fmt: skip
            # piped, each refresh is printed: Ctrl-C once a few frames are out (a fixed sleep raced the
            # process's start on a loaded CI host and interrupted it before its first frame)
            first = await asyncio.to_thread(read_until, top, "replica", 60)
            await asyncio.sleep(1.5)
            top.send_signal(signal.SIGINT)
            rest, top_err = await asyncio.to_thread(top.communicate, timeout=30)
            shown = first + rest
            assert top.returncode == 130 and "Traceback" not in top_err, top_err  # Ctrl-C: 130 (interrupt.py)
            flat = " ".join(shown.split())  # rich wraps the title to the table's width
            assert f"run {run_id}:" in flat and "in flight" in flat and "replica" in flat, shown
            result = await asyncio.wait_for(handle.result(), timeout=200)
            status = await asyncio.to_thread(cli, client, tmp_path, "status", run_id)  # from its result
            shown_status = status.stdout + status.stderr
            assert status.returncode == 0 and f"run {run_id}: workflow COMPLETED" in shown_status, status
            assert "cancelled" in status.stdout and "Traceback" not in shown_status, status  # the summary
            actions = store.manual_actions(run_id)
            # every documented filter is valid; the reason filter finds the rollouts acted on
            for q in (ops.stuck_filter(run_id, time.time()), ops.retrying_filter(run_id),
                      ops.replica_filter(run_id, url), ops.phase_filter(run_id, "generate"),
                      ops.failed_filter(run_id, "infra: EngineUnavailable")):  # fmt: skip
                await client.count_workflows(q)

            async def by_reason() -> list[str] | None:
                q = f'{ops.rollouts_of(run_id)} AND RolloutReason IN ("manual", "manual-retry")'
                found = sorted([w.id async for w in client.list_workflows(q)])
                return found if len(found) == 2 else None

            assert await wait_for(by_reason, 10, "the reason filter") == [r(0, 0), r(0, 1)]
    rollouts, groups = export(store, run_id)
    by_id = {x["rollout_id"]: x for x in rollouts}
    assert result.done and result.groups_done == 4
    assert len(by_id) == len(rollouts) == 13  # 12 slots + the retried slot's second attempt
    assert len(groups) == 4 and all(g["size"] == 3 for g in groups)
    assert sum(result.outcomes.values()) == 13 == sum(sum(g["outcomes"].values()) for g in groups)
    assert (by_id[r(0, 0)]["outcome"], by_id[r(0, 0)]["reason"]) == ("cancelled", "manual")
    assert (by_id[r(0, 1)]["outcome"], by_id[r(0, 1)]["reason"]) == ("cancelled", "manual-retry")
    again = by_id[f"{r(0, 1)}r1"]  # the retried slot's fresh attempt ran to its end
    assert again["outcome"] in ("completed", "truncated") and again["sample_index"] == 1
    assert by_id[r(1, 0)]["outcome"] == "failed" and by_id[r(1, 0)]["reason"].startswith("infra: ")
    g2 = [x for x in rollouts if x["group_id"] == "g000002"]
    assert sorted(x["sample_index"] for x in g2) == [0, 1, 2]
    assert all(x["outcome"] == "failed" and "terminated" in x["reason"] for x in g2), g2
    assert Counter(a["action"] for a in actions) == {"cancel": 1, "retry": 1, "terminate": 2}
    assert {a["target"] for a in actions} == {r(0, 0), r(0, 1), r(1, 0), f"{run_id}/g000002"}
    assert RunStore(tmp_path).schema_version() >= 1


@pytest.mark.timeout(300)
async def test_a_sandboxed_rollout_is_findable_by_its_sandbox_host_replica_and_attempt(
    client: Client, docker: DockerBackend, task_queue: str, tmp_path: Path
) -> None:
    settings = SimSettings(tasks=CODING_TASKS, mode=Mode.REFERENCE, max_model_len=4096)
    async with SimEngine(settings).serve(port=0) as url:
        cfg = coding_config(url, task_queue, groups=1, size=2)
        async with worker(client, task_queue, tmp_path):
            await (await start_run(client, cfg, "hosted")).result()
    host = docker.host()
    q = f'{ops.rollouts_of("hosted")} AND RolloutSandboxHost = "{host}" AND RolloutEngine = "{url}"'

    async def found() -> list[str] | None:
        ids = sorted([w.id async for w in client.list_workflows(f"{q} AND RolloutAttempt = 1")])
        return ids if len(ids) == 2 else None

    assert await wait_for(found, 15, "both rollouts by host, replica and attempt") == [
        "hosted/g000000/0",
        "hosted/g000000/1",
    ]
    assert_no_containers(docker, "hosted")


@pytest.mark.timeout(300)
async def test_retry_then_terminate_of_a_group_running_its_members_inline_records_every_attempt(
    client: Client, task_queue: str, tmp_path: Path
) -> None:
    """``group.inline_rollouts``: members have no workflow of their own. A member retried by hand runs its
    slot again as ``<i>r1``; terminating the group then records every attempt that began and has no
    record (found by the tokens it stored, as Temporal has no workflow of it to list), and every slot."""
    run_id = "inline-acted"
    async with SimEngine(SimSettings(policy="random", prefill_ms=500)).serve(port=0) as url:
        cfg = acted_config(url, task_queue, tmp_path, 2, 2, 60, local=True, inline=True)  # ~30 s each
        async with worker(client, task_queue, tmp_path) as store:
            handle = await start_run(client, cfg, run_id)
            r = lambda i: f"{run_id}/g000000/{i}"  # noqa: E731

            def stored(rid: str, name: str):  # type: ignore[no-untyped-def]
                async def check() -> bool:
                    return store.get_segment(rid, name) is not None

                return check

            await wait_for(stored(r(1), "t00001.model"), 60, "member 1's turns")
            said = await ops.retry(client, store, r(1), wait_s=60)
            assert said.startswith(f"retrying {r(1)} as {r(1)}r1: recorded cancelled (manual-retry)"), said
            await wait_for(stored(f"{r(1)}r1", "prompt"), 60, "the retry's start")
            said = await ops.terminate(client, store, f"{run_id}/g000000", wait_s=60)
            assert said.startswith(f"terminated group {run_id}/g000000: recorded size 2"), said
            result = await asyncio.wait_for(handle.result(), timeout=200)
    rollouts, groups = export(store, run_id)
    by_id = {x["rollout_id"]: x for x in rollouts}
    assert result.done and len(groups) == 2
    assert sorted(by_id) == sorted([r(0), r(1), f"{r(1)}r1", f"{run_id}/g000001/0", f"{run_id}/g000001/1"])
    assert (by_id[r(1)]["outcome"], by_id[r(1)]["reason"]) == ("cancelled", "manual-retry")
    for rid in (r(0), f"{r(1)}r1"):  # ended by the terminate: recorded by the run
        assert by_id[rid]["outcome"] == "failed" and "terminated" in by_id[rid]["reason"], by_id[rid]
    assert sum(result.outcomes.values()) == 5
