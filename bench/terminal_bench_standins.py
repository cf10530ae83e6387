"""Terminal-Bench 2 survey, stand-ins: local servers for the hosts the tasks' scripts download from.

Every published ``tests/test.sh`` downloads its test runner when it runs: ``apt-get update; apt-get install
-y curl`` (``deb.debian.org``), ``curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh`` (the installer
then fetches uv's release from ``github.com``), ``uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5
pytest ...`` (``pypi.org``, ``files.pythonhosted.org``); some ``solution/solve.sh`` files ``pip install``.
This module makes, at set-up (the only time anything is downloaded, into ``.cache/tb2-standins``):

1. a PEP 503 simple index (``pypi.org``) and its files (``files.pythonhosted.org``): every wheel the
   runnable tasks install (`REQUIREMENTS`), for CPython 3.13 on x86_64 where binary;
2. ``astral.sh/uv/0.9.5/install.sh`` and ``github.com/astral-sh/uv/releases/download/0.9.5/
   uv-x86_64-unknown-linux-gnu.tar.gz``: neither host answers from this machine, so the installer is a
   stand-in (`INSTALLER`: the published installer's effect, ``uv`` and ``uvx`` in ``~/.local/bin`` and the
   ``~/.local/bin/env`` file the scripts source, downloaded from the release URL the published one uses)
   and the tarball is laid out as the release's from uv 0.9.5's own binaries (its PyPI wheel);
3. a Debian mirror (``deb.debian.org``, plain HTTP as the images' sources name it): the real signed
   ``InRelease`` of ``bookworm``, ``bookworm-updates`` and ``bookworm-security`` with the ``Packages``
   files they sign (served by path and by hash), and the pool ``.deb`` files of `APT_PACKAGES` and what
   they pull in on the stand-in base image (apt verifies every signature and hash unchanged);
4. a throwaway certificate authority and one certificate for every HTTPS name (`HTTPS_NAMES`), made by
   ``openssl``; sandboxes are told to trust it through their environment only (``SSL_CERT_FILE``,
   ``CURL_CA_BUNDLE``, ``REQUESTS_CA_BUNDLE``, ``PIP_CERT``; uv reads ``SSL_CERT_FILE``: the run config's
   ``sandbox.env``), the CA file itself in the stand-in base image (`terminal_bench_standin_run`).

`build_server_image` bakes all of it into one image whose server (`SERVER`) answers HTTPS on 8443 and
HTTP on 8080, by ``Host``; the egress proxy maps each allowed name to it.
"""

from __future__ import annotations

import hashlib
import html
import io
import re
import shutil
import subprocess
import tarfile
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "tb2-standins"
UV_VERSION = "0.9.5"
UV_TARGET = "x86_64-unknown-linux-gnu"
HTTPS_NAMES = ("pypi.org", "files.pythonhosted.org", "astral.sh", "github.com")
HTTP_NAMES = ("deb.debian.org",)
HTTPS_PORT, HTTP_PORT = 8443, 8080
SERVER_IMAGE = "tb2-standins:local"
DEBIAN = "http://deb.debian.org"
SUITES = (("debian", "bookworm"), ("debian", "bookworm-updates"), ("debian-security", "bookworm-security"))
APT_PACKAGES = ("curl", "gcc", "git", "openssl", "vim", "nano", "gnucobol3", "tmux", "screen", "expect")
"""What the runnable tasks ``apt-get install``: their test.sh files ``curl``; the rest the Dockerfiles
built through the stand-ins (`BUILD_TASKS`) and their solve.sh (fetched as one install: what apt fetches for
any subset on the same base is part of it)."""
BUILD_TASKS = (
    "circuit-fibsqrt", "cobol-modernization", "fix-git", "openssl-selfsigned-cert", "sanitize-git-repo",
    "vulnerable-secret", "large-scale-text-editing", "headless-terminal", "feal-differential-cryptanalysis",
    "feal-linear-cryptanalysis", "model-extraction-relu-logits", "regex-chess", "largest-eigenval",
)  # fmt: skip
"""Tasks on the stand-in base whose Dockerfile downloads only from the stood-in hosts (Debian's packages
above, wheels below): built with the stand-ins as their network."""
REQUIREMENTS = (
    ("pytest==8.4.1", "pytest-json-ctrf==0.3.5"),  # every uvx test runner
    ("scipy==1.16.0", "numpy==2.3.1"),  # raman-fitting's solve.sh
    ("setuptools==80.9.0", "numpy==2.2.5", "chess"),  # BUILD_TASKS' Dockerfiles
    ("numpy==2.3.0",),
    (  # kv-store-grpc's test.sh and solve.sh
        "pytest==8.4.2", "requests==2.32.5", "psutil==7.0.0", "pytest-json-ctrf==0.3.5", "grpcio==1.73.0",
        "grpcio-tools==1.73.0",
    ),
)  # fmt: skip
_PLATFORM = ["--python-version", "3.13", "--implementation", "cp", "--abi", "cp313"] + [
    a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
    for a in ("--platform", p)
]  # fmt: skip

