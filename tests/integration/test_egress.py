"""Network by policy: a sandbox reaches the hosts its egress policy allows through the egress proxy, and
nothing else (real Docker; every allowed host is a local stand-in on an --internal network made here, so
no outside address is ever a target).

The probe runs inside a sandbox: allowed names (plain http and a CONNECT tunnel) answer from their
stand-ins; a name not allowed, a raw IP, an allowed name that resolves to a private address, the host's
ports (through every gateway), the stand-in's own address and another sandbox are refused by the proxy
(403, one log line each) and unreachable directly. A Harbor task shaped like Terminal-Bench's (the default
``public`` network mode; test.sh fetches uv's installer and pip-installs its test tool from the index)
scores 1.0 by its solve.sh through the pipeline, and is refused at submit when the run allows no egress.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowFailureError
from typer.testing import CliRunner

from durable_rollouts.cli.rollouts import app
from durable_rollouts.sandboxes import DockerBackend, SandboxSpec, egress
from durable_rollouts.sandboxes.egress import LABEL_NETWORK, LABEL_PROXY, network_name, proxy_name
from durable_rollouts.sandboxes.egress_policy import EgressPolicy
from durable_rollouts.simengine import Mode, ModeRule, SimEngine, SimSettings
from tests import REPO_ROOT
from tests.integration.egress_standins import PORT, PROBE_TOOL, StandIns, bridge_gateway, pip_zip, stand_ins
from tests.integration.support import assert_no_containers, export, make_config, run_to_end, worker

pytestmark = pytest.mark.timeout(300)

SPEC = {"memory_mb": 256, "workdir_size_mb": 32, "tmp_size_mb": 32, "command_timeout_s": 30}
PROBE = r"""
import json, os, socket, sys, urllib.error, urllib.request
targets = json.loads(sys.argv[1])
proxy = os.environ["HTTP_PROXY"].removeprefix("http://").rstrip("/")
phost, pport = proxy.rsplit(":", 1)
out = {}
def via_proxy(raw):
    s = socket.create_connection((phost, int(pport)), timeout=5)
    s.sendall(raw)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data.decode(errors="replace")
