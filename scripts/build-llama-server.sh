#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the tree vendored in the PyPI sdist of llama-cpp-python, for the engine
# benchmark's second baseline (benchmarks/engine_throughput.py --llamacpp). Native CPU flags, server target only.
# The binary (plus the tree's convert_hf_to_gguf.py and gguf-py) is cached under
# ${PDSERVE_CACHE_DIR:-~/.cache/pdserve}/llama.cpp/<llama-cpp-python version>/ and reused on later runs.
# Usage: scripts/build-llama-server.sh [version]   (prints the cache directory on its last line)
set -euo pipefail
PY=${PYTHON:-python3}
VERSION=${1:-${LLAMA_CPP_PYTHON_VERSION:-0.3.36}}
CACHE=${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}/llama.cpp/$VERSION
if [[ -x $CACHE/bin/llama-server && -f $CACHE/convert_hf_to_gguf.py ]]; then echo "$CACHE"; exit 0; fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC=$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >&2
ninja -C "$WORK/build" -j "${BUILD_JOBS:-2}" llama-server >&2
mkdir -p "$CACHE.tmp/bin"
cp "$WORK/build/bin/llama-server" "$CACHE.tmp/bin/"
cp "$SRC/convert_hf_to_gguf.py" "$CACHE.tmp/"
cp -r "$SRC/gguf-py" "$CACHE.tmp/gguf-py"
[[ -d $SRC/conversion ]] && cp -r "$SRC/conversion" "$CACHE.tmp/" || true
rm -rf "$CACHE" && mv "$CACHE.tmp" "$CACHE"
echo "$CACHE"
