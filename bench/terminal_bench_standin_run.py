"""Terminal-Bench 2 survey, stage ``standins``: the buildable tasks, unchanged, by their own solve.sh and
test.sh through the pipeline, with the hosts their scripts download from stood in.

    python bench/terminal_bench_standin_run.py --tasks DIR --out bench/results/terminal_bench_survey.json

The tasks run as they were written to: as root, with network. Root: a second Docker daemon with
``--userns-remap=default`` (root in a sandbox is an unprivileged user of the host), and the dataset file's
``default_user = "root"`` (the tasks name no user). Network: no ``network_policy`` in the dataset file,
so each task's ``public`` mode goes through the run's egress policy, which allows only the hosts the
scripts use and maps every one to the local stand-ins (`terminal_bench_standins`), on a Docker
``--internal`` network: nothing a sandbox does can leave the machine.

Set-up (the only downloads, into ``.cache/tb2-standins``): the stand-ins' content, and the stand-in base
image `BASE` (``python:3.13-slim-bookworm``): the survey's Debian bookworm base (the project's
debootstrap sandbox image) with Python 3.13 at ``/usr/local/bin/python3.13`` (also ``python3``,
``python``, ``pip``), copied from a local build with the shared libraries it needs, the real image's
Debian sources (``deb.debian.org`` for ``bookworm``, ``bookworm-updates``, ``bookworm-security``),
``Acquire::Languages "none"`` as Debian's slim images have it, ``APT::Sandbox::User "root"`` (apt's download
user switch needs a capability sandboxes never have), and the stand-in certificate authority's file
(``/usr/local/share/tb2-standin/ca.pem``, in no system trust store). The run config (`SETTINGS`) names
it in every command's environment (``SSL_CERT_FILE``, ``CURL_CA_BUNDLE``, ``REQUESTS_CA_BUNDLE``,
``PIP_CERT``) and lets the tasks write to their image's filesystem (``sandbox.writable_root``).

The tasks run are those whose image the survey built (`--names` to choose); the result merges into the
survey's result file as each row's ``reference_standins`` and ``summary.reference_standins``, the rest
of the file unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import terminal_bench_accept as accept
import terminal_bench_images as images
import terminal_bench_standins as si

REPO = Path(__file__).resolve().parent.parent
PYTHON = Path.home() / ".pyenv" / "versions" / "3.13.0"
BASE = "python:3.13-slim-bookworm"
BASE_LOCAL = "tb2-standin/python:3.13-slim-bookworm"
"""The stand-in base's tag on the main daemon (set-up's apt query), apart from the survey's own."""
DEBIAN_SOURCES = """Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
CA_PATH = "/usr/local/share/tb2-standin/ca.pem"
CA_VARS = ("SSL_CERT_FILE", "CURL_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "PIP_CERT")
SETTINGS: dict[str, Any] = {
    "sandbox.writable_root": True,
    "sandbox.tmp_size_mb": 512,
    "sandbox.memory_mb": 2048,  # the defaults must fit the larger /tmp; each task sets its own memory
    **{f"sandbox.env.{v}": CA_PATH for v in CA_VARS},
}
"""The run config besides the egress policy: the tasks install packages into their image's filesystem
(apt-get, pip), unpack uv's release in /tmp (the default 64 MiB /tmp is too small), and trust the
stand-ins' CA through the environment only (uv reads ``SSL_CERT_FILE``)."""
_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "__pycache__", "config-3.13-x86_64-linux-gnu"}


def _host_libs(files: list[Path]) -> set[Path]:
    libs: set[Path] = set()
    for f in files:
        done = subprocess.run(["ldd", str(f)], capture_output=True, text=True)
        for line in done.stdout.splitlines():
            parts = line.split("=>")
            if len(parts) == 2 and parts[1].strip().startswith("/"):
                lib = Path(parts[1].split()[0])
                if not lib.name.startswith(("libc.so", "libm.so", "libpython")):
                    libs.add(lib)
    return libs


