#!/usr/bin/env bash
# tools/gpu/steps.sh NAME: one step of the GPU check, run by tools/gpu-check.sh inside the
# step's timeout (see tools/gpu/lib.sh for what a step leaves and how it exits).
set -euo pipefail
REPO=${REPO:?} WORK=${WORK:?} BUILD=${BUILD:?} PREFIX=${PREFIX:?} LOGS=${LOGS:?} STEPS=${STEPS:?}
CARRY=${CARRY:?} DEVICE=${DEVICE:?} STEP=${STEP:?} LOG=${LOG:?} STEP_DEADLINE=${STEP_DEADLINE:?}
NO_BUILD=${NO_BUILD:-0} NO_GLOO=${NO_GLOO:-0} LAUNCHER=${LAUNCHER:-auto} JOBS=${JOBS:-$(nproc)}
# shellcheck source=tools/gpu/lib.sh
source "$REPO/tools/gpu/lib.sh"

# The test binaries the `cuda` label's tests are in (tests/collectives/CMakeLists.txt).
TEST_TARGETS=${TETRA_GPU_TEST_TARGETS:-collectives_test_nccl}

# ---- environment: the GPU, the python3 whose torch the build uses, the tools ---------
step_environment() {
  local problems=() notes=()
  local smi="" c
  for c in nvidia-smi /usr/local/nvidia/bin/nvidia-smi /usr/bin/nvidia-smi; do
    if command -v "$c" >/dev/null 2>&1; then smi=$(command -v "$c"); break; fi
  done
  local gpu_name="" gpu_mem="" driver="" gpu_count=0 q
  if [[ -n $smi ]] && q=$(timeout 30 "$smi" --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1) && [[ -n $q ]]; then
    IFS=, read -r gpu_name gpu_mem driver <<<"$(head -1 <<<"$q")"
    gpu_name=$(xargs <<<"$gpu_name"); gpu_mem=$(xargs <<<"$gpu_mem"); driver=$(xargs <<<"$driver")
    gpu_count=$(grep -c . <<<"$q")
    figure_str gpu "$gpu_name"; figure_str gpu_memory "$gpu_mem"; figure_str driver "$driver"; figure gpus "$gpu_count"
  elif [[ $DEVICE == cuda ]]; then
    problems+=("no GPU: ${smi:-no nvidia-smi on the PATH (nor in /usr/local/nvidia/bin)}${q:+: $q}")
  else
    notes+=("no GPU here (--device cpu: a rehearsal)")
  fi

  # The python3 whose torch has CUDA (on --device cpu, any torch).
  local -a candidates=()
  [[ -n ${TETRA_GPU_PYTHON:-} ]] && candidates+=("$TETRA_GPU_PYTHON")
  for c in python3 /opt/torch/.venv/bin/python3 /usr/bin/python3 /usr/local/bin/python3; do
    if command -v "$c" >/dev/null 2>&1; then candidates+=("$(command -v "$c")"); fi
  done
  local chosen="" json="" i=0 seen=" " first_py=""
  for c in "${candidates[@]}"; do
    local real
    real=$(readlink -f "$c")
    [[ $seen == *" $real "* ]] && continue
    seen+="$real "
    [[ -z $first_py ]] && first_py=$c
    i=$((i + 1))
    local out=$LOGS/torch-probe-$i.json
    echo "probing $c"
    # stdout is the probe's JSON alone; whatever the import prints goes to this log.
    if ! timeout 120 env -u LD_LIBRARY_PATH "$c" "$GPU_DIR/probe_torch.py" >"$out" 2>>"$LOG"; then
      notes+=("$c: the torch probe failed (exit $?; see the log)")
      continue
    fi
    local get=("$c" "$GPU_DIR/jget.py" "$out")
    local tv cuda avail
    tv=$("${get[@]}" torch)
    if [[ -z $tv ]]; then notes+=("$c: no torch ($("${get[@]}" error))"); continue; fi
    cuda=$("${get[@]}" cuda)
    avail=$("${get[@]}" available)
    if [[ $DEVICE == cpu ]]; then chosen=$c; json=$out; break; fi
    if [[ -z $cuda ]]; then notes+=("$c: torch $tv has no CUDA (a CPU build)"); continue; fi
    if [[ $avail != True ]]; then
      notes+=("$c: torch $tv (CUDA $cuda) sees no GPU")
      [[ -z $chosen ]] && { chosen=$c; json=$out; }
      continue
    fi
    chosen=$c; json=$out; break
  done
  HOSTPY=${chosen:-${first_py:-/usr/bin/python3}}
  TORCH_JSON=$json
  if [[ -z $chosen ]]; then
    local what="a CUDA torch"
    [[ $DEVICE == cpu ]] && what="torch"
    problems+=("no python3 with $what (tried ${candidates[*]:-none}: $(printf '%s; ' "${notes[@]}")); TETRA_GPU_PYTHON=/path/to/python3 names one")
  else
    PY=$chosen
    figure torch "$(cat "$json")"
    if [[ $DEVICE == cuda && $(torch available) != True ]]; then problems+=("${notes[*]}"); fi
    if [[ $NO_BUILD != 1 && $(torch cmake_prefix_missing) == True ]]; then
      problems+=("$chosen's torch has no CMake package (no Torch/TorchConfig.cmake under $(torch cmake_prefix)): LibTorch cannot be built against")
    fi
    if [[ $(torch cxx11_abi) != True ]]; then
      problems+=("$chosen's torch is built with _GLIBCXX_USE_CXX11_ABI=0, the carried Debian C++ libraries (yaml-cpp, GoogleTest) with the new ABI: they cannot link into one program")
    fi
  fi

  local t
  for t in g++ gcc timeout tar; do command -v "$t" >/dev/null || problems+=("no $t on the PATH"); done
  local gen=""
  if command -v ninja >/dev/null; then gen="ninja $(ninja --version)"; elif command -v make >/dev/null; then gen="make"; fi
  [[ -n $gen ]] || problems+=("neither ninja nor make on the PATH")
  figure_str generator "$gen"
  if command -v cmake >/dev/null; then
    local cv
    cv=$(cmake --version | head -1 | awk '{print $3}')
    figure_str cmake "$cv"
    [[ $(printf '%s\n' 3.18 "$cv" | sort -V | head -1) == 3.18 ]] || problems+=("cmake $cv is older than the 3.18 tetra needs")
  elif [[ $NO_BUILD != 1 ]]; then
    problems+=("no cmake on the PATH")
  fi
  if command -v g++ >/dev/null; then figure_str gxx "$(g++ -dumpfullversion 2>/dev/null || g++ -dumpversion)"; fi

  # nvcc: a CUDA LibTorch's CMake package (Caffe2's cuda.cmake) finds the CUDA toolkit.
  local nvcc=""
  if [[ $DEVICE == cuda ]]; then
    for c in nvcc "${CUDA_HOME:-/nonexistent}/bin/nvcc" "${CUDA_PATH:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
      if command -v "$c" >/dev/null 2>&1; then nvcc=$(command -v "$c"); break; fi
    done
    if [[ -z $nvcc && -n $json ]]; then nvcc=$(torch pip_nvcc.0); fi
    if [[ -z $nvcc && $NO_BUILD != 1 ]]; then
      problems+=("no nvcc (PATH, \$CUDA_HOME, /usr/local/cuda, pip's nvidia/*/bin): a CUDA LibTorch's CMake package needs the CUDA toolkit")
    elif [[ -n $nvcc ]]; then
      local nv tcuda=""
      nv=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
      figure_str nvcc "$nvcc ($nv)"
      [[ -n $json ]] && tcuda=$(torch cuda)
      if [[ -n $tcuda && -n $nv && ${tcuda%%.*} != "${nv%%.*}" ]]; then
        notes+=("torch is built for CUDA $tcuda, nvcc is $nv (another major version: LibTorch's CMake may refuse)")
      fi
    fi
  fi
  local gloo=""
  if [[ -n $json ]]; then gloo=$(torch gloo_headers); fi
  if [[ $NO_GLOO == 1 ]]; then
    notes+=("--no-gloo: built without the gloo backend")
    gloo=""
  elif [[ -z $gloo && -n $json ]]; then
    notes+=("this torch ships no Gloo headers: built without the gloo backend (TETRA_WITH_GLOO=OFF)")
  fi
  figure_str gloo_headers "${gloo:-none}"
  figure cores "$(nproc)"
  {
    printf 'PY=%q\nHOSTPY=%q\nNVCC=%q\nGPU_NAME=%q\nGPU_COUNT=%q\nTORCH_JSON=%q\nGLOO_HEADERS=%q\n' \
      "$chosen" "$HOSTPY" "$nvcc" "$gpu_name" "$gpu_count" "$json" "$gloo"
  } >"$LOGS/env.sh"
  if [[ -n $chosen ]]; then
    local tinfo
    tinfo="torch $(torch torch)"
    [[ -n $(torch cuda) ]] && tinfo+=" (CUDA $(torch cuda), NCCL $(torch nccl_version), capability $(torch capability))"
    headline "${gpu_name:-no GPU}${driver:+ (driver $driver)}, ${gpu_count} GPU(s); $tinfo at $chosen; $gen; $(nproc) cores"
  fi
  if ((${#problems[@]})); then fail "$(printf '%s; ' "${problems[@]}" | sed 's/; $//')"; fi
  if ((${#notes[@]})); then reason "$(printf '%s; ' "${notes[@]}" | sed 's/; $//')"; fi
}

# ---- matmul: the bf16 ceiling measured on the spot --------------------------------------
step_matmul() {
  local out=$LOGS/matmul.json
  local -a args=(--device "$DEVICE" --n 8192 --dtype bf16 --repeat 20)
  [[ $DEVICE == cpu ]] && args=(--device cpu --n 1024 --dtype fp32 --repeat 5)
  timeout "$(left)" env -u LD_LIBRARY_PATH "$PY" "$GPU_DIR/matmul.py" "${args[@]}" >"$out" ||
    fail "tools/gpu/matmul.py ${args[*]}: exit $? (log: $LOG)"
  figure matmul "$(cat "$out")"
  local get=(hpy "$GPU_DIR/jget.py" "$out")
  headline "$("${get[@]}" dtype) $("${get[@]}" n)^3 matmul on $("${get[@]}" name): $(printf '%.4g' "$("${get[@]}" tflops_median)") TFLOP/s (median of $("${get[@]}" repeat)), best $(printf '%.4g' "$("${get[@]}" tflops_best)")"
}

# ---- unpack: the carried .deb files under $PREFIX -------------------------------------
step_unpack() {
  local debs=$CARRY/debs
  [[ -d $debs ]] || fail "no folder $debs: run tools/gpu-check.sh --prepare here where apt works, and carry $(basename "$CARRY")"
  local need missing=()
  for need in libyaml-cpp-dev libopenmpi-dev openmpi-bin libhwloc-dev libgtest-dev libcli11-dev nlohmann-json3-dev dataset-fashion-mnist; do
    compgen -G "$debs/${need}_*.deb" >/dev/null || missing+=("$need")
  done
  ((${#missing[@]} == 0)) || fail "$debs lacks: ${missing[*]} (run --prepare again)"
  figure debs "$(find "$debs" -name '*.deb' | wc -l)"
  figure debs_bytes "$(du -sb "$debs" | cut -f1)"
  bash "$GPU_DIR/unpack.sh" "$debs" "$PREFIX" || fail "tools/gpu/unpack.sh failed (log: $LOG)"
  prefix_env
  local lib=$PREFIX/usr/lib/$ARCH_TRIPLET f missing_libs
  missing_libs=$(for f in "$PREFIX"/usr/bin/orterun "$PREFIX"/usr/bin/orted "$lib"/libmpi.so.40 "$lib"/libyaml-cpp.so.0.7 "$lib"/libhwloc.so.15; do
    [[ -e $f ]] || { echo "$(basename "$f")(absent)"; continue; }
    ldd "$f" 2>/dev/null | awk '/not found/ { print $1 }'
  done | sort -u | xargs)
  [[ -z $missing_libs ]] || fail "the carried programs need libraries this machine lacks: $missing_libs"
  figure prefix_bytes "$(du -sb "$PREFIX" | cut -f1)"
}

# ---- mpirun: the relocated Open MPI starts two ranks that meet ------------------------
step_mpirun() {
  prefix_env
  mpirun_cmd
  [[ -x $PREFIX/usr/bin/mpirun ]] || fail "no mpirun in the prefix (openmpi-bin not unpacked)"
  local v out
  v=$("${MPIRUN[@]}" --version 2>&1 | head -1) || fail "mpirun --version: $v"
  figure_str mpirun "$v"
  local seen
  seen=$(ompi_info --path prefix --parsable 2>/dev/null | sed -n 's/^path:prefix://p')
  figure_str ompi_prefix "$seen"
  [[ $seen == "$PREFIX/usr" ]] || fail "ompi_info's prefix is '$seen', not $PREFIX/usr: OPAL_PREFIX is not honoured"
  local t=$LOGS/mpi-hello
  mkdir -p "$t"
  out=$(mpicc -o "$t/hello" "$GPU_DIR/mpi_hello.c" 2>&1) || fail "mpicc tools/gpu/mpi_hello.c: $(tail -3 <<<"$out" | xargs)"
  local libmpi
  libmpi=$(ldd "$t/hello" | awk '/libmpi\.so/ { print $3 }')
  figure_str libmpi "$libmpi"
  [[ $libmpi == "$PREFIX"/* ]] || fail "mpi_hello loads libmpi from '$libmpi', not from the carried $PREFIX"
  out=$(timeout "$(left)" "${MPIRUN[@]}" -np 2 "$t/hello" 2>&1) || fail "mpirun -np 2 mpi_hello (MPI_Init, MPI_Allreduce): $(tail -5 <<<"$out" | xargs)"
  echo "$out"
  [[ $(grep -c 'of 2: sum 1$' <<<"$out") -eq 2 ]] || fail "mpirun -np 2 mpi_hello printed: $(xargs <<<"$out")"
  # A relocated Open MPI that misses a component or a help file says so, and still runs.
  local extra
  extra=$(grep -vE '^rank [01] of 2: sum 1$|^-+$|^$' <<<"$out" | head -5 | xargs) || true
  [[ -z $extra ]] || reason "mpirun ran, and printed: ${extra:0:600}"
  headline "$v from $PREFIX/usr: mpicc built, mpirun -np 2 met in MPI_Allreduce"
}

# ---- configure --------------------------------------------------------------------------
step_configure() {
  prefix_env
  local lib=$PREFIX/usr/lib/$ARCH_TRIPLET tcmake
  tcmake=$(torch cmake_prefix)
  local link="-Wl,-rpath-link,$lib:$PREFIX/lib/$ARCH_TRIPLET:$lib/openmpi/lib:$lib/pmix2/lib"
  local -a args=(
    -S "$REPO" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_PREFIX_PATH=$PREFIX/usr;$lib/cmake;$tcmake"
    "-DCMAKE_LIBRARY_PATH=$lib;$PREFIX/lib/$ARCH_TRIPLET"
    "-DTorch_DIR=$tcmake/Torch"
    "-DMPI_C_COMPILER=$PREFIX/usr/bin/mpicc" "-DMPIEXEC_EXECUTABLE=$PREFIX/usr/bin/mpirun"
    # The libraries the carried ones load (libhwloc under libmpi, ...), for the linker.
    "-DCMAKE_EXE_LINKER_FLAGS=$link" "-DCMAKE_SHARED_LINKER_FLAGS=$link"
    -DTETRA_BUILD_TESTS=ON
  )
  local gen="Unix Makefiles"
  if command -v ninja >/dev/null; then gen=Ninja; fi  # Ninja when it is there
  args+=(-G "$gen")
  if [[ -f $CARRY/COMMIT ]]; then args+=("-DTETRA_COMMIT_FILE=$CARRY/COMMIT"); fi
  if ! command -v pkg-config >/dev/null && [[ -x $PREFIX/usr/bin/pkgconf ]]; then
    args+=("-DPKG_CONFIG_EXECUTABLE=$PREFIX/usr/bin/pkgconf")
  fi
  local notes=()
  if [[ -n $GLOO_HEADERS && ! -f $BUILD/.gpu-check-without-gloo ]]; then
    args+=(-DTETRA_WITH_GLOO=ON "-DGLOO_INCLUDE_DIR=$GLOO_HEADERS")
  else
    args+=(-DTETRA_WITH_GLOO=OFF)
    [[ -f $BUILD/.gpu-check-without-gloo ]] && notes+=("without the gloo backend: its sources failed to compile here in an earlier call (rm $BUILD/.gpu-check-without-gloo to try again)")
  fi
  if [[ -f $BUILD/.gpu-check-without-nccl ]]; then
    args+=(-DTETRA_WITH_NCCL=OFF)
    notes+=("without the nccl backend: its sources failed to compile here in an earlier call (rm $BUILD/.gpu-check-without-nccl to try again)")
  fi
  if [[ $DEVICE == cuda ]]; then
    local cuda_root nccl_lib nccl_inc cap
    cuda_root=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
    args+=("-DCMAKE_CUDA_COMPILER=$NVCC" "-DCUDAToolkit_ROOT=$cuda_root" "-DCUDA_TOOLKIT_ROOT_DIR=$cuda_root")
    # One NCCL in the process: the one torch loads, with its headers.
    nccl_lib=$(torch nccl_lib)
    nccl_inc=$(torch nccl_include)
    if [[ -n $nccl_lib && -n $nccl_inc ]]; then
      args+=("-DNCCL_LIBRARY=$nccl_lib" "-DNCCL_INCLUDE_DIR=$nccl_inc")
      figure_str nccl "$nccl_lib"
    fi
    cap=$(torch capability)
    if [[ -n $cap ]]; then export TORCH_CUDA_ARCH_LIST=$cap; fi  # LibTorch's CMake need not probe the GPU
    export CUDACXX=$NVCC
  else
    args+=(-DTETRA_WITH_NCCL=OFF)
  fi
  local stamp generator
  stamp=$(printf '%s\n' "${args[@]}" "${TORCH_CUDA_ARCH_LIST:-}" | sha1sum | cut -d' ' -f1)
  generator=$(grep -s '^CMAKE_GENERATOR:' "$BUILD/CMakeCache.txt" | cut -d= -f2 || true)
  if [[ -n $generator && $generator != "$gen" ]]; then
    echo "the build folder was made by $generator, not $gen: started afresh"
    rm -rf "$BUILD"
  fi
  if [[ -f $BUILD/CMakeCache.txt && $(cat "$BUILD/.gpu-check-configured" 2>/dev/null) == "$stamp" ]]; then
    echo "configured already with these arguments: kept (the build reruns CMake itself where a CMakeLists.txt changed)"
    figure_str configured "kept"
  else
    rm -f "$BUILD/.gpu-check-configured"
    echo "cmake ${args[*]}"
    local rc=0
    timeout "$(left)" cmake "${args[@]}" || rc=$?
    if ((rc)); then
      grep -A4 'CMake Error' "$LOG" | cut -c1-400 >"$LOGS/configure-errors.txt" || true
      figure errors "$(hpy "$GPU_DIR/lines.py" "$LOGS/configure-errors.txt")"
      ((rc == 124)) && fail "cmake ran out of its time (log: $LOG)"
      fail "cmake failed: $(grep -m1 -A2 'CMake Error' "$LOG" | xargs | cut -c1-400) (every error: the summary's errors)"
    fi
    printf '%s\n' "$stamp" >"$BUILD/.gpu-check-configured"
    cp "$LOG" "$BUILD/gpu-check-configure.log"
  fi
  local backends crc
  backends=$(grep -h 'tetra collectives:' "$BUILD/gpu-check-configure.log" 2>/dev/null | tail -1 | sed 's/.*tetra collectives: //' || true)
  crc=$(grep -h 'tetra core: CRC-32C' "$BUILD/gpu-check-configure.log" 2>/dev/null | tail -1 | sed 's/.*tetra core: //' || true)
  figure_str collectives "$backends"
  figure_str crc32c "$crc"
  headline "collectives: ${backends:-?}; ${crc:-?}"
  if [[ $DEVICE == cuda && $backends != *"nccl 1"* && ! -f $BUILD/.gpu-check-without-nccl ]]; then
    notes+=("configured without the nccl backend ($backends): CMake found no CUDA toolkit with NCCL, so the cuda tests will skip")
  fi
  if ((${#notes[@]})); then reason "$(printf '%s; ' "${notes[@]}" | sed 's/; $//')"; fi
}

# ---- build: train and the cuda-labelled tests' binaries ---------------------------------
step_build() {
  prefix_env
  local -a targets=(train ckpt generate)
  read -r -a extra <<<"$TEST_TARGETS"
  targets+=("${extra[@]}")
  figure_str targets "${targets[*]}"
  figure jobs "$JOBS"
  hpy "$GPU_DIR/mtimes.py" restore "$REPO" "$BUILD/.gpu-check-sources.json" || true
  local rc=0 t0 note=""
  t0=$(date +%s)
  build_targets "${targets[@]}" || rc=$?
  # An optional backend whose sources alone failed (gloo.cpp against a wheel's c10d, say):
  # its errors stay in the summary, and the build goes on without it, so that the
  # figures that do not need it still come from this call.
  if ((rc && rc != 124)); then
    local objs only=""
    objs=$(grep -E '^FAILED: |\*\*\*' "$LOG" | grep -oE '[A-Za-z0-9_./-]+\.cpp\.o' | sort -u || true)
    if [[ -n $objs ]] && ! grep -qv '/gloo[^/]*\.cpp\.o$' <<<"$objs"; then only=gloo; fi
    if [[ -n $objs ]] && ! grep -qv '/nccl[^/]*\.cpp\.o$' <<<"$objs"; then only=nccl; fi
    if [[ -n $only ]]; then
      local up=${only^^}
      echo "every failure is in the $only backend's sources: configured again with TETRA_WITH_$up=OFF and built again"
      touch "$BUILD/.gpu-check-without-$only"
      note="built without the $only backend: its sources failed to compile here (their errors: the summary's errors)"
      rc=0
      timeout "$(left)" cmake -S "$REPO" -B "$BUILD" "-DTETRA_WITH_$up=OFF" || rc=$?
      rm -f "$BUILD/.gpu-check-configured"  # the next call configures as its options say
      ((rc)) || build_targets "${targets[@]}" || rc=$?
    fi
  fi
  figure compile_s "$(($(date +%s) - t0))"
  # Every error: the compiler's (file:line:col: error:), the linker's, and each failed
  # target; the summary carries them all.
  # (CMake asks the compiler for colours under Ninja: the escapes go before the grep.)
  sed 's/\x1b\[[0-9;]*[mK]//g' "$LOG" |
    grep -E '^[^ ]+:[0-9]+(:[0-9]+)?: (fatal )?error: |undefined reference to|^/usr/bin/ld: .*error|^FAILED: |^make(\[[0-9]+\])?: \*\*\* ' |
    awk '!seen[$0]++' | cut -c1-400 >"$LOGS/build-errors.txt" || true
  local nerr nfail progress
  nerr=$(grep -cE ': (fatal )?error: |undefined reference' "$LOGS/build-errors.txt" || true)
  nfail=$(grep -c '^FAILED: ' "$LOGS/build-errors.txt" || true)
  progress=$(grep -oE '^\[[0-9]+/[0-9]+\]' "$LOG" | tail -1 || true)
  figure_str progress "${progress:-}"
  if [[ -s $LOGS/build-errors.txt ]]; then figure errors "$(hpy "$GPU_DIR/lines.py" "$LOGS/build-errors.txt")"; fi
  if ((rc == 124)); then
    fail "the build ran out of its time at ${progress:-?}${nerr:+ with $nerr error(s)}: call again on the same machine, the build folder stays and goes on from there"
  fi
  if ((rc)); then
    # train may have built all the same (the errors elsewhere, a test's say): the figures
    # that need only train still run.
    if [[ -x $BUILD/bin/train ]] && ! grep '^FAILED: ' "$LOGS/build-errors.txt" | grep -qvE '^FAILED: (tests/|bin/[a-z_]+_test_)'; then
      touch "$STEPS/build.train-ok"
      echo "train built: every failure is in the tests' own sources"
    fi
    fail "$nerr compile/link error(s), $nfail failed target(s) (every one in the summary's errors; the first: $(grep -m1 -E 'error|undefined' "$LOGS/build-errors.txt" | cut -c1-300))"
  fi
  hpy "$GPU_DIR/mtimes.py" save "$REPO" "$BUILD/.gpu-check-sources.json" || true
  [[ -n $note ]] && reason "$note"
  headline "built ${targets[*]} with -j$JOBS in $(($(date +%s) - t0)) s ${progress:+($progress)}"
}

build_targets() {
  if [[ -f $BUILD/build.ninja ]]; then
    # -k 0: keep going after a failed compile, so one call lists every error.
    timeout "$(left)" ninja -C "$BUILD" -k 0 -j "$JOBS" "$@"
  else
    timeout "$(left)" make -C "$BUILD" -k -j "$JOBS" "$@"
  fi
}

# ---- binaries: what the built train is and loads ----------------------------------------
step_binaries() {
  prefix_env
  local train=$BUILD/bin/train
  [[ -x $train ]] || fail "no $train${NO_BUILD:+ (--no-build: --build-dir names a folder with a build of train)}"
  local v
  v=$("$train" --version 2>&1) || fail "train --version: $(tail -3 <<<"$v" | xargs)"
  echo "$v"
  figure_str version "$v"
  local libs bad libmpi libtorch
  libs=$(ldd "$train")
  echo "$libs"
  bad=$(awk '/not found/ { print $1 }' <<<"$libs" | xargs)
  [[ -z $bad ]] || fail "train needs libraries not found: $bad"
  libmpi=$(awk '/libmpi\.so/ { print $3 }' <<<"$libs")
  libtorch=$(awk '/libtorch_cpu\.so|libtorch\.so/ { print $3; exit }' <<<"$libs")
  figure_str libmpi "$libmpi"; figure_str libtorch "$libtorch"
  [[ $libmpi == "$PREFIX"/* ]] || fail "train loads libmpi from '$libmpi', not the carried Open MPI under $PREFIX"
  local commit carried=""
  commit=$(sed -n 's/.*commit \([0-9a-f+]*\).*/\1/p' <<<"$v" | head -1)
  [[ -f $CARRY/COMMIT ]] && carried=$(head -1 "$CARRY/COMMIT")
  figure_str commit "${commit:-unknown}"
  local missing=() t
  for t in $TEST_TARGETS; do [[ -x $BUILD/bin/$t ]] || missing+=("$t"); done
  if ((${#missing[@]})); then reason "no test binary ${missing[*]} in $BUILD/bin: the cuda tests will fail"; fi
  headline "$(head -1 <<<"$v"); $(grep -E '^ +(gloo|mpi|nccl):' <<<"$v" | sed 's/^ *//; s/ (.*//' | xargs | sed 's/ \([a-z]*:\)/; \1/g'); libmpi $libmpi${carried:+; COMMIT (the carry) $carried}"
}

# ---- ctest -L cuda ------------------------------------------------------------------------
step_ctest_cuda() {
  prefix_env
  local out rc=0
  if [[ $NO_BUILD == 1 ]]; then
    # Not this check's build folder: the binaries themselves, nothing written there.
    local t
    for t in $TEST_TARGETS; do
      [[ -x $BUILD/bin/$t ]] || fail "no $BUILD/bin/$t"
      out+=$(timeout "$(left)" "$BUILD/bin/$t" 2>&1) || rc=$?
      out+=$'\n'
    done
    echo "$out"
    local passed failed
    passed=$(grep -c '^\[       OK \]' <<<"$out" || true)
    failed=$(grep -c '^\[  FAILED  \] [A-Za-z]' <<<"$out" || true)
    figure_str ctest "$passed passed, $failed failed (the binaries $TEST_TARGETS run directly: --no-build)"
  else
    if [[ $(cat "$STEPS/build.status" 2>/dev/null) != pass ]]; then
      fail "the cuda tests' binaries ($TEST_TARGETS) did not build: see the build's errors"
    fi
    out=$(cd "$BUILD" && timeout "$(left)" ctest -L cuda --no-tests=error -V --timeout 120 2>&1) || rc=$?
    echo "$out"
    local line
    line=$(grep -E 'tests passed|No tests were found' <<<"$out" | tail -1 || true)
    figure_str ctest "$line"
    if [[ $line == *"No tests were found"* ]]; then
      fail "ctest -L cuda found no test labelled cuda among the built binaries ($TEST_TARGETS)"
    fi
  fi
  ((rc == 0)) || fail "the cuda tests failed (exit $rc; log: $LOG)"
  # A GTEST_SKIP passes but checked nothing: say why it skipped.
  if grep -q '\[  SKIPPED \]' <<<"$out"; then
    local why
    why=$(grep -E 'Skipped|skipped|cannot run here' <<<"$out" | grep -v '^\[  SKIPPED \]\|tests, listed below' | sed 's/^[0-9]*: //' | sort -u | head -3 | xargs)
    if [[ $DEVICE == cpu ]]; then skip "the cuda tests skip without a GPU, as they should: ${why:-see the log}"; fi
    fail "the cuda tests skipped instead of running: ${why:-see $LOG}"
  fi
  headline "$(grep -E 'tests passed' <<<"$out" | tail -1 || echo "$(grep -c '^\[       OK \]' <<<"$out") passed")"
}

# ---- the quickstart on the device ------------------------------------------------------------
step_quickstart() {
  prefix_env
  local dir
  dir=$(run_dir quickstart)
  timeout "$(left)" "$BUILD/bin/train" "$REPO/configs/quickstart.yaml" \
    --set name=gpu-check-quickstart --set "log.dir=$dir" --set "train.device=$DEVICE" \
    --set "data.path=$PREFIX/usr/share/datasets/fashion-mnist" --set log.progress=plain ||
    fail "train configs/quickstart.yaml on $DEVICE: exit $? (log: $LOG)"
  local figs rc=0
  figs=$(hpy "$GPU_DIR/runs.py" quickstart "$dir") || rc=$?
  figure run "$figs"
  local get=(hpy "$GPU_DIR/jget.py" --json "$figs")
  headline "test accuracy $("${get[@]}" test_accuracy), final loss $("${get[@]}" final_loss), $("${get[@]}" samples_per_s) samples/s, $("${get[@]}" train_seconds) s training ($("${get[@]}" steps) steps)"
  ((rc == 0)) || fail "$("${get[@]}" problems)"
}

# ---- a GPT at bf16 on one GPU: samples/s and MFU --------------------------------------
# A corpus for the GPTs: the repository's own sources and text, a few MB (the same bytes
# on every machine that has this checkout).
make_corpus() {
  local c=$LOGS/corpus.txt
  if [[ ! -s $c ]]; then
    find "$REPO" -path "$REPO/build*" -prune -o -path "$REPO/.git" -prune -o -path "$REPO/runs" -prune -o -type f \
      \( -name '*.md' -o -name '*.cpp' -o -name '*.h' -o -name '*.yaml' -o -name '*.sh' -o -name '*.txt' \) -print0 |
      sort -z | xargs -0 cat >"$c"
  fi
  echo "$c"
}

# The GPT: 12 layers of d_model 1024 (about 152M parameters), 256-byte sequences, 64 a
# step, 120 steps; on --device cpu (the rehearsal) a small one. TETRA_GPU_GPT="layers
# d_model heads seq_len batch steps" picks another.
if [[ $DEVICE == cuda ]]; then GPT_DEFAULT="12 1024 16 256 64 120"; else GPT_DEFAULT="2 128 4 64 8 12"; fi
read -r GPT_LAYERS GPT_D GPT_HEADS GPT_T GPT_BATCH GPT_STEPS <<<"${TETRA_GPU_GPT:-$GPT_DEFAULT}"

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
    --set train.on_nonfinite=stop --set optimizer.lr=3.0e-4 --set schedule.warmup_steps=20
    --set 'checkpoint.dir=""' --set log.every=10 --set log.progress=plain
  )
  # The parameter count from the plan (the model built as shapes, no GPU work).
  local plan params=""
  if plan=$(timeout 60 "$BUILD/bin/train" "$REPO/configs/zero3-gpt.yaml" "${sets[@]}" --dry-run --json 2>/dev/null); then
    params=$(hpy "$GPU_DIR/jget.py" --json "$plan" parameters)
  fi
  timeout "$(left)" "$BUILD/bin/train" "$REPO/configs/zero3-gpt.yaml" "${sets[@]}" ||
    fail "train (GPT ${GPT_LAYERS}x$GPT_D, bf16, $DEVICE): exit $? (log: $LOG)"
  local figs rc=0 mm=""
  mm=$(figure_of matmul matmul.tflops_median 2>/dev/null || true)
  figs=$(hpy "$GPU_DIR/mfu.py" "$dir" --layers "$GPT_LAYERS" --d-model "$GPT_D" --seq-len "$GPT_T" \
    --batch "$GPT_BATCH" --parameters "${params:-0}" --gpu "${GPU_NAME:-cpu}" --matmul-tflops "${mm:-0}") || rc=$?
  figure run "$figs"
  headline "$(hpy - "$figs" <<'PY'
import json, sys
f = json.loads(sys.argv[1])
pct = lambda x: "n/a" if x is None else "%.1f%%" % (100 * x)
print("%s parameters, %.1f samples/s (%d tokens/s), %.1f model TFLOP/s: MFU %s of the datasheet's %s TFLOP/s, %s of the %s TFLOP/s matmul measured here; final loss %s" % (
    f.get("parameters"), f.get("samples_per_s_steady") or 0, f.get("tokens_per_s_steady") or 0,
    f.get("model_tflops_per_s") or 0, pct(f.get("mfu_datasheet")), f.get("datasheet_peak_tflops") or "(unknown card)",
    pct(f.get("mfu_measured_matmul")), f.get("matmul_tflops_measured") or "n/a", f.get("final_loss")))
PY
)"
  ((rc == 0)) || fail "$(hpy "$GPU_DIR/jget.py" --json "$figs" problems)"
}

# ---- ZeRO-3: two ranks sharing the GPU, against one process --------------------------
zero3_sets() {
  local dir=$1 corpus=$2
  ZSETS=(
    --set "log.dir=$dir" --set "train.device=$DEVICE" --set "data.path=$corpus"
    --set collectives.timeout_s=90 --set train.max_steps=40 --set train.eval_every=40
    --set data.eval_samples=256 --set 'checkpoint.dir=""' --set checkpoint.safetensors=model.safetensors
    --set log.every=1 --set log.progress=plain --set train.on_nonfinite=stop
  )
}

# How two ranks start: mpirun when the carried one works (the mpirun step passed), else
# the environment rendezvous (torchrun's variables; gloo needs no launcher).
two_rank_launcher() {
  local l=$LAUNCHER
  if [[ $l == auto ]]; then
    if [[ $(cat "$STEPS/mpirun.status" 2>/dev/null) == pass ]]; then l="mpirun"; else l="env"; fi
  fi
  echo "$l"
}

step_zero3_one() {
  prefix_env
  local dir corpus
  dir=$(run_dir zero3-one-rank)
  corpus=$(make_corpus)
  zero3_sets "$dir" "$corpus"
  timeout "$(left)" "$BUILD/bin/train" "$REPO/configs/zero3-gpt.yaml" "${ZSETS[@]}" \
    --set name=gpu-check-zero3-one --set mesh.data=1 --set zero.stage=0 ||
    fail "train configs/zero3-gpt.yaml, one process on $DEVICE: exit $? (log: $LOG)"
  local figs rc=0
  figs=$(hpy "$GPU_DIR/runs.py" check "$dir") || rc=$?
  figure run "$figs"
  ((rc == 0)) || fail "$(hpy "$GPU_DIR/jget.py" --json "$figs" problems)"
}

step_zero3_two() {
  prefix_env
  # NCCL refuses two ranks on one GPU; Gloo's collectives take CUDA tensors through the
  # host. On a cuda job the device tensors go over the backend named here.
  if ! grep -q '^ *gloo:' <<<"$(figure_of binaries version)"; then
    local why="the torch here ships no Gloo headers"
    [[ $NO_GLOO == 1 ]] && why="--no-gloo"
    skip "this build has no gloo backend ($why), and NCCL refuses two ranks on one GPU: ZeRO-3 over 2 ranks sharing a GPU needs Gloo, or 2 GPUs"
  fi
  local dir corpus launcher
  dir=$(run_dir zero3-two-ranks)
  corpus=$(make_corpus)
  zero3_sets "$dir" "$corpus"
  launcher=$(two_rank_launcher)
  figure_str launcher "$launcher"
  local -a cmd=("$BUILD/bin/train" "$REPO/configs/zero3-gpt.yaml" "${ZSETS[@]}" --set name=gpu-check-zero3-two
                --set mesh.data=2 --set zero.stage=3 --set collectives.backend=gloo)
  local rc=0
  if [[ $launcher == mpirun ]]; then
    mpirun_cmd
    timeout "$(left)" "${MPIRUN[@]}" -np 2 "${cmd[@]}" || rc=$?
  else
    local port
    port=$(free_port)
    timeout "$(left)" bash -c "$(declare -f env_ranks); env_ranks 2 $port \"\$@\"" _ "${cmd[@]}" || rc=$?
  fi
  ((rc == 0)) || fail "2 ranks ($launcher) of train configs/zero3-gpt.yaml, zero.stage 3 over gloo, both on $DEVICE${GPU_NAME:+ 0}: exit $rc (log: $LOG)"
}

step_zero3_compare() {
  local figs rc=0
  figs=$(hpy "$GPU_DIR/runs.py" compare "$LOGS/runs/zero3-one-rank" "$LOGS/runs/zero3-two-ranks") || rc=$?
  figure compare "$figs"
  local get=(hpy "$GPU_DIR/jget.py" --json "$figs")
  headline "final loss $("${get[@]}" final_loss_one_rank) (one process) vs $("${get[@]}" final_loss_two_ranks) (two ZeRO-3 ranks over gloo, $(figure_of zero3-two-ranks launcher)), $("${get[@]}" final_loss_diff) apart; parameters at most $("${get[@]}" parameter_max_abs_diff) apart (reported, not judged); $("${get[@]}" samples_per_s_one_rank) vs $("${get[@]}" samples_per_s_two_ranks) samples/s"
  ((rc == 0)) || fail "$("${get[@]}" problems)"
}

# ---- the GPT as Hugging Face's GPT-2 (issue 48) ---------------------------------------
# A small GPT without a head bias trained on DEVICE, exported with `ckpt export --format hf`,
# loaded by transformers (tools/gpu/hf_check.py): its logits against tetra's (`generate
# --logits`) within 1e-3, and the greedy text equal; generate's tokens/s with the cache.
step_hf_gpt2() {
  prefix_env
  [[ -x $BUILD/bin/ckpt && -x $BUILD/bin/generate ]] || fail "ckpt and generate were not built"
  local dir corpus
  dir=$(run_dir hf-gpt2)
  corpus=$(make_corpus)
  timeout "$(left)" "$BUILD/bin/train" "$REPO/configs/zero3-gpt.yaml" --set name=gpu-check-hf --set "log.dir=$dir" \
    --set mesh.data=1 --set zero.stage=0 --set model.layers=2 --set model.d_model=128 --set model.heads=4 \
    --set model.head_bias=false --set "data.path=$corpus" --set data.seq_len=128 --set data.batch_size=16 \
    --set train.max_steps=100 --set train.eval_every=100 --set data.eval_samples=64 --set "train.device=$DEVICE" \
    --set log.progress=plain || fail "train (the small GPT for the export): exit $?"
  "$BUILD/bin/ckpt" export "$dir" --format hf -o "$dir/hf" || fail "ckpt export --format hf: exit $?"
  local prompt="int main(int argc, char** argv) {" gen_err
  "$BUILD/bin/generate" "$dir" --prompt "$prompt" --tokens 64 --temperature 0 --device "$DEVICE" \
    --logits "$dir/logits.json" >"$dir/greedy.txt" 2>"$dir/generate.err" || fail "generate: exit $?: $(cat "$dir/generate.err")"
  gen_err=$(cat "$dir/generate.err")
  figure_str generate "$gen_err"
  local figs rc=0
  figs=$(tpy "$GPU_DIR/hf_check.py" "$dir/hf" "$prompt" "$dir/logits.json" "$dir/greedy.txt" 64 "$DEVICE") || rc=$?
  figure run "$figs"
  ((rc == 3)) && skip "$(hpy "$GPU_DIR/jget.py" --json "$figs" problems)"
  local get=(hpy "$GPU_DIR/jget.py" --json "$figs")
  headline "transformers $("${get[@]}" transformers): logits within $("${get[@]}" logit_max_abs_diff) of tetra's, greedy text equal: $("${get[@]}" greedy_equal), tokenizer gives the bytes: $("${get[@]}" tokenizer_ids_equal); $(grep -o '[0-9.]* tokens/s' <<<"$gen_err" | head -1) (tetra's generate, greedy)"
  ((rc == 0)) || fail "$("${get[@]}" problems)"
}

# ---- two ranks over NCCL: on one GPU only if NCCL allows it ----------------------------
step_nccl_two() {
  [[ $DEVICE == cuda ]] || skip "needs cuda (--device cpu)"
  grep -q '^ *nccl:' <<<"$(figure_of binaries version)" || skip "this build has no nccl backend"
  prefix_env
  mpirun_cmd
  local dir corpus
  dir=$(run_dir nccl-two-ranks)
  corpus=$(make_corpus)
  zero3_sets "$dir" "$corpus"
  figure gpus "${GPU_COUNT:-0}"
  local rc=0 launcher
  launcher=$(two_rank_launcher)
  figure_str launcher "$launcher"
  # NCCL carries the device tensors; its communicators bootstrap over the host plane
  # beside it (mpi under mpirun, gloo under the environment rendezvous).
  local -a cmd=("$BUILD/bin/train" "$REPO/configs/zero3-gpt.yaml" "${ZSETS[@]}" --set name=gpu-check-nccl-two
                --set mesh.data=2 --set zero.stage=3 --set collectives.backend=nccl)
  if [[ $launcher == mpirun ]]; then
    timeout "$(left)" "${MPIRUN[@]}" -np 2 "${cmd[@]}" || rc=$?
  else
    timeout "$(left)" bash -c "$(declare -f env_ranks); env_ranks 2 $(free_port) \"\$@\"" _ "${cmd[@]}" || rc=$?
  fi
  if ((rc)); then
    local words
    words=$(grep -m1 -i 'duplicate gpu' "$LOG" | sed 's/^[^A-Za-z]*//' | cut -c1-300 || true)
    if [[ -n $words && ${GPU_COUNT:-0} -lt 2 ]]; then
      skip "NCCL refuses two ranks on one GPU (\"$words\"): the two-rank NCCL job needs 2 GPUs; this machine has ${GPU_COUNT:-0}"
    fi
    fail "2 ranks ($launcher) of train over nccl: exit $rc (log: $LOG)"
  fi
  local figs rc2=0
  figs=$(hpy "$GPU_DIR/runs.py" compare "$LOGS/runs/zero3-one-rank" "$dir") || rc2=$?
  figure compare "$figs"
  local get=(hpy "$GPU_DIR/jget.py" --json "$figs")
  headline "2 ranks over NCCL on ${GPU_COUNT} GPU(s): final loss $("${get[@]}" final_loss_two_ranks), $("${get[@]}" final_loss_diff) from one process's; $("${get[@]}" samples_per_s_two_ranks) samples/s"
  ((rc2 == 0)) || fail "$("${get[@]}" problems)"
}

case $1 in
  environment | matmul | unpack | mpirun | configure | build | binaries | quickstart) "step_$1" ;;
  ctest-cuda) step_ctest_cuda ;;
  gpt-bf16) step_gpt_bf16 ;;
  hf-gpt2) step_hf_gpt2 ;;
  zero3-one-rank) step_zero3_one ;;
  zero3-two-ranks) step_zero3_two ;;
  zero3-compare) step_zero3_compare ;;
  nccl-two-ranks) step_nccl_two ;;
  *) echo "tools/gpu/steps.sh: no step '$1'" >&2; exit 2 ;;
esac
