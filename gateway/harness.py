"""The harness process inside a rollout's sandbox: started once, watched, stopped (no Temporal).

Invariants:
- Started once per sandbox: a marker in the sandbox's /tmp says it was; a retried activity (its worker
  died) finds it and watches the same process instead of starting a second one.
- The harness runs as the sandbox's unprivileged user in its own session (it outlives the exec that
  started it and the worker that watched it), with the gateway's URL and key in its environment; with a
  TCP port, the loopback shim (``gateway/shim.py``) runs beside it, as the same user.
- Its exit code and output stay in the sandbox (``/tmp/.dr-harness``) until the sandbox is destroyed.
- A file the environment keeps (``HarnessCommand.keep``) is read after the harness exits, wherever it lies
  in the sandbox: copied under the workdir for the sandbox's checked reader, read, the copy removed.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.resources
import shlex

from durable_rollouts.environments.base import Sandbox
from durable_rollouts.environments.harness_trait import HarnessCommand
from durable_rollouts.errors import SandboxFileError, SandboxGone
from durable_rollouts.sandboxes.base import GATEWAY_MOUNT

STATE = "/tmp/.dr-harness"
SOCKET = f"{GATEWAY_MOUNT}/gw.sock"
TAIL_LINES = 20
KEEP_LIMIT = 64 * 1024 * 1024
"""Largest file kept from a harness (bytes); a larger one is kept as the reason it was not."""
SHIM_PYTHON = "DR_SHIM_PYTHON"
"""The variable of `HarnessCommand.env` naming the interpreter that runs the TCP shim (stdlib only), for a
harness that brings its own (e.g. ``/opt/harness/bin/python3``); unset: the task image's ``python3``."""


def gateway_env(cmd: HarnessCommand, key: str, model: str) -> dict[str, str]:
    """The environment the harness runs with: its own, plus where and how to reach its gateway."""
    env = {"DR_GATEWAY_SOCKET": SOCKET, "OPENAI_API_KEY": key, "DR_MODEL": model}
    if cmd.tcp_port is not None:
        url = f"http://127.0.0.1:{cmd.tcp_port}/v1"
        env.update(OPENAI_BASE_URL=url, OPENAI_API_BASE=url, DR_GATEWAY_URL=url)
    return {**env, **cmd.env}


def launcher(cmd: HarnessCommand, env: dict[str, str]) -> str:
    """The script that runs the shim and the harness and records the harness's exit code."""
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(env.items()))
    shim = ""
    if cmd.tcp_port is not None:
        py = shlex.quote(env.get(SHIM_PYTHON, "python3"))
        shim = (
            f"{py} {STATE}/shim.py {cmd.tcp_port} {SOCKET} &\n"
            f"i=0; while [ $i -lt 50 ] && ! {py} -c 'import socket,sys; socket.create_connection("
            f'("127.0.0.1", {cmd.tcp_port}), 1)\' 2>/dev/null; do sleep 0.1; i=$((i+1)); done\n'
        )
    return (
        "#!/bin/sh\n"
        f"echo $$ > {STATE}/pid\n"  # after setsid: its pid is its session's and process group's id
        f"{exports}{shim}"
        f"sh -c {shlex.quote(cmd.command)}\n"
        "rc=$?\n"
        f"echo $rc > {STATE}/rc.tmp && mv {STATE}/rc.tmp {STATE}/rc\n"
    )


async def start(box: Sandbox, cmd: HarnessCommand, env: dict[str, str]) -> bool:
    """Start the harness unless this sandbox started it already; True when this call started it."""
    res = await box.exec(f"mkdir -p {STATE} && test -e {STATE}/started && echo STARTED || echo NEW", 30)
    if "STARTED" in res.output:
        return False
    shim = importlib.resources.files("durable_rollouts.gateway").joinpath("shim.py").read_text()
    await _write(box, f"{STATE}/shim.py", shim)
    await _write(box, f"{STATE}/run.sh", launcher(cmd, env))
    res = await box.exec(
        f"touch {STATE}/started && setsid -f sh {STATE}/run.sh </dev/null >{STATE}/out 2>&1; "
        f"i=0; while [ ! -s {STATE}/pid ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done; "
        f"test -s {STATE}/pid",
        30,
    )
    if res.exit_code != 0:
        raise SandboxGone(f"harness launcher did not start: {res.output[-300:]}")
    return True


