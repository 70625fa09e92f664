#include "tools/planner/plugins.h"

#include "data_parallel/data_parallel.h"
#include "pipeline/pipeline.h"
#include "replicate/replicate.h"
#include "tensor_parallel/tensor_parallel.h"
#include "zero/zero.h"

namespace tetra::planner {

void register_builtin_plugins(core::SectionRegistry& registry) {
  data_parallel::register_data_parallel(registry);
  pipeline::register_pipeline(registry);
  zero::register_zero(registry);
  replicate::register_replicate(registry);
  tensor_parallel::register_tensor_parallel(registry);
}

const core::SectionRegistry& builtin_plugins() {
  static const core::SectionRegistry registry = [] {
    core::SectionRegistry r;
    register_builtin_plugins(r);
    return r;
  }();
  return registry;
}

}  // namespace tetra::planner