INSTALLER = f"""#!/bin/sh
# Stand-in for https://astral.sh/uv/{UV_VERSION}/install.sh (unreachable from the machine that made it): the
# published installer's effect. It downloads uv's release tarball from the URL the published installer
# uses, unpacks uv and uvx into $UV_INSTALL_DIR (default ~/.local/bin) and writes the env file to source.
set -eu
APP_VERSION="{UV_VERSION}"
ARCH="$(uname -m)-unknown-linux-gnu"
URL="https://github.com/astral-sh/uv/releases/download/$APP_VERSION/uv-$ARCH.tar.gz"
DEST="${{UV_INSTALL_DIR:-${{XDG_BIN_HOME:-$HOME/.local/bin}}}}"
TMP="$(mktemp -d)"
echo "downloading uv $APP_VERSION $ARCH" >&2
if command -v curl >/dev/null 2>&1; then curl -sSfL "$URL" -o "$TMP/uv.tar.gz"
elif command -v wget >/dev/null 2>&1; then wget -q "$URL" -O "$TMP/uv.tar.gz"
else echo "need curl or wget" >&2; exit 1; fi
tar -xzf "$TMP/uv.tar.gz" -C "$TMP"
mkdir -p "$DEST"
cp "$TMP/uv-$ARCH/uv" "$TMP/uv-$ARCH/uvx" "$DEST/"
chmod +x "$DEST/uv" "$DEST/uvx"
cat > "$DEST/env" <<'ENV'
#!/bin/sh
# add binaries to PATH if they aren't added yet
case ":${{PATH}}:" in
    *:"$HOME/.local/bin":*)
        ;;
    *)
        export PATH="$HOME/.local/bin:$PATH"
        ;;
esac
ENV
rm -rf "$TMP"
echo "installing to $DEST" >&2
echo "everything's installed!" >&2
"""

SERVER = r"""
import hashlib, http.server, os, ssl, sys, threading
ROOT = "/srv/sites"
BY_HASH = {}
for base, _, names in os.walk(os.path.join(ROOT, "deb.debian.org")):
    for n in names:
        p = os.path.join(base, n)
        if "/dists/" in p:
            with open(p, "rb") as f:
                BY_HASH[hashlib.sha256(f.read()).hexdigest()] = p
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def _file(self):
        host = (self.headers.get("Host") or "").split(":")[0].lower()
        path = self.path.split("?")[0].split("#")[0]
        if "/by-hash/SHA256/" in path and host == "deb.debian.org":
            return BY_HASH.get(path.rsplit("/", 1)[1])
        from urllib.parse import unquote
        full = os.path.normpath(os.path.join(ROOT, host, unquote(path).lstrip("/")))
        if not full.startswith(os.path.join(ROOT, host) + os.sep):
            return None
        if os.path.isdir(full):
            full = os.path.join(full, "index.html")
        return full if os.path.isfile(full) else None
    def _answer(self, body):
        p = self._file()
        if p is None:
            data = f"stand-in: no {self.path} on {self.headers.get('Host')}\n".encode()
            self.send_response(404)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)
            return
        size = os.path.getsize(p)
        self.send_response(200)
        kind = "text/html" if p.endswith(".html") else "application/octet-stream"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        if body:
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    self.wfile.write(chunk)
    def do_GET(self):
        self._answer(True)
    def do_HEAD(self):
        self._answer(False)
    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s\n" % (self.headers.get("Host"), fmt % args))
plain = http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H)
tls = http.server.ThreadingHTTPServer(("0.0.0.0", 8443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain("/srv/tls/server.pem", "/srv/tls/server.key")
tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
threading.Thread(target=plain.serve_forever, daemon=True).start()
tls.serve_forever()
"""


