// tetra/tetra.h, the umbrella header of tetra::tetra, as a program uses it: it compiles on
// its own under tetra's warnings, and register_builtin_plugins registers the sections a
// job file may name, as `train` does. (tests/tools/install_example.cmake builds a program
// on it against an install.)
#include "tetra/tetra.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

TEST(Api, RegistersTheBuiltinPlugins) {
  tetra::core::SectionRegistry registry;
  tetra::register_builtin_plugins(registry);
  EXPECT_EQ(registry.names(),
            (std::vector<std::string>{"data_parallel", "pipeline", "replicate", "zero"}));
  const tetra::core::ParsedJob parsed = tetra::core::parse_job_string(
      "model: {type: mlp}\ndata: {type: synthetic}\nreplicate: {replicas: 2}\n", "api.yaml", {},
      registry);
  const auto replicate = parsed.spec.plugin<tetra::replicate::Options>("replicate");
  ASSERT_NE(replicate, nullptr);
  EXPECT_EQ(replicate->replicas, 2);
}

}  // namespace
