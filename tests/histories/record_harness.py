"""Record the history of a harness rollout (the ``harness-rollouts`` patch: mini-swe-agent through the
gateway, each model call a ``gateway_call`` signal and activity, the harness one long activity).

Runs, on a real Temporal dev server with an in-process worker, real Docker and the simulated engine
playing the oracle through mini-swe-agent: the Harbor example ``fix-inventory-totals`` (reward 1.0).
Needs the images of environments/harbor/base_images.sh and environments/harness/build_image.sh.

    python -m tests.histories.record_harness --release 0.3.0-harness
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from durable_rollouts.environments import registry
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from tests import REPO_ROOT
from tests.histories.record import _save, dev_server, main_of
from tests.integration.support import run_to_end, worker
from tests.integration.test_harness import _plugin_site, harness_config

EXAMPLE = REPO_ROOT / "environments" / "harbor" / "examples" / "fix-inventory-totals"


async def record(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    async with dev_server() as client:
        with tempfile.TemporaryDirectory() as home:
            _plugin_site(Path(home) / "site")
            registry.get.cache_clear()
            from harness_env.transcripts import write

            data = Path(home) / "datasets"
            shutil.copytree(EXAMPLE, data / "fix")
            transcripts = write(Path(home) / "t.jsonl", data)
            rules = [ModeRule(on="request", prefix="", mode=Mode.REFERENCE)]
            settings = SimSettings(transcripts=transcripts, mode_rules=rules, max_model_len=65536)
            async with SimEngine(settings).serve(port=0) as url, worker(client, "histories", Path(home)):
                cfg = harness_config([url], "histories", data, "mini-swe-agent")
                await run_to_end(client, cfg, "harness-fix")
        counts = {"harness-rollout": await _save(client, out, "harness-rollout", "harness-fix/g000000/0")}
    print(json.dumps(counts))


if __name__ == "__main__":
    main_of(record, __doc__)
