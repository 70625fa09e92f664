#!/usr/bin/env bash
# tools/gpu/prepare.sh [DIR]: the GPU check's carry, made here (Debian 12, root or sudo,
# apt works); tools/gpu-check.sh --prepare [DIR] runs it. DIR (default build-gpu-carry, a
# /build*/ folder, so git ignores it and the device tool carries it by name) gets:
#   debs/*.deb   the Debian packages tetra needs besides LibTorch (apt-get download,
#                nothing installed): yaml-cpp, Open MPI (dev, bin, libs and what they
#                load: hwloc, libevent, PMIx, libfabric, UCX, ...), hwloc, CLI11,
#                nlohmann-json, GoogleTest, zlib's headers, pkgconf and the Fashion-MNIST
#                data, with their dependency closure less what any Debian-like machine
#                with g++ has; kept compressed. Downloaded again only when the closure's
#                packages or versions changed.
#   debs/MANIFEST  package, version and sha256 of each .deb
#   COMMIT       the commit the working tree is at ("+" when it has uncommitted changes):
#                the GPU machine gets the tree without .git, and the build
#                (TETRA_COMMIT_FILE) and the summary read it there
#   CARRY.txt    what travels, file by file, with the working tree's size beside it
# Not carried, with why:
#   Boost         tetra includes only boost/crc.hpp; without Boost it uses a CRC-32C of
#                 its own (Note [Two CRC-32Cs] in core/crc32c.h): 9.5 MB of .deb saved.
#   libgloo-dev   Debian 12's Gloo headers (2022) are not the Gloo torch 2.x's c10d was
#                 built with; the wheel ships its own, and without them the check builds
#                 without the gloo backend (TETRA_WITH_GLOO=OFF).
#   openssh-client, gfortran, jquery, libhwloc-plugins: see SKIP_PACKAGES below.
# Run it again before each call to the GPU machine: it rewrites COMMIT (seconds when the
# packages are there).
set -euo pipefail
SELF=$(readlink -f "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/../.." && pwd)
DIR=${1:-$REPO/build-gpu-carry}
LIMIT_MIB=64

die() { echo "gpu-check --prepare: $*" >&2; exit 2; }

SEED_PACKAGES=(
  libyaml-cpp-dev libopenmpi-dev openmpi-bin libhwloc-dev zlib1g-dev libgtest-dev
  libcli11-dev nlohmann-json3-dev pkgconf dataset-fashion-mnist
)
# Dependencies left out on purpose, with why:
#   openssh-client, <ssh-client>  mpirun starts ranks on its own host by fork; the check
#                                 sets plm_rsh_agent to false, so no ssh is looked for.
#   gfortran-*, flang-*           Open MPI's Fortran bindings.
#   libjs-jquery, libjs-jquery-ui Open MPI's HTML documentation.
#   libhwloc-plugins              hwloc's optional plugins (PCI, GL, OpenCL, NVML), loaded
#                                 from an absolute /usr path that a relocated prefix
#                                 does not serve; hwloc works without them.
#   libboost*, libgloo*           see above.
SKIP_PACKAGES=(openssh-client gfortran gfortran-12 libjs-jquery libjs-jquery-ui libhwloc-plugins
               libboost-dev libboost1.74-dev libgloo-dev libgloo0)

# "PKG DEP" for each dependency of the given packages (Depends and Pre-Depends; of an
# alternative a|b only the first; virtual packages as VIRTUAL:<name>).
deps_of() {
  apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
    --no-enhances "$@" 2>/dev/null |
    awk '
      /^[^ ]/ { pkg = $1; inalt = 0; next }
      /^ +\|?(Pre)?Depends:/ {
        isalt = ($1 ~ /^\|/)
        if (!inalt) print pkg, ($2 ~ /^</ ? "VIRTUAL:" $2 : $2)
        inalt = isalt
        next
      }'
}

