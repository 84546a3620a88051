#!/usr/bin/env bash
# The deployment, run for real: Podman builds the image and runs every CPU service of
# docker-compose.yml through podman-compose, as a user would; any failed step fails the check.
#
#     SKETCHY_DATA=/path/to/sketchy-mini deploy/check.sh        (root, Debian 12)
#
#  1. engine       deploy/engine.sh: podman, runc, podman-compose
#  2. base image   deploy/local-base.sh (Debian 12 by debootstrap), unless BASE_IMAGE is set
#  3. build        the cpu image; then the gpu image, build only (CHECK_GPU_BUILD=0 skips it)
#  4. no index     `up -d api` on empty volumes: never healthy, exits 2, says why in its log
#  5. train        `run --rm train` (training.cdk on the training data, cpu preset, writing
#                  the model bundle; then index.build of the photo folder)
#  6. volumes      bundle, checkpoint and index in the runs volume, owned by uid 1000; the
#                  photos and the training data read only
#  7. index        `run --rm index` rebuilds the index
#  8. api          `up -d api`, healthy, its only mounts the runs volume and the photos (no
#                  training data), POST /retrieve through the published port (answers well
#                  formed; precision@5 of the first sketch of each served class >= 0.5), uid 1000
#  9. rebuild      `run --rm index` again and `restart api`: healthy, answers again
# 10. down         `down -v`; the training data and the photos are as they were
#
# The photos served are not the training data's folder: PHOTO_CLASSES (40) classes of its
# photos copied into one flat folder (no class folders; some names with spaces), which the
# answers are judged against by a labels file.
#
# Settings (environment): SKETCHY_DATA (required: the photo/ and sketch/ folders),
# BASE_IMAGE (an image to build from instead of the local Debian one), LOCAL_PYPI (a folder
# with a PEP 503 index in simple/, mounted for the builds only and passed as TORCH_INDEX;
# default: the first local folder index (file://.../simple) the host's pip is configured with
# that holds torch; "" for PyPI alone), CHECK_GPU_BUILD (1),
# KEEP_IMAGES (1: keep sketchsvd:cpu/gpu and the base image for the next run's layer cache),
# CHECK_TRAIN_ARGS (the compose file's TRAIN_ARGS for `train`; default none: the quick start's
# model, whose 200 epochs take about 4 minutes on 2 cores once the features are extracted),
# CHECK_MIN_PRECISION (0.5: the least precision@5 of the first sketch of every served class
# against the served photo folder; the quick start's model scored 0.830 on the 40 classes'
# folder, where photos drawn at random score 0.025), PHOTO_CLASSES (40).
# Everything else it makes (containers, volumes, the network, the pod) is removed at the end,
# also when a step fails. Logs of each step: CHECK_LOGS (a new folder under /var/tmp).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PROJECT=sketchsvd-check
CHECK_GPU_BUILD=${CHECK_GPU_BUILD:-1}
KEEP_IMAGES=${KEEP_IMAGES:-1}
CHECK_LOGS=${CHECK_LOGS:-$(mktemp -d /var/tmp/sketchsvd-check.XXXXXX)}
mkdir -p "$CHECK_LOGS"
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-300}
K=5
MIN_PRECISION=${CHECK_MIN_PRECISION:-0.5}

die() { echo "FAILED: $*" >&2; exit 1; }

step_start=$SECONDS
step() {  # step NAME: prints the time the previous step took, then the new name
    echo "   ($((SECONDS - step_start)) s)"
    step_start=$SECONDS
    echo "== $*"
}

quiet() {  # quiet LOG CMD...: run CMD with its output in LOG; its tail on failure
    local log="$CHECK_LOGS/$1"
    shift
    if ! "$@" >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        die "$* (log: $log)"
    fi
}

