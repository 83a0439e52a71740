#!/usr/bin/env bash
# Install llama.cpp's Python binding (llama-cpp-python, pinned) into a venv: the judge of the GGUF
# files `export --format gguf` writes, in the tests and in `make demo`.
#
#   utils/llama_cpp_install.sh .venv/bin/python
#
# PyPI has no wheel of it for this platform, only its source, which vendors llama.cpp's. The build
# (about 4 minutes on 2 cores) runs once per version, flags and machine type: its wheel is kept
# outside the checkout, in $LLAMA_CPP_CACHE (default ~/.cache/tpu-lora), and installed from there.
set -euo pipefail

VERSION=0.3.36
PYTHON=${1:?usage: $0 PATH/TO/VENV/bin/python}
# The library alone (no llama.cpp command-line tools, server or multimodal library), for any
# x86-64 or arm64 CPU of its kind rather than this one's instruction set, so the cached wheel
# runs on another machine of the same kind.
FLAGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
KEY=$(printf '%s %s %s' "$VERSION" "$(uname -m)" "$FLAGS" | sha256sum | cut -c1-12)
CACHE=${LLAMA_CPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tpu-lora}/llama-cpp-python-$VERSION-$KEY

if "$PYTHON" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    exit 0
fi
wheel=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    echo "building llama-cpp-python $VERSION from source (llama.cpp's library; once, into $CACHE)"
    mkdir -p "$(dirname "$CACHE")"
    staging=$(mktemp -d "$CACHE.partial-XXXXXX")
    trap 'rm -rf "$staging"' EXIT
    CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$PYTHON" -m pip wheel --quiet --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -w "$staging"
    rm -rf "$CACHE"
    mv "$staging" "$CACHE"  # complete or absent: an interrupted build leaves only a .partial- directory
    trap - EXIT
    wheel=$(ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl | head -n 1)
fi
"$PYTHON" -m pip install --quiet "$wheel"