def base_context(ctx: Path) -> Path:
    """The stand-in base's build context: Python 3.13 (without its tests, IDLE, Tk, static library or any
    ``.pth`` hook of the machine it came from), the libraries its modules link, the sources, the CA."""
    if not (PYTHON / "bin" / "python3.13").is_file():
        raise SystemExit(f"{PYTHON}: no Python 3.13 here to copy into the stand-in base image")
    shutil.rmtree(ctx, ignore_errors=True)
    lib = ctx / "local" / "lib"
    (ctx / "local" / "bin").mkdir(parents=True)
    lib.mkdir(parents=True)
    shutil.copy2(PYTHON / "bin" / "python3.13", ctx / "local" / "bin" / "python3.13")
    for so in (PYTHON / "lib").glob("libpython3.13.so*"):
        shutil.copy2(so, lib / so.name, follow_symlinks=False)

    def ignore(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n in _SKIP or n.endswith(".pth") or n.startswith("_tkinter")}

    shutil.copytree(PYTHON / "lib" / "python3.13", lib / "python3.13", ignore=ignore, symlinks=True)
    modules = [*(lib / "python3.13" / "lib-dynload").glob("*.so"), PYTHON / "bin" / "python3.13"]
    (ctx / "libs").mkdir()
    for h in _host_libs(modules) | _host_libs(list((PYTHON / "lib").glob("libpython3.13.so.1.0"))):
        shutil.copy2(h, ctx / "libs" / h.name)
    (ctx / "debian.sources").write_text(DEBIAN_SOURCES)
    shutil.copy2(si.make_certs() / "ca.pem", ctx / "ca.pem")
    (ctx / "Dockerfile").write_text(
        f"FROM {images.SANDBOX_IMAGE}\nUSER root\nENV HOME=/root\nWORKDIR /\n"
        "COPY local /usr/local/\nCOPY libs /tmp/libs\n"
        "RUN for f in /tmp/libs/*; do n=$(basename $f); "
        "[ -e /lib/x86_64-linux-gnu/$n ] || [ -e /usr/lib/x86_64-linux-gnu/$n ] || cp -a $f /usr/local/lib/; "
        "done && rm -rf /tmp/libs && ldconfig \\\n"
        " && ln -sf python3.13 /usr/local/bin/python3 && ln -sf python3 /usr/local/bin/python \\\n"
        " && for p in pip pip3 pip3.13; do"
        " printf '#!/bin/sh\\nexec /usr/local/bin/python3.13 -m pip \"$@\"\\n'"
        " > /usr/local/bin/$p && chmod 755 /usr/local/bin/$p; done \\\n"
        " && rm -f /etc/apt/sources.list && mkdir -p /etc/apt/sources.list.d /usr/local/share/tb2-standin"
        " && echo 'Acquire::Languages \"none\";' > /etc/apt/apt.conf.d/docker-no-languages"
        " && echo 'APT::Sandbox::User \"root\";' > /etc/apt/apt.conf.d/sandbox-no-setuid\n"
        "COPY debian.sources /etc/apt/sources.list.d/debian.sources\n"
        f"COPY ca.pem {CA_PATH}\n"
        f"ENV {' '.join(f'{v}={CA_PATH}' for v in CA_VARS)}\n"
        f"RUN chmod 644 {CA_PATH} && python3.13 -c 'import ssl, sqlite3, ctypes, lzma, bz2'\n"
        f'LABEL {images.STANDIN_LABEL}="python:3.13-slim-bookworm from Debian bookworm with Python 3.13.0"\n'
    )
    return ctx


def _docker(
    host: str | None, *args: str, timeout: float = 900, stdin: Any = None
) -> subprocess.CompletedProcess[str]:
    pre = ["docker"] if host is None else ["docker", "-H", host]
    return subprocess.run([*pre, *args], capture_output=True, text=True, timeout=timeout, stdin=stdin)


def set_up(cache: Path = si.CACHE) -> tuple[Path, dict[str, Any]]:
    """Everything downloaded and made (kept in ``cache`` between set-ups): the sites folder, what it holds."""
    sites = cache / "sites"
    wheels = si.fetch_wheels(cache)
    projects = si.write_index(wheels, sites)
    si.write_uv(wheels, sites)
    ctx = base_context(cache / "base-ctx")
    done = _docker(None, "build", "-q", "-t", BASE_LOCAL, str(ctx))
    if done.returncode != 0:
        raise SystemExit(f"stand-in base image: {done.stderr.strip()[-400:]}")
    indexes = si.fetch_debian_indexes(sites)
    debs = si.fetch_debs(si.print_uris(BASE_LOCAL), sites)
    return sites, {"projects": projects, "debian_indexes": indexes, "debs": debs}


