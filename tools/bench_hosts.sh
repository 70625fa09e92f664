#!/usr/bin/env bash
# tools/bench_hosts.sh: the same job on 4 ranks inside one host and across 2 test hosts
# (tools/test-hosts.sh), data parallel with flat and hierarchical allreduce, and pipeline
# x data; prints each layout's samples/s (median of its rounds; the layouts alternate
# within a round so that a slow moment of a shared machine spreads over all of them) and
# its ratio to the one-host run of the same strategy. Then the cost model's prediction of
# each (Note [Cost model]: train --dry-run on a calibration that bench-collectives
# --calibrate measures on the same hosts first) beside the measurement.
#
#   tools/bench_hosts.sh [--rate RATE] [--rounds N] [--steps N] [--hidden H] [--bin DIR]
#
# --rate shapes the link between the hosts (default 1gbit; "none" leaves it unshaped).
# --hidden: the MLP's hidden widths (default 1024: [1024, 1024], 1.9 M parameters, 7.6 MB
# of fp32 gradients per step). Needs root; brings the hosts up and takes them down.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=1gbit rounds=3 steps=40 hidden=1024 bin=build/bin
while (($#)); do
  case $1 in
    --rate) rate=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --hidden) hidden=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    *) echo "bench_hosts.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
train=$(readlink -f "$bin/train")
[[ -x $train ]] || { echo "bench_hosts.sh: no $bin/train: build first" >&2; exit 2; }
up=(up 2)
[[ $rate != none ]] && up+=(--rate "$rate")
tools/test-hosts.sh "${up[@]}" >/dev/null
trap 'tools/test-hosts.sh down' EXIT
work=$(mktemp -d)
cat >"$work/job.yaml" <<EOF
name: bench_hosts
model: {type: mlp, hidden: [$hidden, $hidden]}
data: {type: fashion-mnist, batch_size: 256, eval_samples: 0}
optimizer: {type: sgd, lr: 0.05}
train: {max_steps: $steps, seed: 1, threads: 1}
checkpoint: {dir: ""}
log: {every: 10, progress: off, metrics: ""}
EOF

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# name | where (one|two) | --set ...
layouts=(
  "dp, one host|one|mesh.data=4"
  "dp, 2 hosts, flat|two|mesh.data=4 data_parallel.hierarchical=off"
  "dp, 2 hosts, hierarchical|two|mesh.data=4 data_parallel.hierarchical=on"
  "pipeline x data, one host|one|mesh.pipeline=2 mesh.data=2 pipeline.micro_batches=4"
  "pipeline x data, 2 hosts|two|mesh.pipeline=2 mesh.data=2 pipeline.micro_batches=4"
  "zero-3, one host|one|mesh.data=4 zero.stage=3"
  "zero-3, 2 hosts|two|mesh.data=4 zero.stage=3"
)
# The links and compute rate of these hosts, for the predictions.
tools/test-hosts.sh run -np 4 "$(readlink -f "$bin/bench-collectives")" --calibrate "$work/calibration.json" >"$work/calibration.txt"
declare -A got
for ((r = 1; r <= rounds; r++)); do
  for l in "${layouts[@]}"; do
    IFS='|' read -r name where sets <<<"$l"
    args=()
    for s in $sets; do args+=(--set "$s"); done
    if [[ $where == one ]]; then
      out=$(mpirun --oversubscribe --bind-to none -np 4 "$train" "$work/job.yaml" "${args[@]}" 2>&1)
    else
      out=$(tools/test-hosts.sh run -np 4 "$train" "$work/job.yaml" "${args[@]}" 2>&1)
    fi
    sps=$(sed -n 's/^  throughput *\([0-9.]*\) samples\/s.*/\1/p' <<<"$out")
    [[ -n $sps ]] || { echo "bench_hosts.sh: '$name' failed:" >&2; echo "$out" | tail -20 >&2; exit 1; }
    got[$name]+="$sps "
  done
done
median() { tr ' ' '\n' <<<"$1" | sed '/^$/d' | sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
echo "bench_hosts: 4 ranks, MLP [$hidden, $hidden], batch 256, $steps steps, link ${rate}, $rounds rounds (median samples/s)"
sed 's/^/  calibration: /' "$work/calibration.txt" | sed '$d'
printf '  %-30s %12s %10s %12s %10s   %s\n' layout samples/s "vs 1 host" predicted measured/pred rounds
base_dp=$(median "${got[dp, one host]}") base_pp=$(median "${got[pipeline x data, one host]}")
base_z=$(median "${got[zero-3, one host]}")
for l in "${layouts[@]}"; do
  IFS='|' read -r name where sets <<<"$l"
  m=$(median "${got[$name]}")
  base=$base_dp
  [[ $name == pipeline* ]] && base=$base_pp
  [[ $name == zero* ]] && base=$base_z
  args=()
  for s in $sets; do args+=(--set "$s"); done
  per_host=2
  [[ $where == one ]] && per_host=4
  pred=$("$train" "$work/job.yaml" "${args[@]}" --dry-run --np 4 --ranks-per-host $per_host \
           --calibration "$work/calibration.json" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["cost"]["samples_per_s"])')
  printf '  %-30s %12.0f %10.2f %12.0f %10.2f   %s\n' "$name" "$m" "$(awk -v a="$m" -v b="$base" 'BEGIN {print a / b}')" \
    "$pred" "$(awk -v a="$m" -v b="$pred" 'BEGIN {print a / b}')" "${got[$name]}"
done
rm -rf "$work"
