"""Record the histories of Harbor rollouts (the ``task-timeout`` patch: a task's own time limit).

Runs, on a real Temporal dev server with an in-process worker, real Docker and the simulated engine
playing the oracle: the example ``hello-from-image`` (its agent timeout sets a deadline whose timer is
cancelled when it completes) and a copy whose agent timeout (3 s) cuts its solve.sh (a 20 s sleep) short.

    python -m tests.histories.record_harbor --release 0.3.0-harbor
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from tests import REPO_ROOT
from tests.histories.record import _save, dev_server, main_of
from tests.integration.support import make_config, run_to_end, worker

SANDBOX = {"memory_mb": 512, "workdir_size_mb": 64, "tmp_size_mb": 64, "command_timeout_s": 30}
EXAMPLE = REPO_ROOT / "environments" / "harbor" / "examples" / "hello-from-image"


async def record(out: Path) -> None:
    from harbor_env.transcripts import write

    out.mkdir(parents=True, exist_ok=True)
    async with dev_server() as client:
        with tempfile.TemporaryDirectory() as home:
            data = Path(home) / "datasets"
            shutil.copytree(EXAMPLE, data / "hello")
            slow = data / "slow"
            shutil.copytree(EXAMPLE, slow)
            toml = (
                (slow / "task.toml").read_text().replace("examples/hello-from-image", "examples/hello-slow")
            )
            (slow / "task.toml").write_text(toml.replace("timeout_sec = 120.0", "timeout_sec = 3.0"))
            (slow / "solution" / "solve.sh").write_text("#!/bin/bash\nsleep 20\n")
            transcripts = write(Path(home) / "t.jsonl", data)
            rules = [ModeRule(on="request", prefix="harbor", mode=Mode.REFERENCE)]
            settings = SimSettings(transcripts=transcripts, mode_rules=rules, max_model_len=8192)
            async with SimEngine(settings).serve(port=0) as url, worker(client, "histories", Path(home)):
                for name in ("hello", "slow"):
                    cfg = make_config(
                        [url], "histories",
                        run={"env": "harbor", "task_file": str(data / name), "num_groups": 1,
                             "group_size": 1},
                        sampling={"max_tokens": 2048}, rollout={"max_turns": 12, "max_total_tokens": 8000},
                        sandbox=SANDBOX,
                    )  # fmt: skip
                    await run_to_end(client, cfg, f"harbor-{name}")
        counts = {
            "harbor-rollout": await _save(client, out, "harbor-rollout", "harbor-hello/g000000/0"),
            "harbor-timeout-rollout": await _save(
                client, out, "harbor-timeout-rollout", "harbor-slow/g000000/0"
            ),
        }
    print(json.dumps(counts))


if __name__ == "__main__":
    main_of(record, __doc__)
