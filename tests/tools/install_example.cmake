# The installed package as a user's projects meet it: installs the build into a fresh
# prefix, configures tools/examples/replicator_loop and tools/examples/custom_model against
# it alone (find_package(tetra CONFIG REQUIRED) with CMAKE_PREFIX_PATH = the prefix), builds
# them, runs them (custom_model as pipeline 2 x data 2 x ZeRO-1 under mpirun -np 4) and
# checks what they printed. The prefix and the examples' builds live in WORK_DIR, removed
# before and after.
#
#   cmake -DSOURCE_DIR=. -DBUILD_DIR=build -DWORK_DIR=... -DLIBDIR=lib -DGENERATOR=...
#         -DCXX_COMPILER=... -DMPIEXEC=mpirun -P tests/tools/install_example.cmake
foreach(v SOURCE_DIR BUILD_DIR WORK_DIR LIBDIR GENERATOR CXX_COMPILER MPIEXEC)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "install_example.cmake: -D${v}=... is required")
  endif()
endforeach()

set(example ${SOURCE_DIR}/tools/examples/replicator_loop)
set(prefix ${WORK_DIR}/prefix)
set(example_build ${WORK_DIR}/build)
set(custom ${SOURCE_DIR}/tools/examples/custom_model)
set(custom_build ${WORK_DIR}/build-custom)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

macro(fail what)
  file(REMOVE_RECURSE ${WORK_DIR})
  message(FATAL_ERROR "${what}")
endmacro()

# run(<what> <command>...): runs it, and fails with its output when it fails or hangs.
function(run what)
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out
                  TIMEOUT 300)
  string(TIMESTAMP t1 "%s")
  math(EXPR dt "${t1} - ${t0}")
  if(NOT rc EQUAL 0)
    fail("${what} failed (${rc}): ${ARGN}\n${out}")
  endif()
  message(STATUS "${what}: ${dt} s")
  set(out "${out}" PARENT_SCOPE)
endfunction()

run("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})

# What the package promises, by path.
foreach(f ${LIBDIR}/cmake/tetra/tetraConfig.cmake ${LIBDIR}/cmake/tetra/tetraConfigVersion.cmake
          ${LIBDIR}/cmake/tetra/tetraTargets.cmake ${LIBDIR}/libtetra_core.a ${LIBDIR}/libtetra_replicate.a
          include/tetra/tetra.h include/tetra/core/trainer.h include/tetra/replicate/replicate.h
          include/tetra/collectives/build_config.h bin/train bin/topo)
  if(NOT EXISTS ${prefix}/${f})
    fail("the install has no ${f}")
  endif()
endforeach()
# The exported targets name nothing of the build: no build-only helper, no path into the
# source or build tree.
file(GLOB targets_files ${prefix}/${LIBDIR}/cmake/tetra/tetraTargets*.cmake)
foreach(f ${targets_files})
  file(READ ${f} text)
  foreach(leak tetra_warnings ${SOURCE_DIR} ${BUILD_DIR})
    string(FIND "${text}" "${leak}" at)
    if(NOT at EQUAL -1)
      fail("${f} names ${leak}")
    endif()
  endforeach()
endforeach()

# No build type: unoptimised compiles fastest, and the example's work is in LibTorch.
run("configure the example" ${CMAKE_COMMAND} -S ${example} -B ${example_build} -G ${GENERATOR}
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix})
run("build the example" ${CMAKE_COMMAND} --build ${example_build} -j2)
run("run the example" ${example_build}/replicator-loop 2 300)
message("${out}")
foreach(expect "steps  250-299   huber loss [0-9.]+\n"
               "2 replicas \\(2 per process\\), 300 steps: squared error to the clean targets [0-9.]+ -> [0-9.]+ \\(learned\\)"
               "weights equal on all 2 replicas")
  if(NOT out MATCHES "${expect}")
    fail("the example's output lacks /${expect}/")
  endif()
endforeach()

# A model and a dataset of the program's own, built with tetra::PlanBuilder as pipeline 2 x
# data 2 x ZeRO-1: alone it prints its plan, under mpirun -np 4 it trains and checks itself.
run("configure the custom model" ${CMAKE_COMMAND} -S ${custom} -B ${custom_build} -G ${GENERATOR}
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_PREFIX_PATH=${prefix})
run("build the custom model" ${CMAKE_COMMAND} --build ${custom_build} -j2)
run("print the custom model's plan" ${custom_build}/custom-model)
foreach(expect "1. pipeline +pipeline +x2" "3. zero +data +x2" "Residual" "mpirun -np 4 custom-model")
  if(NOT out MATCHES "${expect}")
    fail("the custom model's plan lacks /${expect}/:\n${out}")
  endif()
endforeach()
run("train the custom model on 4 processes" ${MPIEXEC} --oversubscribe --bind-to none -np 4 ${custom_build}/custom-model)
message("${out}")
if(NOT out MATCHES "custom model, pipeline 2 x data 2 x ZeRO-1: loss [0-9.]+ -> [0-9.]+, test accuracy [0-9.]+%")
  fail("the custom model's run lacks its result line:\n${out}")
endif()

file(REMOVE_RECURSE ${WORK_DIR})
