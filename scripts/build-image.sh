#!/usr/bin/env bash
# Build the real pdserve image from the real Dockerfile without Docker, and cache it as an OCI archive.
#
#   scripts/build-image.sh            # build if the inputs changed, print the archive path
#   scripts/build-image.sh --print    # print the archive path for the current inputs (no build)
#
# 1. A Debian bookworm base (python3, python3-venv, ca-certificates) from Debian packages with `mmdebstrap`, committed
#    as the local image localhost/pdserve-base:bookworm: there is no registry for base images here.
# 2. `buildah bud` (chroot isolation, no daemon) of ./Dockerfile with BASE_IMAGE=that base, torch from PyPI
#    (TORCH_INDEX_URL) and EXTRAS=operator,nixl,tracing; tagged ghcr.io/pdserve/pdserve:<chart appVersion> (the operator's
#    default image), so the chart and the operator use it as they would in a real cluster.
# 3. `buildah push` to ${PDSERVE_CACHE_DIR:-~/.cache/pdserve}/image/pdserve-<inputs hash>.oci.tar (oci-archive), named by a
#    hash of the build inputs (Dockerfile, .dockerignore, pyproject.toml, package sources, base packages, build args),
#    so an unchanged tree reuses it. `ctr -n k8s.io images import` loads it into containerd (tests/cluster).
# Needs root plus Debian's mmdebstrap and buildah (installed with apt when missing).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
CACHE="${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}/image"
APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/charts/pdserve/Chart.yaml")"
TAG="${PDSERVE_IMAGE_TAG:-ghcr.io/pdserve/pdserve:$APP_VERSION}"
BASE_TAG="localhost/pdserve-base:bookworm"
BASE_PACKAGES="python3,python3-venv,ca-certificates"
TORCH_INDEX_URL="${PDSERVE_TORCH_INDEX_URL:-https://pypi.org/simple}"
MIRROR="${PDSERVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
EXTRAS="operator,nixl,tracing"  # nixl: the KV transfer of crds/examples/smollm2-pd.yaml; tracing: OTLP export
log() { echo "[build-image] $*" >&2; }

# The build's inputs: every file of the build context and the settings below. README.md is left out on purpose: it is
# only the package's long description, and hashing it would rebuild a multi-GB image for every documentation edit.
BUILD_RECIPE="bookworm $BASE_PACKAGES $MIRROR $TORCH_INDEX_URL $TAG $EXTRAS"
inputs_hash() {
  (cd "$ROOT" && {
    printf '%s\n' "$BUILD_RECIPE"
    find Dockerfile .dockerignore pyproject.toml pdserve runtime router kv_connectors kernels operator \
      -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-16)
}
ARCHIVE="$CACHE/pdserve-$(inputs_hash).oci.tar"
if [[ "${1:-}" == "--print" ]]; then echo "$ARCHIVE"; exit 0; fi
if [[ -s "$ARCHIVE" ]]; then log "cached: $ARCHIVE"; echo "$ARCHIVE"; exit 0; fi

[[ $(id -u) -eq 0 ]] || { log "needs root (buildah with chroot isolation, mmdebstrap)"; exit 1; }
if ! command -v buildah >/dev/null || ! command -v mmdebstrap >/dev/null; then
  log "installing buildah and mmdebstrap with apt"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah mmdebstrap >/dev/null
fi
mkdir -p "$CACHE"
start=$SECONDS

# 1. The base image, from Debian packages (rebuilt only when missing from buildah's local store).
if ! buildah inspect --type image "$BASE_TAG" >/dev/null 2>&1; then
  log "mmdebstrap bookworm ($BASE_PACKAGES)"
  rootfs_tar="$(mktemp --suffix=.tar)"
  mmdebstrap --variant=minbase --include="$BASE_PACKAGES" --aptopt='APT::Install-Recommends "false"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$rootfs_tar" "$MIRROR" "deb ${MIRROR%/debian}/debian-security bookworm-security main"
  ctr="$(buildah from scratch)"
  buildah add --quiet "$ctr" "$rootfs_tar" /
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
  buildah commit --quiet --rm "$ctr" "$BASE_TAG" >/dev/null
  rm -f "$rootfs_tar"
fi

# 2. The real Dockerfile. The build's RUN steps see the host's CA bundle and pip settings (a TLS-inspecting egress
# proxy may sign PyPI's certificate) through volumes, which are not part of the image.
pipconf="$(mktemp)"; trap 'rm -f "$pipconf"' EXIT
{ echo "[global]"; echo "cert = /etc/ssl/certs/ca-certificates.crt"; echo "timeout = 180"
  [[ -n "${PIP_INDEX_URL:-}" ]] && echo "index-url = $PIP_INDEX_URL"; } > "$pipconf"
log "buildah bud $TAG (torch from $TORCH_INDEX_URL)"
# --layers: an edit of the final stage reuses the builder stage (several GB of wheels) from buildah's local store.
buildah bud --isolation=chroot --layers --pull=false --format=oci \
  --build-arg BASE_IMAGE="$BASE_TAG" --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" \
  --build-arg EXTRAS="$EXTRAS" \
  --volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
  --volume "$pipconf:/etc/pip.conf:ro" \
  -t "$TAG" -f "$ROOT/Dockerfile" "$ROOT"

# 3. Export (older archives of other inputs are removed: one image of several GB is enough).
rm -f "$CACHE"/pdserve-*.oci.tar "$CACHE"/*.tmp
buildah push --quiet "$TAG" "oci-archive:$ARCHIVE.tmp:$TAG"
mv "$ARCHIVE.tmp" "$ARCHIVE"
log "built $TAG in $((SECONDS - start))s: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1))"
echo "$ARCHIVE"