preconditions() {
    [[ $(id -u) == 0 ]] || die "needs root (podman as root, apt-get, debootstrap)"
    [[ -f /etc/debian_version ]] || die "needs Debian (apt-get, debootstrap)"
    [[ -n "${SKETCHY_DATA:-}" && -d "$SKETCHY_DATA/photo" && -d "$SKETCHY_DATA/sketch" ]] \
        || die "SKETCHY_DATA=${SKETCHY_DATA:-} has no photo/ and sketch/ folders"
    TRAIN_DATA=$(realpath "$SKETCHY_DATA")
    PHOTOS=$(mktemp -d /var/tmp/sketchsvd-photos.XXXXXX)
    LABELS=$PHOTOS.labels.json
    export TRAIN_DATA PHOTOS
    if [[ -z "${LOCAL_PYPI+set}" ]]; then  # the host pip's own local index that holds torch
        local url
        for url in $(python3 -m pip config get global.extra-index-url 2>/dev/null); do
            [[ "$url" == file://*/simple && -f "${url#file://}/torch/index.html" ]] \
                && { LOCAL_PYPI=$(dirname "${url#file://}"); break; }
        done
    fi
    LOCAL_PYPI=${LOCAL_PYPI:-}
    SKETCHSVD_ADDRESS=127.0.0.1
    SKETCHSVD_PORT=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
    export SKETCHSVD_ADDRESS SKETCHSVD_PORT
    TRAIN_ARGS=${CHECK_TRAIN_ARGS-}
    export TRAIN_ARGS
}

# A fingerprint of the data folders: every path, size and modification time.
data_fingerprint() {
    find "$TRAIN_DATA" "$PHOTOS" -printf '%p %s %T@\n' | sort | sha256sum | cut -d' ' -f1
}

# The photo folder served: the photos of the first PHOTO_CLASSES classes of the training
# data, flat, every other class's files named "<class> <file>" (a space in the name), and
# LABELS, {file name: class}, for the probe. Readable by the image's user.
flat_photos() {
    python3 - "$TRAIN_DATA/photo" "$PHOTOS" "$LABELS" "${PHOTO_CLASSES:-40}" <<'PY'
import json, shutil, sys
from pathlib import Path
src, dst, labels, n = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
out = {}
for i, cls in enumerate(sorted(d.name for d in src.iterdir() if d.is_dir())[:n]):
    for f in sorted((src / cls).iterdir()):
        name = f"{cls} {f.name}" if i % 2 else f.name
        shutil.copyfile(f, dst / name)
        out[name] = cls
labels.write_text(json.dumps(out, indent=1))
print(f"{len(out)} photos of {n} classes, flat, in {dst}")
PY
    chmod 755 "$PHOTOS"
    chmod 644 "$PHOTOS"/*
}

# podman-compose leaves out a service of a profile that is not enabled, even when it is named
compose() {
    "$PODMAN_COMPOSE" -p "$PROJECT" -f docker-compose.yml --profile train --profile index "$@"
}

container_of() {  # the container of a compose service, running or not
    podman ps -a --filter "label=io.podman.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | awk 'NR == 1'
}

cleanup() {
    local status=$?
    if [[ -n "${PODMAN_COMPOSE:-}" ]]; then
        compose down -v -t 5 >"$CHECK_LOGS/down-on-exit.log" 2>&1 || true
        podman ps -aq --filter "label=io.podman.compose.project=$PROJECT" \
            | xargs -r podman rm -f -t 0 >/dev/null 2>&1 || true
        podman volume ls -q --filter "label=io.podman.compose.project=$PROJECT" \
            | xargs -r podman volume rm -f >/dev/null 2>&1 || true
        podman pod rm -f "pod_$PROJECT" >/dev/null 2>&1 || true
        podman network rm -f "${PROJECT}_default" >/dev/null 2>&1 || true
    fi
    rm -rf "$PHOTOS" "$LABELS"
    if [[ "$KEEP_IMAGES" == 0 ]]; then
        podman rmi -f sketchsvd:cpu sketchsvd:gpu >/dev/null 2>&1 || true
    fi
    if ((status == 0)); then
        rm -rf "$CHECK_LOGS"
    else
        echo "logs kept in $CHECK_LOGS" >&2
    fi
}

build() {  # build SERVICE TAG: the image of a compose service, by podman-compose
    local service=$1 tag=$2 old new mounts=(-v /etc/ssl/certs:/etc/ssl/certs:ro)
    local args=(--build-arg "TORCH_INDEX=")
    [[ -n "$LOCAL_PYPI" ]] && mounts+=(-v "$LOCAL_PYPI:/wheels:ro") \
        && args=(--build-arg "TORCH_INDEX=file:///wheels/simple")
    args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
    old=$(podman image inspect "$tag" --format '{{.Id}}' 2>/dev/null || true)
    # HEALTHCHECK needs the docker format; the registries are reached from the host's network
    # with the host's certificate authorities.
    BUILDAH_FORMAT=docker quiet "build-$service.log" "$PODMAN_COMPOSE" -p "$PROJECT" \
        -f docker-compose.yml --profile gpu --podman-build-args "--network host ${mounts[*]}" \
        build "${args[@]}" "$service"
    new=$(podman image inspect "$tag" --format '{{.Id}}')
    if [[ -n "$old" && "$old" != "$new" ]]; then  # the previous build, now untagged
        podman rmi "$old" >/dev/null 2>&1 || true
    fi
    echo "   $tag: $(podman image inspect "$tag" --format '{{.Size}}' | numfmt --to=si)B," \
         "torch $(podman run --rm --network none --no-healthcheck --entrypoint python "$tag" -c \
                  'import torch; print(torch.__version__)')"
}

wait_healthy() {  # wait_healthy CONTAINER: run the image's healthcheck until it passes
    # Podman schedules healthchecks with systemd timers; where systemd is absent this loop
    # is the timer (`podman healthcheck run` runs the container's own check command).
    local ctr=$1 deadline=$((SECONDS + HEALTH_TIMEOUT))
    until podman healthcheck run "$ctr" >/dev/null 2>&1; do  # exit 0: healthy
        if ((SECONDS > deadline)); then
            podman logs --tail 30 "$ctr" >&2
            die "$ctr not healthy after $HEALTH_TIMEOUT s"
        fi
        sleep 5
    done
    [[ "$(podman inspect "$ctr" --format '{{.State.Health.Status}}')" == healthy ]] \
        || die "$ctr: the healthcheck passed but the health status is not healthy"
}

probe() {  # probe SKETCH: POST it to the published port, check the answer
    python3 deploy/probe.py --url "http://$SKETCHSVD_ADDRESS:$SKETCHSVD_PORT" \
        --photos "$PHOTOS" --labels "$LABELS" --sketch "$1" --k "$K" \
        --sketches "$TRAIN_DATA/sketch" --classes "${PHOTO_CLASSES:-40}" \
        --min-precision "$MIN_PRECISION" | sed 's/^/   /'
}

runs_volume() { podman volume inspect "${PROJECT}_runs" --format '{{.Mountpoint}}'; }

index_fingerprint() {  # the index folder's paths, sizes and times
    find "$(runs_volume)/index" -printf '%P %s %T@\n' | sort | sha256sum | cut -d' ' -f1
}

check_no_index() {  # api on empty volumes: exits 2 with the reason, never healthy
    local since ctr id log="" codes="" deadline=$((SECONDS + 180))
    since=$(date -u +%Y-%m-%dT%H:%M:%SZ)  # podman 4.3's `events --stream=false` hangs without it
    quiet up-empty.log compose up -d api
    ctr=$(container_of api)
    id=$(podman inspect "$ctr" --format '{{.Id}}')
    # Its restart policy starts it again at once, so the exit codes are in the events.
    until [[ "$log" == *"build the index first"* ]] && grep -qx 2 <<<"$codes"; do
        ((SECONDS < deadline)) || die "api without an index: no exit 2 with the reason in its log"
        sleep 3
        log=$(podman logs "$ctr" 2>&1)
        codes=$(timeout 60 podman events --stream=false --since "$since" \
                --filter "container=$id" --filter event=died --format '{{.ContainerExitCode}}')
    done
    awk '/build the index first/ && !n++ { print "   log: " substr($0, 1, 150) }' <<<"$log"
    local health
    ! health=$(podman healthcheck run "$ctr" 2>&1) || die "api without an index reported healthy"
    echo "   exit status $(tr '\n' ' ' <<<"$codes")(restarted by its policy" \
         "$(podman inspect "$ctr" --format '{{.RestartCount}}') times); healthcheck: $health"
    quiet down-empty.log compose down -t 5  # the volumes stay: train writes into them next
}

check_volumes() {  # what train and index wrote, as whom; and the photos stay read only
    local runs
    runs=$(runs_volume)
    [[ -s "$runs/cdk/checkpoint.pt" ]] || die "no checkpoint in the runs volume"
    [[ -s "$runs/cdk/model/model.json" ]] || die "no model bundle in the runs volume"
    echo "   model bundle: $(find "$runs/cdk/model" -mindepth 1 -printf '%f ')"
    [[ -n "$(find "$runs/index" -mindepth 1 -print -quit)" ]] || die "no index in the runs volume"
    local owners
    owners=$(find "$runs" -mindepth 1 -printf '%U\n' | sort -u | tr '\n' ' ')
    [[ "$owners" == "1000 " ]] || die "files in the runs volume owned by uid $owners, not 1000 alone"
    echo "   runs volume: $(du -sh "$runs" | cut -f1), all files owned by uid 1000"
    echo "   cdk/: $(find "$runs/cdk" -mindepth 1 -maxdepth 1 -printf '%f ')"
    echo "   index/: $(find "$runs/index" -mindepth 1 -maxdepth 1 -printf '%f ')"
    if compose run -T --rm index sh -c 'touch /photos/.written' \
            >"$CHECK_LOGS/touch.log" 2>&1; then
        die "the photo mount is writable"
    fi
    grep -q "Read-only file system" "$CHECK_LOGS/touch.log" \
        || die "writing to the photo mount failed for another reason: $(cat "$CHECK_LOGS/touch.log")"
    echo "   photo mount: $(grep -m 1 -o "Read-only file system" "$CHECK_LOGS/touch.log")"
}

check_api() {  # healthy, no training data, answers through the published port, uid 1000
    local ctr mounts
    ctr=$(container_of api)
    wait_healthy "$ctr"
    echo "   $ctr healthy; published $(podman port "$ctr" | tr '\n' ' ')"
    mounts=$(podman inspect "$ctr" --format '{{range .Mounts}}{{.Destination}}:{{.RW}} {{end}}')
    [[ "$(tr ' ' '\n' <<<"$mounts" | sed '/^$/d' | sort | tr '\n' ' ')" == "/photos:false /runs:false " ]] \
        || die "api mounts $mounts; expected the runs volume and the photos, read only"
    ! podman inspect "$ctr" --format '{{range .Mounts}}{{.Source}} {{end}}' \
        | grep -qF "$TRAIN_DATA" || die "api has the training data mounted"
    echo "   mounts: $mounts(no training data)"
    probe "$SKETCH"
    # real, effective, saved and filesystem uid of each process, read from /proc on the host
    local pid uids=""
    for pid in $(podman top "$ctr" hpid | tail -n +2); do
        [[ -r "/proc/$pid/status" ]] || continue  # ended meanwhile (a healthcheck's exec)
        uids+=$(awk '/^Uid:/ { print $2, $3, $4, $5 }' "/proc/$pid/status")$'\n'
    done
    uids=$(sort -u <<<"$uids" | sed '/^$/d' | tr '\n' ' ')
    [[ "$uids" == "1000 1000 1000 1000 " ]] || die "api processes run as uids $uids"
    echo "   processes: $(podman top "$ctr" hpid | tail -n +2 | wc -l), uid 1000 (real, effective," \
         "saved, fs): $(podman top "$ctr" user args | awk 'NR == 2 { print substr($0, 1, 60) }')"
}

main() {
    preconditions
    trap cleanup EXIT
    flat_photos | sed 's/^/   /'
    local fingerprint total_start=$SECONDS
    fingerprint=$(data_fingerprint)
    trap 'exit 130' INT TERM  # cleanup runs on the way out
    echo "== engine"
    PODMAN_COMPOSE=$(deploy/engine.sh 2>"$CHECK_LOGS/engine.log" | tail -n 1) \
        || { cat "$CHECK_LOGS/engine.log" >&2; die "engine setup"; }
    grep -v WARNING "$CHECK_LOGS/engine.log" | sed 's/^/   /'  || true
    compose down -v -t 0 >/dev/null 2>&1 || true  # a run that was killed

    step "base image"
    if [[ -z "${BASE_IMAGE:-}" ]]; then
        BASE_IMAGE=localhost/sketchsvd-base:bookworm
        deploy/local-base.sh "$BASE_IMAGE" | sed 's/^/   /'
    fi

    step "build cpu image (base $BASE_IMAGE, torch index ${LOCAL_PYPI:-PyPI})"
    build api sketchsvd:cpu
    if [[ "$CHECK_GPU_BUILD" == 1 ]]; then
        step "build gpu image (build only: no GPU here)"
        build train-gpu sketchsvd:gpu
    fi

    SKETCH=$(find "$TRAIN_DATA/sketch" -name '*.png' | sort | awk 'NR == 1')
    step "api without an index"
    check_no_index

    step "train: training.cdk --preset cpu $TRAIN_ARGS, then index.build"
    quiet train.log compose run -T --rm train
    grep -E "mAP@all|photos, kind=|built in" "$CHECK_LOGS/train.log" | tail -n 5 | sed 's/^/   /' || true

    step "volumes"
    check_volumes

    step "index: index.build"
    quiet index.log compose run -T --rm index

    step "api: up -d, health, POST /retrieve on port $SKETCHSVD_PORT"
    quiet up.log compose up -d api
    check_api

    step "rebuild the index, restart api"
    local before
    before=$(index_fingerprint)
    quiet index2.log compose run -T --rm index
    [[ "$(index_fingerprint)" != "$before" ]] || die "the index was not rebuilt"
    quiet restart.log compose restart api
    check_api

    step "down -v"
    quiet down.log compose down -v -t 10
    [[ -z "$(podman ps -aq --filter "label=io.podman.compose.project=$PROJECT")" ]] \
        || die "containers left after down"
    ! podman volume exists "${PROJECT}_runs" || die "the runs volume is left after down -v"
    [[ "$(data_fingerprint)" == "$fingerprint" ]] || die "the data folders changed"
    echo "   no containers or volumes left; $TRAIN_DATA and $PHOTOS unchanged"
    step "passed in $((SECONDS - total_start)) s"
}

# Sourced (`. deploy/check.sh`), it only defines the steps.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