def _get(url: str, dest: Path, timeout: float = 120) -> Path:
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    with urllib.request.urlopen(url, timeout=timeout) as r, part.open("wb") as f:
        shutil.copyfileobj(r, f)
    part.rename(dest)
    return dest


def fetch_wheels(cache: Path = CACHE) -> Path:
    """`REQUIREMENTS` with their dependencies as wheels (``pip download``; kept between set-ups)."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [str(REPO / ".venv" / "bin" / "pip"), "download", "-q", "-d", str(wheels), "--only-binary", ":all:"]
    for reqs in REQUIREMENTS:
        subprocess.run([*pip, *_PLATFORM, *reqs], check=True, timeout=900)
    subprocess.run([*pip, "--no-deps", *_PLATFORM, f"uv=={UV_VERSION}"], check=True, timeout=900)
    return wheels


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def write_index(wheels: Path, sites: Path) -> list[str]:
    """The simple index (``pypi.org/simple/<name>/``) of ``wheels`` and their files; the project names."""
    projects: dict[str, list[Path]] = {}
    for w in sorted(wheels.glob("*.whl")):
        projects.setdefault(_norm(w.name.split("-")[0]), []).append(w)
    files = sites / "files.pythonhosted.org" / "packages"
    files.mkdir(parents=True, exist_ok=True)
    for name, ws in projects.items():
        links = []
        for w in ws:
            shutil.copy2(w, files / w.name)
            sha = hashlib.sha256(w.read_bytes()).hexdigest()
            url = f"https://files.pythonhosted.org/packages/{urllib.parse.quote(w.name)}#sha256={sha}"
            links.append(f'<a href="{html.escape(url)}">{html.escape(w.name)}</a><br/>')
        page = sites / "pypi.org" / "simple" / name / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    top = "".join(f'<a href="{n}/">{n}</a><br/>\n' for n in sorted(projects))
    (sites / "pypi.org" / "simple" / "index.html").write_text(
        f"<!DOCTYPE html><html><body>\n{top}</body></html>\n"
    )
    return sorted(projects)


def write_uv(wheels: Path, sites: Path) -> None:
    """The installer stand-in and the release tarball (uv 0.9.5's binaries from its wheel)."""
    (sites / "astral.sh" / "uv" / UV_VERSION).mkdir(parents=True, exist_ok=True)
    (sites / "astral.sh" / "uv" / UV_VERSION / "install.sh").write_text(INSTALLER)
    (sites / "astral.sh" / "uv" / "install.sh").write_text(INSTALLER)
    (wheel,) = wheels.glob(f"uv-{UV_VERSION}-*.whl")
    buf = io.BytesIO()
    with zipfile.ZipFile(wheel) as z, tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for tool in ("uv", "uvx"):
            data = z.read(f"uv-{UV_VERSION}.data/scripts/{tool}")
            info = tarfile.TarInfo(f"uv-{UV_TARGET}/{tool}")
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    rel = sites / "github.com" / "astral-sh" / "uv" / "releases" / "download" / UV_VERSION
    rel.mkdir(parents=True, exist_ok=True)
    name = f"uv-{UV_TARGET}.tar.gz"
    (rel / name).write_bytes(buf.getvalue())
    (rel / f"{name}.sha256").write_text(f"{hashlib.sha256(buf.getvalue()).hexdigest()}  {name}\n")


def _signed(inrelease: str) -> dict[str, tuple[str, int]]:
    """``InRelease``'s SHA256 section: path -> (hash, size)."""
    out: dict[str, tuple[str, int]] = {}
    section = False
    for line in inrelease.splitlines():
        if line.startswith("SHA256:"):
            section = True
            continue
        if section and line.startswith(" "):
            digest, size, path = line.split()
            out[path] = (digest, int(size))
        elif section:
            section = False
    return out


def fetch_debian_indexes(sites: Path) -> list[str]:
    """The suites' real ``InRelease`` and the ``main`` amd64 ``Packages.xz`` each signs (fetched by
    hash, so they match); the paths written."""
    done: list[str] = []
    for archive, suite in SUITES:
        rel = f"{archive}/dists/{suite}"
        local = sites / "deb.debian.org" / rel
        inrelease = _get(f"{DEBIAN}/{rel}/InRelease", local / "InRelease")
        signed = _signed(inrelease.read_text(errors="replace"))
        path = "main/binary-amd64/Packages.xz"
        digest, size = signed[path]
        got = _get(f"{DEBIAN}/{rel}/main/binary-amd64/by-hash/SHA256/{digest}", local / path)
        if hashlib.sha256(got.read_bytes()).hexdigest() != digest or got.stat().st_size != size:
            got.unlink()
            raise SystemExit(f"{DEBIAN}/{rel}/{path}: not the file its InRelease signs (mirror changed?)")
        done += [f"{rel}/InRelease", f"{rel}/{path}"]
    return done


def fetch_debs(uris: list[str], sites: Path) -> list[str]:
    """The pool files ``apt-get install --print-uris`` named, at their paths."""
    out = []
    for uri in uris:
        path = urllib.parse.unquote(urllib.parse.urlsplit(uri).path).lstrip("/")
        _get(uri, sites / "deb.debian.org" / path)
        out.append(path)
    return out


def print_uris(base_image: str, packages: tuple[str, ...] = APT_PACKAGES) -> list[str]:
    """The .deb URLs apt on ``base_image`` (its sources, its installed packages) fetches to install
    ``packages``, asked of the real mirror at set-up (a container with network, as root)."""
    script = f"apt-get update -qq >/dev/null && apt-get install --print-uris -qq -y {' '.join(packages)}"
    done = subprocess.run(
        ["docker", "run", "--rm", "--user", "root", "--entrypoint", "sh", base_image, "-c", script],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"apt-get --print-uris {packages} on {base_image}: {done.stderr.strip()[-300:]}")
    return re.findall(r"^'(http://[^']+\.deb)'", done.stdout, re.M)


def make_certs(cache: Path = CACHE) -> Path:
    """A throwaway CA (``ca.pem``) and one server certificate for `HTTPS_NAMES` it signs; the folder."""
    tls = cache / "tls"
    if (tls / "server.pem").is_file():
        return tls
    tls.mkdir(parents=True, exist_ok=True)

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tls, timeout=120)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-keyout", "ca.key", "-out",
        "ca.pem", "-subj", "/CN=durable-rollouts Terminal-Bench stand-in CA (throwaway)")  # fmt: skip
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
        f"/CN={HTTPS_NAMES[0]}")  # fmt: skip
    sans = ",".join(f"DNS:{n}" for n in HTTPS_NAMES)
    (tls / "ext.cnf").write_text(
        f"subjectAltName={sans}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
    )
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "30", "-out", "server.pem", "-extfile", "ext.cnf")  # fmt: skip
    for f in tls.iterdir():
        f.chmod(0o644)  # read by the server's unprivileged user inside its image
    return tls


