#!/usr/bin/env bash
# The largest MLP (784-W x 7-10, fp32 Adam, batch 16) that trains on N ranks when each
# rank may use at most CAP of memory, at each ZeRO stage. Each rank runs in a memory
# cgroup of its own (v1 or v2) capped at CAP; a width "fits" when two steps run to the
# end. Needs root (cgroups) and a build (build/bin/train).
#
#   tools/bench_zero_capacity.sh [--cap 3G] [--np 2] [--stages "0 3"] [--widths "2048 3072 ..."]
#
# Prints, per stage, each width tried with its parameter count and whether it fit.
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

cap=3G np=2 stages="0 3" widths="2048 3072 4096 5120 6144 7168 8192"
while (($#)); do
  case $1 in
    --cap) cap=$2; shift 2 ;;
    --np) np=$2; shift 2 ;;
    --stages) stages=$2; shift 2 ;;
    --widths) widths=$2; shift 2 ;;
    *) echo "usage: $0 [--cap 3G] [--np 2] [--stages '0 3'] [--widths '2048 4096 ...']" >&2; exit 2 ;;
  esac
done
[[ $(id -u) -eq 0 ]] || { echo "bench_zero_capacity: needs root for memory cgroups" >&2; exit 2; }
bytes=$(numfmt --from=iec "$cap")
job=$(mktemp --suffix=.yaml)
trap 'rm -f "$job"; for d in /sys/fs/cgroup/memory/tetra-cap-* /sys/fs/cgroup/tetra-cap-*; do [[ -d $d ]] && rmdir "$d" 2>/dev/null; done; true' EXIT
cat >"$job" <<'EOF'
name: zero-capacity
model: {type: mlp}
data: {type: synthetic, shape: [784], classes: 10, train_samples: 64, test_samples: 16, batch_size: 16}
optimizer: {type: adam, lr: 1.0e-4}
train: {max_steps: 2, threads: 1, eval_every: 0}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
EOF
echo "cap $cap per rank, $np ranks, MLP 784-Wx7-10, fp32 Adam, batch 16"
for stage in $stages; do
  largest=none
  for w in $widths; do
    params=$((784 * w + w + 6 * (w * w + w) + 10 * w + 10))
    hidden="[$w,$w,$w,$w,$w,$w,$w]"
    if OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        mpirun --oversubscribe --bind-to none -np "$np" "$0" --rank "$bytes" build/bin/train "$job" \
        --set "model.hidden=$hidden" --set "mesh.data=$np" --set "zero.stage=$stage" >/tmp/zero-capacity.log 2>&1; then
      result=fits
      largest="W=$w ($params parameters)"
    else
      result="does not fit"
    fi
    printf 'stage %s  W=%-5s %11s parameters  %s\n' "$stage" "$w" "$params" "$result"
    [[ $result == fits ]] || break
  done
  echo "stage $stage: largest that trains: $largest"
done
