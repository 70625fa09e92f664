// gtest as an MPI job: every rank runs the same tests (they are collectives), rank 0
// prints gtest's report, the others only their failures tagged with their rank, and the
// job fails when any rank failed. Shared by the mpi test mains (test_mpi.cpp,
// test_mpi_hierarchical.cpp).
#pragma once

#include <gtest/gtest.h>
// The C API only (no deprecated C++ bindings, which would need libmpi_cxx).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstdio>
#include <string>

namespace tetra::collectives::mpi_gtest {

// Ranks other than 0 print only their failures, tagged with the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  // (UnitTest's own lock is held here: no current_test_info().)
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: Failure\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
    std::fflush(stderr);
  }

 private:
  int rank_;
  std::string test_ = "?";
};

// RUN_ALL_TESTS on this rank; returns 1 when any rank failed. The result is combined on
// MPI_COMM_WORLD itself: the tetra communicators may be broken by a failed test.
inline int run_all_tests(int rank, const char* program) {
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  const int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any = failed;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any && !failed) std::fprintf(stderr, "%s: another rank failed (see its output)\n", program);
  return any;
}

}  // namespace tetra::collectives::mpi_gtest
