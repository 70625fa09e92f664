#!/usr/bin/env bash
# tools/gpu-check.sh: tetra's prepared check on a machine with one NVIDIA GPU and a CUDA
# PyTorch, which reaches no package registry. Two halves, on two machines:
#
#   1. Here (Debian 12, root or sudo, apt works):
#        tools/gpu-check.sh --prepare build-gpu-debs
#      downloads (apt-get download, nothing installed) the Debian packages tetra needs
#      besides LibTorch: yaml-cpp, the Boost headers, Open MPI (dev, bin, libs and what
#      they load: hwloc, libevent, PMIx, libfabric, UCX, ...), hwloc, CLI11, nlohmann-json,
#      GoogleTest, the Gloo headers, zlib's headers, pkgconf and the Fashion-MNIST data,
#      with their dependency closure less what any Debian-like machine with g++ already
#      has. The .deb files stay compressed in DIR (a /build*/ folder is ignored by git, so
#      it travels as a carried path); the total is printed.
#   2. Carry DIR to the GPU machine beside this checkout (the device tool: carry
#      ["build-gpu-debs"]) and run there, from the repository root:
#        tools/gpu-check.sh [--debs build-gpu-debs] [--out FILE] [--budget S] [--no-build]
#      It unpacks the .deb files under build-gpu/prefix (dpkg-deb -x, never into /),
#      finds the python3 whose torch has CUDA (TETRA_GPU_PYTHON=... picks one), configures
#      build-gpu (Release) against that torch's LibTorch and the unpacked prefix, builds
#      train and the CUDA-labelled test binaries with -j$(nproc), then runs:
#        ctest -L cuda                  the CUDA-labelled tests (the NCCL backend's)
#        quickstart on cuda             configs/quickstart.yaml, train.device=cuda
#        gpt-bf16                       a 12-layer d1024 GPT, bf16 autocast, one GPU:
#                                       samples/s and model FLOP utilisation
#        zero3 one rank / two ranks     configs/zero3-gpt.yaml on cuda over gloo, two
#                                       ranks sharing the GPU under the carried mpirun,
#                                       against one process: final loss within 1e-3
#      and writes one summary (build-gpu/gpu-check-summary.json, or --out) with each
#      step's status (pass, fail, skipped and why), wall time and figures, prints it, and
#      exits 1 if any step failed. Every step has its own timeout, the whole run a budget
#      (--budget, default 450 s); a failed step skips only the steps that need it.
#      --no-build stops before CMake: it checks the machine, the packages and mpirun.
#      Logs: build-gpu/gpu-check/<step>.log (the summary names each, with the last lines
#      of a failed one); run folders: build-gpu/gpu-check/runs/<step>.
#      Knobs: TETRA_GPU_PYTHON (the python3 with the CUDA torch), TETRA_GPU_JOBS (build
#      jobs, default nproc), TETRA_GPU_TEST_TARGETS (the test binaries the cuda label's
#      tests are in, default collectives_test_nccl), --build-dir (default build-gpu).
#
# It relies on the tree it checks: tests/collectives' test_nccl case labelled `cuda`,
# and train.device: cuda accepting collectives.backend: gloo across processes (whose
# c10d ProcessGroupGloo takes CUDA tensors; NCCL refuses two ranks on one GPU).
#
# The carried Debian libraries use the C++11 ABI (_GLIBCXX_USE_CXX11_ABI=1): a torch
# built with the old ABI cannot link with them, and the check says so instead of building.
set -euo pipefail

SELF=$(readlink -f "${BASH_SOURCE[0]}")
REPO=$(cd "$(dirname "$SELF")/.." && pwd)
ARCH_TRIPLET=x86_64-linux-gnu

