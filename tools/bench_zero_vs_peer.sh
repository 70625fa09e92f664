#!/usr/bin/env bash
# tetra's ZeRO against PyTorch's, side by side in one run: bench-zero (stages 0-3 of tetra on
# the 104M-parameter MLP, 784-4096x7-10, Adam, batch 16) and tools/bench_zero_peer.py
# (PyTorch's DDP + Adam, and DDP + ZeroRedundancyOptimizer(Adam), on the same job, each with
# the bucket views that made it fastest here), each rank one thread, alternating for --rounds rounds (this machine is shared and noisy: only what
# runs side by side compares), keeping each one's best. PyTorch runs with the allocator
# settings tetra gives itself (big blocks kept, never mapped and unmapped per step):
# MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ and MALLOC_TOP_PAD_ below.
#
#   tools/bench_zero_vs_peer.sh [--np 2] [--rounds 3] [--steps 6]
#
# Prints samples/s of each, then the ratios the ZeRO issue asks for: tetra's stage 1 over
# PyTorch's ZeRO-1 (at least 1.2), stage 2 over stage 1 (0.95), stage 3 over stage 2 (0.8).
# Needs a build (build/bin/bench-zero) and Debian's python3-torch (tools/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

np=2 rounds=3 steps=6
while (($#)); do
  case $1 in
    --np) np=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    *) echo "usage: $0 [--np 2] [--rounds 3] [--steps 6]" >&2; exit 2 ;;
  esac
done
[[ -x build/bin/bench-zero ]] || { echo "bench_zero_vs_peer: build/bin/bench-zero is missing (cmake --build build)" >&2; exit 2; }
torchrun=$(command -v torchrun || true)
[[ -n $torchrun ]] || { echo "bench_zero_vs_peer: torchrun is missing (Debian's python3-torch; tools/setup.sh)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

declare -A best
keep() {  # keep NAME SAMPLES_PER_S: the best of the rounds
  local old=${best[$1]:-0}
  if awk -v a="$2" -v b="$old" 'BEGIN{exit !(a > b)}'; then best[$1]=$2; fi
}

for ((r = 1; r <= rounds; r++)); do
  # Each run under a time limit: a run that hangs (a peer's rendezvous once did) loses its round.
  out=$(timeout 600 mpirun --oversubscribe --bind-to none -np "$np" build/bin/bench-zero --steps "$steps" --repeats 1 2>/dev/null) ||
    echo "  round $r: bench-zero failed or timed out" >&2
  while read -r stage sps _; do
    [[ $stage =~ ^[0-3]$ ]] && keep "tetra stage $stage" "$sps" && echo "  round $r: tetra stage $stage $sps samples/s" >&2
  done <<<"$out"
  for mode in ddp zero1; do
    # The peer at its fastest here: gradients as views of DDP's buckets, and (ZeRO-1) one
    # broadcast per rank's bucket of parameters rather than one per parameter.
    views=(--bucket-view)
    [[ $mode == zero1 ]] && views+=(--zero-bucket-view)
    json=$(MALLOC_MMAP_THRESHOLD_=2147483647 MALLOC_TRIM_THRESHOLD_=4294967295 MALLOC_TOP_PAD_=536870912 \
      OMP_NUM_THREADS=1 timeout 600 "$torchrun" --redirects 2 --tee 2 --standalone --nproc_per_node "$np" \
      tools/bench_zero_peer.py --mode "$mode" --steps "$steps" --warmup 2 "${views[@]}" 2>/dev/null | tail -n 1) || true
    sps=$(/usr/bin/python3 -c 'import json,sys; print(json.loads(sys.argv[1])["samples_per_s"])' "$json" 2>/dev/null) || {
      echo "  round $r: pytorch $mode failed or timed out" >&2
      continue
    }
    keep "pytorch $mode" "$sps"
    echo "  round $r: pytorch $mode $sps samples/s" >&2
  done
done

echo "ZeRO, $np ranks x 1 thread, MLP 784-4096x7-10 (104M parameters), Adam, batch 16; best of $rounds rounds of $steps steps"
for name in "pytorch ddp" "pytorch zero1" "tetra stage 0" "tetra stage 1" "tetra stage 2" "tetra stage 3"; do
  printf '  %-14s %8.2f samples/s\n' "$name" "${best[$name]:-0}"
done
ratio() { awk -v a="${1:-0}" -v b="${2:-0}" 'BEGIN{if (b > 0) printf "%.3f", a / b; else printf "n/a"}'; }
echo "  tetra stage 1 / pytorch zero1: $(ratio "${best[tetra stage 1]}" "${best[pytorch zero1]}") (goal >= 1.2)"
echo "  tetra stage 0 / pytorch ddp:   $(ratio "${best[tetra stage 0]}" "${best[pytorch ddp]}")"
echo "  stage 2 / stage 1:             $(ratio "${best[tetra stage 2]}" "${best[tetra stage 1]}") (goal >= 0.95)"
echo "  stage 3 / stage 2:             $(ratio "${best[tetra stage 3]}" "${best[tetra stage 2]}") (goal >= 0.8)"
