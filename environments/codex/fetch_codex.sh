#!/usr/bin/env bash
# Fetch Codex CLI (npm @openai/codex, pinned) on this host, at setup time: its Linux x86_64 platform package
# holds a static (musl) binary, the whole CLI; nothing else of the package is needed to run `codex exec`.
#
# Usage: environments/codex/fetch_codex.sh [--dest DIR]    (default DIR: .cache/codex)
# Writes DIR/<version>/codex (executable) and prints its path; an existing one is reused (idempotent).
set -euo pipefail
VERSION="0.169.0"
PACKAGE="@openai/codex@${VERSION}-linux-x64"   # the platform package @openai/codex names as optional
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
DEST="$ROOT/.cache/codex"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dest) DEST="$2"; shift 2 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
OUT="$DEST/$VERSION"
if [[ -x "$OUT/codex" ]]; then
    echo "$OUT/codex"
    exit 0
fi
command -v npm >/dev/null || { echo "fetch_codex.sh: npm is needed to fetch $PACKAGE" >&2; exit 1; }
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && npm pack -q "$PACKAGE" >/dev/null)
tar -xzf "$TMP"/openai-codex-*.tgz -C "$TMP" package/vendor/x86_64-unknown-linux-musl/bin/codex
mkdir -p "$OUT"
install -m 0755 "$TMP/package/vendor/x86_64-unknown-linux-musl/bin/codex" "$OUT/codex.tmp"
"$OUT/codex.tmp" --version | grep -q "$VERSION" || { echo "fetch_codex.sh: not Codex $VERSION" >&2; exit 1; }
mv "$OUT/codex.tmp" "$OUT/codex"
echo "$OUT/codex"
