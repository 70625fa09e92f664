#!/usr/bin/env bash
# tools/bench_hosts.sh: the same job on 4 ranks inside one host and across 2 test hosts
# (tools/test-hosts.sh): data parallel with flat and hierarchical allreduce, pipeline x
# data under 1F1B and ZB-H1, ZeRO-3, and tensor x data (a GPT: tensor parallelism splits
# its blocks); prints each layout's samples/s (median of its rounds; the layouts
# alternate within a round so that a slow moment of a shared machine spreads over all of
# them) and its ratio to the one-host run of the same strategy. Then the cost model's
# prediction of each (Note [Cost model]: train --dry-run --time-layers on a calibration
# that bench-collectives --calibrate measures on the same ranks first, 4 on this host for
# the one-host layouts, 2 + 2 on the test hosts for the others) beside the measurement.
# A run's samples/s is its steady state: the median of the metrics' 10-step rates after
# the first ten steps (the first step allocates and plans; the model prices a later one).
#
#   tools/bench_hosts.sh [--rate RATE] [--rounds N] [--steps N] [--hidden H] [--bin DIR]
#
# --rate shapes the link between the hosts (default 1gbit; "none" leaves it unshaped).
# --hidden: the MLP's hidden widths (default 1024: [1024, 1024], 1.9 M parameters, 7.6 MB
# of fp32 gradients per step). Needs root; brings the hosts up and takes them down.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=1gbit rounds=3 steps=100 hidden=1024 bin=build/bin
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
log: {every: 10, progress: off}
EOF
sed -e "s/max_steps: 400, eval_every: 100/max_steps: $steps, eval_every: 0/" -e 's/^checkpoint:.*/checkpoint: {dir: ""}/' \
    -e 's/^log:.*/log: {every: 10, progress: off}/' -e 's/eval_samples: 256/eval_samples: 0/' configs/tensor-gpt.yaml >"$work/gpt.yaml"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# name | where (one|two) | job | --set ...
layouts=(
  "dp, one host|one|job|mesh.data=4"
  "dp, 2 hosts, flat|two|job|mesh.data=4 data_parallel.hierarchical=off"
  "dp, 2 hosts, hierarchical|two|job|mesh.data=4 data_parallel.hierarchical=on"
  "pipeline x data, one host|one|job|mesh.pipeline=2 mesh.data=2 pipeline.micro_batches=4"
  "pipeline x data, 2 hosts|two|job|mesh.pipeline=2 mesh.data=2 pipeline.micro_batches=4"
  "zbh1 x data, one host|one|job|mesh.pipeline=2 mesh.data=2 pipeline.micro_batches=4 pipeline.schedule=zbh1"
  "zbh1 x data, 2 hosts|two|job|mesh.pipeline=2 mesh.data=2 pipeline.micro_batches=4 pipeline.schedule=zbh1"
  "zero-3, one host|one|job|mesh.data=4 zero.stage=3"
  "zero-3, 2 hosts|two|job|mesh.data=4 zero.stage=3"
  "tensor x data (gpt), one host|one|gpt|mesh.data=2 mesh.tensor=2"
  "tensor x data (gpt), 2 hosts|two|gpt|mesh.data=2 mesh.tensor=2"
)
# The links of these hosts and of this one, for the predictions (Note [Fitted collectives]).
bench=$(readlink -f "$bin/bench-collectives")
tools/test-hosts.sh run -np 4 "$bench" --calibrate "$work/calibration-two.json" >"$work/calibration.txt"
mpirun --oversubscribe --bind-to none -np 4 "$bench" --calibrate "$work/calibration-one.json" >>"$work/calibration.txt"
# The steady samples/s of a run's metrics file: the median 10-step rate after the first.
steady() {
  python3 -c 'import json, statistics, sys
r = [json.loads(l) for l in open(sys.argv[1])]
v = [x["samples_per_s"] for x in r if "samples_per_s" in x and not x.get("eval")][1:]
print(statistics.median(v) if v else "")' "$1"
}
declare -A got
for ((r = 1; r <= rounds; r++)); do
  for i in "${!layouts[@]}"; do
    l=${layouts[$i]}
    IFS='|' read -r name where job sets <<<"$l"
    args=(--set "log.metrics=$work/metrics.jsonl")
    for s in $sets; do args+=(--set "$s"); done
    rm -f "$work/metrics.jsonl"
    if [[ $where == one ]]; then
      out=$(mpirun --oversubscribe --bind-to none -np 4 "$train" "$work/$job.yaml" "${args[@]}" 2>&1) || true
    else
      out=$(tools/test-hosts.sh run -np 4 "$train" "$work/$job.yaml" "${args[@]}" 2>&1) || true
    fi
    sps=$([[ -s $work/metrics.jsonl ]] && steady "$work/metrics.jsonl")
    [[ -n $sps ]] || { echo "bench_hosts.sh: '$name' failed:" >&2; echo "$out" | tail -20 >&2; exit 1; }
    got[$name]+="$sps "
    cp "$work/metrics.jsonl" "$work/metrics-$i.jsonl"  # the last round's, for the terms below
  done
