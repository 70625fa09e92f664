#!/usr/bin/env bash
# tools/predict_scale.sh: the cost model's plan for a job at many ranks (Note [Cost model]).
# For each rank count it prices the plans a user would try — data parallel, ZeRO-1,
# ZeRO-3, pipeline x data (ZeRO-1 over data) with 2, 4 and 8 stages, and for a gpt job
# tensor x data (ZeRO-1) with tensor degrees 2, 4, 8 and tensor 8 x pipeline 4 — with
# `train --dry-run --np N --ranks-per-host R --json`, drops those whose largest rank does
# not fit the device memory, and recommends the fastest. Nothing runs but the dry runs.
#
#   tools/predict_scale.sh JOB [--ranks "8 64 512 4096"] [--ranks-per-host 8]
#                              [--memory-gb 80] [--calibration FILE|gpu-cluster] [--batch-per-rank K]
#                              [--plans "zero-1,zero-3,..."] [--set KEY=VALUE ...] [--bin DIR]
#
# --plans keeps only the named ones (comma-separated). --batch-per-rank K sets
# data.batch_size to K x N at each N (weak scaling); without it the job's global batch
# stays (strong scaling), and plans it does not divide are skipped. A pipeline plan's
# dry run times every layer on a real micro-batch: for a billion-parameter model on a
# CPU, leave the pipeline plans out (--plans "data parallel,zero-1,zero-3").
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { sed -n '2,/^set -e/p' "$0" | sed '$d' >&2; exit 2; }
job=$1
shift
ranks="8 64 512 4096" per_host=8 memory_gb=80 calibration=gpu-cluster per_rank="" bin=build/bin only=""
sets=()
while (($#)); do
  case $1 in
    --ranks) ranks=$2; shift 2 ;;
    --ranks-per-host) per_host=$2; shift 2 ;;
    --memory-gb) memory_gb=$2; shift 2 ;;
    --calibration) calibration=$2; shift 2 ;;
    --batch-per-rank) per_rank=$2; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --plans) only=$2; shift 2 ;;
    *) echo "predict_scale.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
train=$bin/train
[[ -x $train ]] || { echo "predict_scale.sh: no $train: build first" >&2; exit 2; }
cal=()
[[ -n $calibration ]] && cal=(--calibration "$calibration")

# name | --set ... (N: the rank count, D: N / (stages x tensor degree))
plans=(
  "data parallel|mesh.data=N"
  "zero-1|mesh.data=N zero.stage=1"
  "zero-3|mesh.data=N zero.stage=3"
  "pipeline 2 x zero-1|mesh.pipeline=2 mesh.data=D zero.stage=1 pipeline.micro_batches=M"
  "pipeline 4 x zero-1|mesh.pipeline=4 mesh.data=D zero.stage=1 pipeline.micro_batches=M"
  "pipeline 8 x zero-1|mesh.pipeline=8 mesh.data=D zero.stage=1 pipeline.micro_batches=M"
)
# Tensor parallelism splits the gpt model's layers (sequence-parallel: the activations
# between them shrink too); its groups stay inside a host while the degree is at most --ranks-per-host.
if grep -Eq 'type: *gpt' "$job" || [[ "${sets[*]}" == *model.type=gpt* ]]; then
  plans+=(
    "tensor 2 x zero-1|mesh.tensor=2 tensor.sequence_parallel=true mesh.data=D zero.stage=1"
    "tensor 4 x zero-1|mesh.tensor=4 tensor.sequence_parallel=true mesh.data=D zero.stage=1"
    "tensor 8 x zero-1|mesh.tensor=8 tensor.sequence_parallel=true mesh.data=D zero.stage=1"
    "tensor 8 x pipeline 4|mesh.tensor=8 tensor.sequence_parallel=true mesh.pipeline=4 mesh.data=D zero.stage=1 pipeline.micro_batches=M"
  )
fi
summary=()
for n in $ranks; do
  batch_set=()
  [[ -n $per_rank ]] && batch_set=(--set "data.batch_size=$((per_rank * n))")
  echo "== $n ranks ($per_host per host)"
  printf '  %-22s %12s %14s %10s %12s  %s\n' plan "step" samples/s efficiency "memory/rank" note
  best="" best_s=""
  for p in "${plans[@]}"; do
    IFS='|' read -r name spec <<<"$p"
    [[ -z $only || ",$only," == *",$name,"* ]] || continue
    stages=1 tensor=1
    [[ $spec =~ mesh.pipeline=([0-9]+) ]] && stages=${BASH_REMATCH[1]}
    [[ $spec =~ mesh.tensor=([0-9]+) ]] && tensor=${BASH_REMATCH[1]}
    ((n % (stages * tensor) == 0)) || continue
    d=$((n / (stages * tensor)))
    # micro-batches: 4 per stage (a bubble of (p-1)/(5p-1)), fewer when the batch is short
    args=()
    for s in $spec; do
      s=${s//=N/=$n}
      s=${s//=D/=$d}
      s=${s//=M/=$((4 * stages))}
      args+=(--set "$s")
    done
    if ! out=$("$train" "$job" "${sets[@]}" "${batch_set[@]}" "${args[@]}" --dry-run --np "$n" --ranks-per-host "$per_host" \
                 "${cal[@]}" --json 2>&1); then
      printf '  %-22s %s\n' "$name" "not a plan here: $(tail -1 <<<"$out" | cut -c1-110)"
      continue
    fi
    line=$(python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
c = j["cost"]
mem = max(r["bytes"]["total"] for r in j["estimate"])
fits = mem <= float(sys.argv[1]) * 2**30
print("%.6f %.1f %.4f %.2f %d" % (c["step_s"], c["samples_per_s"], c["efficiency"], mem / 2**30, fits))' "$memory_gb" <<<"$out")
    read -r step sps eff mem fits <<<"$line"
    note=""
    ((fits)) || note="does not fit ${memory_gb} GiB"
    printf '  %-22s %10.1f ms %14.0f %9.1f%% %9.1f GiB  %s\n' "$name" "$(awk -v s="$step" 'BEGIN {print s * 1000}')" \
      "$sps" "$(awk -v e="$eff" 'BEGIN {print e * 100}')" "$mem" "$note"
    if ((fits)) && { [[ -z $best_s ]] || awk -v a="$step" -v b="$best_s" 'BEGIN {exit !(a < b)}'; }; then
      best=$name best_s=$step best_line=$(printf '%s: %.1f ms, %.0f samples/s, efficiency %.1f%%, %.1f GiB/rank' "$name" \
        "$(awk -v s="$step" 'BEGIN {print s * 1000}')" "$sps" "$(awk -v e="$eff" 'BEGIN {print e * 100}')" "$mem")
    fi
  done
  if [[ -n $best ]]; then
    echo "  recommended: $best_line"
    summary+=("$(printf '%6d ranks  %s' "$n" "$best_line")")
  else
    echo "  recommended: none fits ${memory_gb} GiB per rank"
    summary+=("$(printf '%6d ranks  none fits' "$n")")
  fi
done
echo "== recommended plans"
printf '%s\n' "${summary[@]}"
