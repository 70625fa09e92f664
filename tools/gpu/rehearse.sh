#!/usr/bin/env bash
# tools/gpu/rehearse.sh [gpu-check options]: the GPU check rehearsed on this machine (no
# GPU), inside a mount namespace (unshare -m) where the system's Open MPI, PMIx and
# /etc/openmpi are hidden (empty folders over their folders, /dev/null over their
# libraries, a stub over their programs), so that the carried, relocated Open MPI is the
# only one there, and the Boost headers too, as on the GPU machine. Root only.
#   tools/gpu/rehearse.sh --no-build --build-dir build --out /tmp/gpu-rehearsal
# runs tools/gpu-check.sh --device cpu with the options given; it prints what it hid.
# Nothing outside the namespace changes; the carry must exist (tools/gpu-check.sh --prepare).
set -euo pipefail
SELF=$(readlink -f "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/../.." && pwd)
[[ $(id -u) -eq 0 ]] || { echo "rehearse: needs root (unshare -m, mount --bind)" >&2; exit 2; }
if [[ ${TETRA_REHEARSE_INSIDE:-} != 1 ]]; then
  exec env TETRA_REHEARSE_INSIDE=1 unshare -m --propagation private bash "$SELF" "$@"
fi
T=x86_64-linux-gnu
empty=$(mktemp -d /tmp/gpu-rehearse-empty.XXXXXX)
stub=$(mktemp /tmp/gpu-rehearse-stub.XXXXXX)
printf '#!/bin/sh\necho "hidden by tools/gpu/rehearse.sh: the system'"'"'s Open MPI is not here" >&2\nexit 127\n' >"$stub"
chmod +x "$stub"
hidden=()
for d in /usr/lib/$T/openmpi /usr/lib/$T/pmix2 /etc/openmpi /usr/share/openmpi /usr/share/pmix \
         /usr/include/boost /usr/include/$T/openmpi; do
  if [[ -d $d ]]; then mount --bind "$empty" "$d"; hidden+=("$d/"); fi
done
# The files of Debian's Open MPI and PMIx packages outside those folders: libraries and
# programs. A library becomes an empty file (loading it fails loudly), a program a stub.
while IFS= read -r f; do
  [[ -f $f && ! -L $f ]] || continue
  case $f in
    /usr/lib/$T/openmpi/* | /usr/lib/$T/pmix2/* | /etc/openmpi/* | /usr/share/*) continue ;;
    /usr/bin/*) mount --bind "$stub" "$f" ;;
    *) mount --bind /dev/null "$f" ;;
  esac
  hidden+=("$f")
done < <(dpkg -L libopenmpi3 libopenmpi-dev openmpi-bin libpmix2 libpmix-dev 2>/dev/null | sort -u)
echo "rehearse: hidden in this namespace (${#hidden[@]}): ${hidden[*]:0:12} ..."
echo "rehearse: entries left in /usr/lib/$T/openmpi: $(find /usr/lib/$T/openmpi -mindepth 1 | wc -l), /etc/openmpi: $(find /etc/openmpi -mindepth 1 | wc -l), /usr/include/boost: $(find /usr/include/boost -mindepth 1 | wc -l)"
echo "rehearse: /usr/lib/$T/libmpi.so.40 is $(stat -L -c %s /usr/lib/$T/libmpi.so.40) bytes; mpirun: $(mpirun --version 2>&1 | head -1)"
rc=0
bash "$REPO/tools/gpu-check.sh" --device cpu "$@" || rc=$?
rm -rf "$empty" "$stub"
exit "$rc"
