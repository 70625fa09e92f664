#!/usr/bin/env bash
# The largest MLP (784-W x DEPTH-10, fp32 Adam, batch 16) that trains on N ranks when each
# rank may use at most CAP of memory, at each ZeRO stage: ZeRO's promise in bytes the kernel
# counts. Each rank runs in a memory cgroup of its own (v1 or v2, no swap) capped at CAP; a
# width "fits" when two steps run to the end. The widest fitting W is found by bisection to
# within --step; deep by default (24 layers), so that one gathered layer is small beside the
# model, as ZeRO-3 wants. Needs root (cgroups) and a build (build/bin/train).
#
#   tools/bench_zero_capacity.sh [--cap 3G] [--np "2 4"] [--stages "0 3"] [--depth 24] [--step 64]
#
# Prints, per rank count and stage, the widest W that fits, its parameter count and its
# ratio to stage 0's on the same ranks (2x on 2 ranks and 4x on 4 in theory for stage 3).
set -euo pipefail
cd "$(dirname "$0")/.."

# Inside mpirun: put this rank in its own capped cgroup, then become the trainer.
if [[ ${1:-} == --rank ]]; then
  shift
  cap=$1
  shift
  rank=${OMPI_COMM_WORLD_RANK:-0}
  if [[ -d /sys/fs/cgroup/memory ]]; then
    cg=/sys/fs/cgroup/memory/tetra-cap-$rank
    mkdir -p "$cg"
    echo "$cap" >"$cg/memory.limit_in_bytes"
    [[ -f $cg/memory.memsw.limit_in_bytes ]] && echo "$cap" >"$cg/memory.memsw.limit_in_bytes" 2>/dev/null || true
  else
    cg=/sys/fs/cgroup/tetra-cap-$rank
    mkdir -p "$cg"
    echo "$cap" >"$cg/memory.max"
    echo 0 >"$cg/memory.swap.max" 2>/dev/null || true
  fi
  echo $$ >"$cg/cgroup.procs"
  exec "$@"
fi

cap=3G nps="2 4" stages="0 3" depth=24 step=64
while (($#)); do
  case $1 in
    --cap) cap=$2; shift 2 ;;
    --np) nps=$2; shift 2 ;;
    --stages) stages=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    --step) step=$2; shift 2 ;;
    *) echo "usage: $0 [--cap 3G] [--np '2 4'] [--stages '0 3'] [--depth 24] [--step 64]" >&2; exit 2 ;;
  esac
done
[[ $(id -u) -eq 0 ]] || { echo "bench_zero_capacity: needs root for memory cgroups" >&2; exit 2; }
[[ -x build/bin/train ]] || { echo "bench_zero_capacity: build/bin/train is missing (cmake --build build)" >&2; exit 2; }
bytes=$(numfmt --from=iec "$cap")
job=$(mktemp --suffix=.yaml)
log=$(mktemp --suffix=.log)
cleanup() {
  rm -f "$job" "$log"
  for d in /sys/fs/cgroup/memory/tetra-cap-* /sys/fs/cgroup/tetra-cap-*; do [[ -d $d ]] && rmdir "$d" 2>/dev/null; done
  true
}
trap cleanup EXIT
cat >"$job" <<'EOF'
name: zero-capacity
model: {type: mlp}
data: {type: synthetic, shape: [784], classes: 10, train_samples: 64, test_samples: 16, batch_size: 16, eval_samples: 16}
optimizer: {type: adam, lr: 1.0e-4}
train: {max_steps: 2, threads: 1, eval_every: 0}
checkpoint: {dir: ""}
log: {metrics: "", progress: off, dir: ""}
EOF

params_of() { echo $((784 * $1 + $1 + (depth - 1) * ($1 * $1 + $1) + 10 * $1 + 10)); }
fits() {  # fits NP STAGE W: two steps run to the end under the cap
  local hidden
  hidden="[$(printf "$3,%.0s" $(seq "$depth"))" && hidden="${hidden%,}]"
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun --oversubscribe --bind-to none -np "$1" "$0" --rank "$bytes" build/bin/train "$job" \
    --set "model.hidden=$hidden" --set "mesh.data=$1" --set "zero.stage=$2" >"$log" 2>&1
}

echo "cap $cap per rank, MLP 784-Wx$depth-10, fp32 Adam, batch 16, widths to within $step"
declare -A widest
for np in $nps; do
  for stage in $stages; do
    lo=0 hi=$step
    while fits "$np" "$stage" "$hi"; do lo=$hi; hi=$((hi * 2)); done  # double until one does not fit
    while ((hi - lo > step)); do
      mid=$(((lo + hi) / 2 / step * step))
      ((mid > lo)) || mid=$((lo + step))
      if fits "$np" "$stage" "$mid"; then lo=$mid; else hi=$mid; fi
    done
    widest[$np,$stage]=$lo
    ratio=-
    if [[ -n ${widest[$np,0]:-} && ${widest[$np,0]} -gt 0 ]]; then
      ratio=$(awk -v a="$(params_of "$lo")" -v b="$(params_of "${widest[$np,0]}")" 'BEGIN{printf "%.2f", a / b}')
    fi
    printf '%d ranks, stage %s: widest W=%-6s %12s parameters   %s x stage 0\n' "$np" "$stage" "$lo" \
      "$([[ $lo -gt 0 ]] && params_of "$lo" || echo 0)" "$ratio"
  done
done
