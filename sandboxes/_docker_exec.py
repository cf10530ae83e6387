"""Exec plumbing of the Docker backend: in-sandbox wrapper scripts, the output stream, status parsing.

Invariant: one exec never holds more than its caps in worker memory (stdout cap, 64 KiB of stderr) and never
blocks past its deadline; the command's exit status comes only from the wrapper's status lines.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import docker
import docker.errors
import requests.exceptions
from docker.utils.socket import frames_iter

from durable_rollouts.errors import SandboxError, SandboxGone, SandboxNotReady
from durable_rollouts.sandboxes.base import ExecResult, SandboxHandle, SandboxSpec

KILL_AFTER_S = 1.0
"""Grace between SIGTERM and SIGKILL to the command's process group when its timeout fires."""
STREAM_GRACE_S = 10.0
"""Extra wall-clock allowed past a command's timeout before the exec is abandoned (frozen container)."""
HELD_OPEN_GRACE_S = 2.0
"""How long output is still read after the command exited (a detached process may hold the pipe)."""

_STATUS_PREFIX = b"dr-status: "

ONCE_DIR = "/tmp/.dr-once"
"""Where a keyed exec (``once_key``) keeps its record in the sandbox: ``<key>/`` with the wrapper's pid, the
capped output, the status lines and a ``done`` mark. A key's scope is its part before the first dot; a
claim removes the records of every other scope (a step's keys share one: only the latest step's stay). The
folder is shared by the sandbox's users (mode 1777): each removes only what it may."""

# Runs as the sandbox user in the workdir. The command gets its own process group (timeout's); after it
# exits or times out the whole group is SIGKILLed, so background children and fork bombs die with it.
# Output is capped inside the sandbox (head -c reads exactly the cap, wc -c drains and counts the rest), so a
# flood never crosses the API socket. Status lines go to the exec's stderr, which nothing else writes to
# (the shell's own job notices, such as "Killed", are discarded).
# With a key ($5), the command runs at most once per key in this container: the first exec claims the key
# (an atomic rename of a directory holding its pid) and records its capped output and status lines as it
# streams them; a later exec with the key runs nothing: it waits until the first one's wrapper is done (or
# dead), then prints what it recorded, with `replayed=1` (and `ms`, the first run's duration). A claim that
# cannot be made (/tmp full) runs the command unrecorded.
EXEC_WRAPPER = r"""
exec 3>&2
d=
st() { echo "dr-status: $1" >&3; [ -z "$d" ] || { echo "dr-status: $1" >> "$d/status"; } 2>/dev/null; }
replay() {
  q=$(cat "$d/pid" 2>/dev/null)
  while [ ! -e "$d/done" ] && [ -n "$q" ] && kill -0 "$q" 2>/dev/null; do sleep 0.1; done
  cat "$d/out" 2>/dev/null
  cat "$d/status" 2>/dev/null >&3
  echo "dr-status: replayed=1" >&3
  [ -e "$d/done" ] && exit 0
  exit 137
}
if [ -n "$5" ]; then
  r=__ONCE__; d=$r/$5; c=$r/.claim.$$
  [ -d "$d" ] && replay
  { [ -d "$r" ] || mkdir -m 1777 "$r" 2>/dev/null; }
  if [ -d "$r" ] && mkdir "$c" 2>/dev/null && echo $$ > "$c/pid" && mv -T "$c" "$d" 2>/dev/null
  then
    for x in "$r"/*; do
      case "${x##*/}" in "${5%%.*}" | "${5%%.*}".*) ;; *) rm -rf -- "$x" 2>/dev/null ;; esac
    done
    : > "$d/out"; : > "$d/status"; s0=$(date +%s%N)
  else
    rm -rf -- "$c" 2>/dev/null
    [ -d "$d" ] && replay
    d=
  fi
fi
oomk() {
  for f in /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do
    [ -r "$f" ] || continue
    while read -r k v; do [ "$k" = oom_kill ] && { echo "$v"; return; }; done < "$f"
  done
  echo 0
}
o0=$(oomk)
{ timeout -k "$4" -s TERM "$1" bash -c "$3" </dev/null 2>&1 3>&- & p=$!
  wait "$p"; rc=$?
  kill -9 "-$p"; kill -9 "-$p"
  st "rc=$rc"
} 2>/dev/null | {
  if [ -z "$d" ]; then stdbuf -o0 head -c "$2"; else stdbuf -o0 head -c "$2" | tee -p "$d/out"; fi
  n=$(wc -c); st "omitted=$n"
}
o1=$(oomk)
st "oom=$((o1 - o0))"
if [ -n "$d" ]; then st "ms=$(( ($(date +%s%N) - s0) / 1000000 ))"; { : > "$d/done"; } 2>/dev/null; fi
""".replace("__ONCE__", ONCE_DIR)

