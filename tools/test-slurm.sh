#!/usr/bin/env bash
# tools/test-slurm.sh: a real Slurm cluster on this machine, for srun-launched runs in tests.
#
#   tools/test-slurm.sh up [--hosts]
#       Starts munged, slurmctld and slurmd (Debian's slurm-wlm: slurmctld, slurmd,
#       slurm-client, munge) with a configuration of their own, on ports 16817/16818, and
#       waits until the nodes are idle. Without --hosts the cluster is this machine: one
#       node, named as `hostname -s`, at 127.0.0.1. With --hosts each test host of
#       tools/test-hosts.sh (which must be up) is a node: a slurmd runs inside its
#       namespaces, so the nodes are tetra-host1..K at 10.213.0.I, and slurmctld listens
#       on the bridge (10.213.0.254). Each node declares 8 CPUs (SlurmdParameters=
#       config_overrides), so 4-rank jobs fit on a 2-core machine, as mpirun
#       --oversubscribe does. Idempotent: `up` on a running cluster of the same shape
#       leaves it as it is.
#   tools/test-slurm.sh srun [SRUN OPTIONS] CMD [ARGS...]
#       srun against this cluster; with --hosts it runs from tetra-host1, as from a login
#       node that is also a compute node.
#   tools/test-slurm.sh exec CMD [ARGS...]
#       any command there, with SLURM_CONF set (sbatch --wait, squeue, scancel, ...)
#   tools/test-slurm.sh env       prints `export SLURM_CONF=...` for srun, sinfo, squeue
#   tools/test-slurm.sh status    sinfo
#   tools/test-slurm.sh down      stops the daemons, removes the state
#
# Needs root and the packages above (tools/setup.sh installs them). Nothing of the
# system's own Slurm or munge is used or touched: the key, the sockets, the spool and the
# logs live in /run/tetra-test-slurm (TETRA_TEST_SLURM_STATE to move it).
set -euo pipefail

state=${TETRA_TEST_SLURM_STATE:-/run/tetra-test-slurm}
hosts_tool="$(cd "$(dirname "$0")" && pwd)/test-hosts.sh"
ctld_port=16817
slurmd_port=16818

die() { echo "test-slurm: $*" >&2; exit 2; }
# After a daemon started: stop what `up` started, then say why (the message is read
# from the logs before `down` removes them).
fail() {
  down >/dev/null 2>&1 || true
  die "$@"
}

need() {
  [[ $(id -u) -eq 0 ]] || die "needs root (the daemons run as root)"
  local p
  for p in munged slurmctld slurmd srun sinfo; do
    command -v "$p" >/dev/null ||
      die "no $p: apt-get install slurmctld slurmd slurm-client munge (tools/setup.sh does)"
  done
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfile() {  # pidfile: SIGTERM, then SIGKILL after 5 s
  [[ -f $1 ]] || return 0
  local pid
  pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$1"
}

down() {
  [[ -d $state ]] || { echo "test-slurm: none up"; return 0; }
  if [[ -f $state/slurm.conf ]]; then
    # jobs first, so that no step outlives the daemons
    SLURM_CONF=$state/slurm.conf timeout 5 scancel --full --quiet -u root 2>/dev/null || true
  fi
  local f
  for f in "$state"/slurmd-*.pid; do [[ -e $f ]] && stop_pidfile "$f"; done
  stop_pidfile "$state/slurmctld.pid"
  stop_pidfile "$state/munged.pid"
  rm -rf "$state"
  echo "test-slurm: down"
}

# node name -> the nsenter prefix that runs a command on it ("" for this machine)
on_node() {
  case $1 in
    tetra-host[0-9]*) echo "$hosts_tool exec $1" ;;
    *) echo "" ;;
  esac
}

