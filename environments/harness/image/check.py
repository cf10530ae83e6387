"""Build-time check of /opt/harness in an image holding nothing else (FROM scratch: no shell, no libc):
every shared object in the tree loads with the bundled libraries alone, mini-swe-agent imports, and sys.path
is the tree's own. Writes /opt/harness/.checked, which the final stage copies (so this stage always runs)."""

import ctypes
import pathlib
import sys

import litellm  # noqa: F401
import minisweagent
from minisweagent.run import mini  # noqa: F401

H = pathlib.Path("/opt/harness")
assert all(p.startswith(str(H)) for p in sys.path if p), sys.path
assert sys.executable == str(H / "bin" / "python3"), sys.executable
missing = []
for p in sorted(H.rglob("*.so*")):
    if p.is_file() and not p.name.startswith("ld-linux"):
        try:
            ctypes.CDLL(str(p))
        except OSError as e:
            if "cannot open shared object file" in str(e):
                missing.append(str(e))
assert not missing, "\n".join(missing)
(H / ".checked").write_text(f"mini-swe-agent {minisweagent.__version__} on {sys.version.split()[0]}\n")
print((H / ".checked").read_text(), end="")
