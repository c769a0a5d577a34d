#!/usr/bin/env bash
# Fill .whl/ in the project checkout with the packages the GPU machine lacks (it has torch,
# numba, tokenizers, safetensors, tensorboard, matplotlib, transformers; not DeepSpeed, Hydra,
# webdataset, decord, nor pytest, which tools/gpu_check.sh runs the GPU tests with). Run from
# the project root on a machine that reaches the package index, bring .whl/ along to the GPU
# machine, and run the line this script prints last there first.
# DeepSpeed ships only as an sdist: it is built here into a pure-Python wheel (DS_BUILD_OPS=0;
# its ops are JIT-built there if a run needs them).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux2010_x86_64"
# pure-Python or cp312 wheels; versions that fit together (hydra-core needs omegaconf < 2.4)
python3 -m pip download -q --no-deps $plat -d .whl \
  pytest pluggy iniconfig packaging \
  pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson \
  hydra-core "omegaconf==2.3.0" webdataset braceexpand ${WITH_DECORD:+decord}
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" deepspeed "antlr4-python3-runtime==4.9.3"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w .whl "$tmp"/*.tar.gz
rm -rf "$tmp"
# pydantic pins one pydantic-core: keep only the pinned one
pin=$(unzip -p .whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
for w in .whl/pydantic_core-*.whl; do case "$w" in *"-$pin-"*) ;; *) rm -f "$w";; esac; done
du -sh .whl
echo 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 9;'
