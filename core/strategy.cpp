#include "core/strategy.h"

#include <functional>

#include "collectives/error.h"

namespace tetra::core {

namespace {

int64_t mix(int64_t h, int64_t v) {
  uint64_t x = static_cast<uint64_t>(h) ^ (static_cast<uint64_t>(v) + 0x9E3779B97F4A7C15ULL + (static_cast<uint64_t>(h) << 6));
  return static_cast<int64_t>(x >> 1);
}
int64_t mix(int64_t h, const std::string& s) { return mix(h, static_cast<int64_t>(std::hash<std::string>{}(s) >> 1)); }

}  // namespace

void check_same_job(collectives::Communicator& group, const TrainState& state, const std::string& who) {
  int64_t shapes = 17, job = 31;
  for (const auto& p : state.params) {
    shapes = mix(shapes, p.name);
    for (int64_t d : p.tensor.sizes()) shapes = mix(shapes, d);
  }
  const auto& s = state.spec;
  job = mix(job, s.model.type);
  job = mix(job, s.data.batch_size);
  job = mix(job, s.train.seed);
  job = mix(job, s.train.accumulation_steps);
  job = mix(job, s.optimizer.type);
  job = mix(job, static_cast<int64_t>(s.optimizer.lr * 1e12));
  at::Tensor mine = at::tensor({shapes, job}, at::kLong), all = at::empty({2 * group.size()}, at::kLong);
  group.allgather(mine, all)->wait();
  auto a = all.accessor<int64_t, 1>();
  for (int r = 1; r < group.size(); ++r) {
    if (a[2 * r] != a[0])
      throw ConfigError(who + ": data rank " + std::to_string(r) + " built a model of other shapes than data rank 0 "
                        "(every rank must run the same job file)");
    if (a[2 * r + 1] != a[1])
      throw ConfigError(who + ": data rank " + std::to_string(r) + " runs other settings (model, batch, seed, "
                        "accumulation or optimizer) than data rank 0 (every rank must run the same job and --set)");
  }
}

void broadcast_from_first(collectives::Communicator& group, TrainState& state) {
  at::NoGradGuard no_grad;
  std::vector<collectives::WorkPtr> works;
  for (auto& p : state.params) works.push_back(group.broadcast(p.tensor.detach()));
  for (auto b : state.model->buffers()) works.push_back(group.broadcast(b));
  for (auto& w : works) w->wait();
}

}  // namespace tetra::core
