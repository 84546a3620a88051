#!/usr/bin/env bash
# Set up Podman as the container engine on Debian 12, as root; safe to run again.
#
#     deploy/engine.sh            prints the podman-compose to use on its last line
#
# - podman, runc and debootstrap from Debian (Podman 4.3 on bookworm).
# - runc, not crun: crun refuses hosts whose cgroups are in hybrid mode (v1 with a v2 mount),
#   and hosts that do not permit setrlimit need the empty default_ulimits below.
# - podman-compose from PyPI in its own virtual environment (COMPOSE_VENV), pinned.
set -euo pipefail

PODMAN_COMPOSE=${PODMAN_COMPOSE:-podman-compose==1.6.0}
COMPOSE_VENV=${COMPOSE_VENV:-/var/tmp/sketchsvd-podman-compose}
CONF=/etc/containers/containers.conf.d/50-sketchsvd-runc.conf

missing=()
for pkg in podman runc debootstrap python3-venv; do
    [[ "$(dpkg-query -W -f '${Status}' "$pkg" 2>/dev/null)" == *"ok installed" ]] \
        || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

want=$(cat <<'EOF'
# deploy/engine.sh: runc with cgroupfs (no systemd here), containers without rlimits of their own
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF
)
if [[ ! -f "$CONF" ]] || [[ "$(cat "$CONF")" != "$want" ]]; then
    mkdir -p "$(dirname "$CONF")"
    printf '%s\n' "$want" >"$CONF"
    echo "wrote $CONF" >&2
fi

# The venv is remade when the pinned requirement changes (its stamp file names it).
if [[ "$(cat "$COMPOSE_VENV/requirement" 2>/dev/null)" != "$PODMAN_COMPOSE" ]]; then
    rm -rf "$COMPOSE_VENV"
    python3 -m venv "$COMPOSE_VENV"
    "$COMPOSE_VENV/bin/pip" install -q "$PODMAN_COMPOSE"
    echo "$PODMAN_COMPOSE" >"$COMPOSE_VENV/requirement"
fi

echo "podman $(podman version --format '{{.Client.Version}}')," \
     "runtime $(podman info --format '{{.Host.OCIRuntime.Name}}')," \
     "cgroups $(podman info --format '{{.Host.CgroupsVersion}}')," \
     "$("$COMPOSE_VENV/bin/podman-compose" version 2>/dev/null | awk 'tolower($0) ~ /^podman-compose version/ && !n++')" >&2
echo "$COMPOSE_VENV/bin/podman-compose"
