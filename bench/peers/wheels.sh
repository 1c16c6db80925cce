#!/usr/bin/env bash
# Issue 14: the peer stacks' packages that the GPU machine lacks (Unsloth and what it imports, TRL, datasets,
# bitsandbytes, Liger), unzipped into ONE folder, ./.peers_site (git-ignored), small enough to carry (< 60 MiB;
# a call carries 64 MiB). Run from the repo root on a machine with PyPI:   bash bench/peers/wheels.sh
# On the GPU:  export PYTHONPATH=.:$PWD/.peers_site HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
#
# Left out (already on the GPU machine, ../shared/GPU.md and the device docs' package list): torch 2.11,
# transformers 5.17, peft 0.21, accelerate 1.15, triton 3.6, numpy, safetensors, huggingface_hub, tokenizers,
# pyyaml, packaging, psutil, pyarrow, pandas, fsspec, xxhash, requests, httpx, aiohttp, tqdm, rich, sentencepiece,
# protobuf, typing-extensions, typing-inspect, regex, filelock. Not needed for training (GPU.md): diffusers, torchao,
# hf_transfer, xformers.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -f fitune/__init__.py ] || { echo "run from the fitune checkout" >&2; exit 1; }
if [ -d .git/info ]; then
  grep -qx '/.peers_site/' .git/info/exclude 2>/dev/null || echo '/.peers_site/' >> .git/info/exclude
  grep -qx '/.peers_whl/' .git/info/exclude 2>/dev/null || echo '/.peers_whl/' >> .git/info/exclude
fi
PKGS=(
  unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5
  tyro docstring-parser typeguard shtab dill multiprocess cut_cross_entropy msgspec json5 structlog nest_asyncio
  pydantic pydantic-core annotated-types typing-inspection importlib_metadata eval-type-backport
  bitsandbytes==0.50.2 liger-kernel==0.8.5
)
PY=${PYTHON:-python3}
rm -rf .peers_whl .peers_site
mkdir -p .peers_whl .peers_site
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .peers_whl "${PKGS[@]}"
ls .peers_whl
for w in .peers_whl/*.whl; do
  "$PY" -m zipfile -e "$w" .peers_site
done
# unsloth's web app (training never imports it); bitsandbytes' libraries for CUDA other than 13 (the GPU runs 13)
# and for ROCm / XPU (the CPU library stays)
rm -rf .peers_site/studio .peers_site/unsloth/studio
find .peers_site -name 'libbitsandbytes_cuda*.so' ! -name 'libbitsandbytes_cuda13*' -delete
find .peers_site \( -name 'libbitsandbytes_rocm*.so' -o -name 'libbitsandbytes_xpu*.so' \) -delete
find .peers_site -name '__pycache__' -type d -prune -exec rm -rf {} +
rm -rf .peers_whl
echo "top level:"
ls .peers_site
size=$(du -sb .peers_site | cut -f1)
echo "total: $((size / 1048576)) MiB ($size bytes)"
[ "$size" -lt $((60 * 1048576)) ] || { echo "too big to carry (limit 60 MiB)" >&2; exit 1; }
