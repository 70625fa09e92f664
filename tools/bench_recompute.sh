#!/usr/bin/env bash
# tools/bench_recompute.sh: what train.recompute saves (issue 48). One GPT (4 blocks,
# d_model 256, 8 heads, seq 1024, a batch of 8, the GPL's text), one process, trained a few
# steps under each of none, selective and blocks, one after another on the same machine:
# the dry run's estimate of the activations and of the whole rank, the peak RSS the OS
# counted (the run's summary), the median step time, and the final loss (the same in
# every mode: the numerics contract). The memory figures are deterministic; the times are
# this machine's at this moment (compare them within one run).
#
#   tools/bench_recompute.sh [--steps N] [--seq N] [--threads N] [--bin DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=6 seq=1024 threads=2 bin=build/bin
while (($#)); do
  case $1 in
    --steps) steps=$2; shift 2 ;;
    --seq) seq=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    *) echo "bench_recompute.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
train=$(readlink -f "$bin/train")
[[ -x $train ]] || { echo "bench_recompute.sh: no $bin/train: build first" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/job.yaml" <<YAML
name: recompute
model: {type: gpt, layers: 4, heads: 8, d_model: 256, dropout: 0.1}
data: {type: text, path: /usr/share/common-licenses/GPL-3, seq_len: $seq, batch_size: 8, eval_samples: 8}
optimizer: {type: adamw, lr: 1.0e-3}
train: {max_steps: $steps, eval_every: $steps, seed: 1, threads: $threads}
checkpoint: {dir: ""}
log: {every: 1, progress: off}
YAML
printf '%-10s %14s %14s %14s %10s %12s\n' recompute "est. activ." "est. rank" "peak RSS" "step ms" "final loss"
for mode in none selective blocks; do
  (cd "$work" && "$train" job.yaml --set name="r-$mode" --set train.recompute=$mode --dry-run --json >"dry-$mode.json" 2>/dev/null)
  (cd "$work" && "$train" job.yaml --set name="r-$mode" --set train.recompute=$mode >"run-$mode.log" 2>&1)
  python3 - "$work/dry-$mode.json" "$work/runs/r-$mode" "$mode" <<'PY'
import json, statistics, sys
dry = json.load(open(sys.argv[1]))["estimate"][0]["bytes"]
run = sys.argv[2]
summary = json.load(open(run + "/summary.json"))
rows = [json.loads(l) for l in open(run + "/metrics.jsonl")]
steps = [r for r in rows if "step_ms" in r]
rss = max(r.get("peak_rss_bytes", 0) for r in rows)
ms = statistics.median(sum(r["step_ms"].values()) for r in steps[1:] or steps)
mib = lambda b: "%.1f MiB" % (b / 2**20)
print("%-10s %14s %14s %14s %10.0f %12.6f" % (sys.argv[3], mib(dry["activations"]), mib(dry["total"]), mib(rss), ms,
                                                summary["final_loss"]))
PY
done
