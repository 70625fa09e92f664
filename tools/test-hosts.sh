#!/usr/bin/env bash
# tools/test-hosts.sh: K test hosts on this machine, for multi-host runs without a cluster.
#
#   tools/test-hosts.sh up K [--rate RATE] [--delay DELAY]
#       Brings up hosts tetra-host1..K (idempotent: the same K and link leave everything as
#       it is; another K or link rebuilds them). Each host is a Linux network namespace with
#       its own UTS namespace (so `hostname` and gethostname() say tetra-hostI), one
#       interface eth0 with address 10.213.0.I/24, and a bridge tetra-br0 joining them
#       (the machine itself is 10.213.0.254 on it); /etc/hosts names them, in lines
#       that `down` removes. --rate and --delay shape every host's
#       link in both directions, e.g. --rate 10gbit --delay 50us: a packet from one host
#       to another passes two shapers (its own eth0, then the other host's bridge port),
#       so it takes 2 x DELAY one way. --delay needs tc's netem; where the kernel lacks it
#       (as on the project's CI machines) --rate alone is a token bucket (tbf).
#   tools/test-hosts.sh run -np N [mpirun options] CMD [ARGS...]
#       mpirun across the hosts: ranks fill host 1, then host 2, ... (ceil(N/K) per host),
#       each rank runs inside its host's namespaces, ranks on one host talk through shared
#       memory and ranks on different hosts through TCP over the bridge, as on a cluster.
#       Open MPI starts its daemon on each host through this script's `agent` (its
#       plm_rsh_agent): no ssh daemon. Options before CMD go to mpirun as they are.
#   tools/test-hosts.sh hostfile [N]
#       Prints the path of an Open MPI hostfile for the hosts (N ranks: ceil(N/K) slots
#       each; without N, one slot per core). For a plain mpirun, the settings come from
#       the environment:
#         eval "$(tools/test-hosts.sh env)"
#         mpirun --hostfile "$(tools/test-hosts.sh hostfile 4)" -np 4 --bind-to none CMD
#   tools/test-hosts.sh exec HOST CMD [ARGS...]   run a command on one host
#   tools/test-hosts.sh kill HOST                 SIGKILL every process on HOST at once
#                                                 (a host that dies: its ranks and Open
#                                                 MPI's daemon; the host stays up)
#   tools/test-hosts.sh status                    what is up, and the link
#   tools/test-hosts.sh down                      removes everything `up` made
#
# Needs root (network and UTS namespaces, a bridge, veth pairs) and iproute2. Nothing
# outside this machine is touched: the bridge has no uplink and no route leaves it.
# State lives in /run/tetra-test-hosts (TETRA_TEST_HOSTS_STATE to move it).
set -euo pipefail

state=${TETRA_TEST_HOSTS_STATE:-/run/tetra-test-hosts}
net=10.213.0
bridge=tetra-br0
self=$(readlink -f "$0")

die() { echo "test-hosts: $*" >&2; exit 2; }
need_root() {
  [[ $(id -u) -eq 0 ]] || die "needs root (network and UTS namespaces); run it as root or with sudo"
  command -v ip >/dev/null || die "needs iproute2's ip (apt-get install iproute2)"
}
host_count() { [[ -f $state/config ]] && sed -n 's/^hosts=//p' "$state/config" || echo 0; }
# The namespaces of host I, as nsenter options.
ns_of() { echo "--net=/run/netns/tetra-host$1 --uts=$state/uts/tetra-host$1"; }
host_index() {  # tetra-hostI or 10.213.0.I -> I
  local h=$1
  case $h in
    tetra-host[0-9]*) echo "${h#tetra-host}" ;;
    "$net".[0-9]*) echo "${h##*.}" ;;
    *) die "unknown test host '$h' (the hosts are tetra-host1..$(host_count))" ;;
  esac
}