write_conf() {  # shape
  local shape=$1 ctld_addr nodes
  if [[ $shape == hosts ]]; then
    local k
    k=$("$hosts_tool" status | sed -n 's/^hosts=//p')
    [[ -n $k && $k -gt 0 ]] || die "up --hosts: the test hosts are not up (tools/test-hosts.sh up K)"
    ctld_addr=10.213.0.254
    nodes=""
    for ((i = 1; i <= k; i++)); do
      nodes+="NodeName=tetra-host$i NodeAddr=10.213.0.$i CPUs=8 RealMemory=2000 State=UNKNOWN"$'\n'
    done
  else
    ctld_addr=127.0.0.1
    nodes="NodeName=$(hostname -s) NodeAddr=127.0.0.1 CPUs=8 RealMemory=2000 State=UNKNOWN"$'\n'
  fi
  cat >"$state/slurm.conf" <<EOF
# written by tools/test-slurm.sh ($shape)
ClusterName=tetra-test
SlurmctldHost=$(hostname -s)($ctld_addr)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$state/munge.socket
CredType=cred/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool-%n
TmpFS=$state/node-tmp
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=30
$nodes
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  # No cgroups (proctrack/linuxproc and task/none use none). Slurm 24.11's slurmd looks
  # for a cgroup file system all the same and stops where /sys/fs/cgroup has none (a
  # container, a chroot: "No filesystem mounted on /sys/fs/cgroup") unless cgroup.conf
  # says CgroupPlugin=disabled, a value that came with 24.05 (22.05 knows no such value).
  local v
  v=$(slurmd -V 2>/dev/null | sed -n 's/^slurm[^ ]* \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')  # "slurm-wlm 22.05.8"
  if [[ -n $v ]] && ((10#${v% *} * 100 + 10#${v#* } >= 2405)); then
    echo "CgroupPlugin=disabled" >"$state/cgroup.conf"
  fi
  echo "$shape" >"$state/shape"
}

up() {
  local shape=local
  while (($#)); do
    case $1 in
      --hosts) shape=hosts; shift ;;
      *) die "up: unknown option '$1' (known: --hosts)" ;;
    esac
  done
  need
  if [[ -f $state/shape && $(cat "$state/shape") == "$shape" ]] && pid_alive "$state/slurmctld.pid"; then
    echo "test-slurm: up ($shape)"
    return 0
  fi
  down >/dev/null
  mkdir -p "$state/ctld"
  write_conf "$shape"
  export SLURM_CONF=$state/slurm.conf
  # munge: a key of our own, its socket in the state directory
  dd if=/dev/urandom of="$state/munge.key" bs=1 count=1024 status=none
  chmod 0400 "$state/munge.key"
  munged --force --key-file="$state/munge.key" --socket="$state/munge.socket" \
    --pid-file="$state/munged.pid" --log-file="$state/munged.log" --seed-file="$state/munged.seed" ||
    die "munged did not start: $(tail -3 "$state/munged.log" 2>/dev/null)"
  slurmctld -i -f "$SLURM_CONF" ||
    fail "slurmctld did not start: $(tail -5 "$state/slurmctld.log" 2>/dev/null)"
  # It forks before it binds its port: a failure after that shows only in its log.
  ctld_alive() { pid_alive "$state/slurmctld.pid"; }
  local node
  for node in $(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' "$SLURM_CONF"); do
    mkdir -p "$state/spool-$node" "$state/tmp-$node" "$state/node-tmp"
    # Each node's TmpFS is its own, as local disks are (Slurm's PMIx plugin keeps a
    # directory per step there, under the same name on every node): slurmd runs in a mount
    # namespace of its own where TmpFS is the node's directory. All else stays shared.
    # shellcheck disable=SC2046
    $(on_node "$node") unshare --mount --propagation private /bin/sh -c \
      "mount --bind '$state/tmp-$node' '$state/node-tmp' && exec env SLURM_CONF='$SLURM_CONF' slurmd -f '$SLURM_CONF' -N '$node'" ||
      fail "slurmd on $node did not start: $(tail -5 "$state/slurmd-$node.log" 2>/dev/null)"
  done
  # ready when every node is idle
  local want
  want=$(grep -c '^NodeName=' "$SLURM_CONF")
  local start=$SECONDS
  while ((SECONDS - start < 30)); do
    if ((SECONDS - start >= 2)) && ! ctld_alive; then
      local logs
      logs=$(tail -3 "$state/slurmctld.log" 2>/dev/null)
      fail "slurmctld stopped while starting: $logs"
    fi
    if [[ $(timeout 2 sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l) -eq $want ]]; then
      echo "test-slurm: up ($shape): $(sinfo -h -N -o '%N' | sort -u | paste -sd, -)"
      return 0
    fi
    sleep 0.1
  done
  timeout 2 sinfo -N -l >&2 || true
  local logs
  logs=$(tail -5 "$state/slurmctld.log" 2>/dev/null)
  fail "the nodes did not become idle in 30 s; slurmctld said: $logs"
}

case ${1:-} in
  up) shift; up "$@" ;;
  down) down ;;
  env) [[ -f $state/slurm.conf ]] || die "not up"; echo "export SLURM_CONF=$state/slurm.conf" ;;
  status)
    [[ -f $state/slurm.conf ]] || { echo "test-slurm: none up"; exit 0; }
    SLURM_CONF=$state/slurm.conf exec sinfo -N -l ;;
  srun | exec)
    [[ $1 == srun ]] || shift
    [[ -f $state/slurm.conf ]] || die "not up (tools/test-slurm.sh up [--hosts])"
    (($#)) || die "exec: no command"
    export SLURM_CONF=$state/slurm.conf
    if [[ $(cat "$state/shape") == hosts ]]; then
      exec "$hosts_tool" exec tetra-host1 env SLURM_CONF="$SLURM_CONF" "$@"
    fi
    exec "$@" ;;
  -h | --help | help | "") sed -n '2,/^set -euo/p' "$0" | sed '$d;s/^# \{0,1\}//' ;;
  *) die "unknown command '$1' (up [--hosts], srun ..., exec CMD ..., env, status, down; --help)" ;;
esac
