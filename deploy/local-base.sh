#!/usr/bin/env bash
# Make a Debian 12 base image with Python 3.11 where no image registry is reachable, for
#     podman build --build-arg BASE_IMAGE=localhost/sketchsvd-base:bookworm ...
#
#     deploy/local-base.sh [IMAGE]        (default localhost/sketchsvd-base:bookworm)
#
# debootstrap fetches Debian from the mirror apt already uses (MIRROR=URL to choose another);
# `podman import` turns the tree into an image. Debian's Python has no `python` command and
# its pip refuses to install into the system, so the image carries a virtual environment at
# /opt/venv that comes first on PATH: `python` and `pip` then work as in python:3.11-slim.
# An existing IMAGE is kept (REBUILD=1 makes it again). Needs root, debootstrap and podman.
set -euo pipefail

IMAGE=${1:-localhost/sketchsvd-base:bookworm}
SUITE=bookworm

if [[ -z "${REBUILD:-}" ]] && podman image exists "$IMAGE"; then
    echo "base image $IMAGE exists (REBUILD=1 to make it again)"
    exit 0
fi

# The Debian mirrors in apt's sources, the first one first (deb822 .sources files, then one-line .list files).
apt_mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -e "$f" ]] || continue
        awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i !~ /security/) { print $i; exit } }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -e "$f" ]] || continue
        awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) { print $i; exit } }' "$f"
    done
}

MIRROR=${MIRROR:-$(apt_mirror | awk 'NR == 1')}
if [[ -z "$MIRROR" ]]; then
    echo "error: no Debian mirror in /etc/apt/sources.list*; set MIRROR=URL" >&2
    exit 2
fi

ROOTFS=$(mktemp -d /var/tmp/sketchsvd-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
echo "debootstrap $SUITE from $MIRROR into $ROOTFS"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
    || { tail -n 20 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"; exit 1; }
rm -f "$ROOTFS.log"
chroot "$ROOTFS" python3 -m venv /opt/venv
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*

PATH_IN=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
tar -C "$ROOTFS" -c . | podman import \
    --change "ENV PATH=$PATH_IN" \
    --change "ENV LANG=C.UTF-8" \
    --change 'CMD ["python"]' \
    --quiet - "$IMAGE" >/dev/null
version=$(podman run --rm --network none "$IMAGE" python --version)
echo "base image $IMAGE: Debian $SUITE, $version"
