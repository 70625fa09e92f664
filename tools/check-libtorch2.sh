#!/usr/bin/env bash
# tools/check-libtorch2.sh: tetra built and tested against Debian 13 (trixie)'s LibTorch 2.6
# and Open MPI 5, in a Debian 13 root beside this Debian 12 machine.
#
#   tools/check-libtorch2.sh [--build-dir DIR] [--no-suite] ROOT_DIR [-- CTEST_ARGS...]
#   tools/check-libtorch2.sh --shell ROOT_DIR [-- CMD...]
#       CMD (default: bash) in the root as the suite sees it (its mounts and namespaces,
#       in this checkout; a fresh /tmp of its own), after phases 1 and 2: to look into
#       a failure, e.g. -- ctest --test-dir build-lt2 -R Gloo --output-on-failure
#
# 1. root       The first run makes ROOT_DIR a minimal trixie root with debootstrap
#               (--variant=minbase, from deb.debian.org); later runs reuse it. A root
#               whose debootstrap did not finish is wiped and made again; a non-empty
#               ROOT_DIR that this script did not make is refused.
# 2. packages   Runs this checkout's tools/setup.sh inside the root (the one package list:
#               trixie names them all as Debian 12 does, LibTorch 2.6, Open MPI 5.0, Slurm
#               24.11, Chromium, python3-torch 2.6 ...), then ccache and ninja-build. Idle
#               when everything is there. Services never start (policy-rc.d says 101).
#               Debian 13's torchrun cannot start as packaged (it asks for a libuv
#               TCPStore, its torch has none): the root's copy is made to ask for the
#               classic server, and USE_LIBUV=0 is set in the root.
# 3. build      Configures (Ninja, ccache) and builds the whole tree in the root, in
#               DIR (default: build-lt2 in this checkout, which git ignores), -j2. The
#               ccache lives in the root (ROOT_DIR/var/cache/ccache): a rebuild with the
#               root kept takes minutes even after the build folder is removed.
# 4. suite      The whole ctest suite there (ctest -j2 --output-on-failure, plus
#               CTEST_ARGS, e.g. -- -R Gloo), as root, ending with ctest's closing line.
#
# Isolation: every phase runs in namespaces of its own (mount and PID; the build and the
# suite also network, UTS and IPC), so nothing the chroot mounts or starts is seen
# outside it, nor outlives it: the test hosts' bridge and namespaces (tools/test-hosts.sh),
# the Slurm daemons and munged (tools/test-slurm.sh), mpirun's daemons and Chromium all
# live and die inside, and a suite running on the machine itself at the same time (its
# bridge, its Slurm ports 16817/16818, its /etc/hosts lines) is not disturbed. The root
# gets its own /proc, /sys, a fresh /dev (the basic nodes, a new devpts, a /dev/shm
# tmpfs), a /run tmpfs and this checkout bound at its own path. Every exit path (a
# failure, ^C) unmounts what it mounted (a trap), and the end of the suite reports what
# the tests left running or mounted, and checks that nothing of the root is mounted or
# running outside.
#
# Needs: root; debootstrap, unshare, chroot (Debian 12: debootstrap, util-linux); HTTP
# to deb.debian.org (0.7 GB of packages, first run only); about 3.5 GB of disk in
# ROOT_DIR (the root with its packages 3.1 GB, its ccache 0.1-0.3 GB) and 0.3 GB for
# the build folder. Outside the root it installs nothing and changes nothing.
# Time, measured on a 2-core machine (Debian 12, at 884db41): from nothing 29 min (root
# 21 s, packages 59 s, configure and build 801 s at -j2, the suite 838 s: 616 tests, 3
# skipped); with the root kept 16 min (the build 28 s from the root's ccache, the suite
# 910 s). The same machine shared with two other builds and suites: packages 4 min, the
# build 30 min, the suite 35 min.
# Exit status: ctest's (0 when every test passed); 2 for a usage or setup error.
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/.." && pwd -P)
SUITE=trixie
MIRROR=http://deb.debian.org/debian
EXTRA_PACKAGES=(ccache ninja-build)   # the check's own tools, besides tools/setup.sh's list
CHROOT_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# (The last line runs main and exits on one line: bash reads a script as it runs it, and an
# edit of this file during a run must not feed the running one new lines.)