die() { echo "gpu-check: $*" >&2; exit 2; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

usage() {
  sed -n '2,/^set -euo/p' "$SELF" | sed -e '$d' -e 's/^# \{0,1\}//'
}

# ---- --prepare: here, with apt ------------------------------------------------------

# What tetra needs besides LibTorch (tools/setup.sh's list, less LibTorch, OpenBLAS and
# the test-only tools). Boost: tetra includes only <boost/crc.hpp> (core/crc32c.h), a
# header-only part, so the headers package alone (libboost1.74-dev, through libboost-dev).
SEED_PACKAGES=(
  libyaml-cpp-dev libboost-dev libopenmpi-dev openmpi-bin libhwloc-dev zlib1g-dev
  libgtest-dev libcli11-dev nlohmann-json3-dev libgloo-dev pkgconf dataset-fashion-mnist
)
# Dependencies left out on purpose, with why:
#   openssh-client, <ssh-client>  mpirun starts ranks on its own host by fork; the check
#                                 sets plm_rsh_agent to false, so no ssh is looked for.
#   gfortran-*, flang-*           Open MPI's Fortran bindings.
#   libjs-jquery, libjs-jquery-ui Open MPI's HTML documentation.
#   libhwloc-plugins              hwloc's optional plugins (PCI, GL, OpenCL, NVML), loaded
#                                 from an absolute /usr path that a relocated prefix
#                                 does not serve; hwloc works without them.
SKIP_PACKAGES=(openssh-client gfortran gfortran-12 libjs-jquery libjs-jquery-ui libhwloc-plugins)

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

# The dependency closure of "$@", not entering the packages named in the associative
# array STOP; the result is left in the associative array SEEN.
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

prepare() {
  local dir=$1
  local t
  for t in apt-get apt-cache dpkg-query dpkg-deb; do
    command -v "$t" >/dev/null || die "--prepare needs $t (a Debian machine with apt)"
  done
  local sudo=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || die "--prepare needs root or sudo for apt-get update"
    sudo=sudo
  fi
  echo "gpu-check: apt-get update"
  $sudo apt-get update -qq

  # A bare machine: Debian's essential and required packages and what they depend on,
  # plus g++ and make with theirs (the GPU machine has a compiler). None of these is
  # carried: the GPU machine has its own libc, libstdc++, zlib, ...
  local -a base
  mapfile -t base < <(dpkg-query -W -f='${Package} ${Essential} ${Priority}\n' |
    awk '$2 == "yes" || $3 == "required" { print $1 }')
  ((${#base[@]})) || die "dpkg-query lists no essential or required package"
  echo "gpu-check: working out what a bare machine with g++ has (${#base[@]} essential/required packages and their dependencies)"
  SEEN=()
  closure "${base[@]}" g++ make
  local k
  STOP=()
  for k in "${!SEEN[@]}"; do STOP[$k]=1; done
  local bare_count=${#SEEN[@]}
  for k in "${SKIP_PACKAGES[@]}"; do STOP[$k]=1; done

  echo "gpu-check: the dependency closure of: ${SEED_PACKAGES[*]}"
  SEEN=()
  closure "${SEED_PACKAGES[@]}"
  local -a carry
  mapfile -t carry < <(printf '%s\n' "${!SEEN[@]}" | sort)
  echo "gpu-check: ${#carry[@]} packages to carry (leaving out the $bare_count of a bare machine and: ${SKIP_PACKAGES[*]})"

  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  rm -f "$dir"/*.deb "$dir"/MANIFEST
  # apt-get download writes into the current folder; as root it warns that _apt cannot
  # write there (the download is not sandboxed): harmless.
  (cd "$dir" && apt-get download -q "${carry[@]}" 2> >(grep -v "unsandboxed as root" >&2))
  local p missing=()
  for p in "${carry[@]}"; do
    compgen -G "$dir/${p}_*.deb" >/dev/null || missing+=("$p")
  done
  ((${#missing[@]} == 0)) || die "apt-get download left out: ${missing[*]}"
  {
    echo "# tools/gpu-check.sh --prepare, $(date -u +%Y-%m-%dT%H:%M:%SZ), on $(sed -n 's/^PRETTY_NAME=//p' /etc/os-release | tr -d '"')"
    echo "# package version sha256"
    for f in "$dir"/*.deb; do
      printf '%s %s %s\n' "$(dpkg-deb -f "$f" Package)" "$(dpkg-deb -f "$f" Version)" "$(sha256sum "$f" | cut -d' ' -f1)"
    done
  } >"$dir/MANIFEST"
  local total_kib
  total_kib=$(du -sk "$dir" | cut -f1)
  du -sh "$dir"/*.deb | sort -h | tail -5 | sed 's/^/  largest: /'
  echo "gpu-check: $(find "$dir" -name '*.deb' | wc -l) .deb files in $dir: $(du -sh "$dir" | cut -f1) ($total_kib KiB) in all"
  if ((total_kib > 58 * 1024)); then
    echo "gpu-check: warning: over 58 MiB; with the working tree it may pass the 64 MiB a carry allows" >&2
  fi
  local shown=$dir
  if [[ $dir == "$REPO"/* ]]; then shown=${dir#"$REPO"/}; fi
  echo "gpu-check: next: carry $shown to the GPU machine (inside the checkout: a /build*/ folder, say build-gpu-debs) and run tools/gpu-check.sh --debs $shown there"
}

# ---- the run, there --------------------------------------------------------------------

# Each step runs as `timeout T bash gpu-check.sh --step NAME` (a new shell with errexit,
# killed with everything it started when its time is up). It leaves, in $STEPS:
#   NAME.reason  one line: why it failed or was skipped (or a note when it passed)
#   NAME.fig     "key<TAB>JSON value" lines: its figures
# and exits 0 (pass), 3 (skipped) or anything else (fail).
SKIP_RC=3
# What the environment step found (its $LOGS/env.sh, which every later step reads).
PY=${PY:-} NVCC=${NVCC:-} GPU_NAME=${GPU_NAME:-} TORCH_INFO=${TORCH_INFO:-}

reason() { printf '%s\n' "$*" >"$STEPS/$STEP.reason"; }
figure() { printf '%s\t%s\n' "$1" "$2" >>"$STEPS/$STEP.fig"; }
figure_str() { figure "$1" "$(json_str "$2")"; }
# One line of figures the driver prints under the step's status.
headline() { printf '%s\n' "$*" >"$STEPS/$STEP.headline"; echo "$*"; }
fail() { reason "$*"; echo "gpu-check: $STEP: $*" >&2; exit 1; }
skip() { reason "$*"; echo "gpu-check: $STEP: skipped: $*" >&2; exit "$SKIP_RC"; }
# Seconds left to this step (its own timeout counts from its start).
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

# python3 with the environment of this machine, not the carried libraries'.
py() { env -u LD_LIBRARY_PATH "$PY" "$@"; }
# jq_py JSON KEY: the key's value ("" for null or absent; True/False; a list's first item).
jq_py() {
  py -c '
import json, sys
v = json.loads(sys.argv[1]).get(sys.argv[2])
v = (v[0] if v else None) if isinstance(v, list) else v
print("" if v is None else v)' "$1" "$2"
}

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
  # /usr/include): Debian's yaml-cpp 0.7 target has no include folder, Boost (crc.hpp)
  # has no target here, gloo is only looked for. After every -I and -isystem, so a
  # header torch ships itself wins.
  export CPLUS_INCLUDE_PATH="$PREFIX/usr/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  export C_INCLUDE_PATH="$PREFIX/usr/include${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}"
  # One host: mpirun forks its ranks and never runs ssh, but Open MPI 4 refuses to
  # start when the rsh agent it would use for other hosts (ssh) is not on the PATH.
  export OMPI_MCA_plm_rsh_agent=false
  # Two ranks share the one GPU and this host: gloo's pairs over loopback.
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
}

mpirun_cmd() {
  MPIRUN=("$PREFIX/usr/bin/mpirun" --oversubscribe --bind-to none)
  if [[ $(id -u) -eq 0 ]]; then MPIRUN+=(--allow-run-as-root); fi
}

# -- step: environment -----------------------------------------------------------------
step_environment() {
  local problems=() notes=()
  # The GPU.
  local smi=""
  for c in nvidia-smi /usr/local/nvidia/bin/nvidia-smi /usr/bin/nvidia-smi; do
    if command -v "$c" >/dev/null 2>&1; then smi=$(command -v "$c"); break; fi
  done
  local gpu_name="" gpu_mem="" driver=""
  if [[ -z $smi ]]; then
    problems+=("no nvidia-smi on the PATH (nor in /usr/local/nvidia/bin): no NVIDIA driver here, is this the GPU machine?")
  else
    local q
    if ! q=$(timeout 30 "$smi" --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1) || [[ -z $q ]]; then
      problems+=("nvidia-smi lists no GPU: ${q:-no output}")
    else
      IFS=, read -r gpu_name gpu_mem driver <<<"$(head -1 <<<"$q")"
      gpu_name=$(xargs <<<"$gpu_name"); gpu_mem=$(xargs <<<"$gpu_mem"); driver=$(xargs <<<"$driver")
      figure_str gpu "$gpu_name"
      figure_str gpu_memory "$gpu_mem"
      figure_str driver "$driver"
      figure gpus "$(grep -c . <<<"$q")"
    fi
  fi

  # The python3 whose torch has CUDA.
  local -a candidates=()
  if [[ -n ${TETRA_GPU_PYTHON:-} ]]; then candidates+=("$TETRA_GPU_PYTHON"); fi
  local c
  for c in python3 /opt/torch/.venv/bin/python3 /usr/bin/python3 /usr/local/bin/python3 python; do
    if command -v "$c" >/dev/null 2>&1; then candidates+=("$(command -v "$c")"); fi
  done
  local info="" tried=() chosen=""
  for c in "${candidates[@]}"; do
    [[ " ${tried[*]} " == *" $c "* ]] && continue
    local out
    if out=$(timeout 120 env -u LD_LIBRARY_PATH "$c" - 2>&1 <<'PY'
import glob, json, os, sys
try:
    import torch
except Exception as e:
    print(json.dumps({"torch": None, "error": str(e).splitlines()[0] if str(e) else type(e).__name__}))
    sys.exit(0)
i = {"torch": torch.__version__, "python": sys.executable, "cuda": torch.version.cuda,
     "cxx11_abi": bool(torch.compiled_with_cxx11_abi()), "cmake_prefix": torch.utils.cmake_prefix_path,
     "torch_dir": os.path.dirname(torch.__file__)}
i["available"] = bool(i["cuda"]) and torch.cuda.is_available()
i["devices"] = torch.cuda.device_count() if i["available"] else 0
if i["available"]:
    i["capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
    i["device_name"] = torch.cuda.get_device_name(0)
# The NCCL this torch loads (a wheel's nvidia-nccl): tetra's nccl backend links the same.
nccl = ""
try:
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1]
            if "libnccl.so" in p:
                nccl = p
                break
except OSError:
    pass
i["nccl_lib"] = nccl
inc = os.path.join(os.path.dirname(os.path.dirname(nccl)), "include") if nccl else ""
i["nccl_include"] = inc if inc and os.path.exists(os.path.join(inc, "nccl.h")) else ""
i["gloo_headers"] = os.path.exists(os.path.join(i["torch_dir"], "include", "gloo", "algorithm.h"))
# nvcc from the pip CUDA toolkit, when there is one beside torch.
site = os.path.dirname(i["torch_dir"])
i["pip_nvcc"] = sorted(glob.glob(os.path.join(site, "nvidia", "*", "bin", "nvcc")) +
                       glob.glob(os.path.join(site, "nvidia", "cuda_nvcc", "bin", "nvcc")))
print(json.dumps(i))
PY
    ); then :; fi
    tried+=("$c")
    out=$(tail -1 <<<"$out")
    local has_torch cuda avail
    has_torch=$("$c" -c 'import json,sys; print(json.loads(sys.argv[1]).get("torch") or "")' "$out" 2>/dev/null || true)
    if [[ -z $has_torch ]]; then
      local err
      err=$("$c" -c 'import json,sys; print(json.loads(sys.argv[1]).get("error") or "")' "$out" 2>/dev/null || tail -1 <<<"$out")
      notes+=("$c: no torch${err:+ ($err)}")
      continue
    fi
    cuda=$("$c" -c 'import json,sys; print(json.loads(sys.argv[1]).get("cuda") or "")' "$out")
    avail=$("$c" -c 'import json,sys; print(json.loads(sys.argv[1]).get("available"))' "$out")
    if [[ -z $cuda ]]; then notes+=("$c: torch $has_torch has no CUDA (torch.version.cuda is None, a CPU build)"); continue; fi
    if [[ $avail != True ]]; then notes+=("$c: torch $has_torch (CUDA $cuda) sees no GPU (torch.cuda.is_available() is False)"); if [[ -z $info ]]; then info=$out; chosen=$c; fi; continue; fi
    info=$out; chosen=$c; break
  done
  if [[ -z $chosen ]]; then
    problems+=("no python3 with a CUDA torch (tried ${tried[*]:-none}: $(printf '%s; ' "${notes[@]}" | sed 's/; $//')); TETRA_GPU_PYTHON=/path/to/python3 names one")
  else
    PY=$chosen
    figure torch "$info"
    [[ $(jq_py "$info" available) == True ]] || problems+=("${notes[*]}")
    if [[ $(jq_py "$info" cxx11_abi) != True ]]; then
      problems+=("$chosen's torch is built with _GLIBCXX_USE_CXX11_ABI=0 (torch.compiled_with_cxx11_abi() is False), the carried Debian C++ libraries (yaml-cpp, GoogleTest) with the new ABI: they cannot link into one program; use a torch built with the C++11 ABI (PyTorch's wheels from 2.7 on, or its cxx11-abi LibTorch)")
    fi
  fi

  # Tools.
  local t
  for t in cmake g++ gcc timeout tar; do
    command -v "$t" >/dev/null || problems+=("no $t on the PATH")
  done
  command -v make >/dev/null || command -v ninja >/dev/null || problems+=("neither make nor ninja on the PATH")
  if command -v cmake >/dev/null; then
    local cv
    cv=$(cmake --version | head -1 | awk '{print $3}')
    figure_str cmake "$cv"
    [[ $(printf '%s\n' 3.18 "$cv" | sort -V | head -1) == 3.18 ]] || problems+=("cmake $cv is older than the 3.18 tetra needs")
  fi
  if command -v g++ >/dev/null; then figure_str gxx "$(g++ -dumpfullversion 2>/dev/null || g++ -dumpversion)"; fi
  command -v dpkg-deb >/dev/null || command -v ar >/dev/null ||
    problems+=("neither dpkg-deb nor ar to unpack the .deb files")

  # nvcc: CUDA LibTorch's CMake package (Caffe2's cuda.cmake) finds the CUDA toolkit.
  local nvcc=""
  for c in nvcc "${CUDA_HOME:-/nonexistent}/bin/nvcc" "${CUDA_PATH:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
    if command -v "$c" >/dev/null 2>&1; then nvcc=$(command -v "$c"); break; fi
  done
  if [[ -z $nvcc && -n $info ]]; then
    nvcc=$(jq_py "$info" pip_nvcc)
  fi
  if [[ -z $nvcc ]]; then
    problems+=("no nvcc (PATH, \$CUDA_HOME, /usr/local/cuda, pip's nvidia/*/bin): a CUDA LibTorch's CMake package needs the CUDA toolkit")
  else
    local nv
    nv=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
    figure_str nvcc "$nvcc ($nv)"
    local tcuda
    tcuda=""
    if [[ -n $info ]]; then tcuda=$(jq_py "$info" cuda); fi
    if [[ -n $tcuda && -n $nv && ${tcuda%%.*} != "${nv%%.*}" ]]; then
      notes+=("torch is built for CUDA $tcuda, nvcc is $nv (a different major version: LibTorch's CMake may refuse)")
    fi
  fi
  figure cores "$(nproc)"

  {
    printf 'PY=%q\n' "$chosen"
    printf 'NVCC=%q\n' "$nvcc"
    printf 'GPU_NAME=%q\n' "$gpu_name"
    printf 'TORCH_INFO=%q\n' "$info"
  } >"$LOGS/env.sh"
  if ((${#problems[@]})); then
    local p all=""
    for p in "${problems[@]}"; do all+="${all:+; }$p"; done
    fail "$all"
  fi
  if ((${#notes[@]})); then
    local n all=""
    for n in "${notes[@]}"; do all+="${all:+; }$n"; done
    reason "$all"
  fi
}

# Symbolic links in the unpacked prefix: an absolute one to a file the prefix holds points
# into the prefix; a dangling one to a library the machine has (zlib1g-dev's libz.so ->
# libz.so.1.2.13 of zlib1g, which is not carried) points to the machine's library.
fix_links() {
  local prefix=$1 link target soname found d
  while IFS= read -r -d '' link; do
    target=$(readlink "$link")
    if [[ -e $prefix$target ]]; then
      ln -sfn "$prefix$target" "$link"
      echo "relinked ${link#"$prefix"/} -> $prefix$target"
    fi
  done < <(find "$prefix" -type l -lname '/*' -print0)
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
      echo "relinked ${link#"$prefix"/} -> $found (this machine's)"
    else
      echo "warning: ${link#"$prefix"/} -> $target: no $soname on this machine"
    fi
  done < <(find "$prefix" -xtype l -name '*.so' -print0)
}

# -- step: unpack ----------------------------------------------------------------------
step_unpack() {
  [[ -d $DEBS ]] || fail "no folder $DEBS: run tools/gpu-check.sh --prepare $DEBS on a Debian machine with apt and carry it here"
  local -a debs
  mapfile -t debs < <(find "$DEBS" -maxdepth 1 -name '*.deb' | sort)
  ((${#debs[@]})) || fail "no .deb files in $DEBS: run tools/gpu-check.sh --prepare $DEBS where apt works and carry it here"
  local need missing=()
  for need in libyaml-cpp-dev libopenmpi-dev openmpi-bin libhwloc-dev libgloo-dev libgtest-dev libcli11-dev nlohmann-json3-dev dataset-fashion-mnist; do
    compgen -G "$DEBS/${need}_*.deb" >/dev/null || missing+=("$need")
  done
  ((${#missing[@]} == 0)) || fail "$DEBS lacks: ${missing[*]} (prepare it again)"
  figure debs "${#debs[@]}"
  figure_str debs_size "$(du -sh "$DEBS" | cut -f1)"
  # The same .deb files as last time: the prefix stands (a warm machine's second run).
  local stamp
  stamp=$(for d in "${debs[@]}"; do printf '%s %s\n' "$(basename "$d")" "$(stat -c %s "$d")"; done)
  if [[ -d $PREFIX && $(cat "$PREFIX/.gpu-check-stamp" 2>/dev/null) == "$stamp" ]]; then
    echo "the prefix $PREFIX holds these packages already"
    figure_str prefix "$PREFIX (kept)"
    step_unpack_checks
    return 0
  fi
  rm -rf "$PREFIX"
  mkdir -p "$PREFIX"
  local d
  if command -v dpkg-deb >/dev/null; then
    # In parallel: the packages hold different files (the folders they share are made by
    # whichever comes first).
    printf '%s\0' "${debs[@]}" | xargs -0 -I{} -P "$(nproc)" dpkg-deb -x {} "$PREFIX" ||
      fail "dpkg-deb -x failed on one of the packages (log: $LOG)"
  fi
  for d in "${debs[@]}"; do
    if ! command -v dpkg-deb >/dev/null; then
      # A .deb is an ar archive whose data.tar.* holds the files.
      local member
      member=$(ar t "$d" | grep '^data\.tar') || fail "$d: no data.tar member"
      local z
      case $member in
        *.xz) z=-J ;; *.zst) z=--zstd ;; *.gz) z=-z ;; *) fail "$d: $member, a compression tar is not told here" ;;
      esac
      ar p "$d" "$member" | tar -x "$z" -f - -C "$PREFIX" --no-same-owner
    fi
  done
  local lib=$PREFIX/usr/lib/$ARCH_TRIPLET
  # Debian's alternatives (mpirun, mpicc, mpi.h's include folder) are made by postinst
  # scripts, which dpkg-deb -x does not run: the names Open MPI's own packages use.
  local n
  for n in mpicc mpicxx mpic++ mpirun mpiexec; do
    if [[ -e $PREFIX/usr/bin/$n.openmpi && ! -e $PREFIX/usr/bin/$n ]]; then ln -s "$n.openmpi" "$PREFIX/usr/bin/$n"; fi
  done
  # pkg-config files name /usr: point them at the prefix.
  local pc
  while IFS= read -r -d '' pc; do
    sed -i -E "s#^([A-Za-z_]+)=/usr([/ ]|\$)#\\1=$PREFIX/usr\\2#" "$pc"
  done < <(find "$PREFIX" -name '*.pc' -type f -print0)
  fix_links "$PREFIX"
  printf '%s\n' "$stamp" >"$PREFIX/.gpu-check-stamp"
  figure_str prefix "$PREFIX"
  step_unpack_checks
}

# Every library the carried programs and libraries need, found?
step_unpack_checks() {
  local lib=$PREFIX/usr/lib/$ARCH_TRIPLET
  prefix_env
  local f missing_libs
  missing_libs=$(for f in "$PREFIX"/usr/bin/orterun "$PREFIX"/usr/bin/orted "$lib"/libmpi.so.40 "$lib"/libyaml-cpp.so.0.7 "$lib"/libhwloc.so.15; do
    [[ -e $f ]] || { echo "$(basename "$f") (absent)"; continue; }
    ldd "$f" 2>/dev/null | awk '/not found/ { print $1 }'
  done | sort -u | xargs)
  [[ -z $missing_libs ]] || fail "the carried programs need libraries this machine lacks: $missing_libs"
  figure_str prefix_size "$(du -sh "$PREFIX" | cut -f1)"
}

# -- step: mpirun ----------------------------------------------------------------------
step_mpirun() {
  prefix_env
  mpirun_cmd
  [[ -x $PREFIX/usr/bin/mpirun ]] || fail "no mpirun in the prefix (openmpi-bin not unpacked)"
  local v
  v=$("${MPIRUN[@]}" --version 2>&1 | head -1) || fail "mpirun --version: $v"
  figure_str mpirun "$v"
  # The relocated Open MPI serves its own components and wrapper data: ompi_info names
  # the prefix, mpicc's flags point into it, and two ranks start and meet in MPI_Init.
  local prefix_seen
  prefix_seen=$(ompi_info --path prefix --parsable 2>/dev/null | sed -n 's/^path:prefix://p')
  figure_str ompi_prefix "$prefix_seen"
  [[ $prefix_seen == "$PREFIX/usr" ]] || fail "ompi_info's prefix is '$prefix_seen', not $PREFIX/usr: OPAL_PREFIX is not honoured"
  local flags
  flags=$(mpicc -showme:compile 2>&1) || fail "mpicc -showme:compile: $flags"
  [[ $flags == *"$PREFIX"* ]] || fail "mpicc -showme:compile gives '$flags', not the prefix's include folder"
  local out
  # shellcheck disable=SC2016  # the ranks' shell expands them
  out=$(timeout "$(left)" "${MPIRUN[@]}" -np 2 sh -c 'echo "rank $OMPI_COMM_WORLD_RANK of $OMPI_COMM_WORLD_SIZE"' 2>&1) ||
    fail "mpirun -np 2 sh: $(tail -3 <<<"$out" | xargs)"
  echo "$out"
  [[ $(grep -c '^rank [01] of 2$' <<<"$out") -eq 2 ]] || fail "mpirun -np 2 printed: $(xargs <<<"$out")"
  # MPI_Init itself, compiled with the carried wrapper (a C file, no CMake).
  local t=$LOGS/mpi-hello
  mkdir -p "$t"
  cat >"$t/hello.c" <<'C'
#include <mpi.h>
#include <stdio.h>
int main(int argc, char** argv) {
  int rank, size, sum = 0;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  printf("rank %d of %d: sum %d\n", rank, size, sum);
  MPI_Finalize();
  return 0;
}
C
  out=$(mpicc -o "$t/hello" "$t/hello.c" 2>&1) || fail "mpicc hello.c: $(tail -3 <<<"$out" | xargs)"
  out=$(timeout "$(left)" "${MPIRUN[@]}" -np 2 "$t/hello" 2>&1) || fail "mpirun -np 2 hello (MPI_Init, MPI_Allreduce): $(tail -5 <<<"$out" | xargs)"
  echo "$out"
  [[ $(grep -c 'of 2: sum 1$' <<<"$out") -eq 2 ]] || fail "mpirun -np 2 hello printed: $(xargs <<<"$out")"
  # A relocated Open MPI that misses a component or a help file says so, and still runs.
  local extra
  extra=$(grep -vE '^rank [01] of 2: sum 1$|^-+$|^$' <<<"$out" | head -5 | xargs) || true
  [[ -z $extra ]] || reason "mpirun ran, and printed: ${extra:0:600}"
}

# -- step: configure -------------------------------------------------------------------
step_configure() {
  prefix_env
  local lib=$PREFIX/usr/lib/$ARCH_TRIPLET
  local tcmake cap nccl_lib nccl_inc gloo_in_torch
  tcmake=$(jq_py "$TORCH_INFO" cmake_prefix)
  cap=$(jq_py "$TORCH_INFO" capability)
  nccl_lib=$(jq_py "$TORCH_INFO" nccl_lib)
  nccl_inc=$(jq_py "$TORCH_INFO" nccl_include)
  gloo_in_torch=""
  if [[ $(jq_py "$TORCH_INFO" gloo_headers) == True ]]; then gloo_in_torch=$(jq_py "$TORCH_INFO" torch_dir)/include; fi
  local cuda_root
  cuda_root=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
  local -a args=(
    -S "$REPO" -B "$BUILD"
    -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_PREFIX_PATH=$PREFIX/usr;$lib/cmake;$tcmake"
    "-DCMAKE_LIBRARY_PATH=$lib;$PREFIX/lib/$ARCH_TRIPLET"
    "-DTorch_DIR=$tcmake/Torch"
    "-DMPI_C_COMPILER=$PREFIX/usr/bin/mpicc"
    "-DMPIEXEC_EXECUTABLE=$PREFIX/usr/bin/mpirun"
    "-DCMAKE_CUDA_COMPILER=$NVCC"
    "-DCUDAToolkit_ROOT=$cuda_root"
    "-DCUDA_TOOLKIT_ROOT_DIR=$cuda_root"
    # The libraries the carried ones load (libhwloc under libmpi, ...), for the linker.
    "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$lib:$PREFIX/lib/$ARCH_TRIPLET:$lib/openmpi/lib:$lib/pmix2/lib"
    "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath-link,$lib:$PREFIX/lib/$ARCH_TRIPLET:$lib/openmpi/lib:$lib/pmix2/lib"
    -DTETRA_BUILD_TESTS=ON
  )
  command -v make >/dev/null || args+=(-G Ninja)
  if ! command -v pkg-config >/dev/null && [[ -x $PREFIX/usr/bin/pkgconf ]]; then
    args+=("-DPKG_CONFIG_EXECUTABLE=$PREFIX/usr/bin/pkgconf")
  fi
  # One NCCL in the process: the one torch loads, when its headers came with it.
  if [[ -n $nccl_lib && -n $nccl_inc ]]; then
    args+=("-DNCCL_LIBRARY=$nccl_lib" "-DNCCL_INCLUDE_DIR=$nccl_inc")
    figure_str nccl "$nccl_lib"
  fi
  # torch's c10d headers with the Gloo headers of the same torch, when it ships them.
  if [[ -n $gloo_in_torch ]]; then
    args+=("-DGLOO_INCLUDE_DIR=$gloo_in_torch")
    figure_str gloo_headers "$gloo_in_torch (torch's own)"
  else
    figure_str gloo_headers "$PREFIX/usr/include (Debian's libgloo-dev)"
  fi
  if [[ -n $cap ]]; then export TORCH_CUDA_ARCH_LIST=$cap; fi  # LibTorch's CMake need not probe the GPU
  export CUDACXX=$NVCC
  echo "cmake ${args[*]}"
  timeout "$(left)" cmake "${args[@]}" || fail "cmake configure failed (log: $LOG)"
  local backends
  backends=$(grep -h 'tetra collectives:' "$LOG" | tail -1 | sed 's/.*tetra collectives: //')
  figure_str collectives "$backends"
  [[ $backends == *"nccl 1"* ]] || reason "configured without the nccl backend ($backends): CMake found no CUDA toolkit with NCCL, so the cuda test will skip"
}

# -- step: build -----------------------------------------------------------------------
step_build() {
  prefix_env
  # The CUDA-labelled tests' binaries (tests/collectives: test_nccl.cpp) and train.
  local -a targets=(train)
  read -r -a extra <<<"${TETRA_GPU_TEST_TARGETS:-collectives_test_nccl}"
  targets+=("${extra[@]}")
  figure_str targets "${targets[*]}"
  local jobs=${TETRA_GPU_JOBS:-$(nproc)}
  figure jobs "$jobs"
  timeout "$(left)" cmake --build "$BUILD" -j "$jobs" --target "${targets[@]}" ||
    fail "build failed (log: $LOG; the first error: $(grep -m1 -E 'error:|Error [0-9]' "$LOG" | cut -c1-300))"
}

# -- step: ctest -L cuda ---------------------------------------------------------------
step_ctest_cuda() {
  prefix_env
  local out rc=0
  out=$(cd "$BUILD" && timeout "$(left)" ctest -L cuda -E NOT_BUILT --no-tests=error -V --timeout 120 2>&1) || rc=$?
  echo "$out"
  local line
  line=$(grep -E 'tests passed|No tests were found' <<<"$out" | tail -1)
  figure_str ctest "$line"
  if [[ $line == *"No tests were found"* ]]; then
    fail "ctest -L cuda found no test labelled cuda among the built binaries (${TETRA_GPU_TEST_TARGETS:-collectives_test_nccl}): label the case in tests/collectives/CMakeLists.txt"
  fi
  ((rc == 0)) || fail "ctest -L cuda: ${line:-exit $rc}"
  # A GTEST_SKIP passes ctest but checked nothing: say why it skipped.
  if grep -q '\[  SKIPPED \]' <<<"$out"; then
    local why
    why=$(grep -A1 -E ': Skipped$' <<<"$out" | grep -vE ': Skipped$|^--$' | sort -u | sed 's/^[0-9]*: //' | xargs)
    fail "the cuda tests skipped instead of running: ${why:-see $LOG}"
  fi
}

# A fresh run folder (a run folder of an earlier check would be resumed or refused).
run_dir() { rm -rf "$LOGS/runs/$1"; mkdir -p "$LOGS/runs"; echo "$LOGS/runs/$1"; }

# -- step: quickstart on cuda ----------------------------------------------------------
step_quickstart() {
  prefix_env
  local dir
  dir=$(run_dir quickstart)
  timeout "$(left)" "$BUILD/bin/train" "$REPO/configs/quickstart.yaml" \
    --set name=gpu-check-quickstart --set "log.dir=$dir" --set "train.device=$DEVICE" \
    --set "data.path=$PREFIX/usr/share/datasets/fashion-mnist" --set log.progress=plain ||
    fail "train configs/quickstart.yaml on cuda: exit $? (log: $LOG)"
  local figs
  figs=$(py - "$dir/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
e = s.get("final_eval") or {}
print(json.dumps({"final_loss": s["final_loss"], "test_accuracy": e.get("test_accuracy"), "steps": s["steps"],
                  "samples_per_s": round(s["samples_per_s"], 1), "train_seconds": round(s["train_seconds"], 2)}))
PY
  ) || fail "no summary.json in $dir"
  figure run "$figs"
  local acc
  acc=$(jq_py "$figs" test_accuracy)
  headline "test accuracy $acc, final loss $(jq_py "$figs" final_loss), $(jq_py "$figs" samples_per_s) samples/s, $(jq_py "$figs" train_seconds) s training"
  awk -v a="$acc" 'BEGIN { exit !(a >= 0.88) }' || fail "test accuracy $acc, under the 0.88 configs/quickstart.yaml promises"
}

# -- step: GPT at bf16 on one GPU ------------------------------------------------------
# A corpus for the GPTs: the repository's own sources and text, a few MB (the same bytes
# on every machine that has this checkout).
make_corpus() {
  local c=$LOGS/corpus.txt
  if [[ ! -s $c ]]; then
    find "$REPO" -path "$REPO/build*" -prune -o -path "$REPO/.git" -prune -o -type f \
      \( -name '*.md' -o -name '*.cpp' -o -name '*.h' -o -name '*.yaml' -o -name '*.sh' -o -name '*.txt' \) -print0 |
      sort -z | xargs -0 cat >"$c"
  fi
  echo "$c"
}

# The GPT: 12 layers of d_model 1024 (about 152M parameters), 256-byte sequences, 64 a
# step. TETRA_GPU_GPT="layers d_model heads seq_len batch steps" picks another, and
# TETRA_GPU_DEVICE=cpu runs every train step on the CPU: both only to try this script's
# own plumbing on a machine without a GPU (tools/gpu-check.sh --step ..., see run_step).
read -r GPT_LAYERS GPT_D GPT_HEADS GPT_T GPT_BATCH GPT_STEPS <<<"${TETRA_GPU_GPT:-12 1024 16 256 64 120}"
DEVICE=${TETRA_GPU_DEVICE:-cuda}
step_gpt_bf16() {
  prefix_env
  local dir corpus
  dir=$(run_dir gpt-bf16)
  corpus=$(make_corpus)
  local -a sets=(
    --set name=gpu-check-gpt-bf16 --set "log.dir=$dir" --set mesh.data=1 --set zero.stage=0
    --set "model.layers=$GPT_LAYERS" --set "model.d_model=$GPT_D" --set "model.heads=$GPT_HEADS"
    --set "data.path=$corpus" --set "data.seq_len=$GPT_T" --set "data.batch_size=$GPT_BATCH"
    --set data.eval_samples=256 --set "train.max_steps=$GPT_STEPS" --set "train.eval_every=$GPT_STEPS"
    --set train.precision=bf16 --set "train.device=$DEVICE" --set train.threads=4
    --set optimizer.lr=3.0e-4 --set schedule.warmup_steps=20
    --set 'checkpoint.dir=""' --set log.every=10 --set log.progress=plain
  )
  # The parameter count from the plan (the model built as shapes, no GPU work).
  local plan params=""
  if plan=$(timeout 60 "$BUILD/bin/train" "$REPO/configs/zero3-gpt.yaml" "${sets[@]}" --dry-run --json 2>/dev/null); then
    params=$(jq_py "$plan" parameters 2>/dev/null || true)
  fi
  timeout "$(left)" "$BUILD/bin/train" "$REPO/configs/zero3-gpt.yaml" "${sets[@]}" ||
    fail "train (GPT ${GPT_LAYERS}x$GPT_D, bf16, cuda): exit $? (log: $LOG)"
  local figs
  figs=$(py - "$dir" "${params:-0}" "$GPT_LAYERS" "$GPT_D" "$GPT_T" "$GPT_BATCH" "$GPU_NAME" <<'PY'
import json, statistics, sys
d, params, L, D, T, B, gpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
s = json.load(open(d + "/summary.json"))
V, F = 256, 4 * D  # byte-level vocabulary, d_ff = 4 d_model (the defaults)
analytic = V * D + T * D + L * (12 * D * D + 13 * D) + 2 * D + D * V + V
params = params or analytic
recs = [json.loads(l) for l in open(d + "/metrics.jsonl") if l.strip()]
train = [r for r in recs if not r.get("eval") and "samples_per_s" in r]
steady = [r["samples_per_s"] for r in train[1:]] or [s["samples_per_s"]]  # past the first interval (warm-up)
sps_steady = statistics.median(steady)
# Model FLOPs per token: 6 N (forward + backward through every parameter) + 12 L d T
# (attention's scores and weighted sum, forward and backward; PaLM's appendix B).
per_token = 6 * params + 12 * L * D * T
per_sample = per_token * T
peaks = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("A100", 312e12)]
peak = next((p for n, p in peaks if n.lower() in gpu.lower()), None)
out = {"parameters": params, "parameters_analytic": analytic, "tokens_per_step": B * T,
       "model_flops_per_step": per_sample * B,
       "samples_per_s": round(s["samples_per_s"], 2), "samples_per_s_steady": round(sps_steady, 2),
       "tokens_per_s_steady": round(sps_steady * T), "model_tflops_per_s": round(per_sample * sps_steady / 1e12, 2),
       "gpu": gpu, "peak_bf16_tflops": peak / 1e12 if peak else "unknown",
       "mfu": round(per_sample * sps_steady / peak, 4) if peak else "unknown",
       "final_loss": s["final_loss"], "step_ms": s["ranks"][0]["step_ms"], "train_seconds": round(s["train_seconds"], 2)}
print(json.dumps(out))
PY
  ) || fail "reading $dir/summary.json and metrics.jsonl failed"
  figure run "$figs"
  headline "$(py -c '
import json, sys
f = json.loads(sys.argv[1])
mfu = f["mfu"] if f["mfu"] == "unknown" else "%.1f%%" % (100 * f["mfu"])
print("%s parameters, %.1f samples/s steady (%d tokens/s; %.1f over the whole run), %s model TFLOP/s, MFU %s of %s TFLOP/s (%s)" % (
    f["parameters"], f["samples_per_s_steady"], f["tokens_per_s_steady"], f["samples_per_s"], f["model_tflops_per_s"], mfu,
    f["peak_bf16_tflops"], f["gpu"]))' "$figs")"
}

# -- steps: ZeRO-3 over gloo, two ranks on the one GPU, against one rank ----------------
zero3_sets() {
  local dir=$1 corpus=$2
  ZSETS=(
    --set "log.dir=$dir" --set "train.device=$DEVICE" --set collectives.backend=gloo
    --set collectives.timeout_s=90 --set "data.path=$corpus" --set train.max_steps=40
    --set train.eval_every=40 --set data.eval_samples=256 --set 'checkpoint.dir=""'
    --set checkpoint.safetensors=model.safetensors --set log.every=1 --set log.progress=plain
  )
}

step_zero3_one() {
  prefix_env
  local dir corpus
  dir=$(run_dir zero3-one-rank)
  corpus=$(make_corpus)
  zero3_sets "$dir" "$corpus"
  timeout "$(left)" "$BUILD/bin/train" "$REPO/configs/zero3-gpt.yaml" "${ZSETS[@]}" \
    --set name=gpu-check-zero3-one --set mesh.data=1 --set zero.stage=0 ||
    fail "train configs/zero3-gpt.yaml, one process on cuda: exit $? (log: $LOG)"
}

step_zero3_two() {
  prefix_env
  mpirun_cmd
  local dir corpus
  dir=$(run_dir zero3-two-ranks)
  corpus=$(make_corpus)
  zero3_sets "$dir" "$corpus"
  timeout "$(left)" "${MPIRUN[@]}" -np 2 "$BUILD/bin/train" "$REPO/configs/zero3-gpt.yaml" "${ZSETS[@]}" \
    --set name=gpu-check-zero3-two --set mesh.data=2 --set zero.stage=3 ||
    fail "mpirun -np 2 train configs/zero3-gpt.yaml (zero.stage 3, gloo, both ranks on GPU 0): exit $? (log: $LOG)"
}

step_zero3_compare() {
  local figs
  figs=$(py - "$LOGS/runs/zero3-one-rank" "$LOGS/runs/zero3-two-ranks" <<'PY'
import array, json, struct, sys
one, two = sys.argv[1], sys.argv[2]
def losses(d):
    return {r["step"]: r["loss"] for r in map(json.loads, filter(str.strip, open(d + "/metrics.jsonl")))
            if not r.get("eval") and "loss" in r}
def tensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in head.items():
        if k == "__metadata__" or v["dtype"] != "F32":
            continue
        a = array.array("f")
        a.frombytes(data[v["data_offsets"][0]:v["data_offsets"][1]])
        out[k] = a
    return out
s1, s2 = (json.load(open(d + "/summary.json")) for d in (one, two))
l1, l2 = losses(one), losses(two)
common = sorted(set(l1) & set(l2))
rel = max((abs(l1[k] - l2[k]) / max(abs(l1[k]), 1e-12) for k in common), default=None)
p1, p2 = tensors(one + "/model.safetensors"), tensors(two + "/model.safetensors")
worst, worst_name, count = 0.0, "", 0
for k in sorted(set(p1) & set(p2)):
    for a, b in zip(p1[k], p2[k]):
        count += 1
        if abs(a - b) > worst:
            worst, worst_name = abs(a - b), k
print(json.dumps({"final_loss_one_rank": s1["final_loss"], "final_loss_two_ranks": s2["final_loss"],
                  "final_loss_diff": abs(s1["final_loss"] - s2["final_loss"]), "steps_compared": len(common),
                  "loss_max_rel_diff": rel, "parameters_compared": count,
                  "parameters_same_names": sorted(p1) == sorted(p2),
                  "parameter_max_abs_diff": worst, "parameter_max_abs_diff_at": worst_name,
                  "samples_per_s_one_rank": round(s1["samples_per_s"], 1),
                  "samples_per_s_two_ranks": round(s2["samples_per_s"], 1)}))
PY
  ) || fail "comparing the two runs' summary.json, metrics.jsonl and model.safetensors failed"
  figure compare "$figs"
  local diff
  diff=$(jq_py "$figs" final_loss_diff)
  headline "final loss $(jq_py "$figs" final_loss_one_rank) (one rank) vs $(jq_py "$figs" final_loss_two_ranks) (two ZeRO-3 ranks), $diff apart; parameters at most $(jq_py "$figs" parameter_max_abs_diff) apart (reported, not judged)"
  awk -v d="$diff" 'BEGIN { exit !(d <= 1e-3) }' ||
    fail "two ZeRO-3 ranks over gloo end at a loss $diff away from one process's (over 1e-3)"
}

# ---- the driver -----------------------------------------------------------------------
STEP_ORDER=()
declare -A STATUS=() WALL=() LIMIT=()

# run_step NAME TIMEOUT_S FUNCTION [NEEDS...]
run_step() {
  local name=$1 limit=$2 fn=$3
  shift 3
  STEP_ORDER+=("$name")
  rm -f "$STEPS/$name".*
  local need
  for need in "$@"; do
    if [[ ${STATUS[$need]:-} != pass ]]; then
      STATUS[$name]=skipped
      WALL[$name]=0
      LIMIT[$name]=$limit
      printf 'needs %s (%s)\n' "$need" "${STATUS[$need]:-not run}" >"$STEPS/$name.reason"
      echo "gpu-check: $name: skipped: needs $need (${STATUS[$need]:-not run})"
      return 0
    fi
  done
  if [[ -n ${NO_BUILD_REASON:-} && $fn != step_environment && $fn != step_unpack && $fn != step_mpirun ]]; then
    STATUS[$name]=skipped; WALL[$name]=0; LIMIT[$name]=$limit
    echo "$NO_BUILD_REASON" >"$STEPS/$name.reason"
    echo "gpu-check: $name: skipped: $NO_BUILD_REASON"
    return 0
  fi
  # The budget: this step gets its own limit or what is left, whichever is less.
  local left_s
  left_s=$(awk -v d="$DEADLINE" -v n="$(now)" 'BEGIN { print int(d - n) }')
  if ((left_s < 15)); then
    STATUS[$name]=skipped; WALL[$name]=0; LIMIT[$name]=$limit
    echo "no time left in the ${BUDGET} s budget" >"$STEPS/$name.reason"
    echo "gpu-check: $name: skipped: no time left in the budget"
    return 0
  fi
  ((limit > left_s)) && limit=$left_s
  LIMIT[$name]=$limit
  local log=$LOGS/$name.log t0 rc=0
  t0=$(now)
  echo "gpu-check: $name (up to ${limit} s; log $log)"
  set +e
  STEP=$name STEP_DEADLINE=$(awk -v n="$t0" -v l="$limit" 'BEGIN { printf "%.0f", n + l - 5 }') LOG=$log \
    timeout -k 10 "$limit" bash "$SELF" --step "$fn" >"$log" 2>&1
  rc=$?
  set -e
  WALL[$name]=$(elapsed "$t0" "$(now)")
  case $rc in
    0) STATUS[$name]=pass ;;
    "$SKIP_RC") STATUS[$name]=skipped ;;
    124 | 137) STATUS[$name]=fail; echo "timed out after ${limit} s (log: $log)" >"$STEPS/$name.reason" ;;
    *)
      STATUS[$name]=fail
      [[ -s $STEPS/$name.reason ]] || echo "exit $rc; the log's last line: $(grep . "$log" | tail -1 | cut -c1-300)" >"$STEPS/$name.reason"
      ;;
  esac
  local why=""
  if [[ -s $STEPS/$name.reason ]]; then why=": $(head -1 "$STEPS/$name.reason")"; fi
  echo "gpu-check: $name: ${STATUS[$name]} in ${WALL[$name]} s$why"
  if [[ -s $STEPS/$name.headline ]]; then echo "gpu-check: $name: $(head -1 "$STEPS/$name.headline")"; fi
}

write_summary() {
  local out=$1 name first=1 result=pass
  for name in "${STEP_ORDER[@]}"; do
    if [[ ${STATUS[$name]} == fail ]]; then result=fail; fi
  done
  {
    printf '{\n  "tool": "tools/gpu-check.sh",\n'
    printf '  "result": "%s",\n' "$result"
    printf '  "started": %s,\n' "$(json_str "$STARTED")"
    printf '  "host": %s,\n' "$(json_str "$(hostname 2>/dev/null || cat /etc/hostname 2>/dev/null || echo unknown)")"
    printf '  "commit": %s,\n' "$(json_str "$(git -C "$REPO" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)")"
    printf '  "budget_s": %s,\n  "wall_s": %s,\n' "$BUDGET" "$(elapsed "$T0" "$(now)")"
    printf '  "steps": ['
    for name in "${STEP_ORDER[@]}"; do
      ((first)) || printf ','
      first=0
      printf '\n    {"name": %s, "status": "%s", "wall_s": %s, "timeout_s": %s' \
        "$(json_str "$name")" "${STATUS[$name]}" "${WALL[$name]}" "${LIMIT[$name]}"
      if [[ -s $STEPS/$name.reason ]]; then printf ', "reason": %s' "$(json_str "$(head -c 2000 "$STEPS/$name.reason")")"; fi
      if [[ -s $STEPS/$name.headline ]]; then printf ', "headline": %s' "$(json_str "$(head -1 "$STEPS/$name.headline")")"; fi
      if [[ -e $LOGS/$name.log ]]; then printf ', "log": %s' "$(json_str "$LOGS/$name.log")"; fi
      if [[ -s $STEPS/$name.fig ]]; then
        printf ', "figures": {'
        local k v ff=1
        while IFS=$'\t' read -r k v; do
          ((ff)) || printf ', '
          ff=0
          printf '%s: %s' "$(json_str "$k")" "$v"
        done <"$STEPS/$name.fig"
        printf '}'
      fi
      if [[ ${STATUS[$name]} == fail && -s $LOGS/$name.log ]]; then
        printf ', "log_tail": ['
        local line lf=1
        while IFS= read -r line; do
          ((lf)) || printf ', '
          lf=0
          json_str "${line:0:300}"
        done < <(grep . "$LOGS/$name.log" | tail -15)
        printf ']'
      fi
      printf '}'
    done
    printf '\n  ]\n}\n'
  } >"$out.tmp"
  mv "$out.tmp" "$out"
  [[ $result == pass ]]
}

main_run() {
  DEBS=$REPO/build-gpu-debs
  BUILD=$REPO/build-gpu
  SUMMARY=""
  BUDGET=450
  NO_BUILD_REASON=""
  while (($#)); do
    case $1 in
      --debs) DEBS=$(readlink -m "${2:?--debs needs a folder}"); shift 2 ;;
      --out) SUMMARY=$(readlink -m "${2:?--out needs a file}"); shift 2 ;;
      --budget) BUDGET=${2:?--budget needs seconds}; shift 2 ;;
      --build-dir) BUILD=$(readlink -m "${2:?--build-dir needs a folder}"); shift 2 ;;
      --no-build) NO_BUILD_REASON="--no-build: stopped before CMake"; shift ;;
      -h | --help) usage; exit 0 ;;
      *) die "unknown argument '$1' (see --help)" ;;
    esac
  done
  [[ $BUDGET =~ ^[0-9]+$ ]] || die "--budget: a whole number of seconds, not '$BUDGET'"
  PREFIX=$BUILD/prefix
  LOGS=$BUILD/gpu-check
  STEPS=$LOGS/steps
  SUMMARY=${SUMMARY:-$BUILD/gpu-check-summary.json}
  mkdir -p "$STEPS" "$(dirname "$SUMMARY")"
  rm -f "$LOGS/env.sh" "$STEPS"/*
  export REPO BUILD PREFIX LOGS STEPS DEBS BUDGET
  T0=$(now)
  STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  DEADLINE=$(awk -v t="$T0" -v b="$BUDGET" 'BEGIN { printf "%.0f", t + b }')
  echo "gpu-check: $REPO, budget ${BUDGET} s, packages from $DEBS, build in $BUILD"

  run_step environment 150 step_environment
  run_step unpack 120 step_unpack
  run_step mpirun 60 step_mpirun unpack
  run_step configure 180 step_configure environment unpack
  run_step build 420 step_build configure
  run_step ctest-cuda 120 step_ctest_cuda build
  run_step quickstart-cuda 150 step_quickstart build
  run_step gpt-bf16 150 step_gpt_bf16 build
  run_step zero3-one-rank 100 step_zero3_one build
  run_step zero3-two-ranks 150 step_zero3_two build mpirun
  run_step zero3-compare 30 step_zero3_compare zero3-one-rank zero3-two-ranks

  local rc=0
  write_summary "$SUMMARY" || rc=1
  cat "$SUMMARY"
  echo "gpu-check: $(grep -o '"result": "[a-z]*"' "$SUMMARY" | head -1) (summary: $SUMMARY)"
  return "$rc"
}

case ${1:-} in
  --prepare)
    [[ -n ${2:-} ]] || die "--prepare needs a folder for the .deb files, e.g. --prepare build-gpu-debs"
    prepare "$2"
    ;;
  --step)
    # One step, inside its timeout (run_step starts it).
    STEP=${STEP:?} LOG=${LOG:?}
    if [[ $2 != step_environment && -f $LOGS/env.sh ]]; then
      # shellcheck source=/dev/null
      source "$LOGS/env.sh"
    fi
    "${2:?}"
    ;;
  *) main_run "$@" ;;
esac
