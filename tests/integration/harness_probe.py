"""A harness that probes its sandbox's containment (tests/integration/test_harness.py): it tries the other
rollout's gateway, the Docker socket, a host port, the Docker bridge and an outside address (TEST-NET-1,
192.0.2.1: nothing real; with no route the connect fails at once and nothing is sent), a wrong key on its
own gateway, then makes one model call whose message carries what it found.
"""

from __future__ import annotations

from typing import ClassVar

from harness_env import MiniSweAgentEnvironment

from durable_rollouts.environments.base import Task
from durable_rollouts.environments.harness_trait import HarnessCommand

PROBE = r"""
import json, os, socket, sys, urllib.request
out = {}
def connect(kind, addr):
    s = socket.socket(kind, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(addr)
        return "connected"
    except OSError as e:
        return type(e).__name__ + ":" + str(e.errno)
    finally:
        s.close()
out["gateway_dir"] = sorted(os.listdir("/.dr-gateway"))
out["other_gateway"] = connect(socket.AF_UNIX, os.environ["OTHER_SOCKET"])
out["docker_sock"] = connect(socket.AF_UNIX, "/var/run/docker.sock")
out["host_loopback_port"] = connect(socket.AF_INET, ("127.0.0.1", int(os.environ["HOST_PORT"])))
out["docker_bridge"] = connect(socket.AF_INET, ("172.17.0.1", int(os.environ["HOST_PORT"])))
out["outside"] = connect(socket.AF_INET, ("192.0.2.1", 80))
out["interfaces"] = sorted(os.listdir("/sys/class/net"))
url = os.environ["OPENAI_BASE_URL"]
req = urllib.request.Request(url + "/models", headers={"Authorization": "Bearer wrong"})
try:
    urllib.request.urlopen(req, timeout=5)
    out["wrong_key"] = 200
except urllib.error.HTTPError as e:
    out["wrong_key"] = e.code
text = os.environ["TASK_LINE"] + "\nPROBE " + json.dumps(out)
body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body.encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
print(json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["finish_reason"])
"""


class ProbeEnvironment(MiniSweAgentEnvironment):
    name: ClassVar[str] = "harness-probe"
    host_port: ClassVar[int] = 7233
    """A port the host listens on (the test sets the Temporal server's)."""
    other: ClassVar[str] = "/tmp/dr-gateway/none/gw.sock"
    """Another rollout's gateway socket, as a host path (the test sets it)."""

    def harness_command(self, task: Task) -> HarnessCommand:
        env = {
            "HOST_PORT": str(self.host_port),
            "OTHER_SOCKET": self.other,
            "TASK_LINE": f"Task id: {task.id}",
        }
        return HarnessCommand(command=f"python3 - <<'EOF'\n{PROBE}\nEOF", env=env, tcp_port=8011)