async def _write(box: Sandbox, path: str, text: str) -> None:
    """Write a file outside the working directory (write_file is workdir-relative)."""
    res = await box.exec(f"cat > {path} <<'DR_EOF'\n{text}\nDR_EOF", 30)
    if res.exit_code != 0:
        raise SandboxGone(f"cannot write {path} in the sandbox: {res.output[-200:]}")


PROBE_TRIES = 3
"""Probes of the harness's state in a row whose answer says nothing (the probe's own command died without
output) before the harness counts as gone."""


async def poll(box: Sandbox, pause_s: float = 1.0) -> int | None:
    """The harness's exit code, or None while it runs.

    The probe reads the exit code again after finding the launcher gone (it writes the code, then exits:
    the first read may precede the write and the liveness check follow the exit). A probe whose answer says
    nothing (its own command killed without output, as seen on a loaded host) is asked again, up to
    ``PROBE_TRIES`` times ``pause_s`` apart: it tells nothing of the harness.

    Raises:
        SandboxGone: it is neither running nor exited (its process vanished without an exit code), or
            ``PROBE_TRIES`` probes in a row said nothing.
    """
    for attempt in range(PROBE_TRIES):
        res = await box.exec(
            f"cat {STATE}/rc 2>/dev/null || {{ kill -0 $(cat {STATE}/pid) 2>/dev/null && echo RUNNING; }}"
            f" || cat {STATE}/rc 2>/dev/null || echo VANISHED",
            30,
        )
        try:
            return exit_code_of(res.output)
        except SandboxGone as e:
            if "vanished" in str(e) or attempt == PROBE_TRIES - 1:
                raise SandboxGone(f"{e} ({attempt + 1} probes)") from None
        await asyncio.sleep(pause_s)
    raise AssertionError("unreachable")


def exit_code_of(output: str) -> int | None:
    """`poll`'s reading of its command's output: the exit code, or None while the harness runs; the notes
    the sandbox may append (``[...]`` lines, e.g. after a slow read of the output) are not part of it.

    Raises:
        SandboxGone: the process vanished, or the output says neither.
    """
    out = output.strip()
    said = [line.strip() for line in out.splitlines() if line.strip() and not line.lstrip().startswith("[")]
    if said and said[-1] == "RUNNING":
        return None
    if said and said[-1] == "VANISHED":
        raise SandboxGone("the harness process vanished without an exit code")
    try:
        return int(said[-1])
    except (ValueError, IndexError):
        raise SandboxGone(f"unreadable harness exit code: {out[-100:]!r}") from None


async def tail(box: Sandbox, lines: int = TAIL_LINES) -> str:
    res = await box.exec(f"tail -n {lines} {STATE}/out 2>/dev/null", 30)
    return res.output.rstrip()


async def stop(box: Sandbox) -> None:
    """Stop the harness's whole session (and its shim): TERM, then KILL after a second."""
    await box.exec(
        f'p=$(cat {STATE}/pid 2>/dev/null) && [ -n "$p" ] && '
        "{ kill -TERM -$p 2>/dev/null; sleep 1; kill -KILL -$p 2>/dev/null; }; true",
        30,
    )


async def read_kept(box: Sandbox, path: str, max_bytes: int = KEEP_LIMIT) -> bytes:
    """A file the harness left at ``path`` (absolute, or relative to the workdir).

    Raises:
        SandboxFileError: missing, not a regular file, or larger than ``max_bytes``.
    """
    copy = f".dr-keep-{hashlib.sha256(path.encode()).hexdigest()[:16]}"
    res = await box.exec(f"cp -- {shlex.quote(path)} {copy} 2>&1", 30)
    if res.exit_code != 0:
        raise SandboxFileError(f"keep {path!r}: {res.output.strip()[-200:] or f'cp exited {res.exit_code}'}")
    try:
        return await box.read_file(copy, max_bytes)
    finally:
        await box.exec(f"rm -f -- {copy}", 30)