# Both file scripts refuse any symlink on the path: realpath of the literal path must be the path itself.
_PATH_CHECK = r"""
w=$(realpath -e -- "$1") || { echo "workdir missing" >&2; exit 90; }
cd "$w" || exit 90
p=$2
[ "$(realpath -m -- "$p" 2>/dev/null)" = "$w/$p" ] || { echo "symlink on path" >&2; exit 92; }
"""
READ_SCRIPT = (
    _PATH_CHECK
    + r"""
[ -e "$p" ] || { echo "no such file" >&2; exit 91; }
[ -f "$p" ] || { echo "not a regular file" >&2; exit 93; }
exec head -c "$3" -- "$p"
"""
)
WRITE_SCRIPT = (
    _PATH_CHECK
    + r"""
d=$(dirname -- "$p")
mkdir -p -- "$d" || exit 93
[ "$(realpath -m -- "$p" 2>/dev/null)" = "$w/$p" ] || { echo "symlink on path" >&2; exit 92; }
t="$d/.dr-write.$$"
cat > "$t" || { rm -f -- "$t"; exit 94; }
mv -fT -- "$t" "$p" || { rm -f -- "$t"; exit 95; }
"""
)


@dataclass
class RawExec:
    """What came back from one exec stream."""

    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    exec_id: str = ""
    dropped: int = 0
    abandoned: bool = False


