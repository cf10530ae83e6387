"""Gateway overhead per model call: a harness's call through the rollout's gateway vs the tool harness's call
path, on one simulated engine, for this checkout's gateway and an older commit's, in one run.

Both sides make ``--calls`` sequential model calls of one growing conversation (a prompt, then each turn
followed by a short observation) against the simulated engine (its own process, no delays), with the run
store in a temporary directory:

- ``tool``: the pipeline's own turn, as the tool harness drives it: the stored context read, one
  token-in/token-out generate, the turn's segment stored, the observation tokenized and stored.
- ``gateway``: a harness process (a child, speaking HTTP over the rollout's Unix socket) posts
  ``/v1/chat/completions``; the gateway server records the request and "signals" (here: schedules the
  call's turn in process, where a worker gets the ``gateway_call`` activity), the turn renders the
  conversation through the engine's chat template, checks it extends the stored tokens, generates, stores,
  detokenizes and answers.

Two engines: ``text``, the scripted policy playing a transcript of tool-calling turns (what a trained model
samples: text whose tokens are the tokenizer's own), and ``random``, random byte tokens (a sample the
template's render of its text never reproduces, so no answer can be checked in one render: the worst case).

Two versions of the code, both extracted with ``git archive`` from this checkout's HEAD: ``after`` as it is,
``before`` with the gateway of commit ``--before`` put back (``gateway/`` and ``store/gateway_calls.py``,
`GATEWAY_FILES`), so everything else (the engine client, the store, the tool path) is the same code on both
sides. Each runs in its own process (``--child``) importing its own ``durable_rollouts``, the versions
alternating ``--repeats`` times per engine so that load drifts hit both. Reported per version and engine:
latency per call (ms, as the harness sees it; median over every call of every repeat), this process's CPU
per call (ms: the worker side; the engine and the harness client are other processes), the chat-template
renders per call (``/tokenize`` requests with messages) and the bytes the store keeps of the calls; and the
ratios after / before of the gateway's added latency and CPU (gateway minus tool path: that version's
process, and both versions' tool path pooled, the same code measured twice).
Temporal's own cost (the signal, the activity's scheduling) is not in either side.

    python bench/gateway_overhead.py --calls 40 --repeats 3 --before e789909 \\
        --out bench/results/gateway_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from durable_rollouts.contracts.harness import GatewayCallInput  # noqa: E402
from durable_rollouts.contracts.types import RolloutRef, SamplingParams  # noqa: E402
from durable_rollouts.engines.client import EngineClient  # noqa: E402
from durable_rollouts.gateway.server import GatewayServer, gateway_key  # noqa: E402
from durable_rollouts.gateway.turn import GatewayTurns  # noqa: E402
from durable_rollouts.store import RunStore, Segment, model_segment, obs_segment  # noqa: E402

SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_tokens=64, seed=1, logprob_mode="processed_logprobs"
)
SYSTEM = "You are a helpful assistant that can interact with a computer. " * 8
OBSERVATION = '{"returncode": 0, "output": "ok"}'

CLIENT = r"""
import http.client, json, socket, sys, time
class Unix(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=120)
        self.path = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)
path, key, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
conn = Unix(path)
messages = [{"role": "system", "content": sys.argv[4]}, {"role": "user", "content": "Task id: bench"}]
out = []
for i in range(calls):
    body = json.dumps({"model": "tiny", "messages": messages})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Authorization": "Bearer " + key,
                 "Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    out.append(time.perf_counter() - t0)
    assert resp.status == 200, data
    messages.append(data["choices"][0]["message"])
    messages.append({"role": "user", "content": sys.argv[5]})
print(json.dumps(out))
"""


TURN = (
    "Step {i}: I will look at the repository and run the failing test again.\n"
    '<tool_call>{{"name": "bash", "arguments": {{"command": "cd /app && ls -la src && python -m pytest -q '
    'tests/test_step_{i}.py"}}}}</tool_call>'
)


GATEWAY_FILES = ("gateway", "store/gateway_calls.py")
"""What ``--before`` takes from the older commit (the rest of both versions is HEAD's)."""


def start_engine(port: int, policy: str, transcripts: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "durable_rollouts.simengine", "--port", str(port),
            "--max-model-len", "65536", "--num-gpu-blocks", "65536"]  # fmt: skip
    if policy == "random":
        argv += ["--policy", "random", "--random-median-tokens", "48"]
    else:
        argv += ["--policy", "scripted", "--transcripts", str(transcripts)]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_up(url: str) -> None:
    import httpx

    async with httpx.AsyncClient() as http:
        for _ in range(200):
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("simulated engine did not start")


async def tool_path(store: RunStore, engine: EngineClient, url: str, calls: int) -> dict[str, list[float]]:
    rid = "bench/tool/0"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Task id: bench"}]
    ids = await engine.tokenize_chat(url, "tiny", messages)
    store.put_segment(rid, Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=ids))
    lat, cpu = [], []
    for turn in range(calls):
        t0, c0 = time.perf_counter(), time.process_time()
        context = await asyncio.to_thread(store.token_ids, rid)
        gen = await engine.generate(url, "tiny", context, SAMPLING, 64, f"{rid}/{turn}/1")
        seg = Segment(name=model_segment(turn), kind="model", turn=turn, start=len(context),
                      token_ids=gen.token_ids, logprobs=gen.logprobs,
                      policy_versions=gen.policy_versions)  # fmt: skip
        seg = await asyncio.to_thread(store.put_segment, rid, seg)
        await engine.detokenize(url, "tiny", seg.token_ids)  # the env step parses the turn
        obs = await engine.tokenize_text(url, "tiny", f"<|user|>{OBSERVATION}<|end|><|assistant|>")
        await asyncio.to_thread(
            store.put_segment, rid,
            Segment(name=obs_segment(turn), kind="observation", turn=turn, start=seg.end, token_ids=obs),
        )  # fmt: skip
        lat.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"latency_s": lat, "cpu_s": cpu}


