#include "core/model_state.h"

#include <torch/types.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <map>
#include <set>

namespace tetra::core {

std::vector<std::string> nonfinite_gradients(const std::vector<NamedParam>& params) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> sums;
  for (const auto& p : params)
    if (p.tensor.grad().defined()) sums.push_back(p.tensor.grad().sum().to(at::kDouble));
  std::vector<std::string> out;
  if (sums.empty() || std::isfinite(at::stack(sums).sum().item<double>())) return out;
  for (const auto& p : params)
    if (p.tensor.grad().defined() && !at::isfinite(p.tensor.grad()).all().item<bool>()) out.push_back(p.name);
  return out;
}

ReplicatedState::ReplicatedState(const OptimizerSpec& spec, std::vector<NamedParam> params)
    : optimizer_(spec, std::move(params)) {}

double ReplicatedState::grad_norm_sq() { return core::grad_norm_sq(params()); }

void ReplicatedState::scale_gradients(double factor) { core::scale_gradients(params(), factor); }

std::vector<std::string> ReplicatedState::nonfinite_gradients() { return core::nonfinite_gradients(params()); }

void ReplicatedState::save_state(Checkpoint& ckpt) {
  for (const auto& p : params()) ckpt.tensors["model/" + p.name] = p.tensor;
  for (const auto& [k, v] : optimizer_.state_dict()) ckpt.tensors["optim/" + k] = v;
}

void ReplicatedState::load_state(const CheckpointReader& reader) {
  torch::NoGradGuard no_grad;
  for (const auto& p : params()) reader.expect_shape("model/" + p.name, p.tensor.sizes(), "model tensor " + p.name);
  std::map<std::string, torch::Tensor> opt;
  for (const auto& name : reader.names())
    if (name.rfind("optim/", 0) == 0) opt[name.substr(6)] = reader.read(name);
  for (const auto& p : params()) p.tensor.copy_(reader.read("model/" + p.name).view(p.tensor.sizes()));
  optimizer_.load_state_dict(opt);
}

void ReplicatedState::gather_parameters(TensorMap& out) {
  for (const auto& p : params()) out[p.name] = p.tensor;
}

ModelStateBytes ReplicatedState::memory() const {
  // Each storage once: data parallelism's gradients are views of its buckets.
  std::set<const void*> seen;
  auto bytes = [&seen](const torch::Tensor& t) -> int64_t {
    if (!t.defined() || !seen.insert(t.storage().unsafeGetStorageImpl()).second) return 0;
    return static_cast<int64_t>(t.storage().nbytes());
  };
  ModelStateBytes m;
  for (const auto& p : params()) m.parameters += bytes(p.tensor);
  for (const auto& p : params()) m.gradients += bytes(p.tensor.grad());
  for (const auto& [k, v] : optimizer_.state_dict())
    if (k != "__step__") m.optimizer += bytes(v);
  return m;
}

}  // namespace tetra::core