class BridgeRules:
    """Traffic within each of the second daemon's networks let through the host's ``FORWARD`` chain.

    The second daemon runs with ``--iptables=false`` (two daemons must not both manage the host's
    rules), and the host bridges traffic through iptables (``bridge-nf-call-iptables``) with a ``DROP``
    policy, so containers on one of its networks cannot reach each other. Every ``POLL_S`` this adds, for
    each network of that daemon, the one rule its own daemon would add: ``-i br-ID -o br-ID -j ACCEPT``
    (within the bridge only, nothing between networks or out of them); `close` removes them."""

    POLL_S = 0.3

    def __init__(self, url: str) -> None:
        import threading

        self.url = url
        self.added: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            ids = _docker(
                self.url, "network", "ls", "-q", "--filter", "driver=bridge", timeout=30
            ).stdout.split()
            for net_id in ids:
                bridge = f"br-{net_id[:12]}"
                if bridge not in self.added and Path(f"/sys/class/net/{bridge}").exists():
                    rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
                    subprocess.run(["iptables", "-w", "-I", *rule], capture_output=True, timeout=30)
                    self.added.append(bridge)
            self._stop.wait(self.POLL_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for bridge in self.added:
            rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
            subprocess.run(["iptables", "-w", "-D", *rule], capture_output=True, timeout=30)


def build_proxy(url: str, egress: dict[str, Any]) -> list[str]:
    """``docker build`` arguments that give a build the stand-ins as its network: the run's own egress
    proxy (started now; the run's sandboxes share it), named by Docker's predefined proxy build args."""
    import docker

    from durable_rollouts.sandboxes.egress import PORT, EgressNetworks
    from durable_rollouts.sandboxes.egress_policy import EgressPolicy

    policy = EgressPolicy.model_validate(egress)
    name = EgressNetworks(docker.APIClient(base_url=url))._proxy(policy)
    fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
    address = _docker(url, "inspect", "-f", fmt, name).stdout.strip()
    names = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
    return [
        "--network",
        policy.upstream_network,
        *(f"--build-arg={n}=http://{address}:{PORT}" for n in names),
    ]


def probe(backend: Any, dirs: list[Path], egress: dict[str, Any], command: str) -> None:
    """A diagnostic: ``command`` in a sandbox of each task's image, as the pipeline makes it for the task."""
    from durable_rollouts.sandboxes.base import SandboxSpec
    from durable_rollouts.sandboxes.egress_policy import EgressPolicy

    env = {k.removeprefix("sandbox.env."): v for k, v in SETTINGS.items() if k.startswith("sandbox.env.")}
    for d in dirs:
        spec = SandboxSpec(
            image=accept.static_facts(d)["docker_image"], user="root", allow_root=True, writable_root=True,
            egress=EgressPolicy.model_validate(egress), env=env, workdir="/app", command_timeout_s=600,
            memory_mb=2048, tmp_size_mb=SETTINGS["sandbox.tmp_size_mb"], workdir_size_mb=1024,
        )  # fmt: skip
        key = f"tb2-probe-{int(time.time())}/a"
        box = backend.create(key, "tb2-probe", spec)
        try:
            res = backend.exec(box, command, timeout_s=600)
            print(f"== {d.name}: exit {res.exit_code}\n{res.output}", flush=True)
            print(_docker(None, "ps", "-a", "--format", "{{.Names}} {{.Status}} {{.Networks}}").stdout)
            for name in _docker(None, "ps", "-a", "--filter", "name=dr-egress-proxy", "-q").stdout.split():
                print(_docker(None, "logs", name).stderr[-2000:], _docker(None, "logs", name).stdout[-2000:])
        finally:
            backend.destroy(key)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", required=True, type=Path, help="folder of Terminal-Bench 2 task directories")
    p.add_argument("--out", required=True, type=Path, help="the survey's result file (merged into)")
    p.add_argument("--names", default=None, help="comma list of tasks (default: those the survey built)")
    p.add_argument("--command-timeout", type=int, default=900, help="seconds per sandbox command")
    p.add_argument("--build-timeout", type=float, default=300.0, help="seconds per image build")
    p.add_argument(
        "--probe",
        default=None,
        help="instead of the pipeline: run this shell command as root in "
        "a sandbox of each task's image, with the run's sandbox settings, and print its output",
    )
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from tests.integration.docker_daemons import SecondDockerd

    result = json.loads(args.out.read_text()) if args.out.is_file() else {"tasks": {}, "summary": {}}
    if args.names:
        names = args.names.split(",")
    else:
        names = [n for n, r in result["tasks"].items() if r.get("build", {}).get("built")]
        names += list(si.BUILD_TASKS)
    dirs = [args.tasks / n for n in names]
    t0 = time.monotonic()
    sites, made = set_up()
    daemon = SecondDockerd("tb2-remap", "--userns-remap=default")
    host_env = os.environ.get("DOCKER_HOST")
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, Any]] = {}
    rules: BridgeRules | None = None
    try:
        daemon.start()
        rules = BridgeRules(daemon.url)
        daemon.load(images.SANDBOX_IMAGE, BASE_LOCAL)
        _docker(daemon.url, "tag", BASE_LOCAL, BASE)
        si.build_server_image(["docker", "-H", daemon.url], sites, si.make_certs(), images.SANDBOX_IMAGE)
        net = f"tb2-standins-{int(time.time())}"
        _docker(daemon.url, "network", "create", "--internal", net)
        done = _docker(
            daemon.url, "run", "-d", "--name", net, "--network", net, "--cap-drop", "ALL", si.SERVER_IMAGE
        )
        if done.returncode != 0:
            raise SystemExit(f"stand-in server: {done.stderr.strip()[-300:]}")
        address = _docker(
            daemon.url, "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", net
        ).stdout.strip()
        os.environ["DOCKER_HOST"] = daemon.url  # the builds below and the pipeline's sandboxes
        via = build_proxy(daemon.url, si.policy(address, net))
        built: list[Path] = []
        for d in dirs:
            facts = accept.static_facts(d)
            t1 = time.monotonic()
            network = via if d.name in si.BUILD_TASKS else None
            rows[d.name] = {"build": images.build_task(d, facts, args.build_timeout, [], network)}
            rows[d.name]["build"]["network"] = "stand-ins" if network else "none"
            rows[d.name]["build"]["seconds"] = round(time.monotonic() - t1, 1)
            print(f"build {d.name}: {rows[d.name]['build']['built']}", flush=True)
            if rows[d.name]["build"]["built"]:
                built.append(d)
        if args.probe:
            probe(daemon.backend(), built, si.policy(address, net), args.probe)
            return 0
        from terminal_bench_reference import run_reference

        with tempfile.TemporaryDirectory(prefix="tb2-standins-") as work:
            runs = asyncio.run(
                run_reference(
                    built, Path(work), args.command_timeout, head=('default_user = "root"',),
                    egress=si.policy(address, net), config=SETTINGS,
                )
            )  # fmt: skip
        print("stand-in server:", _docker(daemon.url, "logs", net).stderr[-3000:], flush=True)
        proxies = _docker(
            daemon.url, "ps", "-a", "--filter", "name=dr-egress-proxy", "--format", "{{.Names}}"
        )
        for proxy in proxies.stdout.split():
            print(proxy, _docker(daemon.url, "logs", proxy).stderr[-3000:], flush=True)
    finally:
        if host_env is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = host_env
        if rules is not None:
            rules.close()
        daemon.close()
    for name, row in rows.items():
        result["tasks"].setdefault(name, {})["build_standins"] = row["build"]
    for name, r in runs.items():
        result["tasks"].setdefault(name, {})["reference_standins"] = r
    result.setdefault("summary", {})["reference_standins"] = {
        "command": "python bench/terminal_bench_standin_run.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "tried": len(dirs),
        "built": sum(r["build"]["built"] for r in rows.values()),
        "run": len(runs),
        "reward_1": sorted(n for n, r in runs.items() if r["reward"] == 1.0),
        "not_1": {n: f"{r['outcome']}, reward {r['reward']}" for n, r in runs.items() if r["reward"] != 1.0},
        "stand_ins": {
            "pypi_projects": made["projects"],
            "debian": made["debian_indexes"],
            "debs": made["debs"],
        },
        "seconds": round(time.monotonic() - t0, 1),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result["summary"]["reference_standins"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
