"""``python -m durable_rollouts.simengine``: serve one simulated engine until SIGTERM or SIGINT.

Invariant: the line ``simengine ready on http://HOST:PORT ...`` is printed (and flushed) only once the port
accepts requests; a bad setting or task file exits with status 2 and one line on stderr, before binding.
The CLI is parsed before the heavy imports, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from durable_rollouts.simengine.engine import SimEngine
    from durable_rollouts.simengine.faults import FaultUpdate
    from durable_rollouts.simengine.settings import SimSettings


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m durable_rollouts.simengine", description="Simulated vLLM engine (HTTP)."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (see the ready line)")
    p.add_argument("--model", default="tiny", help="served model name")
    p.add_argument(
        "--model-dir", default=None, help="directory with tokenizer.json (default: bundled policy)"
    )
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--tasks", default=None, help="coding task file (JSONL); --policy scripted needs it or --transcripts"
    )
    p.add_argument(
        "--transcripts", default=None, help="transcripts file (JSONL): scripted turns for any environment"
    )
    p.add_argument("--policy", default="scripted", choices=["scripted", "random"])
    p.add_argument(
        "--mode", default="reference", choices=["reference", "wrong", "malformed", "loop", "sleep"]
    )
    p.add_argument(
        "--mode-rule",
        action="append",
        default=[],
        metavar="task:PREFIX=MODE|request:PREFIX=MODE",
        help="per-request mode by task-id or request-id prefix; first match wins (repeatable)",
    )
    p.add_argument("--weight-version", default="v0")
    p.add_argument("--prefill-ms", type=float, default=0.0)
    p.add_argument("--decode-ms-per-token", type=float, default=0.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-gpu-blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--random-length", default="uniform", choices=["uniform", "heavy_tail"])
    p.add_argument("--random-median-tokens", type=int, default=64)
    p.add_argument("--random-tail-key", default="request", choices=["request", "rollout", "task"])
    p.add_argument("--random-task-sigma", type=float, default=0.0, help="per-task length scale spread")
    timing = p.add_argument_group("timing model (see simengine/timing.py for the GPU mapping)")
    timing.add_argument("--timing", action="store_true", help="continuous batching, KV blocks, preemption")
    timing.add_argument("--step-base-ms", type=float, default=7.0)
    timing.add_argument("--step-per-seq-ms", type=float, default=0.12)
    timing.add_argument("--prefill-ms-per-token", type=float, default=0.035)
    timing.add_argument("--max-num-batched-tokens", type=int, default=8192)
    timing.add_argument("--time-scale", type=float, default=1.0, help="simulated seconds per wall second")
    faults = p.add_argument_group("faults (also settable at runtime: POST /fault)")
    faults.add_argument("--fail-next", type=int, default=0, help="fail the next N generate requests")
    faults.add_argument("--fail-status", type=int, default=503)
    faults.add_argument("--hang", action="store_true", help="hold generate requests unanswered")
    faults.add_argument(
        "--drop-next", type=int, default=0, help="drop the connection of the next N generates"
    )
    faults.add_argument("--unhealthy", action="store_true", help="GET /health answers 503")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    from pydantic import ValidationError

    from durable_rollouts.errors import TaskFileError
    from durable_rollouts.simengine.engine import SimEngine

    try:
        settings, faults = _settings(args)
        engine = SimEngine(settings)
    except (ValueError, TaskFileError, OSError) as e:
        detail = e.errors()[0]["msg"] if isinstance(e, ValidationError) else str(e).splitlines()[0]
        print(f"simengine: {detail.removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    engine.faults.apply(faults)
    asyncio.run(_serve(engine, args.host, args.port))
    return 0


def _settings(args: argparse.Namespace) -> tuple[SimSettings, FaultUpdate]:
    from durable_rollouts.config.paths import resolve_path
    from durable_rollouts.simengine.faults import FaultUpdate
    from durable_rollouts.simengine.settings import ModeRule, SimSettings

    fields: dict[str, Any] = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "tasks": resolve_path(args.tasks, "--tasks") if args.tasks else None,
        "transcripts": resolve_path(args.transcripts, "--transcripts") if args.transcripts else None,
        "policy": args.policy,
        "mode": args.mode,
        "mode_rules": [ModeRule.parse(r) for r in args.mode_rule],
        "weight_version": args.weight_version,
        "prefill_ms": args.prefill_ms,
        "decode_ms_per_token": args.decode_ms_per_token,
        "max_num_seqs": args.max_num_seqs,
        "num_gpu_blocks": args.num_gpu_blocks,
        "block_size": args.block_size,
        "random_length": args.random_length,
        "random_median_tokens": args.random_median_tokens,
        "random_tail_key": args.random_tail_key,
        "random_task_sigma": args.random_task_sigma,
    }
    if args.timing:
        fields["timing"] = {
            "step_base_ms": args.step_base_ms,
            "step_per_seq_ms": args.step_per_seq_ms,
            "prefill_ms_per_token": args.prefill_ms_per_token,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "time_scale": args.time_scale,
        }
    if args.model_dir:
        fields["model_dir"] = resolve_path(args.model_dir, "--model-dir")
    faults = FaultUpdate(
        fail_next=args.fail_next,
        fail_status=args.fail_status,
        hang=args.hang,
        drop_next=args.drop_next,
        unhealthy=args.unhealthy,
    )
    return SimSettings.model_validate(fields), faults


async def _serve(engine: SimEngine, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with engine.serve(host, port) as url:
        s = engine.settings
        print(
            f"simengine ready on {url} model={s.model} policy={s.policy.value} mode={s.mode.value} "
            f"max_model_len={s.max_model_len} weight_version={engine.weight_version}",
            flush=True,
        )
        await stop.wait()


if __name__ == "__main__":
    sys.exit(main())