done
median() { tr ' ' '\n' <<<"$1" | sed '/^$/d' | sort -n | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
echo "bench_hosts: 4 ranks, MLP [$hidden, $hidden], batch 256, $steps steps, link ${rate}, $rounds rounds (median samples/s)"
sed 's/^/  calibration: /' "$work/calibration.txt" | sed '$d'
printf '  %-30s %12s %10s %12s %10s   %s\n' layout samples/s "vs 1 host" predicted measured/pred rounds
for i in "${!layouts[@]}"; do
  l=${layouts[$i]}
  IFS='|' read -r name where job sets <<<"$l"
  m=$(median "${got[$name]}")
  base=$(median "${got[${name%%, *}, one host]}")  # the same strategy on one host
  args=()
  for s in $sets; do args+=(--set "$s"); done
  per_host=2 cal=two
  [[ $where == one ]] && per_host=4 cal=one
  "$train" "$work/$job.yaml" "${args[@]}" --dry-run --np 4 --ranks-per-host $per_host --time-layers \
    --calibration "$work/calibration-$cal.json" --json >"$work/dry-$i.json"
  pred=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["cost"]["samples_per_s"])' "$work/dry-$i.json")
  printf '  %-30s %12.0f %10.2f %12.0f %10.2f   %s\n' "$name" "$m" "$(awk -v a="$m" -v b="$base" 'BEGIN {print a / b}')" \
    "$pred" "$(awk -v a="$m" -v b="$pred" 'BEGIN {print a / b}')" "${got[$name]}"
done
# Each term on its own, the prediction's against the last round's run: the rank with the
# most compute (a pipeline's slowest stage), each phase's median over the 10-step
# intervals after the first. Forward and backward hold the waits inside them (ZeRO-3's
# gathers); "collectives" is the wait for the gradients' ops after backward; "waits" is
# what the step leaves beside the phases (a pipeline's transfers and bubble, late ranks).
echo "  terms, ms per step (predicted / measured):"
printf '  %-30s %15s %15s %15s %15s %15s %15s\n' layout compute collectives optimizer "data loading" waits step
for i in "${!layouts[@]}"; do
  IFS='|' read -r name _ <<<"${layouts[$i]}"
  python3 - "$name" "$work/dry-$i.json" "$work/metrics-$i.jsonl" <<'PY'
import json, statistics, sys
name, dry, metrics = sys.argv[1:4]
c = json.load(open(dry))["cost"]
recs = [json.loads(l) for l in open(metrics)]
recs = [r for r in recs if "samples_per_s" in r and not r.get("eval") and "ranks" in r][1:]
batch = c["step_s"] * c["samples_per_s"]
med = lambda xs: statistics.median(xs) if xs else float("nan")
def phase(rank, *keys):
    return med([sum(r["ranks"][rank]["step_ms"][k] for k in keys) for r in recs])
ranks = range(len(recs[0]["ranks"])) if recs else []
slow = max(ranks, key=lambda k: phase(k, "forward", "backward"), default=0)
step = med([batch / r["samples_per_s"] * 1e3 for r in recs])
comp, coll, opt, load = (phase(slow, "forward", "backward"), phase(slow, "gradients"), phase(slow, "optimizer"),
                         phase(slow, "data"))
pred = [c["compute_s"], c["other_s"], c["optimizer_s"], c["loading_s"], c["pipeline_s"] + c["bubble_s"], c["step_s"]]
got = [comp, coll, opt, load, step - comp - coll - opt - load, step]
print("  %-30s" % name + "".join("%15s" % ("%.1f / %.1f" % (p * 1e3, m)) for p, m in zip(pred, got)))
PY
done
rm -rf "$work"