down() {
  need_root
  local k i pid
  k=$(host_count)
  for ((i = 1; i <= (k > 0 ? k : 64); i++)); do
    [[ -e /run/netns/tetra-host$i || -e $state/uts/tetra-host$i ]] || { ((k > 0)) && continue; ((i > 8)) && break; continue; }
    # Processes still inside a host (a rank of an aborted run) would keep it alive.
    for pid in $(ip netns pids "tetra-host$i" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip link del "tetra-v$i" 2>/dev/null || true
    ip netns del "tetra-host$i" 2>/dev/null || true
    if [[ -e $state/uts/tetra-host$i ]]; then
      umount "$state/uts/tetra-host$i" 2>/dev/null || true
      rm -f "$state/uts/tetra-host$i"
    fi
  done
  ip link del "$bridge" 2>/dev/null || true
  forget_names
  rm -rf "$state"
}

# The hosts' names in /etc/hosts, each line marked, so that tetra-hostI resolves on every
# host as a cluster's DNS would (gloo's rendezvous at the first node of a Slurm step, a
# host's own address for gloo's sockets). Rewritten in place: /etc/hosts may be a bind mount.
hosts_mark="# tetra-test-hosts"
forget_names() {
  grep -q "$hosts_mark\$" /etc/hosts 2>/dev/null || return 0
  local kept
  kept=$(grep -v "$hosts_mark\$" /etc/hosts)
  printf '%s\n' "$kept" >/etc/hosts
}

up() {
  need_root
  local k=${1:-}
  shift || true
  [[ $k =~ ^[0-9]+$ ]] && ((k >= 1 && k <= 250)) || die "up K: K must be a number of hosts from 1 to 250, not '${k}'"
  local rate="" delay="" i
  while (($#)); do
    case $1 in
      --rate) rate=${2:?--rate needs a value, e.g. 10gbit}; shift 2 ;;
      --delay) delay=${2:?--delay needs a value, e.g. 50us}; shift 2 ;;
      *) die "up: unknown option '$1' (known: --rate RATE, --delay DELAY)" ;;
    esac
  done
  local want="hosts=$k"$'\n'"rate=$rate"$'\n'"delay=$delay"
  if [[ -f $state/config && $(cat "$state/config") == "$want" ]] && all_up "$k"; then
    echo "test-hosts: $k host(s) already up"
    return
  fi
  local shape=()
  if [[ -n $delay ]]; then
    has_netem || die "--delay needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM); --rate alone works (tbf)"
    shape=(netem delay "$delay" ${rate:+rate "$rate"})
  elif [[ -n $rate ]]; then
    read -ra shape <<<"$(tbf_of "$rate")"
    ((${#shape[@]})) || die "--rate: '$rate' is not a rate like 10gbit, 800mbit or 100kbit"
  fi
  down
  mkdir -p "$state/uts"
  echo "hosts=$k" >"$state/config"  # so that `down` finds what a failed `up` left
  # Whatever fails from here on leaves nothing half made.
  trap 'down; echo "test-hosts: up failed; removed what it had made" >&2' ERR
  ip link add "$bridge" type bridge
  ip addr add "$net.254/24" dev "$bridge"
  ip link set "$bridge" up
  for ((i = 1; i <= k; i++)); do
    ip netns add "tetra-host$i"
    ip link add "tetra-v$i" type veth peer name eth0 netns "tetra-host$i"
    ip link set "tetra-v$i" master "$bridge" up
    ip -n "tetra-host$i" link set lo up
    ip -n "tetra-host$i" addr add "$net.$i/24" dev eth0
    ip -n "tetra-host$i" link set eth0 up
    if ((${#shape[@]})); then
      # Both directions: the host's eth0 shapes what it sends, the bridge port what it receives.
      ip netns exec "tetra-host$i" tc qdisc add dev eth0 root "${shape[@]}"
      tc qdisc add dev "tetra-v$i" root "${shape[@]}"
    fi
    touch "$state/uts/tetra-host$i"
    unshare --uts="$state/uts/tetra-host$i" hostname "tetra-host$i"
    # (a file whose last line has no newline would take ours as part of it)
    [[ ! -s /etc/hosts || -z $(tail -c 1 /etc/hosts) ]] || echo >>/etc/hosts
    echo "$net.$i tetra-host$i $hosts_mark" >>/etc/hosts
  done
  trap - ERR
  printf '%s\n' "$want" >"$state/config"
  echo "test-hosts: $k host(s) up: tetra-host1..$k at $net.1..$k${rate:+, rate $rate}${delay:+, delay $delay}"
}

has_netem() {
  ip link add tetra-probe0 type veth peer name tetra-probe1 2>/dev/null || return 1
  local ok=0
  tc qdisc add dev tetra-probe0 root netem delay 1us 2>/dev/null || ok=1
  ip link del tetra-probe0 2>/dev/null || true
  return $ok
}

# A token bucket for RATE (tc's units: kbit, mbit, gbit): a burst of 10 ms at that rate
# (at least 64 KiB, so one jumbo segment always fits) and a queue of at most 50 ms.
tbf_of() {
  local r=$1 num unit bps
  [[ $r =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || return 0
  num=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
  case $unit in kbit) bps=$((num * 1000)) ;; mbit) bps=$((num * 1000000)) ;; gbit) bps=$((num * 1000000000)) ;; esac
  local burst=$((bps / 8 / 100))
  ((burst < 65536)) && burst=65536
  echo "tbf rate $r burst $burst latency 50ms"
}

all_up() {
  local i
  for ((i = 1; i <= $1; i++)); do
    [[ -e /run/netns/tetra-host$i && -e $state/uts/tetra-host$i ]] || return 1
  done
  ip link show "$bridge" >/dev/null 2>&1
}

require_up() {
  local k
  k=$(host_count)
  ((k > 0)) && all_up "$k" || die "no test hosts are up: run 'tools/test-hosts.sh up K' first"
  echo "$k"
}

write_hostfile() {  # N -> path
  local n=$1 k i
  k=$(require_up) || exit 2
  local per=$(((n + k - 1) / k))
  local f="$state/hostfile.$n"
  : >"$f"
  for ((i = 1; i <= k; i++)); do echo "tetra-host$i slots=$per" >>"$f"; done
  echo "$f"
}

# Open MPI's settings for the hosts, as environment variables (OMPI_MCA_*), so that a plain
# mpirun picks them up. Open MPI 5 (Debian 13) starts its daemons through PRRTE, which
# reads its own (PRTE_MCA_*, its ssh launcher's names) and not OMPI_MCA_plm_*; Open MPI 4
# ignores those. The agent starts Open MPI's daemon inside each host; daemons and
# ranks talk over the bridge only (each host's loopback is its own).
mpirun_env() {
  cat <<EOF
export OMPI_MCA_plm_rsh_agent="$self agent"
export OMPI_MCA_plm_rsh_no_tree_spawn=1
export OMPI_MCA_oob_tcp_if_include=$net.0/24
export OMPI_MCA_btl_tcp_if_include=$net.0/24
export OMPI_MCA_btl=self,vader,tcp
export PRTE_MCA_plm_ssh_agent="$self agent"
export PRTE_MCA_plm_ssh_no_tree_spawn=1
EOF
}

# Open MPI calls its rsh agent as `AGENT HOST COMMAND...`, as it would call ssh: the command
# is shell text (it may set variables before starting orted). Run it inside the host.
agent() {
  local host=${1:?agent: no host}
  shift
  local i
  i=$(host_index "$host")
  # shellcheck disable=SC2046
  exec nsenter $(ns_of "$i") /bin/sh -c "$*"
}

case ${1:-} in
  up) shift; up "$@" ;;
  down) down ;;
  status)
    k=$(host_count)
    if ((k == 0)); then echo "test-hosts: none up"; exit 0; fi
    cat "$state/config"
    for ((i = 1; i <= k; i++)); do
      # shellcheck disable=SC2046
      printf 'tetra-host%s: %s %s\n' "$i" "$(nsenter $(ns_of "$i") hostname)" \
        "$(ip -n "tetra-host$i" -4 -o addr show dev eth0 | awk '{print $4}')"
    done ;;
  hostfile) shift; hf=$(write_hostfile "${1:-$(nproc)}") || exit 2; echo "$hf" ;;
  env) require_up >/dev/null || exit 2; mpirun_env ;;
  exec)
    shift
    i=$(host_index "${1:?exec HOST CMD...}") || exit 2
    shift
    require_up >/dev/null || exit 2
    # shellcheck disable=SC2046
    exec nsenter $(ns_of "$i") "$@" ;;
  kill)
    i=$(host_index "${2:?kill HOST}") || exit 2
    require_up >/dev/null || exit 2
    pids=$(ip netns pids "tetra-host$i")
    [[ -n $pids ]] || { echo "test-hosts: nothing runs on tetra-host$i"; exit 0; }
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null || true
    echo "test-hosts: killed $(wc -w <<<"$pids") process(es) on tetra-host$i" ;;
  run)
    shift
    [[ ${1:-} == -np || ${1:-} == -n ]] && [[ ${2:-} =~ ^[0-9]+$ ]] || die "run: usage: run -np N [mpirun options] CMD [ARGS...]"
    n=$2
    shift 2
    hf=$(write_hostfile "$n") || exit 2
    root_opts=()
    [[ $(id -u) -eq 0 ]] && root_opts=(--allow-run-as-root)
    eval "$(mpirun_env)"
    exec mpirun "${root_opts[@]}" -np "$n" --hostfile "$hf" --map-by slot --bind-to none "$@" ;;
  agent) shift; agent "$@" ;;
  -h | --help | help | "") sed -n '2,/^set -euo/p' "$0" | sed '$d;s/^# \{0,1\}//' ;;
  *) die "unknown command '$1' (up K, run -np N CMD, hostfile [N], env, exec HOST CMD, kill HOST, status, down; --help)" ;;
esac
