"""The production compose file and the worker image, checked as files (no Docker daemon, nothing pulled).

``docker-compose config`` (Debian's docker-compose 1.29 under CI; Compose v2 reads the same file) resolves
docker-compose.yml with a password and a model folder given, and these read its output: every published
port on 127.0.0.1 unless BIND says otherwise, every image pinned, the gateways' socket folder at the same
path in the worker as on the daemon's host, each worker replica a named sandbox host, Temporal set up as
Temporal's own compose files do (schema job, server, namespace job, UI), the engine on the vLLM release the
client is tested with. The worker image's Dockerfile installs every plug-in under environments/.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from typing import Any

import pytest
import yaml

from durable_rollouts.sandboxes.base import GATEWAY_ROOT_ENV
from tests import REPO_ROOT

COMPOSE = shutil.which("docker-compose")
PRODUCTION = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "workers/image/Dockerfile"
ENV = {"POSTGRES_PASSWORD": "secret", "MODEL_DIR": "/models/policy"}
SETTINGS = ("BIND", "DR_GATEWAY_DIR", "VLLM_VERSION", "ROLLOUTS_VERSION", "WORKER_REPLICAS")


def _config(**env: str) -> dict[str, Any]:
    if COMPOSE is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose; CI has it)")
    base = {k: v for k, v in os.environ.items() if k not in SETTINGS}  # the file's defaults, not the shell's
    res = subprocess.run(
        [COMPOSE, "-f", str(PRODUCTION), "config"], capture_output=True, text=True, timeout=60,
        env={**base, **ENV, **env}, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


def _host_ips(services: dict[str, Any]) -> dict[str, str]:
    """Every published port as ``service:target -> host_ip``, from the short form docker-compose 1.29
    writes ("127.0.0.1:7233:7233/tcp") or the long form Compose v2 writes ({host_ip, published, ...})."""
    out: dict[str, str] = {}
    for name, svc in services.items():
        for port in svc.get("ports", []):
            if isinstance(port, dict):
                out[f"{name}:{port['target']}"] = port.get("host_ip", "")
                continue
            parts = str(port).split("/")[0].rsplit(":", 2)
            assert len(parts) == 3, f"{name} publishes {port!r} with no host address (every interface)"
            out[f"{name}:{parts[2]}"] = parts[0]
    return out


def _volumes(svc: dict[str, Any]) -> list[tuple[str, str]]:
    """``(source, target)`` of a service's volumes, short ("src:dst:mode") or long form."""
    out = []
    for vol in svc.get("volumes", []):
        if isinstance(vol, dict):
            out.append((str(vol.get("source", "")), str(vol["target"])))
        else:
            src, dst, *_ = str(vol).split(":")
            out.append((src, dst))
    return out


def _needs(svc: dict[str, Any]) -> dict[str, str]:
    deps = svc.get("depends_on", {})
    return dict.fromkeys(deps, "service_started") if isinstance(deps, list) else {
        k: v.get("condition", "service_started") for k, v in deps.items()
    }  # fmt: skip


def test_the_production_file_validates_and_publishes_on_loopback_only_by_default() -> None:
    ips = _host_ips(_config()["services"])
    assert {"temporal:7233", "temporal-ui:8080", "prometheus:9090"} <= set(ips), ips
    assert set(ips.values()) == {"127.0.0.1"}, ips


def test_bind_opts_out_of_loopback_for_every_published_port() -> None:
    ips = _host_ips(_config(BIND="0.0.0.0")["services"])
    assert ips and set(ips.values()) == {"0.0.0.0"}, ips


def test_every_image_is_pinned() -> None:
    images = {name: svc["image"] for name, svc in _config()["services"].items()}
    assert set(images) >= {"postgres", "temporal", "temporal-ui", "engine", "worker", "prometheus"}
    froms = re.findall(r"^FROM\s+(\S+)", DOCKERFILE.read_text(), re.M)
    assert froms, "the worker image's Dockerfile has no FROM"
    for name, image in [*images.items(), *(("Dockerfile", f) for f in froms)]:
        ref = image.split("@")[0]
        tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else ""
        assert tag and tag != "latest", f"{name}: image {image!r} is not pinned to a release tag"