die() { echo "check-libtorch2: $*" >&2; exit 2; }
say() { echo "check-libtorch2: $*"; }
usage() { sed -n '2,/^set -euo/p' "$SELF" | sed -e '$d' -e 's/^# \{0,1\}//'; }

# ---- mounts ------------------------------------------------------------------------------
# The mount points at or under $1 in this mount namespace, deepest first.
mounts_under() {
  awk -v r="$1" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r
}
unmount_under() {
  local m
  for m in $(mounts_under "$1"); do umount -l "$m" 2>/dev/null || true; done
}

# The root's file systems, in this (private) mount namespace. $1: net = the machine's
# network (for apt: its resolv.conf is copied in).
mount_root() {
  local r=$ROOT n
  # The root a mount of its own, as / is on a machine: `ip netns add` (the test hosts)
  # makes / a slave mount, which a plain folder cannot be.
  mount --bind "$r" "$r"
  mount -t proc -o nosuid,nodev,noexec proc "$r/proc"
  mount -t sysfs -o nosuid,nodev,noexec sysfs "$r/sys"
  mount -t tmpfs -o mode=755,nosuid dev "$r/dev"
  for n in null zero full random urandom tty; do
    touch "$r/dev/$n"
    mount --bind "/dev/$n" "$r/dev/$n"
  done
  mkdir -p "$r/dev/pts" "$r/dev/shm" "$r/dev/mqueue"
  mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$r/dev/pts"
  ln -s pts/ptmx "$r/dev/ptmx"
  mount -t tmpfs -o mode=1777,nosuid,nodev shm "$r/dev/shm"
  mount -t mqueue mqueue "$r/dev/mqueue" 2>/dev/null || true
  ln -s /proc/self/fd "$r/dev/fd"
  ln -s /proc/self/fd/0 "$r/dev/stdin"
  ln -s /proc/self/fd/1 "$r/dev/stdout"
  ln -s /proc/self/fd/2 "$r/dev/stderr"
  mount -t tmpfs -o mode=755,nosuid,nodev run "$r/run"
  mkdir -p "$r/run/lock" "$r/run/user"
  mkdir -p "$r$REPO"
  mount --bind "$REPO" "$r$REPO"
  if [[ $BUILD_DIR != "$REPO"/* && $BUILD_DIR != "$ROOT"/* ]]; then
    mkdir -p "$r$B"
    mount --bind "$BUILD_DIR" "$r$B"
  fi
  # The machine's names, less the test hosts' lines of a suite running outside.
  grep -v '# tetra-test-hosts$' /etc/hosts >"$r/etc/hosts" || true
  [[ ${1:-} != net ]] || cp -L /etc/resolv.conf "$r/etc/resolv.conf"
}

in_root() {  # CMD...: in the chroot, with a clean environment
  chroot "$ROOT" /usr/bin/env -i PATH=$CHROOT_PATH HOME=/root USER=root LOGNAME=root LANG=C.UTF-8 \
    TERM=dumb DEBIAN_FRONTEND=noninteractive CCACHE_DIR=/var/cache/ccache CCACHE_MAXSIZE=1G USE_LIBUV=0 "$@"
}

# The processes of this PID namespace other than its first (this script).
others_in_namespace() {
  local p
  for p in "$ROOT"/proc/[0-9]*; do
    p=${p##*/}
    [[ $p == 1 || $p == "$BASHPID" ]] && continue
    [[ -r $ROOT/proc/$p/cmdline ]] && echo "$p"
  done
}

# ---- inside the namespaces -----------------------------------------------------------------
inner_packages() {
  trap 'unmount_under "$ROOT"' EXIT
  trap 'exit 130' INT TERM
  mount_root net
  in_root "$REPO/tools/setup.sh"
  local missing=() p
  for p in "${EXTRA_PACKAGES[@]}"; do
    in_root dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    in_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  in_root apt-get clean  # the downloaded .deb files (0.6 GB): installed, not needed again
  # Debian 13's python3-torch is built without libuv, and its torchrun asks c10d's TCPStore
  # for libuv's server all the same, so it cannot start ("use_libuv was requested but
  # PyTorch was build without libuv support"). PyTorch's switch, USE_LIBUV=0 (set in the
  # root's environment), reaches only some of torchrun's stores: the rendezvous handlers
  # that ignore it ask for the classic server here, in the root's copy only.
  local f
  for f in static_tcp_rendezvous c10d_rendezvous_backend dynamic_rendezvous; do
    f=$ROOT/usr/lib/python3/dist-packages/torch/distributed/elastic/rendezvous/$f.py
    if [[ -f $f ]] && ! grep -q 'use_libuv=False' "$f"; then
      sed -i 's/multi_tenant=True,/multi_tenant=True, use_libuv=False,  # tools\/check-libtorch2.sh/' "$f"
      say "torchrun: ${f#"$ROOT"} asks for the classic TCPStore server"
    fi
  done
  in_root sh -c 'dpkg-query -W -f="LibTorch \${Version}, " libtorch-dev; dpkg-query -W -f="Open MPI \${Version}, " libopenmpi-dev; dpkg-query -W -f="Slurm \${Version}\n" slurmd'
}

inner_build_suite() {
  trap 'unmount_under "$ROOT"' EXIT
  trap 'exit 130' INT TERM
  mount_root
  in_root ip link set lo up
  if ((NO_SUITE == 0)); then rm -f "$ROOT$B/check-libtorch2-ctest.log"; fi
  local t0=$SECONDS gen=() cache=$ROOT$B/CMakeCache.txt
  [[ -x $ROOT/usr/bin/ninja ]] && gen=(-G Ninja)
  if [[ -f $cache ]] && ! grep -q "^CMAKE_GENERATOR:INTERNAL=${gen[1]:-Unix Makefiles}\$" "$cache"; then
    die "$BUILD_DIR was configured with another generator; remove it or name another --build-dir"
  fi
  in_root cmake -S "$REPO" -B "$B" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache >"$ROOT/tmp/configure.log" ||
    { cat "$ROOT/tmp/configure.log"; die "configure failed"; }
  in_root ccache -z >/dev/null
  in_root cmake --build "$B" -j2
  say "ccache: $(in_root ccache -s | grep -iE '^ *(hits|misses)' | tr -s ' ' | paste -sd, -)"
  echo "configure+build $((SECONDS - t0)) s" >>"$STATE/phases"
  [[ $NO_SUITE == 0 ]] || return 0

  # The suite, in a clean /tmp of the root.
  find "$ROOT/tmp" -mindepth 1 -delete 2>/dev/null || true
  t0=$SECONDS
  local rc=0 before
  before=$(mounts_under "$ROOT")
  in_root sh -c 'cd "$1" && shift && exec ctest -j2 --output-on-failure "$@"' ctest "$B" "${CTEST_ARGS[@]}" |
    tee "$ROOT$B/check-libtorch2-ctest.log" || rc=$?
  echo "suite $((SECONDS - t0)) s" >>"$STATE/phases"

  # What the tests left behind, inside (all of it goes with the namespaces).
  local left
  left=$(for p in $(others_in_namespace); do
    printf '%s %s\n' "$p" "$(tr '\0' ' ' <"$ROOT/proc/$p/cmdline" 2>/dev/null | cut -c1-120)"
  done | grep -vE '^[0-9]+ *$|^[0-9]+ (tr|cut|grep) |check-libtorch2.sh --inner' || true)
  if [[ -n $left ]]; then
    say "left running by the suite (ended with its namespace):"
    echo "$left" | sed 's/^/  /'
  fi
  local netns links extra
  netns=$(in_root ip netns list 2>/dev/null || true)
  links=$(in_root ip -o link show 2>/dev/null | awk -F': ' '$2 != "lo" { print $2 }' || true)
  extra=$(comm -13 <(echo "$before" | sort) <(mounts_under "$ROOT" | sort) | grep -v "^$ROOT/run/netns\$" || true)
  [[ -z $netns ]] || say "network namespaces left by the suite (ended with its own): $(echo $netns)"
  [[ -z $links ]] || say "network links left by the suite (ended with its namespace): $(echo $links)"
  [[ -z $extra ]] || say "mounts left by the suite (unmounted now): $(echo $extra)"
  return "$rc"
}

inner_shell() {
  trap 'unmount_under "$ROOT"' EXIT
  trap 'exit 130' INT TERM
  mount_root
  # A /tmp of its own (the suite's is the root's, cleared when a suite starts): a shell
  # may run beside a check, and its PID namespace numbers processes from 1 as the
  # suite's does, so the session folders mpirun names after its PID (prterun.vm.38.0)
  # would collide with the suite's or with those a killed run left (prte_init fails).
  mount -t tmpfs -o mode=1777,nosuid,nodev tmp "$ROOT/tmp"
  in_root ip link set lo up
  ((${#CTEST_ARGS[@]})) || CTEST_ARGS=(bash)
  in_root sh -c 'cd "$1" && shift && exec "$@"' shell "$REPO" "${CTEST_ARGS[@]}"
}

# ---- outside: the phases --------------------------------------------------------------------
make_root() {
  local mark=$ROOT/.tetra-check-libtorch2
  if [[ -f $mark/root-ok ]]; then
    say "root: reusing $ROOT ($(chroot "$ROOT" dpkg-query -W -f='${Version}' base-files 2>/dev/null || echo '?'))"
    return
  fi
  unmount_under "$ROOT"
  [[ -z $(mounts_under "$ROOT") ]] || die "something is still mounted under $ROOT: $(mounts_under "$ROOT" | head -3)"
  if [[ -n $(ls -A "$ROOT") ]]; then
    [[ -d $mark ]] || die "$ROOT is not empty and was not made by this script; name an empty or new folder"
    say "root: $ROOT was left half made; starting it again"
    find "$ROOT" -mindepth 1 -maxdepth 1 ! -name .tetra-check-libtorch2 -exec rm -rf --one-file-system {} +
  fi
  mkdir -p "$mark"
  say "root: debootstrap $SUITE into $ROOT (minbase)"
  # In a mount namespace of its own: what debootstrap mounts (proc, sys) dies with it.
  unshare --mount --propagation private --pid --fork \
    debootstrap --variant=minbase "$SUITE" "$ROOT" "$MIRROR" >"$mark/debootstrap.log" 2>&1 ||
    { tail -20 "$mark/debootstrap.log" >&2; die "debootstrap failed (log: $mark/debootstrap.log)"; }
  # Packages' scripts must not start services in the root (slurmd, munge, ...).
  printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
  chmod 755 "$ROOT/usr/sbin/policy-rc.d"
  touch "$mark/root-ok"
}

leak_check() {  # outside, after the namespaces are gone
  local m p bad=0 in_root_now t
  # A namespace whose first process was killed takes a moment to end the rest.
  for t in $(seq 50); do
    in_root_now=""
    for p in /proc/[0-9]*; do
      [[ $(readlink "$p/root" 2>/dev/null) == "$ROOT" ]] && in_root_now+=" ${p#/proc/}"
    done
    [[ -n $in_root_now ]] || break
    sleep 0.2
  done
  for p in $in_root_now; do
    say "LEAK: process $p runs in the root: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-100)"
    bad=1
  done
  m=$(mounts_under "$ROOT")
  if [[ -n $m ]]; then say "LEAK: still mounted under $ROOT: $(echo $m)"; bad=1; fi
  ((bad)) || say "leak check: nothing mounted under the root, no process running in it"
}

main() {
  local root_arg=""
  BUILD_DIR=$REPO/build-lt2
  NO_SUITE=0
  SHELL_MODE=0
  CTEST_ARGS=()
  while (($#)); do
    case $1 in
      -h | --help) usage; exit 0 ;;
      --build-dir) BUILD_DIR=${2:?--build-dir needs a folder}; shift 2 ;;
      --no-suite) NO_SUITE=1; shift ;;
      --shell) SHELL_MODE=1; shift ;;
      --) shift; CTEST_ARGS=("$@"); break ;;
      -*) die "unknown option '$1' (--build-dir DIR, --no-suite, --shell, --help)" ;;
      *) [[ -z $root_arg ]] || die "one ROOT_DIR only ('$root_arg', '$1')"; root_arg=$1; shift ;;
    esac
  done
  [[ -n $root_arg ]] || { usage >&2; exit 2; }
  [[ $(id -u) -eq 0 ]] || die "needs root (debootstrap, chroot, mounts, namespaces)"
  export PATH=$PATH:/usr/sbin:/sbin
  local c
  for c in debootstrap unshare chroot flock; do
    command -v "$c" >/dev/null || die "needs $c (apt-get install debootstrap util-linux coreutils)"
  done
  mkdir -p "$root_arg"
  ROOT=$(cd "$root_arg" && pwd -P)
  BUILD_DIR=$(realpath -m "$BUILD_DIR")
  [[ $ROOT =~ ^/[A-Za-z0-9._/+-]+$ ]] || die "ROOT_DIR: a path of letters, digits and ._+-/ please ($ROOT)"
  [[ $ROOT != / && $ROOT != "$REPO" && $ROOT != "$REPO"/* && $REPO != "$ROOT"/* ]] ||
    die "ROOT_DIR must be a folder of its own, outside this checkout ($REPO)"
  [[ $BUILD_DIR =~ ^/[A-Za-z0-9._/+-]+$ && $BUILD_DIR != "$REPO" && $BUILD_DIR != "$REPO/build" && $BUILD_DIR != "$ROOT" ]] ||
    die "--build-dir: a folder of its own, not the checkout, its build/ or the root ($BUILD_DIR)"
  # B: the build folder as the root sees it (inside ROOT_DIR, or bound at its own path).
  B=$BUILD_DIR
  [[ $BUILD_DIR != "$ROOT"/* ]] || B=${BUILD_DIR#"$ROOT"}
  STATE=$ROOT/.tetra-check-libtorch2
  export ROOT BUILD_DIR B STATE NO_SUITE REPO

  # One run per root at a time.
  exec 9<"$ROOT"
  flock -n 9 || die "another check-libtorch2 runs on $ROOT"
  trap 'unmount_under "$ROOT"' EXIT
  trap 'exit 130' INT TERM

  local t_all=$SECONDS t0 t_root t_pkg
  t0=$SECONDS
  make_root
  t_root=$((SECONDS - t0))
  : >"$STATE/phases"
  mkdir -p "$BUILD_DIR"

  # Each phase in namespaces of its own; --kill-child: if this script dies, so does all of it.
  t0=$SECONDS
  say "packages: tools/setup.sh in the root"
  unshare --mount --propagation private --pid --fork --kill-child "$SELF" --inner packages ||
    die "installing the packages in the root failed"
  t_pkg=$((SECONDS - t0))
  if ((SHELL_MODE)); then
    exec 9<&-  # a look inside may run beside a check
    exec unshare --mount --propagation private --pid --fork --kill-child --net --uts --ipc \
      "$SELF" --inner shell "${CTEST_ARGS[@]}"
  fi

  say "build and suite in $BUILD_DIR (network, UTS, IPC, PID and mount namespaces of their own)"
  local rc=0
  unshare --mount --propagation private --pid --fork --kill-child --net --uts --ipc \
    "$SELF" --inner build-suite "${CTEST_ARGS[@]}" || rc=$?
  leak_check

  echo "---- check-libtorch2: phases ----"
  echo "root $t_root s"
  echo "packages $t_pkg s"
  cat "$STATE/phases"
  echo "all $((SECONDS - t_all)) s"
  say "disk: root $(du -sh --one-file-system "$ROOT" | cut -f1), build folder $(du -sh "$BUILD_DIR" | cut -f1)"
  local closing
  closing=$(grep -E '^[0-9]+% tests passed' "$BUILD_DIR/check-libtorch2-ctest.log" 2>/dev/null || true)
  if ((NO_SUITE == 0)); then
    [[ -n $closing ]] || say "the suite did not finish (exit $rc)"
    [[ -z $closing ]] || echo "$closing"
  fi
  return "$rc"
}

if [[ ${1:-} == --inner ]]; then
  phase=$2
  shift 2
  CTEST_ARGS=("$@")
  case $phase in
    packages) inner_packages ;;
    build-suite) inner_build_suite ;;
    shell) inner_shell ;;
    *) die "unknown inner phase $phase" ;;
  esac
  exit $?
fi
main "$@"; exit $?
