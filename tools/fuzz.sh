#!/usr/bin/env bash
# tools/fuzz.sh [target] [runs] [libFuzzer args...]
#
# Builds a libFuzzer harness of tools/fuzz in the asan-ubsan preset's tree (build-asan/:
# clang, ASan + UBSan + libFuzzer coverage on tetra's code; the same instrumented libraries
# the sanitizer suite runs) and fuzzes it for `runs` inputs (default 1000000). Targets:
#   job-spec (the default)  tools/fuzz/fuzz_job_spec.cpp: the job-spec parser and its --set
#                           overrides, from tools/fuzz/corpus (configs/*.yaml and
#                           hand-written override inputs) with tools/fuzz/job_spec.dict.
#   safetensors             tools/fuzz/fuzz_safetensors.cpp: a safetensors file through
#                           parse_safetensors, SafetensorsFile and a format-1 checkpoint,
#                           from tools/fuzz/corpus-safetensors with safetensors.dict.
#   checkpoint-meta         tools/fuzz/fuzz_checkpoint_meta.cpp: a checkpoint's meta.json
#                           through CheckpointReader, from tools/fuzz/corpus-checkpoint-meta
#                           with checkpoint_meta.dict.
# New inputs go to build-asan/fuzz/corpus (job-spec) or build-asan/fuzz/<target>/corpus,
# never into the repo; a crash, leak, timeout or OOM leaves its input beside that corpus
# (crash-*, leak-*, timeout-*, oom-*) and a non-zero exit. Reproduce one with
#   build-asan/bin/fuzz-<target> build-asan/fuzz/.../crash-...
# and add it to the target's tests (tests/core/test_config.cpp for job-spec,
# tests/core/test_checkpoint.cpp for the other two) once the reader is fixed.
#
# Guards: -timeout=10 (a hang), -rss_limit_mb=2048 (and so -malloc_limit_mb: one allocation
# past it is a finding), -max_total_time (FUZZ_MAX_S, default 3 hours) so a slow machine
# cannot run for ever.
#
# FUZZ_CHUNK=N runs the `runs` in fresh processes of N runs each (same growing corpus, a
# new seed each), stopping at the first finding. One long process slows down as it ages
# (here from ~500 to ~20 runs/s over 200,000 runs, in ASan's allocator); 25,000-run
# chunks kept ~160-290 runs/s.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
target=job-spec
if [[ $# -gt 0 && ! $1 =~ ^[0-9]+$ ]]; then
  target=$1
  shift
fi
case $target in
  job-spec) corpus=tools/fuzz/corpus dict=tools/fuzz/job_spec.dict max_len=4096 out=build-asan/fuzz ;;
  safetensors) corpus=tools/fuzz/corpus-safetensors dict=tools/fuzz/safetensors.dict max_len=4096
    out=build-asan/fuzz/safetensors ;;
  checkpoint-meta) corpus=tools/fuzz/corpus-checkpoint-meta dict=tools/fuzz/checkpoint_meta.dict
    max_len=8192 out=build-asan/fuzz/checkpoint-meta ;;
  *) echo "fuzz.sh: unknown target $target (job-spec, safetensors, checkpoint-meta)" >&2; exit 2 ;;
esac
runs=${1:-1000000}
shift || true

export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=1"
export LSAN_OPTIONS="suppressions=$root/tools/sanitizers/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$root/tools/sanitizers/ubsan.supp"

nice -n 19 cmake --preset asan-ubsan >/dev/null
nice -n 19 cmake --build build-asan -j2 --target "fuzz-$target"

mkdir -p "$out/corpus"
t0=$SECONDS
rc=0
fuzz() {  # fuzz RUNS SEED
  nice -n 19 "build-asan/bin/fuzz-$target" "$out/corpus" "$corpus" \
    -dict="$dict" -runs="$1" -seed="$2" -timeout=10 -rss_limit_mb=2048 \
    -max_total_time="${FUZZ_MAX_S:-10800}" -max_len="$max_len" -artifact_prefix="$out/" \
    -print_final_stats=1 "${extra[@]}"
}
extra=("$@")
if [[ -z "${FUZZ_CHUNK:-}" ]]; then
  fuzz "$runs" 0 || rc=$?
else
  done_runs=0 chunk=0
  while ((done_runs < runs && rc == 0 && SECONDS - t0 < ${FUZZ_MAX_S:-10800})); do
    chunk=$((chunk + 1))
    n=$((runs - done_runs < FUZZ_CHUNK ? runs - done_runs : FUZZ_CHUNK))
    fuzz "$n" "$chunk" >"$out/chunk.log" 2>&1 || rc=$?
    ran=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out/chunk.log")
    done_runs=$((done_runs + ${ran:-0}))
    echo "fuzz.sh: $target: chunk $chunk: ${ran:-0} runs, $done_runs in all, $((SECONDS - t0)) s"
  done
  ((rc == 0)) || cat "$out/chunk.log"
fi
echo "fuzz.sh: $target: $runs runs asked, $((SECONDS - t0)) s, exit $rc"
exit $rc
