"""Record the history of a harness rollout (the ``harness-rollouts`` patch: mini-swe-agent through the
gateway, each model call a ``gateway_call`` signal and activity, the harness one long activity).

Runs, on a real Temporal dev server with an in-process worker, real Docker and the simulated engine
playing the oracle through mini-swe-agent: the Harbor example ``fix-inventory-totals`` (reward 1.0).
Needs the images of environments/harbor/base_images.sh and environments/harness/build_image.sh.

    python -m tests.histories.record_harness --release 0.3.0-harness
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from config.paths import REPO_ROOT, venv_bin
from envs import registry
from simengine import Mode, ModeRule, SimEngine, SimSettings
from tests.histories.record import HERE, _save
from tests.integration.support import run_to_end, worker
from tests.integration.test_harness import _plugin_site, harness_config
from workflows import search_attributes as sa

EXAMPLE = REPO_ROOT / "environments" / "harbor" / "examples" / "fix-inventory-totals"


async def record(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(venv_bin("temporal")), data_converter=pydantic_data_converter,
        search_attributes=sa.ALL, dev_server_log_level="error",
    )  # fmt: skip
    try:
        client = env.client
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
    finally:
        await env.shutdown()
    print(json.dumps(counts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--release", required=True, help="folder name under tests/histories/")
    asyncio.run(record(HERE / p.parse_args().release))


if __name__ == "__main__":
    main()