async def gateway_path(
    store: RunStore, engine: EngineClient, url: str, calls: int, home: Path
) -> dict[str, Any]:
    rid = "bench/gateway/0"
    os.environ["DR_GATEWAY_DIR"] = str(home / "gw")
    server = GatewayServer(store, secret="bench")
    turns = GatewayTurns(store, engine)

    running: set[asyncio.Task[None]] = set()

    ref = RolloutRef(run_id="bench", group_id="g000000", rollout_id=rid, task_id="bench", sample_index=0,
                     env="bench", model="tiny")  # fmt: skip

    async def signal(rollout_id: str, index: int) -> None:  # the worker's gateway_call activity, in process
        inp = GatewayCallInput(ref=ref, index=index, engine_url=url,
                               sampling=SAMPLING, max_tokens=64, max_total_tokens=0)  # fmt: skip

        async def run() -> None:
            await turns.answer(inp)
            server.notify(rollout_id, index)

        task = asyncio.ensure_future(run())
        running.add(task)
        task.add_done_callback(running.discard)

    path = await server.serve(rid, "tiny", signal)
    c0 = time.process_time()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, path, gateway_key(rid, "bench"), str(calls), SYSTEM, OBSERVATION,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    cpu = time.process_time() - c0
    await server.aclose()
    lat = json.loads(out)
    return {"latency_s": lat, "cpu_s_total": cpu}


def summary(lat: list[float], cpu_per_call: float) -> dict[str, float]:
    return {
        "latency_ms_median": round(1e3 * statistics.median(lat), 2),
        "latency_ms_mean": round(1e3 * statistics.mean(lat), 2),
        "cpu_ms_per_call": round(1e3 * cpu_per_call, 2),
    }


async def child(url: str, calls: int) -> dict[str, Any]:
    """One version's measurement (this process imports that version's ``durable_rollouts``)."""
    import durable_rollouts.gateway.turn as turn_module

    engine = EngineClient()
    renders = 0
    tokenize_chat = engine.tokenize_chat

    async def counted(*args: Any, **kw: Any) -> list[int]:  # the renders this version asks for
        nonlocal renders
        renders += 1
        return await tokenize_chat(*args, **kw)

    engine.tokenize_chat = counted  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        store = RunStore(home / "store")
        await tool_path(store, engine, url, 3)  # warm both paths (connections, caches)
        tool = await tool_path(store, engine, url, calls)
        renders = 0
        gw = await gateway_path(store, engine, url, calls, home)
        segs = store.segments("bench/gateway/0")
        q = "SELECT sum(length(request_json)), sum(length(detail_json)) FROM gateway_calls"
        req_bytes, detail_bytes = store.db.execute(q).fetchone()
    await engine.aclose()
    return {
        "code": str(Path(turn_module.__file__).resolve().parents[1]),
        "tool": tool,
        "gateway": gw,
        "renders": renders,
        "tokens_at_end": segs[-1].end if segs else 0,
        "stored_bytes": {"requests": req_bytes, "details": detail_bytes},
    }


