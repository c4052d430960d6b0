#!/usr/bin/env bash
# Runs every libFuzzer target of a QKV_FUZZ build for a bounded time each, FUZZ_JOBS (2) at a
# time, and prints its figures (executions, coverage, corpus, crashes). Usage:
# fuzz/run.sh <build dir> <seconds each>
# The working corpus (build dir/corpus/<target>) starts from the committed seeds (fuzz/corpus/)
# and grows across runs; a target with a dictionary (fuzz/<target>.dict) gets it; crashes land
# in <build dir>/artifacts/ and fail the run.
set -euo pipefail
build=$1
seconds=$2
here=$(cd "$(dirname "$0")" && pwd)
# One OpenMP thread: the kernels' thread pool adds nothing to what is fuzzed, and the CI has 2 cores.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
mkdir -p "$build/artifacts" "$build/logs"
# Two targets at a time, one per core (each still runs its full time): 4 x 30 s in CI take 60 s.
jobs=${FUZZ_JOBS:-2}
if ! [[ $jobs =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz/run.sh: FUZZ_JOBS must be a whole number >= 1, not '$jobs'" >&2
  exit 2
fi

# Runs one target, then prints its figures (and the log's end when it failed) to its summary
# file; the exit status is the fuzzer's.
fuzz_one() {
  local target=$1 corpus="$build/corpus/$1" log="$build/logs/$1.log" summary="$build/logs/$1.summary"
  rm -f "$summary"
  mkdir -p "$corpus"
  # A target's dictionary (fuzz/<target>.dict: the grammar's words), when it has one.
  local dict=()
  if [ -f "$here/$target.dict" ]; then dict=(-dict="$here/$target.dict"); fi
  local result=0
  "$build/fuzz/$target" "${dict[@]}" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=3072 -print_final_stats=1 \
    -artifact_prefix="$build/artifacts/$target-" "$corpus" "$here/corpus/$target" >"$log" 2>&1 || result=$?
  local runs last cov ft corp
  runs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  cov=$(echo "$last" | grep -o 'cov: [0-9]*' | grep -o '[0-9]*' || echo "?")
  ft=$(echo "$last" | grep -o 'ft: [0-9]*' | grep -o '[0-9]*' || echo "?")
  corp=$(echo "$last" | grep -o 'corp: [0-9]*' | grep -o '[0-9]*' || echo "?")
  {
    echo "fuzz: $target: ${seconds} s, $runs executions, coverage $cov edges, $ft features, corpus $corp inputs, exit $result"
    if [ $result -ne 0 ]; then
      echo "fuzz: $target FAILED; the log's end ($log):"
      tail -40 "$log"
    fi
  } >"$summary"
  return $result
}

targets=(fuzz_attention fuzz_model_load fuzz_mask_expression fuzz_explorer_api fuzz_safetensors fuzz_tokenizer_json)
status=0
for ((first = 0; first < ${#targets[@]}; first += jobs)); do
  pids=()
  for target in "${targets[@]:first:jobs}"; do
    fuzz_one "$target" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for target in "${targets[@]:first:jobs}"; do
    cat "$build/logs/$target.summary" 2>/dev/null || echo "fuzz: $target: no summary (the run stopped early)"
  done
done
exit $status
