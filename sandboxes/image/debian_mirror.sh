# Sourced by the offline image builds (sandboxes/image/build_image.sh, workers/image/build_local_image.sh).
# find_mirror: the Debian mirror this machine's apt uses: deb822 "URIs:" lines first, then one-line
# "deb URL suite" entries; the security archive skipped; deb.debian.org when none is found.
find_mirror() {
    local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list)
    local uri
    uri=$(grep -hs '^URIs:' "${files[@]}" | awk '{print $2}' | grep -v security | grep -i debian | head -n1 || true)
    if [[ -z "$uri" ]]; then
        uri=$(grep -hs '^deb ' "${files[@]}" | awk '{print $2}' | grep -v security | grep -i debian | head -n1 || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}
