# The mpi backend's tests: one gtest binary run as real Open MPI jobs (mpirun -np 2, 3,
# 4) by tetra_add_mpi_test. Not gtest_discover_tests: its cases are collectives, every
# rank must run all of them together (test_mpi.cpp has its own main that combines the
# ranks' results).
add_executable(collectives_test_mpi ${CMAKE_CURRENT_SOURCE_DIR}/test_mpi.cpp)
target_link_libraries(collectives_test_mpi PRIVATE tetra::collectives GTest::gtest MPI::MPI_C tetra_warnings)
target_compile_definitions(collectives_test_mpi PRIVATE
  TETRA_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
  TETRA_BIN_DIR="${CMAKE_RUNTIME_OUTPUT_DIRECTORY}")
foreach(np 2 3 4)
  tetra_add_mpi_test(collectives_mpi_np${np} TARGET collectives_test_mpi NP ${np} TIMEOUT 120
                     LABELS collectives)
endforeach()

# The hierarchical communicator with an MPI outer: 2 processes x 3 replica threads.
add_executable(collectives_test_mpi_hierarchical ${CMAKE_CURRENT_SOURCE_DIR}/test_mpi_hierarchical.cpp)
target_link_libraries(collectives_test_mpi_hierarchical PRIVATE tetra::collectives GTest::gtest MPI::MPI_C
                                                                tetra_warnings)
tetra_add_mpi_test(collectives_mpi_hierarchical_np2 TARGET collectives_test_mpi_hierarchical NP 2 TIMEOUT 120
                   LABELS collectives)
