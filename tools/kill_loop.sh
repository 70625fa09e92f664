#!/usr/bin/env bash
# kill_loop.sh — fault injection in a loop: start a training job, kill -9 one random rank
# at a random moment, and check what the issue promises:
#   - every surviving rank ends within 30 s (a rank still running after 60 s is a hang),
#     with exit status 3 and a message that names the dead rank (launcher gloo), or the
#     launcher ends the job (mpirun);
#   - running the same command again resumes from the last checkpoint and ends with
#     exactly the weights of an uninterrupted run (the exported safetensors, byte for byte).
# One line per trial, then a summary per strategy (trials, hangs, worst time to exit,
# resumes that matched).
#
#   tools/kill_loop.sh [--build build] [--trials 10] [--np 4] [--launcher gloo|mpirun]
#                      [--strategies "dp zero3 pipeline"] [--out /tmp/kill-loop]
set -uo pipefail

build=build trials=10 np=4 launcher=gloo strategies="dp zero3 pipeline" out=/tmp/kill-loop
while (($#)); do
  case $1 in
    --build) build=$2; shift 2 ;;
    --trials) trials=$2; shift 2 ;;
    --np) np=$2; shift 2 ;;
    --launcher) launcher=$2; shift 2 ;;
    --strategies) strategies=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "kill_loop.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
train=$(realpath "$build/bin/train")
[[ -x $train ]] || { echo "kill_loop.sh: no $train (build first)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$out"

# The job of one strategy on np ranks: 300 steps, a checkpoint every 10, the weights
# exported at the end.
job() {  # strategy dir
  local mesh extra
  case $1 in
    dp) mesh="{data: $np}"; extra="" ;;
    zero3) mesh="{data: $np}"; extra="zero: {stage: 3}" ;;
    pipeline) mesh="{pipeline: 2, data: $((np / 2))}"; extra="pipeline: {schedule: 1f1b, micro_batches: 4}" ;;
  esac
  cat > "$2/job.yaml" <<EOF
name: kill-$1
model: {type: mlp, hidden: [256, 128, 64]}
data: {type: synthetic, batch_size: 64}
optimizer: {type: sgd, lr: 0.05}
train: {max_steps: 300, seed: 7, threads: 1}
mesh: $mesh
$extra
collectives: {backend: $( [[ $launcher == gloo ]] && echo gloo || echo mpi ), timeout_s: 120}
checkpoint: {dir: $2/ckpt, every_steps: 10, keep: 2, safetensors: $2/final.safetensors}
log: {every: 1, progress: off, metrics: $2/metrics.jsonl, dir: $2}
EOF
}

# Starts the job; the rank pids land in $2/pids (one per line, rank order).
launch() {  # dir
  local d=$1 port
  : > "$d/pids"
  if [[ $launcher == gloo ]]; then
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    for ((r = 0; r < np; r++)); do
      RANK=$r WORLD_SIZE=$np LOCAL_RANK=$r LOCAL_WORLD_SIZE=$np MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        "$train" "$d/job.yaml" > "$d/out$r.txt" 2> "$d/err$r.txt" &
      echo $! >> "$d/pids"
    done
  else
    mpirun --oversubscribe --bind-to none -np "$np" "$train" "$d/job.yaml" > "$d/out.txt" 2> "$d/err.txt" &
    echo $! > "$d/mpirun.pid"
    local ranks=""
    for _ in $(seq 100); do
      ranks=$(pgrep -P "$(cat "$d/mpirun.pid")" -f "$train" | sort -n)
      [[ $(echo "$ranks" | grep -c .) -eq $np ]] && break
      sleep 0.1
    done
    echo "$ranks" > "$d/pids"
  fi
}

# Runs the job to its end in the foreground.
run_to_end() {  # dir
  launch "$1"
  if [[ $launcher == gloo ]]; then
    local st=0; for p in $(cat "$1/pids"); do wait "$p" || st=$?; done; return $st
  else
    wait "$(cat "$1/mpirun.pid")"
  fi
}

now() { date +%s.%N; }

printf '%-9s %5s %5s %8s %10s %8s %s\n' strategy trial rank "kill at" "exit (s)" resumed "statuses / note"
# "kill at": seconds after the first step; "exit": seconds from the kill until the last rank ended.
for s in $strategies; do
  ref="$out/$s-reference"; rm -rf "$ref"; mkdir -p "$ref"; job "$s" "$ref"
  t0=$(now); run_to_end "$ref" || { echo "$s: the uninterrupted run failed: $(cat "$ref"/err*.txt | tail -5)"; continue; }
  full=$(python3 -c "print(f'{$(now) - $t0:.1f}')")
  hangs=0 worst=0 matched=0 named=0
  for ((t = 1; t <= trials; t++)); do
    d="$out/$s-$t"; rm -rf "$d"; mkdir -p "$d"; job "$s" "$d"
    victim=$((RANDOM % np))
    at=$(python3 -c "import random; print(f'{random.uniform(0.0, 0.5 * $full):.2f}')")
    launch "$d"
    # A random moment of training: after the first step (a kill during start-up, before
    # the monitor is up, is bounded by collectives.timeout_s only).
    for _ in $(seq 1200); do [[ -s $d/metrics.jsonl ]] && break; sleep 0.05; done
    sleep "$at"
    pids=($(cat "$d/pids"))
    kill -9 "${pids[$victim]}" 2>/dev/null
    k=$(now) statuses="" last=0 hung=0
    for ((r = 0; r < np; r++)); do
      p=${pids[$r]}
      while kill -0 "$p" 2>/dev/null && [[ $(python3 -c "print(int($(now) - $k < 60))") == 1 ]]; do sleep 0.05; done
      if kill -0 "$p" 2>/dev/null; then hung=1; kill -9 "$p"; fi
      if [[ $launcher == gloo ]]; then wait "$p"; statuses+="$? "; fi
      last=$(python3 -c "print(f'{$(now) - $k:.2f}')")
    done
    [[ $launcher == mpirun ]] && { wait "$(cat "$d/mpirun.pid")"; statuses="mpirun $?"; }
    hangs=$((hangs + hung))
    worst=$(python3 -c "print(max($worst, $last))")
    note=""
    if [[ $launcher == gloo ]]; then
      survivors=$(cat "$d"/err*.txt | grep -c "rank $victim (host [^)]*) died" || true)
      [[ $survivors -eq $((np - 1)) ]] && named=$((named + 1)) || note="named by $survivors of $((np - 1)) survivors"
    fi
    for f in "$d"/out*.txt "$d"/err*.txt; do [[ -e $f ]] && mv "$f" "$d/killed-$(basename "$f")"; done
    # The kill may land after the run ended: then there is nothing to resume.
    if run_to_end "$d" >/dev/null 2>&1 && cmp -s "$d/final.safetensors" "$ref/final.safetensors"; then
      matched=$((matched + 1)); res=same
    else
      res=DIFFERENT
    fi
    printf '%-9s %5d %5d %8s %10s %8s %s %s\n' "$s" "$t" "$victim" "$at" "$last" "$res" "$statuses" "$note"
  done
  echo "== $s: $trials trials on $np ranks ($launcher), uninterrupted run $full s: hangs $hangs, worst time to exit $worst s, named by every survivor $named/$trials, resumed to the same weights $matched/$trials"
done
