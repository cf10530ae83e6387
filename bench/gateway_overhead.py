"""Gateway overhead per model call: a harness's call through the rollout's gateway vs the tool harness's
call path, on one simulated engine, in one run.

Both sides make ``--calls`` sequential model calls of one growing conversation (a prompt, then each turn
followed by a short observation) against the simulated engine (its own process, the random policy, no
delays), with the run store in a temporary directory:

- ``tool``: the pipeline's own turn, as the tool harness drives it: the stored context read, one
  token-in/token-out generate, the turn's segment stored, the observation tokenized and stored.
- ``gateway``: a harness process (a child, speaking HTTP over the rollout's Unix socket) posts
  ``/v1/chat/completions``; the gateway server records the request and "signals" (here: schedules the
  call's turn in process, where a worker gets the ``gateway_call`` activity), the turn renders the
  conversation through the engine's chat template (two renders: the new conversation and the previous
  one closed), checks it extends the stored tokens, generates, stores, detokenizes and answers.

Reported per call: latency (ms, as the caller sees it) and this process's CPU (ms: the worker side; the
engine and the harness client are other processes). Temporal's own cost (the signal, the activity's
scheduling) is not in either side: it is the same per call for both (one activity) plus one signal for the
gateway.

    python bench/gateway_overhead.py --calls 40 --out bench/results/gateway_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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


def start_engine(port: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "durable_rollouts.simengine", "--port", str(port), "--policy", "random",
            "--random-median-tokens", "48", "--max-model-len", "65536",
            "--num-gpu-blocks", "65536"]  # fmt: skip
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


async def main(calls: int, out: Path | None) -> dict[str, Any]:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = start_engine(port)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_up(url)
        engine = EngineClient()
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp)
            store = RunStore(home / "store")
            await tool_path(store, engine, url, 3)  # warm both paths (connections, caches)
            tool = await tool_path(store, engine, url, calls)
            gw = await gateway_path(store, engine, url, calls, home)
            segs = store.segments("bench/gateway/0")
            tokens = segs[-1].end if segs else 0
        await engine.aclose()
    finally:
        proc.terminate()
        proc.wait(10)
    tool_sum = summary(tool["latency_s"], statistics.mean(tool["cpu_s"]))
    gw_sum = summary(gw["latency_s"], gw["cpu_s_total"] / calls)
    result = {
        "bench": "gateway_overhead",
        "calls": calls,
        "gateway_context_tokens_at_end": tokens,
        "tool": tool_sum,
        "gateway": gw_sum,
        "overhead_per_call": {
            "latency_ms": round(gw_sum["latency_ms_median"] - tool_sum["latency_ms_median"], 2),
            "cpu_ms": round(gw_sum["cpu_ms_per_call"] - tool_sum["cpu_ms_per_call"], 2),
        },
        "note": "simulated engine (random policy, no delays) in its own process; Temporal's signal and "
        "activity scheduling not included; CPU = this (worker-side) process only",
    }
    print(json.dumps(result, indent=2))
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    asyncio.run(main(args.calls, args.out))
