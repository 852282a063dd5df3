#!/usr/bin/env bash
# The pod sandbox ("pause") image for the one-node cluster, as an OCI archive: a static build of pause.c, tagged
# registry.k8s.io/pause:3.10 (containerd's sandbox_image in tests/cluster). Cached by the source's hash; prints the path.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}/image"
TAG="registry.k8s.io/pause:3.10"
ARCHIVE="$CACHE/pause-$(cat "$HERE/pause.c" "$0" | sha256sum | cut -c1-16).oci.tar"
if [[ "${1:-}" == "--print" ]]; then echo "$ARCHIVE"; exit 0; fi
[[ -s "$ARCHIVE" ]] && { echo "$ARCHIVE"; exit 0; }
mkdir -p "$CACHE"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
gcc -static -Os -s -o "$tmp/pause" "$HERE/pause.c"
ctr="$(buildah from scratch)"
buildah copy --quiet "$ctr" "$tmp/pause" /pause
buildah config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
buildah commit --quiet --rm "$ctr" "$TAG" >/dev/null
buildah push --quiet "$TAG" "oci-archive:$ARCHIVE.tmp:$TAG"
mv "$ARCHIVE.tmp" "$ARCHIVE"
echo "$ARCHIVE"
