#!/usr/bin/env bash
# tools/gpu/unpack.sh DEBS PREFIX: unpacks the carried .deb files of DEBS under PREFIX
# (dpkg-deb -x, or ar and tar where dpkg-deb is not; never into /) and makes the tree
# work where it lies: Debian's alternatives (mpirun, mpicc) as links, pkg-config files
# pointing into PREFIX, absolute links into PREFIX, dangling ones to this machine's
# libraries. When PREFIX already holds the same packages (a second call on a warm
# machine) it leaves it as it is. Prints what it did; exit 1 with the reason on failure.
set -euo pipefail
DEBS=${1:?DEBS}
PREFIX=${2:?PREFIX}
ARCH_TRIPLET=x86_64-linux-gnu

die() { echo "unpack: $*" >&2; exit 1; }

mapfile -t debs < <(find "$DEBS" -maxdepth 1 -name '*.deb' | sort)
((${#debs[@]})) || die "no .deb files in $DEBS: run tools/gpu-check.sh --prepare where apt works and carry its folder"
stamp=$(for d in "${debs[@]}"; do printf '%s %s\n' "$(basename "$d")" "$(stat -c %s "$d")"; done)
if [[ -d $PREFIX && $(cat "$PREFIX/.gpu-check-stamp" 2>/dev/null) == "$stamp" ]]; then
  echo "unpack: $PREFIX holds these ${#debs[@]} packages already: kept"
  exit 0
fi
rm -rf "$PREFIX"
mkdir -p "$PREFIX"
if command -v dpkg-deb >/dev/null; then
  # In parallel: the packages hold different files (the folders they share are made by
  # whichever comes first).
  printf '%s\0' "${debs[@]}" | xargs -0 -I{} -P "$(nproc)" dpkg-deb -x {} "$PREFIX" ||
    die "dpkg-deb -x failed on one of the packages"
else
  command -v ar >/dev/null || die "neither dpkg-deb nor ar to unpack the .deb files"
  for d in "${debs[@]}"; do
    # A .deb is an ar archive whose data.tar.* holds the files.
    member=$(ar t "$d" | grep '^data\.tar') || die "$d: no data.tar member"
    case $member in
      *.xz) z=-J ;; *.zst) z=--zstd ;; *.gz) z=-z ;; *) die "$d: $member, a compression tar is not told here" ;;
    esac
    ar p "$d" "$member" | tar -x "$z" -f - -C "$PREFIX" --no-same-owner
  done
fi
echo "unpack: ${#debs[@]} packages under $PREFIX"

# Debian's alternatives (mpirun, mpicc, mpi.h's include folder) are made by postinst
# scripts, which dpkg-deb -x does not run: the names Open MPI's own packages use.
for n in mpicc mpicxx mpic++ mpirun mpiexec; do
  if [[ -e $PREFIX/usr/bin/$n.openmpi && ! -e $PREFIX/usr/bin/$n ]]; then ln -s "$n.openmpi" "$PREFIX/usr/bin/$n"; fi
done
# pkg-config files name /usr: point them at the prefix.
while IFS= read -r -d '' pc; do
  sed -i -E "s#^([A-Za-z_]+)=/usr([/ ]|\$)#\\1=$PREFIX/usr\\2#" "$pc"
done < <(find "$PREFIX" -name '*.pc' -type f -print0)

# Symbolic links: an absolute one to a file the prefix holds points into the prefix; a
# dangling one to a library the machine has (zlib1g-dev's libz.so -> libz.so.1.2.13 of
# zlib1g, which is not carried) points to the machine's library.
while IFS= read -r -d '' link; do
  target=$(readlink "$link")
  if [[ -e $PREFIX$target ]]; then ln -sfn "$PREFIX$target" "$link"; fi
done < <(find "$PREFIX" -type l -lname '/*' -print0)
while IFS= read -r -d '' link; do
  target=$(readlink "$link")
  soname=$(basename "$target" | sed -E 's/^(.*\.so\.[0-9]+).*/\1/')
  found=$({ ldconfig -p 2>/dev/null || true; } | awk -v n="$soname" '$1 == n && /x86-64/ && !f { print $NF; f = 1 }')
  if [[ -z $found ]]; then
    for d in /lib/$ARCH_TRIPLET /usr/lib/$ARCH_TRIPLET /lib64 /usr/lib64; do
      if [[ -e $d/$soname ]]; then found=$d/$soname; break; fi
    done
  fi
  if [[ -n $found ]]; then
    ln -sfn "$found" "$link"
    echo "unpack: ${link#"$PREFIX"/} -> $found (this machine's)"
  else
    echo "unpack: warning: ${link#"$PREFIX"/} -> $target: no $soname on this machine"
  fi
done < <(find "$PREFIX" -xtype l -name '*.so' -print0)
printf '%s\n' "$stamp" >"$PREFIX/.gpu-check-stamp"
