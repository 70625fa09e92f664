// Every test process starts in a folder of its own (linked into every tetra_add_test
// binary). ctest runs each case as its own process, two at a time, from one build folder;
// a job left to its defaults writes its run folder (runs/<name>) in the working folder, and
// a finished run is never trained over (Note [A finished run stays], core/trainer.cpp), so
// two cases running jobs of one name from one folder would see each other's runs. Here
// each case gets TMPDIR/tetra_case_<pid>, removed when it ends. A test binary that mpirun
// starts (its ranks must share a folder) keeps the one it was started in.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace {

std::filesystem::path& own_folder() {
  static std::filesystem::path folder;
  return folder;
}

const bool kInOwnFolder = [] {
  for (const char* launched : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (std::getenv(launched)) return false;
  std::error_code ec;
  const std::filesystem::path d =
      std::filesystem::temp_directory_path(ec) / ("tetra_case_" + std::to_string(::getpid()));
  if (ec || !std::filesystem::create_directories(d, ec) || ec || ::chdir(d.c_str()) != 0) return false;
  own_folder() = d;
  std::atexit([] {
    std::error_code ignored;
    std::filesystem::remove_all(own_folder(), ignored);
  });
  return true;
}();

}  // namespace
