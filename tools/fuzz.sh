#!/usr/bin/env bash
# tools/fuzz.sh [runs] [libFuzzer args...]
#
# Builds fuzz-job-spec (tools/fuzz/fuzz_job_spec.cpp) in the asan-ubsan preset's tree
# (build-asan/: clang, ASan + UBSan + libFuzzer coverage on tetra's code; the same
# instrumented libraries the sanitizer suite runs) and fuzzes the job-spec parser and
# its --set overrides for `runs` inputs (default 1000000), starting from
# tools/fuzz/corpus (configs/*.yaml and hand-written override inputs) with the
# dictionary tools/fuzz/job_spec.dict. New inputs go to build-asan/fuzz/corpus, never
# into the repo; a crash, leak, timeout or OOM leaves its input in build-asan/fuzz/
# (crash-*, leak-*, timeout-*, oom-*) and a non-zero exit. Reproduce one with
#   build-asan/bin/fuzz-job-spec build-asan/fuzz/crash-...
# and add it to tests/core/test_config.cpp once the parser is fixed.
#
# Guards: -timeout=10 (a hang), -rss_limit_mb=2048, -max_total_time (FUZZ_MAX_S, default
# 3 hours) so a slow machine cannot run for ever.
#
# FUZZ_CHUNK=N runs the `runs` in fresh processes of N runs each (same growing corpus, a
# new seed each), stopping at the first finding. One long process slows down as it ages
# (here from ~500 to ~20 runs/s over 200,000 runs, in ASan's allocator); 25,000-run
# chunks kept ~160-290 runs/s.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
runs=${1:-1000000}
shift || true

export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=1"
export LSAN_OPTIONS="suppressions=$root/tools/sanitizers/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$root/tools/sanitizers/ubsan.supp"

nice -n 19 cmake --preset asan-ubsan >/dev/null
nice -n 19 cmake --build build-asan -j2 --target fuzz-job-spec

out=build-asan/fuzz
mkdir -p "$out/corpus"
t0=$SECONDS
rc=0
fuzz() {  # fuzz RUNS SEED
  nice -n 19 build-asan/bin/fuzz-job-spec "$out/corpus" tools/fuzz/corpus \
    -dict=tools/fuzz/job_spec.dict -runs="$1" -seed="$2" -timeout=10 -rss_limit_mb=2048 \
    -max_total_time="${FUZZ_MAX_S:-10800}" -max_len=4096 -artifact_prefix="$out/" \
    -print_final_stats=1
}
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
    echo "fuzz.sh: chunk $chunk: ${ran:-0} runs, $done_runs in all, $((SECONDS - t0)) s"
  done
  ((rc == 0)) || cat "$out/chunk.log"
fi
echo "fuzz.sh: $runs runs asked, $((SECONDS - t0)) s, exit $rc"
exit $rc
