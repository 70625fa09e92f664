# tools/gpu/lib.sh: what the GPU check's steps share (sourced by tools/gpu/steps.sh).
#
# A step runs as `timeout T bash tools/gpu/steps.sh NAME` (tools/gpu-check.sh starts it)
# with REPO, WORK, BUILD, PREFIX, LOGS, STEPS, CARRY, DEVICE, STEP, LOG and STEP_DEADLINE
# in its environment. It leaves, in $STEPS:
#   NAME.reason    one line: why it failed or was skipped (or a note when it passed)
#   NAME.headline  one line of figures, printed under the step's status
#   NAME.fig       "key<TAB>JSON value" lines: its figures for the summary
# and exits 0 (pass), 3 (skipped) or anything else (fail).
# shellcheck shell=bash

ARCH_TRIPLET=x86_64-linux-gnu
SKIP_RC=3
GPU_DIR=$REPO/tools/gpu

now() { date +%s.%N; }
reason() { printf '%s\n' "$*" >"$STEPS/$STEP.reason"; }
figure() { printf '%s\t%s\n' "$1" "$2" >>"$STEPS/$STEP.fig"; }
figure_str() { figure "$1" "$(json_str "$2")"; }
headline() { printf '%s\n' "$*" >"$STEPS/$STEP.headline"; echo "$*"; }
fail() { reason "$*"; echo "gpu-check: $STEP: $*" >&2; exit 1; }
skip() { reason "$*"; echo "gpu-check: $STEP: skipped: $*" >&2; exit "$SKIP_RC"; }
# Seconds left to this step (its own limit counts from its start).
left() { awk -v d="$STEP_DEADLINE" -v n="$(now)" 'BEGIN { s = int(d - n); print (s > 1 ? s : 1) }'; }

json_str() {
  local s
  s=$(printf '%s' "$1" | tr -d '\000-\010\013\014\016-\037')
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\t'/\\t}
  s=${s//$'\r'/}
  s=${s//$'\n'/\\n}
  printf '"%s"' "$s"
}

# What the environment step found ($LOGS/env.sh): PY (the python3 whose torch the build
# uses), HOSTPY (a python3 for the helpers), NVCC, GPU_NAME, GPU_COUNT, TORCH_JSON.
if [[ -f $LOGS/env.sh ]]; then
  # shellcheck source=/dev/null
  source "$LOGS/env.sh"
fi
HOSTPY=${HOSTPY:-$(command -v python3 || echo /usr/bin/python3)}

# The helpers run under this machine's python3, never the carried libraries' environment.
hpy() { env -u LD_LIBRARY_PATH "$HOSTPY" "$@"; }
tpy() { env -u LD_LIBRARY_PATH "${PY:?no python3 with torch (the environment step found none)}" "$@"; }
# torch VALUE: a key of the torch probe's JSON ("" for null or absent).
torch() { hpy "$GPU_DIR/jget.py" "$TORCH_JSON" "$1"; }
# figures STEP KEY: a figure another step left ("" when absent).
figure_of() { hpy "$GPU_DIR/jget.py" --fig "$STEPS/$1.fig" "$2"; }

# The carried prefix's environment: programs, libraries, Open MPI and PMIx relocated.
prefix_env() {
  local lib=$PREFIX/usr/lib/$ARCH_TRIPLET
  export PATH="$PREFIX/usr/bin:$PATH"
  # Some packages (libnl-3-200) still put their libraries in /lib.
  export LD_LIBRARY_PATH="$lib:$PREFIX/lib/$ARCH_TRIPLET:$lib/openmpi/lib:$lib/pmix2/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # Open MPI takes its folders from OPAL_PREFIX (its components, wrapper data, help) and
  # OPAL_SYSCONFDIR (Debian's openmpi-mca-params.conf: no openib, UCX or OFI).
  export OPAL_PREFIX="$PREFIX/usr"
  export OPAL_SYSCONFDIR="$PREFIX/etc/openmpi"
  # Debian's PMIx (its own prefix, /usr/lib/<triplet>/pmix2) has absolute plugin and
  # help folders: named one by one.
  export PMIX_INSTALL_PREFIX="$lib/pmix2"
  export PMIX_PKGLIBDIR="$lib/pmix2/lib/pmix"
  export PMIX_MCA_mca_base_component_path="$lib/pmix2/lib/pmix"
  export PMIX_PKGDATADIR="$lib/pmix2/share/pmix"
  export PKG_CONFIG_LIBDIR="$lib/pkgconfig:$PREFIX/usr/share/pkgconfig"
  # Headers that no CMake target or pkg-config file names (tetra includes them as if in
  # /usr/include): Debian's yaml-cpp 0.7 target has no include folder. After every -I
  # and -isystem, so a header torch ships itself wins.
  export CPLUS_INCLUDE_PATH="$PREFIX/usr/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  export C_INCLUDE_PATH="$PREFIX/usr/include${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}"
  # One host: mpirun forks its ranks and never runs ssh, but Open MPI 4 refuses to
  # start when the rsh agent it would use for other hosts (ssh) is not on the PATH.
  export OMPI_MCA_plm_rsh_agent=false
  # Ranks share this host: gloo's pairs over loopback.
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
  if [[ $(id -u) -eq 0 ]]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
}

# The carried mpirun, for ranks on this host alone.
# shellcheck disable=SC2034  # used by the steps that source this file
MPIRUN=()
# shellcheck disable=SC2034
mpirun_cmd() { MPIRUN=("$PREFIX/usr/bin/mpirun" --oversubscribe --bind-to none); }

# A fresh run folder (a run folder of an earlier check would be resumed or refused).
run_dir() {
  rm -rf "$LOGS/runs/$1"
  mkdir -p "$LOGS/runs"
  echo "$LOGS/runs/$1"
}

# N ranks of a command through the environment rendezvous (torchrun's variables: RANK,
# WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each rank's output
# to the log with its rank in front; the exit status is the first failing rank's.
env_ranks() {
  local n=$1 port=$2
  shift 2
  local -a pids=()
  local r rc=0
  for ((r = 0; r < n; r++)); do
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$@" > >(sed -u "s/^/[rank $r] /") 2>&1 &
    pids+=($!)
  done
  local code
  for r in "${!pids[@]}"; do
    code=0
    wait "${pids[$r]}" || code=$?
    if ((code && rc == 0)); then rc=$code; fi
  done
  return "$rc"
}

# The free TCP port from 29500 on that a rendezvous can listen at.
free_port() {
  hpy - <<'PY'
import socket
for p in range(29500, 29700):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    finally:
        s.close()
    print(p)
    break
PY
}
