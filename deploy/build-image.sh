#!/usr/bin/env bash
# Builds the TridentMQ image (and, where the official ones cannot be pulled, local redis and haproxy images).
#
#   deploy/build-image.sh                 # tridentmq:latest on the official python:3.11-slim if it can be had,
#                                         # else on a Debian base made here with debootstrap
#   TRIDENTMQ_BASE=local deploy/build-image.sh   # always the local Debian base (no registry needed)
#   TRIDENTMQ_PULL=0 ...                  # never try a registry; TRIDENTMQ_IMAGE names the result
#
# Steps: (a) the local base images (Debian bookworm + python3.11, + redis-server, + haproxy), made with
# debootstrap and `docker import`, each reused when its tag exists; (b) wheels of the locked dependencies and
# of the workspace built on this host into deploy/wheelhouse (containers need no package index); (c) `docker
# build` of deploy/Dockerfile installing those wheels with --no-index. Needs root (debootstrap), docker, uv.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# One build at a time: two at once would each make the base images, and one would delete the wheels the
# other just built (the end-to-end test modules build on separate test workers).
exec 9>"$here/.build.lock"
flock 9
export PATH="/usr/sbin:/sbin:$PATH"
image="${TRIDENTMQ_IMAGE:-tridentmq:latest}"
base="${TRIDENTMQ_BASE:-auto}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
suite=bookworm  # its python3 is 3.11, as the lock expects

pull="${TRIDENTMQ_PULL:-1}"  # 0: never ask a registry (none is reachable)

have_image() { docker image inspect "$1" >/dev/null 2>&1; }
# The image is here, or the registry gave it.
have_or_pull() { have_image "$1" || { [ "$pull" != 0 ] && docker pull -q "$1" >/dev/null 2>&1; }; }

# A Debian root file system with these extra packages, imported as an image (kept: later runs reuse it).
local_image() {
    local tag="$1" packages="$2" cmd="$3"
    have_image "$tag" && return 0
    local rootfs
    rootfs="$(mktemp -d)"
    echo "building $tag with debootstrap ($packages)" >&2
    debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >&2
    chroot "$rootfs" apt-get clean
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
        "$rootfs"/usr/share/locale/* "$rootfs"/var/cache/debconf/*-old
    tar -C "$rootfs" -c . | docker import --change "CMD $cmd" - "$tag" >/dev/null
    rm -rf "$rootfs"
}

# (a) base images
if [ "$base" = auto ]; then
    if have_or_pull python:3.11-slim; then
        base=python:3.11-slim
    else
        base=local
    fi
fi
if [ "$base" = local ]; then
    base=tridentmq-base:bookworm
    local_image "$base" python3,python3-venv '["python3"]'
fi
if ! have_or_pull redis:7; then
    local_image tridentmq-redis:bookworm redis-server '["redis-server","--protected-mode","no"]'
    docker tag tridentmq-redis:bookworm redis:7
fi
if ! have_or_pull haproxy:2.6; then
    local_image tridentmq-haproxy:bookworm haproxy '["haproxy","-f","/usr/local/etc/haproxy/haproxy.cfg"]'
    docker tag tridentmq-haproxy:bookworm haproxy:2.6
fi

# (b) wheels: the locked third-party dependencies (python-qpid-proton is built from source here) and the
# workspace's own packages
wheels="$here/wheelhouse"
mkdir -p "$wheels"
cd "$root"
uv export --frozen --no-dev --no-emit-workspace --no-hashes --no-header \
    --package tridentmq-core --package tridentmq-stomp --package tridentmq-mqtt --package tridentmq-amqp \
    >"$wheels/requirements.txt"
# pip from uv's tool cache, on a Python 3.11 as in the image (the binary wheels are built for it)
pip=(uv tool run --quiet --python 3.11 --from pip pip)
# Every locked package whatever its environment marker: the image's Python (3.11.2 in Debian) may need one
# that this host's does not (async-timeout below 3.11.3); the install in the image applies the markers.
sed 's/ *;.*//' "$wheels/requirements.txt" >"$wheels/all-platforms.txt"
"${pip[@]}" wheel --quiet --disable-pip-version-check --no-deps -r "$wheels/all-platforms.txt" -w "$wheels" >&2
rm -f "$wheels"/tridentmq*.whl
for package in shared services/core-broker services/gateway-stomp services/gateway-mqtt services/gateway-amqp; do
    uv build --quiet --wheel --out-dir "$wheels" "$package" >&2
done

# (c) the image
docker build --build-arg "BASE=$base" -t "$image" -f "$here/Dockerfile" "$here" >&2
echo "$image built on $base ($(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1/1e6}'))"
