#!/usr/bin/env bash
# The GPU check of issue 30, in one call: the GPU's facts, `pytest -m cuda tests/cuda`, and
# benchmarks/bench_gpu.py, every result written under $OUT (default: out/gpu).
#
# On a GPU machine whose python3 already holds torch and transformers (nothing can be
# installed from the network there), qkv runs from src/ and its one missing dependency,
# array-api-compat, comes as a wheel in .whl/ (an ignored folder, carried to the machine),
# fetched beforehand where pip works:
#     pip download --no-deps --only-binary=:all: -d .whl array-api-compat==1.16.0
# Then, on the GPU machine:
#     bash benchmarks/gpu_check.sh
#     bash benchmarks/gpu_check.sh --tests-only          # rerun only the cuda tests
#     bash benchmarks/gpu_check.sh --bench-only attention # rerun only some bench sections
# On a machine without a GPU, check the script itself in seconds (tests skip, bench tiny):
#     bash benchmarks/gpu_check.sh --smoke
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [ "${1:-}" = "--smoke" ] && PY=.venv/bin/python
mode="${1:-all}"
shift || true
if [ "$mode" = "--smoke" ]; then  # a check of the script: no time limits worth keeping
    : "${TESTS_LIMIT:=900}" "${ATTENTION_LIMIT:=900}" "${OTHERS_LIMIT:=900}"
fi

if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/qkv-site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/qkv-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1

{
    date -u
    nvidia-smi 2>&1 || echo "nvidia-smi: not found"
    "$PY" - <<'PYEOF'
import platform, torch
import qkv
print("python", platform.python_version(), "torch", torch.__version__, "qkv", qkv.__version__)
try:
    import transformers
    print("transformers", transformers.__version__)
except ImportError:
    print("transformers: not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, f"{p.total_memory / 2**30:.0f} GiB", p.multi_processor_count, "SMs",
          "capability", torch.cuda.get_device_capability(0))
PYEOF
} > "$OUT/facts.txt" 2>&1
cat "$OUT/facts.txt"

if [ "$mode" = "all" ] || [ "$mode" = "--tests-only" ] || [ "$mode" = "--smoke" ]; then
    workers=14  # FlexAttention compiles on the CPU: one compilation per worker at a time
    [ "$mode" = "--smoke" ] && workers=0
    export TORCHINDUCTOR_COMPILE_THREADS=1
    limit=()  # one test's limit, where pytest-timeout is installed
    "$PY" -c "import pytest_timeout" 2> /dev/null && limit=(--timeout="${TEST_LIMIT:-180}")
    timeout "${TESTS_LIMIT:-240}" "$PY" -m pytest -m cuda tests/cuda -n "$workers" -v -rfEs \
        -p no:cacheprovider "${limit[@]}" "$@" > "$OUT/tests.log" 2>&1
    echo "cuda tests: exit $?" | tee -a "$OUT/tests.log"
    tail -n 40 "$OUT/tests.log"
fi

if [ "$mode" = "all" ] || [ "$mode" = "--bench-only" ] || [ "$mode" = "--smoke" ]; then
    smoke=()
    [ "$mode" = "--smoke" ] && smoke=(--smoke)
    sections=("$@")
    [ "$mode" = "--bench-only" ] || sections=()
    run() {  # name, limit (s), bench arguments
        local name=$1 limit=$2
        shift 2
        timeout "$limit" "$PY" benchmarks/bench_gpu.py "${smoke[@]}" --out "$OUT/$name.md" "$@" \
            >> "$OUT/bench.log" 2>&1
        echo "bench $name: exit $?" | tee -a "$OUT/bench.log"
    }
    if [ ${#sections[@]} -eq 0 ] || [[ " ${sections[*]} " == *" attention "* ]]; then
        shapes=(--shapes 8,16,128,4096 2,16,128,16384 1,16,128,32768)
        [ "$mode" = "--smoke" ] && shapes=()
        run attention "${ATTENTION_LIMIT:-200}" --only attention --repeats 5 "${shapes[@]}"
    fi
    rest=()
    for s in dispatch mha trace hf decode; do
        if [ ${#sections[@]} -eq 0 ] || [[ " ${sections[*]} " == *" $s "* ]]; then rest+=("$s"); fi
    done
    [ ${#rest[@]} -gt 0 ] && run others "${OTHERS_LIMIT:-110}" --only "${rest[@]}" --repeats 5
    cat "$OUT"/*.md 2>/dev/null
fi