def build_server_image(docker: list[str], sites: Path, tls: Path, base: str) -> str:
    """`SERVER_IMAGE` on the daemon ``docker`` names: ``base`` (any image with python3) with the sites
    and the certificate baked in."""
    ctx = CACHE / "server-ctx"
    shutil.rmtree(ctx, ignore_errors=True)
    ctx.mkdir(parents=True)
    shutil.copytree(sites, ctx / "sites")
    (ctx / "tls").mkdir()
    for name in ("server.pem", "server.key"):
        shutil.copy2(tls / name, ctx / "tls" / name)
    (ctx / "server.py").write_text(SERVER)
    (ctx / "Dockerfile").write_text(
        f"FROM {base}\nUSER root\nCOPY sites /srv/sites\nCOPY tls /srv/tls\nCOPY server.py /srv/server.py\n"
        'RUN chmod -R a+rX /srv\nUSER 65534:65534\nCMD ["python3", "/srv/server.py"]\n'
    )
    done = subprocess.run([*docker, "build", "-q", "--network", "none", "-t", SERVER_IMAGE, str(ctx)],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"stand-in server image: {done.stderr.strip()[-300:]}")
    shutil.rmtree(ctx, ignore_errors=True)
    return SERVER_IMAGE


def policy(address: str, network: str) -> dict[str, object]:
    """The run config's ``[sandbox.egress]`` for the stand-ins at ``address`` on ``network``."""
    names = (*HTTPS_NAMES, *HTTP_NAMES)
    stand_in = {n: f"{address}:{HTTPS_PORT}" for n in HTTPS_NAMES}
    stand_in.update({n: f"{address}:{HTTP_PORT}" for n in HTTP_NAMES})
    return {"allow": list(names), "map": stand_in, "upstream_network": network}
