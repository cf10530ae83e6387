#!/bin/sh
# Assemble /opt/harness's runtime from this (build) image's CPython 3.11: the interpreter, its standard
# library, and every shared library the interpreter and any extension module in the tree links (ldd),
# glibc's dynamic loader included. Run after the harness's packages are installed into the tree.
set -eu
H=/opt/harness
cp /usr/lib/x86_64-linux-gnu/libgcc_s.so.1 "$H/lib/"  # dlopened by glibc (thread cancellation)
for f in /usr/lib/x86_64-linux-gnu/libnss_*.so.2; do cp -L "$f" "$H/lib/"; done  # dlopened by glibc (NSS)
{ echo "$H/bin/python3.11"; find "$H" -type f -name '*.so*'; } | while read -r f; do ldd "$f" 2>/dev/null || true; done |
    awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' | sort -u | while read -r name path; do
        case "$path" in "$H"/*) continue ;; esac
        [ -e "$H/lib/$name" ] || cp -L "$path" "$H/lib/$name"
    done
cp -L /lib64/ld-linux-x86-64.so.2 "$H/lib/ld-linux-x86-64.so.2"
missing=$({ echo "$H/bin/python3.11"; find "$H" -type f -name '*.so*'; } | while read -r f; do ldd "$f" 2>/dev/null || true; done | grep 'not found' || true)
[ -z "$missing" ] || { echo "unresolved libraries: $missing" >&2; exit 1; }