def test_the_engine_is_the_vllm_release_the_client_is_tested_with() -> None:
    gpu = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    (version,) = [req.split("==")[1] for req in gpu if req.startswith("vllm==")]
    assert _config()["services"]["engine"]["image"] == f"vllm/vllm-openai:v{version}"


def test_temporal_is_set_up_as_temporal_documents_it() -> None:
    """The schema job (temporal-sql-tool) runs to completion, then the server starts; the namespace job
    waits for a healthy server, the UI too; the project's setup registers its search attributes last."""
    services = _config()["services"]
    schema, namespace = services["temporal-schema"], services["temporal-namespace"]
    server = services["temporal"]
    assert "auto-setup" not in server["image"] and server["image"].startswith("temporalio/server:")
    release = server["image"].split(":")[1]
    for job in (schema, namespace):
        assert job["image"] == f"temporalio/admin-tools:{release}" and job.get("restart", "no") == "no"
    assert _needs(schema) == {"postgres": "service_healthy"}
    assert _needs(server)["temporal-schema"] == "service_completed_successfully"
    assert _needs(namespace) == {"temporal": "service_healthy"}
    assert _needs(services["temporal-ui"]) == {"temporal": "service_healthy"}
    assert _needs(services["setup"])["temporal-namespace"] == "service_completed_successfully"
    assert "rollouts stack search-attributes" in " ".join(services["setup"]["command"])
    script = (REPO_ROOT / "config/compose/temporal-schema.sh").read_text()
    for step in ("create", "setup-schema -v 0.0", "update-schema -d"):
        assert f" {step}" in script, step
    assert {dst for _, dst in _volumes(schema)} == {"/compose/temporal-schema.sh"}


def test_the_compose_scripts_are_valid_sh() -> None:
    for script in sorted((REPO_ROOT / "config/compose").glob("*.sh")):
        res = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True, check=False)
        assert res.returncode == 0, f"{script.name}: {res.stderr}"


@pytest.mark.parametrize("folder", [None, "/srv/rollouts/gw"], ids=["default", "DR_GATEWAY_DIR"])
def test_the_gateway_folder_is_mounted_at_the_same_path_in_the_worker(folder: str | None) -> None:
    worker = _config(**({"DR_GATEWAY_DIR": folder} if folder else {}))["services"]["worker"]
    path = worker["environment"][GATEWAY_ROOT_ENV]
    assert path.startswith("/") and (folder is None or path == folder)
    assert (path, path) in _volumes(worker), _volumes(worker)


def test_each_worker_replica_is_a_named_sandbox_host() -> None:
    worker = _config()["services"]["worker"]
    command = " ".join(worker["command"])
    # the name is the replica's hostname (its container id), so no two replicas share one
    assert re.search(r"--sandbox-host \S*\$\$?\(hostname\)", command), command
    assert ("/var/run/docker.sock", "/var/run/docker.sock") in _volumes(worker)


def _plugins() -> set[str]:
    return {p.parent.name for p in (REPO_ROOT / "environments").glob("*/pyproject.toml")}


def test_the_worker_image_installs_every_plugin() -> None:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    (install,) = [step for step in re.split(r"&&|\n", text) if "pip install" in step]
    installed = set(re.findall(r"/src/environments/(\w+)(?=\s|$)", install))
    assert {"math", "harbor", "harness", "reasoning_gym"} <= _plugins()
    assert installed == _plugins(), f"missing {_plugins() - installed}, unknown {installed - _plugins()}"


def test_every_path_the_worker_image_copies_exists() -> None:
    text = DOCKERFILE.read_text()
    paths = set(re.findall(r"/src/([\w./-]+)", text)) | set(re.findall(r"\b(environments/[\w./-]+/?)", text))
    paths = {p.rstrip("/*") for p in paths if "*" not in p.rstrip("/*")}
    assert "engines/tiny-policy" in paths
    missing = sorted(p for p in paths if not (REPO_ROOT / p).exists())
    assert not missing, f"the Dockerfile copies paths the checkout lacks: {missing}"
