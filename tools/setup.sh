#!/usr/bin/env bash
# Installs tetra's build and run dependencies from Debian's packages. Idempotent: when
# everything is present it only checks (well under a second) and installs nothing.
#
#   tools/setup.sh            install what is missing (root, or sudo when available)
#   tools/setup.sh --check    report what is missing and exit 1 if anything is
#
# The CUDA toolkit and NCCL are optional and never installed here: CMake detects them.
set -euo pipefail

packages=(
  g++ cmake make pkg-config
  git                     # the commit train --version names (collectives/git_commit.cmake)
  libtorch-dev            # LibTorch (CPU build on Debian)
  libopenblas0-pthread    # fast BLAS for LibTorch (else the reference BLAS, ~30x slower)
  libopenmpi-dev openmpi-bin
  libyaml-cpp-dev
  libboost-dev
  libhwloc-dev
  zlib1g-dev
  libgtest-dev
  libcli11-dev
  nlohmann-json3-dev
  libgloo-dev             # headers for LibTorch's c10d Gloo process group
  dataset-fashion-mnist   # /usr/share/datasets/fashion-mnist/*.gz
  iproute2                # ip, tc: tools/test-hosts.sh (network namespaces as test hosts)
  procps                  # pgrep: the tuner's test looks for a trial left running
  python3-torch           # torchrun: the tests launch train under it
  slurmctld slurmd slurm-client munge  # a real Slurm for the srun tests (tools/test-slurm.sh)
  protobuf-compiler python3-protobuf   # the TensorBoard test decodes event files independently
  python3-jsonschema python3-yaml      # the schema test validates configs/ with an independent validator
  chromium chromium-driver python3-selenium python3-pil fonts-dejavu-core  # the report's test opens it in a real browser
  librsvg2-bin                         # report --png: rsvg-convert draws the report's SVG
)

missing=()
for p in "${packages[@]}"; do
  [[ $p == \#* ]] && continue
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ ${1:-} == --check ]]; then
  if ((${#missing[@]})); then echo "missing: ${missing[*]}"; exit 1; fi
  echo "all dependencies present"; exit 0
fi

if ((${#missing[@]})); then
  echo "tools/setup.sh: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "tools/setup.sh: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
    SUDO=sudo
  fi
  export DEBIAN_FRONTEND=noninteractive
  # A new machine knows no packages until the lists are fetched.
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# LibTorch multiplies through libblas.so.3: make sure OpenBLAS (pthread) serves it.
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3 2>/dev/null || true)
if [[ -n $blas && $blas != *openblas* ]]; then
  echo "tools/setup.sh: warning: libblas.so.3 resolves to $blas, not OpenBLAS;" \
       "run: update-alternatives --config libblas.so.3-x86_64-linux-gnu" >&2
fi
echo "tools/setup.sh: dependencies ready"
