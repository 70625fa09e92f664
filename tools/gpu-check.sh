#!/usr/bin/env bash
# tools/gpu-check.sh: tetra's check on a machine with one NVIDIA GPU (H100, H200) and a
# CUDA PyTorch, which reaches no package registry: one call of at most 10 minutes
# (budget 560 s), with time left to call it again on the same machine.
#
# What it needs there: a python3 whose torch has CUDA and the C++11 ABI (PyTorch 2.x's
# wheels: LibTorch's headers, libraries and CMake package, NCCL from nvidia-nccl-cu*),
# nvcc of the same CUDA major version, cmake >= 3.18, g++, ninja (else make), tar.
# Everything else comes in the carry.
#
# What it carries (made here, on Debian 12 with apt, root or sudo):
#     tools/gpu-check.sh --prepare [DIR]          (DIR: build-gpu-carry)
#   DIR/debs: the Debian packages tetra needs besides LibTorch, kept compressed (Open MPI
#   with PMIx, hwloc, libevent, UCX, ...; yaml-cpp, CLI11, nlohmann-json, GoogleTest,
#   zlib's headers, pkgconf, the Fashion-MNIST data): about 43 MB, 30 MB of which are
#   the data. Not Boost (tetra has a CRC-32C of its own where Boost is not found), not
#   Debian's Gloo headers (the wheel's own, or no gloo backend). DIR/COMMIT: the commit
#   of the tree (the GPU machine gets it without .git). --prepare prints the carry file by
#   file and, beside it, the working tree's size: together under the 64 MiB of a call.
#   Run it before each call (it downloads only when the packages changed).
#
# How to call it, in one command of at most 10 minutes (the device tool):
#     run(command="tools/gpu-check.sh --out $OUT", carry=["build-gpu-carry"], timeout_s=600)
#   A second call on the same warm machine reuses the unpacked packages, the configured
#   build and what it compiled (the build folder, build-gpu/, is git-ignored and stays),
#   so it runs the figures again, or finishes a build the first call ran out of time in.
#
# What it does there, step by step, each with its own time limit inside the budget; a
# failed step skips only the steps that need it:
#   environment      the GPU, the python3 with CUDA torch (tools/gpu/probe_torch.py:
#                    version, CUDA, ABI, CMake prefix, NCCL, Gloo headers; read from its
#                    stdout alone), cmake, g++, ninja, nvcc
#   matmul           a bf16 8192^3 matmul through torch: the measured ceiling for MFU
#   unpack, mpirun   the carry under build-gpu/prefix; the relocated Open MPI: ompi_info's
#                    prefix, mpicc, mpirun -np 2 of tools/gpu/mpi_hello.c
#   configure, build build-gpu/cmake against that torch and the prefix (Release, Ninja
#                    when there is one, -j nproc); only train and the cuda tests' binaries;
#                    ninja -k 0 (make -k): every compile error of the tree in one call
#   binaries         train --version and what it loads (libmpi must be the carried one)
#   ctest-cuda       ctest -L cuda: the CUDA-labelled tests (a skip is a failure here)
#   quickstart       configs/quickstart.yaml on train.device=cuda: test accuracy >= 0.88
#   gpt-bf16         a 12-layer d1024 GPT (~152M parameters) at bf16 on one GPU:
#                    samples/s and MFU against the datasheet (989 TFLOP/s dense bf16, H100
#                    SXM and H200) and against the matmul measured above (tools/gpu/mfu.py);
#                    fails on a loss that is not finite or a skipped step
#   hf-gpt2          a small GPT exported by `ckpt export --format hf` and loaded by
#                    transformers (tools/gpu/hf_check.py): logits within 1e-3 of tetra's,
#                    the same greedy text as `generate`, the tokenizer giving the bytes;
#                    skipped where transformers is missing
#   zero3-*          configs/zero3-gpt.yaml: ZeRO-3 over 2 ranks sharing the GPU (gloo;
#                    launched by the carried mpirun, else by the environment rendezvous)
#                    against one process: final loss within 1e-3
#   nccl-two-ranks   ZeRO-3 over 2 ranks on NCCL; on one GPU NCCL refuses ("Duplicate GPU
#                    detected"), and the summary says it needs 2 GPUs
#
# Options:
#   --out DIR        write there gpu-check-summary.json and gpu-check-logs.tar.gz (every
#                    step's log, the build log, the runs' metrics); the caller passes the
#                    folder it collects ($OUT)
#   --carry DIR      the carried folder (default build-gpu-carry)
#   --budget S       seconds for the whole check (default 560)
#   --work DIR       where the prefix, logs and runs go (default build-gpu)
#   --build-dir DIR  the CMake build (default WORK/cmake)
#   --no-build       no CMake: use the binaries already in --build-dir (a rehearsal)
#   --no-gloo        build without the gloo backend (TETRA_WITH_GLOO=OFF); also chosen by
#                    itself when the torch ships no Gloo headers
#   --device D       cuda (default), or cpu: the rehearsal on a machine without a GPU
#                    (every step's limit x4, a small GPT; the cuda tests' skip is expected)
#   --launcher L     how the 2-rank runs start: auto (mpirun when the mpirun step passed,
#                    else env), mpirun, env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
#   --jobs N         build jobs (default nproc)
#   -h, --help       this text
# The rehearsal here, under unshare -m with the system's Open MPI, PMIx, /etc/openmpi and
# Boost headers hidden so the carried Open MPI is the one used (tools/gpu/rehearse.sh):
#     tools/gpu/rehearse.sh --no-build --build-dir build --out /tmp/gpu-rehearsal
# (without --no-build it configures and builds too, in --work's folder).
# Exit: 0 when every step passed or was skipped for a stated reason, 1 when one failed.
set -euo pipefail
SELF=$(readlink -f "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/.." && pwd)