def direct(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "OPEN"
    except OSError as e:
        return type(e).__name__
for name, url in targets["get"].items():
    try:
        out[name] = urllib.request.urlopen(url, timeout=10).read().decode()
    except urllib.error.HTTPError as e:
        out[name] = f"{e.code} {e.read().decode()}"
    except OSError as e:
        out[name] = f"error {e}"
for name, authority in targets["connect"].items():
    host = authority.rsplit(":", 1)[0]
    out[name] = via_proxy(
        f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n"
        f"GET /ok HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    )
for name, (host, port) in targets["direct"].items():
    out[name] = direct(host, port)
print(json.dumps(out))
"""


@pytest.fixture
def upstream(docker: DockerBackend) -> Iterator[StandIns]:
    with stand_ins(docker.client) as s:
        yield s


@pytest.fixture
def host_port() -> Iterator[int]:
    """A TCP port the host listens on at every address (0.0.0.0): what a sandbox must never reach."""
    srv = socket.create_server(("0.0.0.0", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                srv.accept()[0].close()
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield srv.getsockname()[1]
    stop.set()
    thread.join(5)
    srv.close()


def _policy(up: StandIns, **extra: list[str]) -> EgressPolicy:
    return EgressPolicy(
        allow=["pypi.org", "files.pythonhosted.org", "astral.sh", *extra.get("allow", [])],
        map=up.map(), upstream_network=up.network,
    )  # fmt: skip


def _address(docker: DockerBackend, container: str, network: str) -> str:
    attrs = docker.api.inspect_container(container)["NetworkSettings"]["Networks"]
    return str(attrs[network]["IPAddress"])


def test_a_sandbox_reaches_only_the_allowed_hosts_through_the_proxy(
    docker: DockerBackend, upstream: StandIns, host_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = f"egress-{uuid.uuid4().hex[:8]}"
    stand_in_name = f"dr-test-standin-{upstream.network.rsplit('-', 1)[1]}"
    policy = _policy(
        upstream, allow=[f"{stand_in_name}:{PORT}"]
    )  # allowed, but resolves to a private address
    spec = SandboxSpec(**SPEC, egress=policy)
    a = docker.create(f"{run}/a", run, spec)
    b = docker.create(f"{run}/b", run, spec)
    try:
        assert docker.create(f"{run}/a", run, spec).container_id == a.container_id  # idempotent
        b_address = _address(docker, b.name, network_name(b.name))
        proxy_upstream = _address(docker, proxy_name(policy), upstream.network)
        docker0 = bridge_gateway(docker.api.inspect_network("bridge"))
        targets = {
            "get": {
                "index": f"http://pypi.org/simple/{PROBE_TOOL}/",
                "installer": "http://astral.sh/uv/install.sh",
                "other_name": "http://example.org/",
                "raw_ip": f"http://{docker0}:{host_port}/",
                "private_name": f"http://{stand_in_name}:{PORT}/ok",
                "sandbox_b": f"http://{b_address}:{PORT}/",
            },
            "connect": {
                "tunnel": "astral.sh:443",
                "tunnel_other": "example.org:443",
                "tunnel_local": "localhost:3128",
            },
            "direct": {
                "docker0_host_port": [docker0, host_port],
                "upstream_gateway_host_port": [upstream.gateway, host_port],
                "stand_in": [upstream.address, PORT],
                "proxy_upstream": [proxy_upstream, 3128],
                "sandbox_b_direct": [b_address, PORT],
            },
        }
        res = docker.exec(a, f"python3 -c {_q(PROBE)} {_q(json.dumps(targets))}", timeout_s=60)
        assert res.exit_code == 0, res.output
        out = json.loads(res.output.strip().splitlines()[-1])
        assert 'href="http://files.pythonhosted.org/packages/drprobe-1.0' in out["index"], out["index"]
        assert out["installer"].startswith("#!/bin/sh"), out["installer"]
        assert out["tunnel"].startswith("HTTP/1.1 200 Connection established") and "astral stand-in" in out[
            "tunnel"], out["tunnel"]  # fmt: skip
        refusals = {
            "other_name": "not in the egress policy's allow list",
            "raw_ip": "a raw IP address is never allowed",
            "private_name": "resolves to the non-public address",
            "sandbox_b": "a raw IP address is never allowed",
            "tunnel_local": "not in the egress policy's allow list",
            "tunnel_other": "not in the egress policy's allow list",
        }
        logs = docker.api.logs(proxy_name(policy)).decode()
        for name, why in refusals.items():
            assert "403" in out[name] and why in out[name], (name, out[name], logs)
        for name in targets["direct"]:
            assert out[name] != "OPEN", (name, out)
        assert (
            f"egress refused GET example.org:80 from {_address(docker, a.name, network_name(a.name))}" in logs
        )
        assert (
            "egress refused CONNECT example.org:443" in logs
            and "egress allowed CONNECT astral.sh:443" in logs
        )
        plain = docker.create(f"{run}/plain", run, SandboxSpec(**SPEC))  # no policy: no network at all
        assert docker.api.inspect_container(plain.name)["HostConfig"]["NetworkMode"] == "none"
        assert "HTTP_PROXY" not in docker.exec(plain, "env").output
        proxy = docker.api.inspect_container(proxy_name(policy))
        assert proxy["HostConfig"]["CapDrop"] == ["ALL"] and proxy["HostConfig"]["ReadonlyRootfs"]
        assert proxy["Config"]["User"] == "65534:65534" and not proxy["HostConfig"]["Binds"]
    except BaseException:
        docker.destroy(f"{run}/b")  # a failed check leaves no sandbox behind (b is removed below otherwise)
        raise
    finally:
        for key in ("a", "plain"):
            docker.destroy(f"{run}/{key}")
    assert docker.api.networks(filters={"name": network_name(a.name)}) == []  # destroy removes its network
    docker.api.remove_container(b.name, force=True)  # b lost without its destroy: its network stays behind
    docker.reap(run_id=run)
    assert docker.api.networks(filters={"name": network_name(b.name)}) != []  # too young to be an orphan
    monkeypatch.setattr(egress, "NETWORK_GRACE_S", 0.0)
    docker.reap(run_id=run)  # the orphaned network, then the proxy no sandbox network uses any more
    assert docker.api.networks(filters={"label": [LABEL_NETWORK, f"durable-rollouts.run={run}"]}) == []
    assert docker.api.containers(all=True, filters={"label": [f"{LABEL_PROXY}={policy.key()}"]}) == []
    assert_no_containers(docker, run)


def _q(text: str) -> str:
    import shlex

    return shlex.quote(text)


# ------------------------------------------------------------------------------------ through the pipeline

HARBOR_BASE = "harbor-examples/base:bookworm"
TEST_SH = f"""#!/bin/bash
set -euo pipefail
# as Terminal-Bench's test.sh: the installer from its website, then the test tool from the package index
python3 -c "import urllib.request as u; print(u.urlopen('http://astral.sh/uv/install.sh').read().decode())" \\
    > /tmp/install.sh
sh /tmp/install.sh && test -f "$HOME/.local/bin/uv.txt"
python3 /opt/pip.zip/pip install --disable-pip-version-check --no-cache-dir -q \\
    --index-url http://pypi.org/simple --trusted-host pypi.org --trusted-host files.pythonhosted.org \\
    --target /tmp/tools {PROBE_TOOL}
PYTHONPATH=/tmp/tools python3 -m {PROBE_TOOL} /app/answer.txt > /logs/verifier/reward.txt
"""


def _task(root: Path, name: str, toml: str) -> Path:
    d = root / name
    for part in ("environment", "solution", "tests"):
        (d / part).mkdir(parents=True)
    (d / "task.toml").write_text(f'[task]\nname = "egress/{name}"\n[environment]\nmemory_mb = 512\n{toml}')
    (d / "instruction.md").write_text("Write 42 to /app/answer.txt.\n")
    pip_zip(d / "environment" / "pip.zip")
    (d / "environment" / "Dockerfile").write_text(
        f"FROM {HARBOR_BASE}\nWORKDIR /app\nCOPY pip.zip /opt/pip.zip\n"
    )
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\necho 42 > /app/answer.txt\n")
    (d / "tests" / "test.sh").write_text(TEST_SH)
    (d / "tests" / "test.sh").chmod(0o755)
    return d


@pytest.fixture(scope="module")
async def sim(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, Path]]:
    from harbor_env.transcripts import write

    done = subprocess.run(
        ["bash", str(REPO_ROOT / "environments" / "harbor" / "base_images.sh")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    work = tmp_path_factory.mktemp("egress")
    tasks = work / "tasks"
    _task(tasks, "public", "")  # Harbor's default network mode, as every Terminal-Bench 2 task
    settings = SimSettings(
        transcripts=write(work / "transcripts.jsonl", tasks),
        mode_rules=[ModeRule(on="request", prefix="egress-ref", mode=Mode.REFERENCE)],
        max_model_len=8192,
    )
    async with SimEngine(settings).serve(port=0) as url:
        yield url, tasks
    shutil.rmtree(work, ignore_errors=True)


async def test_a_task_installing_its_test_tool_from_the_allowed_index_scores_one(
    client: Client, docker: DockerBackend, upstream: StandIns, sim: tuple[str, Path], task_queue: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    url, tasks = sim
    cfg = make_config(
        [url], task_queue,
        run={"env": "harbor", "task_file": str(tasks), "num_groups": 1, "group_size": 1},
        sampling={"max_tokens": 2048}, rollout={"max_turns": 8, "max_total_tokens": 8000},
        sandbox={**SPEC, "memory_mb": 512},
    )  # fmt: skip
    cfg = cfg.model_copy(update={"sandbox": cfg.sandbox.model_copy(update={"egress": _policy(upstream)})})
    run = f"egress-ref-{uuid.uuid4().hex[:8]}"
    async with worker(client, task_queue, tmp_path) as store:
        await run_to_end(client, cfg, run)
        # Started without `rollouts run` on a run that allows no egress: refused when the run loads its tasks.
        offline = cfg.model_copy(
            update={"sandbox": cfg.sandbox.model_copy(update={"egress": EgressPolicy()})}
        )
        with pytest.raises(WorkflowFailureError) as failed:
            await run_to_end(client, offline, f"{run}-offline")
    error: BaseException | None = failed.value
    while error is not None and "TaskFileError" not in str(error):
        error = error.__cause__ or getattr(error, "cause", None)
    cause = str(error)
    assert "task.toml [environment].network_mode: 'public'" in cause and "sandbox.egress.allow" in cause, (
        cause
    )
    (rec,) = export(store, run)[0]
    assert rec["outcome"] == "completed" and rec["reward"] == 1.0, rec["reason"]
    assert_no_containers(docker, run)
    assert docker.api.networks(filters={"label": [f"{LABEL_NETWORK}", f"durable-rollouts.run={run}"]}) == []
    docker.reap(run_id=run)
    assert docker.api.containers(all=True, filters={"label": [LABEL_PROXY]}) == []

    # The same task at submit, on a run that allows no egress: one line naming the file, field and key.
    result = CliRunner().invoke(
        app, ["run", "--task-file", str(tasks / "public"), "--set", 'run.env="harbor"',
              "--set", f"store.url={json.dumps(str(tmp_path / 'store'))}"],
    )  # fmt: skip
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {tasks / 'public'}: task.toml [environment].network_mode: 'public'")
    assert "sandbox.egress.allow" in lines[0], lines[0]