def run_child(import_path: str, url: str, calls: int) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = import_path
    argv = [sys.executable, "-P", str(Path(__file__).resolve()), "--child", url, "--calls", str(calls)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def aggregate(runs: list[dict[str, Any]], calls: int) -> dict[str, Any]:
    """One version on one engine over its repeats: both paths' summaries and the gateway's added cost."""
    tool_lat = [x for r in runs for x in r["tool"]["latency_s"]]
    tool_cpu = statistics.mean(x for r in runs for x in r["tool"]["cpu_s"])
    gw_lat = [x for r in runs for x in r["gateway"]["latency_s"]]
    gw_cpu = statistics.mean(r["gateway"]["cpu_s_total"] / calls for r in runs)
    tool, gw = summary(tool_lat, tool_cpu), summary(gw_lat, gw_cpu)
    return {
        "tool": tool,
        "gateway": gw,
        "added_per_call": {
            "latency_ms": round(gw["latency_ms_median"] - tool["latency_ms_median"], 2),
            "cpu_ms": round(gw["cpu_ms_per_call"] - tool["cpu_ms_per_call"], 2),
        },
        "renders_per_call": round(statistics.mean(r["renders"] for r in runs) / calls, 2),
        "context_tokens_at_end": runs[-1]["tokens_at_end"],
        "stored_bytes": runs[-1]["stored_bytes"],
    }


def ratio(after: float, before: float) -> float | None:
    return round(after / before, 3) if before > 0 else None


def main(calls: int, repeats: int, before: str, out: Path | None) -> dict[str, Any]:
    import socket

    sys.path.insert(0, str(REPO / "bench"))
    from orchestration_cost import checkout, import_path

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()

    rev, head = git("rev-parse", before), git("rev-parse", "HEAD")
    engines: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        transcripts = Path(tmp) / "transcripts.jsonl"
        turns = [TURN.format(i=i) for i in range(calls + 8)]
        transcripts.write_text(json.dumps({"task_id": "bench", "mode": "reference", "turns": turns}) + "\n")
        old = checkout(head, Path(tmp) / "before")
        for name in GATEWAY_FILES:  # the older gateway over HEAD's tree
            target = old / name
            if target.is_dir():
                shutil.rmtree(target)
            archive = subprocess.run(["git", "archive", rev, name], cwd=REPO, capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        versions = {"before": import_path(old), "after": import_path(checkout(head, Path(tmp) / "after"))}
        try:
            for policy in ("text", "random"):
                s = socket.socket()
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
                s.close()
                engines[policy] = (start_engine(port, policy, transcripts), f"http://127.0.0.1:{port}")
            for _, url in engines.values():
                asyncio.run(wait_up(url))
            for r in range(repeats):
                order = list(versions) if r % 2 == 0 else list(reversed(versions))
                for policy, (_, url) in engines.items():
                    for name in order:
                        run = run_child(versions[name], url, calls)
                        results.setdefault(policy, {}).setdefault(name, []).append(run)
        finally:
            for proc, _ in engines.values():
                proc.terminate()
                proc.wait(10)
    by_engine: dict[str, Any] = {}
    for policy, per_version in results.items():
        agg = {name: aggregate(runs, calls) for name, runs in per_version.items()}
        b, a = agg["before"], agg["after"]
        # The tool path is the same code in both versions: one quantity measured in each version's
        # process. Its latency moves with the load more than the gateway's difference, so the added cost is
        # also given over both measurements pooled.
        tool_lat = statistics.median(
            x for runs in per_version.values() for r in runs for x in r["tool"]["latency_s"]
        )
        tool_cpu = statistics.mean(
            x for runs in per_version.values() for r in runs for x in r["tool"]["cpu_s"]
        )
        pooled = {"latency_ms_median": round(1e3 * tool_lat, 2), "cpu_ms_per_call": round(1e3 * tool_cpu, 2)}
        added = {
            name: {
                "latency_ms": round(
                    agg[name]["gateway"]["latency_ms_median"] - pooled["latency_ms_median"], 2
                ),
                "cpu_ms": round(agg[name]["gateway"]["cpu_ms_per_call"] - pooled["cpu_ms_per_call"], 2),
            }
            for name in ("before", "after")
        }
        agg["tool_both_versions"] = pooled
        agg["added_per_call_over_tool_both_versions"] = added
        agg["after_over_before"] = {
            "added_latency_over_tool_both": ratio(
                added["after"]["latency_ms"], added["before"]["latency_ms"]
            ),
            "added_cpu_over_tool_both": ratio(added["after"]["cpu_ms"], added["before"]["cpu_ms"]),
            "added_latency": ratio(a["added_per_call"]["latency_ms"], b["added_per_call"]["latency_ms"]),
            "added_cpu": ratio(a["added_per_call"]["cpu_ms"], b["added_per_call"]["cpu_ms"]),
            "gateway_latency": ratio(a["gateway"]["latency_ms_median"], b["gateway"]["latency_ms_median"]),
            "gateway_cpu": ratio(a["gateway"]["cpu_ms_per_call"], b["gateway"]["cpu_ms_per_call"]),
            "stored_bytes": ratio(sum(a["stored_bytes"].values()), sum(b["stored_bytes"].values())),
        }
        by_engine[policy] = agg
    result = {
        "bench": "gateway_overhead",
        "command": " ".join(["python", "bench/gateway_overhead.py", *sys.argv[1:]]),
        "calls": calls,
        "repeats": repeats,
        "before": {"code": head, "gateway_of": rev, "files": list(GATEWAY_FILES)},
        "after": {"code": head},
        "engines": by_engine,
        "note": "simulated engine (no delays) in its own process; Temporal's signal and activity scheduling "
        "not included; CPU = the worker-side process only; a shared 2-core machine: absolute numbers are "
        "upper bounds, the ratios (both versions alternating in one run) are what compares",
    }
    print(json.dumps(result, indent=2))
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--before", default="HEAD", help="the older commit whose gateway is compared")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", metavar="ENGINE_URL", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args.child, args.calls))))
    else:
        main(args.calls, args.repeats, args.before, args.out)