usage() { sed -n '2,/^set -euo/p' "$SELF" | sed -e '$d' -e 's/^# \{0,1\}//'; }
die() { echo "gpu-check: $*" >&2; exit 2; }
now() { date +%s.%N; }

if [[ ${1:-} == --prepare ]]; then
  shift
  exec bash "$REPO/tools/gpu/prepare.sh" "$@"
fi

CARRY=$REPO/build-gpu-carry WORK=$REPO/build-gpu BUILD="" OUT="" BUDGET=560
NO_BUILD=0 NO_GLOO=0 DEVICE=cuda LAUNCHER=auto JOBS=$(nproc)
while (($#)); do
  case $1 in
    --out) OUT=$(readlink -m "${2:?--out needs a folder}"); shift 2 ;;
    --carry) CARRY=$(readlink -m "${2:?--carry needs a folder}"); shift 2 ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift 2 ;;
    --work) WORK=$(readlink -m "${2:?--work needs a folder}"); shift 2 ;;
    --build-dir) BUILD=$(readlink -m "${2:?--build-dir needs a folder}"); shift 2 ;;
    --no-build) NO_BUILD=1; shift ;;
    --no-gloo) NO_GLOO=1; shift ;;
    --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
    --launcher) LAUNCHER=${2:?--launcher needs auto, mpirun or env}; shift 2 ;;
    --jobs) JOBS=${2:?--jobs needs a number}; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ $BUDGET =~ ^[0-9]+$ ]] || die "--budget: a whole number of seconds, not '$BUDGET'"
[[ $DEVICE == cuda || $DEVICE == cpu ]] || die "--device: cuda or cpu, not '$DEVICE'"
[[ $LAUNCHER =~ ^(auto|mpirun|env)$ ]] || die "--launcher: auto, mpirun or env, not '$LAUNCHER'"
BUILD=${BUILD:-$WORK/cmake}
PREFIX=$WORK/prefix LOGS=$WORK/logs STEPS=$WORK/logs/steps
rm -rf "$LOGS" && mkdir -p "$STEPS"  # this call's logs alone (the prefix and the build stay)
export REPO WORK BUILD PREFIX LOGS STEPS CARRY DEVICE NO_BUILD NO_GLOO LAUNCHER JOBS
T0=$(now)
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
DEADLINE=$(awk -v t="$T0" -v b="$BUDGET" 'BEGIN { printf "%.0f", t + b }')
echo "gpu-check: $REPO on $DEVICE, budget $BUDGET s; carry $CARRY, build $BUILD${OUT:+, out $OUT}"

