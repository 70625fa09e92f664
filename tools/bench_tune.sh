#!/usr/bin/env bash
# tools/bench_tune.sh: what `train --tune` buys on this machine (issue 31). The quickstart
# MLP on 2 processes, started from a poorly chosen job (ZeRO-3 with 0.05 MB buckets and no
# prefetch): the tuner's search (timed, with its table), then the poor job, the tuned job
# and plain data parallelism (the quickstart with mesh.data 2) run side by side under
# mpirun, alternating within each round so that a slow moment of a shared machine falls on
# all three. A run's samples/s is its steady state: the median of the metrics' 10-step
# rates after the first ten steps. Prints each job's median over the rounds and the two
# ratios the issue asks for: tuned / poor (>= 1.2) and tuned / plain data parallel (>= 0.95);
# and the tuned job against plain data parallelism at one thread a rank, which a user who
# knew to set train.threads would run.
#
#   tools/bench_tune.sh [--rounds N] [--steps N] [--budget SECONDS] [--bin DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 steps=150 budget=300 bin=build/bin
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    *) echo "bench_tune.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
train=$(readlink -f "$bin/train")
[[ -x $train ]] || { echo "bench_tune.sh: no $bin/train: build first" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The quickstart (configs/quickstart.yaml), as one would first spread it over 2 processes.
cat >"$work/dp.yaml" <<EOF
name: bench_tune_dp
model: {type: mlp, hidden: [1024, 1024]}
data: {type: fashion-mnist, batch_size: 128}
optimizer: {type: adamw, lr: 1.0e-3, weight_decay: 0.01}
schedule: {type: cosine, warmup_steps: 200}
train: {epochs: 6, eval_every: 0, seed: 1, threads: 2, precision: fp32}
mesh: {data: 2}
checkpoint: {dir: ""}
log: {every: 100, dir: $work/runs/dp}
EOF
sed -e 's/^name: .*/name: bench_tune_poor/' -e "s#dir: $work/runs/dp#dir: $work/runs/poor#" "$work/dp.yaml" >"$work/poor.yaml"
echo 'zero: {stage: 3, bucket_mb: 0.05, prefetch: 0}' >>"$work/poor.yaml"
# Plain data parallelism at one thread a rank (2 ranks on 2 cores), as a user who knew to
# set it would run it: the tuner's threads knob is not all it finds.
sed -e 's/^name: .*/name: bench_tune_dp1/' -e 's/threads: 2/threads: 1/' "$work/dp.yaml" >"$work/dp1.yaml"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "== the search: train poor.yaml --tune --np 2 --budget $budget"
start=$(date +%s.%N)
"$train" "$work/poor.yaml" --tune --np 2 --budget "$budget" -o "$work/tuned.yaml" | sed -n '/^== /,$p'
search=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.0f", b - a}')
echo "search took ${search} s (limit ${budget} s)"
sed -n '1,/^name:/p' "$work/tuned.yaml" | sed '$d'

mpirun=(mpirun --oversubscribe --bind-to none -np 2)
run() {  # job -> samples/s
  rm -rf "$work/runs/$1"
  "${mpirun[@]}" "$train" "$work/$1.yaml" --set train.max_steps="$steps" --set log.every=10 --set log.progress=off \
    --set log.dir="$work/runs/$1" --set log.metrics=metrics.jsonl >/dev/null
  python3 -c 'import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
rates = [r["samples_per_s"] for r in recs if "samples_per_s" in r and not r.get("eval") and r.get("step", 0) > 10]
print("%.0f" % statistics.median(rates))' "$work/runs/$1/metrics.jsonl"
}
declare -A got
for ((round = 1; round <= rounds; round++)); do
  order=(poor tuned dp dp1)
  ((round % 2 == 0)) && order=(dp1 dp tuned poor)
  for j in "${order[@]}"; do got[$j]+="$(run "$j") "; done
done
median() { python3 -c 'import statistics, sys; print(statistics.median(float(x) for x in sys.argv[1:]))' "$@"; }
poor=$(median ${got[poor]}) tuned=$(median ${got[tuned]}) dp=$(median ${got[dp]}) dp1=$(median ${got[dp1]})
echo "== side by side, $rounds rounds of $steps steps (samples/s, median of rounds; each round's in brackets)"
printf '  %-34s %10.0f   [%s]\n' "poor (zero-3, 0.05 MB, no prefetch)" "$poor" "${got[poor]% }"
printf '  %-34s %10.0f   [%s]\n' "tuned" "$tuned" "${got[tuned]% }"
printf '  %-34s %10.0f   [%s]\n' "plain data parallel" "$dp" "${got[dp]% }"
printf '  %-34s %10.0f   [%s]\n' "plain data parallel, 1 thread" "$dp1" "${got[dp1]% }"
awk -v t="$tuned" -v p="$poor" -v d="$dp" -v e="$dp1" 'BEGIN {
  a = t / p; b = t / d; c = t / e
  printf "  tuned / poor                 %.2fx (goal >= 1.20: %s)\n", a, (a >= 1.2) ? "met" : "NOT MET"
  printf "  tuned / plain data parallel  %.2fx (goal >= 0.95: %s)\n", b, (b >= 0.95) ? "met" : "NOT MET"
  printf "  tuned / the same at 1 thread %.2fx\n", c }'