# The dependency closure of "$@", not entering the packages of the associative array
# STOP; the result is left in the associative array SEEN.
declare -A SEEN=() STOP=()
closure() {
  local -a frontier=("$@") next
  local p d
  for p in "$@"; do SEEN[$p]=1; done
  while ((${#frontier[@]})); do
    next=()
    while read -r p d; do
      [[ $d == VIRTUAL:* ]] && continue
      [[ -n ${STOP[$d]:-} || -n ${SEEN[$d]:-} ]] && continue
      SEEN[$d]=1
      next+=("$d")
    done < <(deps_of "${frontier[@]}")
    frontier=("${next[@]}")
  done
}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

download() {
  local debs=$1
  local t
  for t in apt-get apt-cache dpkg-query dpkg-deb; do
    command -v "$t" >/dev/null || die "needs $t (a Debian machine with apt)"
  done
  local sudo=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || die "needs root or sudo for apt-get update"
    sudo=sudo
  fi
  echo "gpu-check --prepare: apt-get update"
  $sudo apt-get update -qq
  # A bare machine: Debian's essential and required packages and their dependencies,
  # plus g++ and make with theirs (the GPU machine has a compiler). None of these is
  # carried: the GPU machine has its own libc, libstdc++, zlib, ...
  local -a base
  mapfile -t base < <(dpkg-query -W -f='${Package} ${Essential} ${Priority}\n' |
    awk '$2 == "yes" || $3 == "required" { print $1 }')
  ((${#base[@]})) || die "dpkg-query lists no essential or required package"
  SEEN=()
  closure "${base[@]}" g++ make
  local k
  STOP=()
  for k in "${!SEEN[@]}"; do STOP[$k]=1; done
  for k in "${SKIP_PACKAGES[@]}"; do STOP[$k]=1; done
  SEEN=()
  closure "${SEED_PACKAGES[@]}"
  local -a carry
  mapfile -t carry < <(printf '%s\n' "${!SEEN[@]}" | sort)
  # Each package's candidate version: the download is skipped when MANIFEST has them all.
  local wanted
  wanted=$(for p in "${carry[@]}"; do
    printf '%s %s\n' "$p" "$(apt-cache policy "$p" | awk '/Candidate:/ { print $2; exit }')"
  done | sort)
  local have=""
  if [[ -f $debs/MANIFEST ]]; then have=$(grep -v '^#' "$debs/MANIFEST" | awk '{ print $1, $2 }' | sort); fi
  if [[ -n $have && $have == "$wanted" ]] && (($(find "$debs" -name '*.deb' | wc -l) == ${#carry[@]})); then
    echo "gpu-check --prepare: $debs holds the ${#carry[@]} packages at their versions already: kept"
    return 0
  fi
  echo "gpu-check --prepare: downloading ${#carry[@]} packages, the closure of: ${SEED_PACKAGES[*]}"
  mkdir -p "$debs"
  rm -f "$debs"/*.deb "$debs"/MANIFEST
  # apt-get download writes into the current folder; as root it warns that _apt cannot
  # write there (the download is not sandboxed): harmless.
  (cd "$debs" && apt-get download -q "${carry[@]}" 2> >(grep -v "unsandboxed as root" >&2)) >/dev/null
  local p missing=()
  for p in "${carry[@]}"; do
    compgen -G "$debs/${p}_*.deb" >/dev/null || missing+=("$p")
  done
  ((${#missing[@]} == 0)) || die "apt-get download left out: ${missing[*]}"
  {
    echo "# tools/gpu-check.sh --prepare, $(date -u +%Y-%m-%dT%H:%M:%SZ), on $(sed -n 's/^PRETTY_NAME=//p' /etc/os-release | tr -d '"')"
    echo "# package version sha256"
    local f
    for f in "$debs"/*.deb; do
      printf '%s %s %s\n' "$(dpkg-deb -f "$f" Package)" "$(dpkg-deb -f "$f" Version)" "$(sha256sum "$f" | cut -d' ' -f1)"
    done
  } >"$debs/MANIFEST"
}

write_commit() {
  local out=$1 commit dirty="" changed=0
  commit=$(git -C "$REPO" rev-parse --short=12 HEAD 2>/dev/null) || die "$REPO is no git checkout: nothing to write into COMMIT"
  changed=$(git -C "$REPO" status --porcelain --untracked-files=no | wc -l)
  if ((changed)); then dirty="+"; fi
  {
    echo "$commit$dirty"
    echo "# written by tools/gpu-check.sh --prepare at $(date -u +%Y-%m-%dT%H:%M:%SZ) on branch $(git -C "$REPO" rev-parse --abbrev-ref HEAD); $changed tracked file(s) changed since $commit"
    if ((changed)); then git -C "$REPO" status --porcelain --untracked-files=no | sed 's/^/#   /' | head -40; fi
  } >"$out"
  echo "gpu-check --prepare: $(head -1 "$out") written to $out"
}

# What travels: the carry, file by file, and the working tree (tracked files and
# untracked ones git does not ignore) beside it.
report() {
  local dir=$1 out=$1/CARRY.txt rel
  rel=${dir#"$REPO"/}
  local tree_bytes tree_files carry_bytes carry_files
  read -r tree_files tree_bytes < <(cd "$REPO" && git ls-files -z -c -o --exclude-standard |
    xargs -0 stat -c %s 2>/dev/null | awk '{ n++; s += $1 } END { print n + 0, s + 0 }')
  {
    echo "# What tools/gpu-check.sh carries to the GPU machine ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
    echo "# bytes  file (under $rel)"
    (cd "$dir" && find . -type f ! -name 'CARRY.txt*' -printf '%s %P\n' | sort -k1,1n -k2)
  } >"$out.tmp"
  carry_bytes=$(awk '!/^#/ { s += $1 } END { print s + 0 }' "$out.tmp")
  carry_files=$(grep -vc '^#' "$out.tmp")
  carry_bytes=$((carry_bytes + 4096))  # CARRY.txt itself, about
  {
    cat "$out.tmp"
    echo "# carry: $carry_bytes bytes ($(mib "$carry_bytes")) in $((carry_files + 1)) files"
    echo "# working tree: $tree_bytes bytes ($(mib "$tree_bytes")) in $tree_files files (tracked, and untracked not ignored)"
    echo "# together: $((carry_bytes + tree_bytes)) bytes ($(mib $((carry_bytes + tree_bytes)))) of the $LIMIT_MIB MiB a call may carry"
  } >"$out"
  rm -f "$out.tmp"
  echo "gpu-check --prepare: the carry, $rel, file by file (bytes):"
  grep -v '^# together\|^# carry\|^# working' "$out" | grep -v '^#' | awk '{ printf "  %10d  %s\n", $1, $2 }'
  grep '^# carry\|^# working\|^# together' "$out" | sed 's/^# /gpu-check --prepare: /'
  if ((carry_bytes + tree_bytes > LIMIT_MIB * 1048576)); then
    die "over the $LIMIT_MIB MiB a call may carry"
  fi
  echo "gpu-check --prepare: next, one call of the device tool:"
  echo "  run(command=\"tools/gpu-check.sh --out \$OUT\", carry=[\"$rel\"], timeout_s=600)"
}

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
[[ $DIR == "$REPO"/* ]] || die "$DIR is outside the checkout: the device tool carries only folders inside it"
if [[ -z $(cd "$REPO" && git check-ignore "${DIR#"$REPO"/}/x" 2>/dev/null) ]]; then
  die "${DIR#"$REPO"/} is not ignored by git: it would travel as part of the working tree; use a /build*/ folder"
fi
download "$DIR/debs"
write_commit "$DIR/COMMIT"
report "$DIR"
