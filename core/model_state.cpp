#include "core/model_state.h"

#include <torch/types.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <map>
#include <set>

#include "core/init.h"

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

ReplicatedState::ReplicatedState(const OptimizerSpec& spec, std::vector<NamedParam> params, const Materializer* parts,
                                 int tensor_index)
    : optimizer_(spec, std::move(params)), parts_(parts), tensor_index_(tensor_index) {}

std::string parameter_of_key(const std::string& key) {
  if (key.rfind("model/", 0) == 0) return key.substr(6);
  if (key.rfind("optim/", 0) == 0) {
    const std::string rest = key.substr(6);
    return rest.substr(0, rest.rfind('.'));
  }
  return key;
}

const Placement* ReplicatedState::part(const std::string& name) const {
  return parts_ ? parts_->placement(name) : nullptr;
}

double ReplicatedState::grad_norm_sq() {
  if (tensor_index_ == 0) return core::grad_norm_sq(params());
  // The tensor strategy sums the norm over its group: a whole parameter counts once.
  std::vector<NamedParam> counted;
  for (const auto& p : params())
    if (const Placement* at = part(p.name); at && at->is_split()) counted.push_back(p);
  return core::grad_norm_sq(counted);
}

void ReplicatedState::scale_gradients(double factor) { core::scale_gradients(params(), factor); }

std::vector<std::string> ReplicatedState::nonfinite_gradients() { return core::nonfinite_gradients(params()); }

void ReplicatedState::save_state(Checkpoint& ckpt) {
  for (const auto& p : params()) ckpt.tensors["model/" + p.name] = p.tensor;
  for (const auto& [k, v] : optimizer_.state_dict()) ckpt.tensors["optim/" + k] = v;
}

void ReplicatedState::load_state(const CheckpointReader& reader) {
  torch::NoGradGuard no_grad;
  std::map<std::string, const NamedParam*> by_name;
  for (const auto& p : params()) {
    const Placement* at = part(p.name);
    reader.expect_shape("model/" + p.name, at ? at::IntArrayRef(at->whole_shape()) : p.tensor.sizes(),
                        "model tensor " + p.name);
    by_name[p.name] = &p;
  }
  // A part of a parameter, and of its optimizer state ("<name>.exp_avg"), is read as its
  // elements of the whole tensor the checkpoint holds.
  auto mine = [&](const std::string& name, const at::Tensor& whole) -> at::Tensor {
    auto it = by_name.find(name);
    const Placement* at = it == by_name.end() ? nullptr : part(name);
    return at ? part_of(*at, whole, it->second->tensor) : whole;
  };
  std::map<std::string, torch::Tensor> opt;
  for (const auto& name : reader.names()) {
    if (name.rfind("optim/", 0) != 0) continue;
    opt[name.substr(6)] = mine(parameter_of_key(name), reader.read(name));
  }
  for (const auto& p : params())
    p.tensor.copy_(mine(p.name, reader.read("model/" + p.name)).view(p.tensor.sizes()));
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
