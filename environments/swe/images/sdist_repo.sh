# Helpers for the image folders whose repository comes from a PyPI sdist (sourced by their prepare.sh).
#
# Everything is fetched on the host at build time, with the ordinary clients: sdists by
# `pip download --no-binary :all:`, Debian packages by `apt-get download`; both are kept in a cache
# (SWE_SDIST_CACHE, default ~/.cache/durable-rollouts-swe) so a rebuild fetches nothing. The docker build
# itself has no network: its Dockerfile only COPYs the prepared context and extracts the .debs.

CACHE="${SWE_SDIST_CACHE:-$HOME/.cache/durable-rollouts-swe}"
read -r -a PIP <<< "${SWE_PIP:-python3 -m pip}"  # a command line: the default is the PATH python3's pip

# sdist NAME VERSION DEST: unpack NAME==VERSION's sdist into DEST (the tarball's top folder stripped).
sdist() {
    local name=$1 version=$2 dest=$3 file
    mkdir -p "$CACHE/sdists" "$dest"
    file=$(find "$CACHE/sdists" -maxdepth 1 -iname "${name//-/[-_]}-${version}.tar.gz" | head -n1)
    if [[ -z "$file" ]]; then
        "${PIP[@]}" download -q --no-deps --no-binary :all: "$name==$version" -d "$CACHE/sdists" >&2
        file=$(find "$CACHE/sdists" -maxdepth 1 -iname "${name//-/[-_]}-${version}.tar.gz" | head -n1)
    fi
    [[ -n "$file" ]] || { echo "no sdist of $name==$version in $CACHE/sdists" >&2; return 1; }
    tar -xzf "$file" -C "$dest" --strip-components=1 --no-same-owner
}

# debs DEST PACKAGE...: the Debian packages' .deb files (the host's release) into DEST.
debs() {
    local dest=$1; shift
    mkdir -p "$CACHE/debs" "$dest"
    local pkg
    for pkg in "$@"; do
        if ! ls "$CACHE/debs/${pkg}_"*.deb >/dev/null 2>&1; then
            (cd "$CACHE/debs" && { apt-get download -q "$pkg" >/dev/null 2>&1 \
                || { apt-get update -q >/dev/null && apt-get download -q "$pkg" >/dev/null; }; })
        fi
        cp "$CACHE/debs/${pkg}_"*.deb "$dest/"
    done
}

# commit DIR: DIR as a git repository with one commit of everything in it. Fixed author, committer and
# dates, so the same files give the same commit id on every host (the rows name it as base_commit).
commit() {
    local dir=$1
    rm -rf "$dir/.git"
    (
        cd "$dir"
        export GIT_AUTHOR_NAME=durable-rollouts GIT_AUTHOR_EMAIL=swe@localhost \
            GIT_COMMITTER_NAME=durable-rollouts GIT_COMMITTER_EMAIL=swe@localhost \
            GIT_AUTHOR_DATE="2026-01-01T00:00:00Z" GIT_COMMITTER_DATE="2026-01-01T00:00:00Z" \
            GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_NOSYSTEM=1
        git init -q -b main .
        git add -A -f .
        git commit -q -m "base: $(basename "$dir") from its PyPI sdist"
        git gc -q --prune=now
        git rev-parse HEAD > ../base_commit
    )
}