class Watchdog:
    """Runs `action` once after a (resettable) delay, from a timer thread."""

    def __init__(self, seconds: float, action: Callable[[], None]) -> None:
        self._action = action
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.fired = False
        self.reset(seconds)

    def reset(self, seconds: float) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(seconds, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
        with contextlib.suppress(OSError):  # already closed
            self._action()


@contextmanager
def docker_errors(what: str) -> Iterator[None]:
    """Translate docker SDK errors into the sandbox error hierarchy."""
    try:
        yield
    except docker.errors.NotFound as exc:
        raise SandboxGone(f"{what}: container not found ({exc.explanation})") from exc
    except docker.errors.APIError as exc:
        if exc.status_code == 409:  # not running, paused, restarting
            raise SandboxGone(f"{what}: {exc.explanation}") from exc
        raise SandboxError(f"{what}: docker API error: {exc.explanation or exc}") from exc
    except (requests.exceptions.ConnectionError, docker.errors.DockerException) as exc:
        raise SandboxNotReady(f"{what}: docker daemon unreachable: {exc}") from exc


def stream_exec(
    api: docker.APIClient,
    handle: SandboxHandle,
    argv: list[str],
    *,
    deadline_s: float,
    stdout_cap: int,
    stdin: bytes | None = None,
    watch_status: bool = False,
    user: str | None = None,
) -> RawExec:
    """Run one exec as the sandbox user (or ``user``, numeric ``uid:gid``) in the workdir and collect its
    output.

    stdout beyond `stdout_cap` is counted and dropped; after `deadline_s` the socket is shut down and the
    result is marked abandoned. With `watch_status`, reading stops soon after the wrapper reports the exit
    status (a detached process may hold the output pipe open).
    """
    spec = handle.spec
    with docker_errors(f"exec in sandbox {handle.name}"):
        exec_id = api.exec_create(
            handle.container_id, argv, stdin=stdin is not None, user=user or spec.user, workdir=spec.workdir
        )["Id"]
        sock = api.exec_start(exec_id, socket=True)
    raw_sock: socket.socket = getattr(sock, "_sock", sock)
    watchdog = Watchdog(deadline_s, lambda: raw_sock.shutdown(socket.SHUT_RDWR))
    out = RawExec(exec_id=exec_id)
    try:
        if stdin is not None:
            raw_sock.sendall(stdin)
            raw_sock.shutdown(socket.SHUT_WR)
        for stream, data in frames_iter(sock, tty=False):
            if stream == 2:
                out.stderr += data[: max(0, 65536 - len(out.stderr))]
                if watch_status and b"dr-status: rc=" in out.stderr:
                    watch_status = False
                    watchdog.reset(HELD_OPEN_GRACE_S)
                continue
            room = max(0, stdout_cap - len(out.stdout))
            out.stdout += data[:room]
            out.dropped += len(data) - min(room, len(data))
    except OSError as exc:
        if not watchdog.fired:
            raise SandboxError(f"exec in sandbox {handle.name}: stream failed: {exc}") from exc
    finally:
        watchdog.cancel()
        sock.close()
        raw_sock.close()
    out.abandoned = watchdog.fired
    return out


def parse_status(stderr: bytes) -> tuple[dict[str, int], str]:
    """Split the wrapper's stderr into its status values and any other text."""
    status: dict[str, int] = {}
    other = []
    for line in stderr.splitlines():
        if line.startswith(_STATUS_PREFIX) and b"=" in line:
            name, _, value = line[len(_STATUS_PREFIX) :].partition(b"=")
            if value.strip().lstrip(b"-").isdigit():
                status[name.decode()] = int(value)
                continue
        other.append(line.decode(errors="replace"))
    return status, "\n".join(other).strip()


def exec_result(
    raw: RawExec, timeout: float, duration: float, spec: SandboxSpec, wrapper_exit: int | None = None
) -> ExecResult:
    """Build the ExecResult of a wrapper run from its output and status lines.

    `wrapper_exit` is the exec's own exit code, used when the wrapper died before reporting a status. A
    replayed result (a keyed exec's second call) is the first run's: its output, status and duration.
    """
    status, other = parse_status(bytes(raw.stderr))
    replayed = status.get("replayed", 0) > 0
    if replayed and "ms" in status:  # the first run's result: its own duration decides a timeout
        duration = status["ms"] / 1000
    killed_wrapper = "rc" not in status and not raw.abandoned
    exit_code = status.get("rc", wrapper_exit if killed_wrapper and wrapper_exit is not None else -1)
    omitted = status.get("omitted", 0) + raw.dropped
    timed_out = (exit_code in (124, 137) and duration >= timeout) or ("rc" not in status and raw.abandoned)
    oom = status.get("oom", 0) > 0
    output = bytes(raw.stdout).decode("utf-8", errors="replace")
    notes = []
    if omitted:
        notes.append(f"[output truncated: {omitted} bytes omitted]")
    if killed_wrapper:
        notes.append("[no exit status: the command's supervisor was killed, probably by the command itself]")
    elif "rc" not in status:
        notes.append(f"[no exit status: the command did not finish within {timeout:g} s]")
    elif timed_out:
        notes.append(f"[timed out after {timeout:g} s: the command's process group was killed]")
    elif raw.abandoned:
        notes.append("[stopped reading output: a detached process still holds it open]")
    if oom:
        notes.append(f"[killed: out of memory (sandbox limit {spec.memory_mb} MiB)]")
    if other:
        notes.append(f"[sandbox: {other[:1000]}]")
    if notes:
        output += "\n" + "\n".join(notes)
    return ExecResult(
        exit_code=exit_code,
        output=output,
        truncated=omitted > 0,
        timed_out=timed_out,
        oom_killed=oom,
        duration_s=round(duration, 4),
        replayed=replayed,
    )