declare -A STATUS=()
# run_step NAME LIMIT_S [NEEDS...]: the step in its own shell, under its limit or what
# is left of the budget, whichever is less; skipped when a step it needs did not pass.
run_step() {
  local name=$1 limit=$2
  shift 2
  local need why=""
  for need in "$@"; do
    if [[ ${STATUS[$need]:-} != pass ]]; then why="needs $need (${STATUS[$need]:-not run})"; break; fi
  done
  # A rehearsal on a CPU (two cores, say) is slower than the GPU machine at everything.
  [[ $DEVICE == cpu ]] && limit=$((limit * 4))
  local left_s
  left_s=$(awk -v d="$DEADLINE" -v n="$(now)" 'BEGIN { print int(d - n) }')
  if [[ -z $why ]] && ((left_s < 10)); then why="no time left in the $BUDGET s budget: call again on the same machine"; fi
  if [[ -n $why ]]; then
    STATUS[$name]=skipped
    printf '%s\n' "$why" >"$STEPS/$name.reason"
    printf 'skipped\n' >"$STEPS/$name.status"
    printf '0\n%s\n' "$limit" >"$STEPS/$name.time"
    echo "$name" >>"$STEPS/ORDER"
    echo "gpu-check: $name: skipped: $why"
    return 0
  fi
  ((limit > left_s)) && limit=$left_s
  local log=$LOGS/$name.log t0 rc=0
  t0=$(now)
  echo "gpu-check: $name (up to $limit s) ..."
  STEP=$name LOG=$log STEP_DEADLINE=$(awk -v n="$t0" -v l="$limit" 'BEGIN { printf "%.0f", n + l - 5 }') \
    timeout -k 10 "$limit" bash "$REPO/tools/gpu/steps.sh" "$name" >"$log" 2>&1 || rc=$?
  local wall
  wall=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
  case $rc in
    0) STATUS[$name]=pass ;;
    3) STATUS[$name]=skipped ;;
    124 | 137) STATUS[$name]=fail
      [[ -s $STEPS/$name.reason ]] || echo "timed out after $limit s (log: $log)" >"$STEPS/$name.reason" ;;
    *) STATUS[$name]=fail
      [[ -s $STEPS/$name.reason ]] || echo "exit $rc; the log's last line: $(grep . "$log" | tail -1 | cut -c1-300)" >"$STEPS/$name.reason" ;;
  esac
  printf '%s\n' "${STATUS[$name]}" >"$STEPS/$name.status"
  printf '%s\n%s\n' "$wall" "$limit" >"$STEPS/$name.time"
  echo "$name" >>"$STEPS/ORDER"
  local line="gpu-check: $name: ${STATUS[$name]} in $wall s"
  [[ -s $STEPS/$name.reason ]] && line+=": $(head -1 "$STEPS/$name.reason" | cut -c1-400)"
  echo "$line"
  if [[ -s $STEPS/$name.headline ]]; then echo "gpu-check:   $(head -1 "$STEPS/$name.headline" | cut -c1-400)"; fi
}

# The order puts what needs no build first (the matmul's ceiling is a figure even when
# the build fails), and the figures after the build by what they cost.
run_step environment 60
run_step matmul 60 environment
run_step unpack 60
run_step mpirun 40 unpack
if ((NO_BUILD)); then
  STATUS[configure]=pass STATUS[build]=pass STATUS[train]=pass
  printf -- '--no-build: the binaries of %s\n' "$BUILD" >"$STEPS/configure.reason"
  cp "$STEPS/configure.reason" "$STEPS/build.reason"
  for s in configure build; do printf 'skipped\n' >"$STEPS/$s.status"; printf '0\n0\n' >"$STEPS/$s.time"; echo "$s" >>"$STEPS/ORDER"; done
  echo "gpu-check: configure, build: skipped: --no-build, the binaries of $BUILD"
else
  run_step configure 120 environment unpack
  run_step build 330 configure
  # train built (a failure elsewhere, in a test's sources say, leaves the figures that
  # need only train to run).
  if [[ ${STATUS[build]} == pass || -f $STEPS/build.train-ok ]]; then STATUS[train]=pass; fi
fi
run_step binaries 30 unpack train
run_step ctest-cuda 90 binaries
run_step quickstart 90 binaries
run_step gpt-bf16 120 binaries
run_step hf-gpt2 60 binaries
run_step zero3-one-rank 60 binaries
run_step zero3-two-ranks 90 binaries
run_step zero3-compare 20 zero3-one-rank zero3-two-ranks
run_step nccl-two-ranks 60 binaries zero3-one-rank

# The summary and the tarball: written where --out says, else beside the logs.
DEST=${OUT:-$WORK}
mkdir -p "$DEST"
# shellcheck source=/dev/null
PYS=$(if [[ -f $LOGS/env.sh ]]; then source "$LOGS/env.sh"; fi; echo "${HOSTPY:-}")
PYS=${PYS:-$(command -v python3 || echo /usr/bin/python3)}
rc=0
env -u LD_LIBRARY_PATH "$PYS" "$REPO/tools/gpu/summary.py" --steps "$STEPS" --logs "$LOGS" --carry "$CARRY" \
  --repo "$REPO" --build "$BUILD" --device "$DEVICE" --budget "$BUDGET" --started "$STARTED" \
  --wall "$(awk -v a="$T0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')" --out "$DEST" || rc=$?
exit "$rc"
