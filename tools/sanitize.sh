#!/usr/bin/env bash
# tools/sanitize.sh [asan|tsan|all] [ctest args...]
#
# Builds tetra under a sanitizer preset (CMakePresets.json: clang, -O1 -g, only tetra's own
# targets instrumented) and runs the suite under it, with the suppressions and options of
# tools/sanitizers/. Builds run under nice -n 19 with -j2 (the machine is shared);
# TETRA_SAN_TARGETS="t1 t2" builds only those targets instead of everything.
#
#   asan  ASan + UBSan (preset asan-ubsan, build-asan/). Default labels: every label but
#         the tools tests that install the tree and build examples against it
#         (`-LE install`-like: tools_install_example is excluded; it rebuilds the project
#         with the system compiler, which is not the point of this run). Leaks are checked
#         (LSan) with lsan.supp for Open MPI's, hwloc's and LibTorch's process-lifetime
#         allocations; UBSan halts on the first report. mpirun tests get the same
#         environment: ranks started by a local mpirun inherit it, with
#         tools/sanitizers/keep_dsos.c preloaded so that Open MPI's components stay
#         mapped at exit and lsan.supp can name them.
#   tsan  TSan (preset tsan, build-tsan/). Default: the collectives label without the mpi
#         label (the local backend's thread ranks, progress threads, fusion, flight
#         recorder, hierarchical, launch). Real mpirun jobs and the tensor-heavy suites
#         (core's trainer, the strategies) are left out: Open MPI, LibTorch's intra-op pool, OpenMP and OpenBLAS are
#         uninstrumented, so TSan cannot see their synchronisation and what it would
#         report there is noise about code tetra does not own (tsan.supp lists those
#         libraries for the parts of them the chosen tests still reach).
#
# ctest args given after the mode replace the default selection (e.g. -R '^Config').
# With TETRA_SAN_TARGETS, the binaries not built show as *_NOT_BUILT tests: add
# -E NOT_BUILT to the selection, e.g.
#   TETRA_SAN_TARGETS="core_test_config collectives_test_local" \
#     tools/sanitize.sh asan -L 'core|collectives' -E 'NOT_BUILT|install'

set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
mode=${1:-all}
shift || true

san_env() {
  export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=0:allocator_may_return_null=0"
  export LSAN_OPTIONS="suppressions=$root/tools/sanitizers/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$root/tools/sanitizers/ubsan.supp"
  export TSAN_OPTIONS="suppressions=$root/tools/sanitizers/tsan.supp:second_deadlock_stack=1:halt_on_error=1:history_size=4"
  # Open MPI: ranks on one machine over shared memory; its memory hooks (the patcher that
  # intercepts malloc for registration caches) fight the sanitizers' own allocator.
  export OMPI_MCA_memory="^patcher"
  export OMPI_MCA_btl_vader_single_copy_mechanism=none
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # gtest_discover_tests runs each test binary at build time: it runs sanitized as well.
}

run_one() {
  local preset=$1 dir=$2
  shift 2
  local t0=$SECONDS
  nice -n 19 cmake --preset "$preset" >/dev/null
  if [[ -n "${TETRA_SAN_TARGETS:-}" ]]; then
    # shellcheck disable=SC2086
    nice -n 19 cmake --build "$dir" -j2 --target $TETRA_SAN_TARGETS
  else
    nice -n 19 cmake --build "$dir" -j2
  fi
  local t1=$SECONDS
  local rc=0
  nice -n 19 ctest --test-dir "$dir" --output-on-failure -j2 "$@" || rc=$?
  echo "sanitize.sh $preset: build $((t1 - t0)) s, tests $((SECONDS - t1)) s, ctest rc $rc"
  return $rc
}

san_env
rc=0
case "$mode" in
  asan|all)
    if (($#)); then args=("$@"); else args=(-E tools_install_example); fi
    # Open MPI unloads its components in MPI_Finalize, and LSan then cannot name the
    # frames of what they kept for the process (keep_dsos.c): keep them mapped.
    mkdir -p build-asan
    cc -O1 -shared -fPIC -o build-asan/keep_dsos.so tools/sanitizers/keep_dsos.c
    export LD_PRELOAD="$root/build-asan/keep_dsos.so${LD_PRELOAD:+:$LD_PRELOAD}"
    run_one asan-ubsan build-asan "${args[@]}" || rc=1
    unset LD_PRELOAD ;;&
  tsan|all)
    if (($#)); then args=("$@"); else
      args=(-L collectives -LE mpi)
    fi
    run_one tsan build-tsan "${args[@]}" || rc=1 ;;
  asan|tsan|all) ;;
  *) echo "usage: tools/sanitize.sh [asan|tsan|all] [ctest args...]" >&2; exit 2 ;;
esac
exit $rc
