// The program's own data and layers (custom-model's, and tests/tools/test_api.cpp's): a
// dataset and a layer tetra does not know, as a program brings them to the trainer.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cstdint>

#include "core/data.h"

namespace own {

// Points in `dims` dimensions drawn around `classes` seeded centres, labelled by centre.
class Clusters : public tetra::core::Dataset {
 public:
  Clusters(uint64_t seed, int64_t classes, int64_t dims, int64_t train, int64_t test) {
    torch::NoGradGuard no_grad;
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const at::Tensor centres = at::randn({classes, dims}, gen) * 1.5;
    for (int s = 0; s < 2; ++s) {
      labels_[s] = at::randint(0, classes, {s == 0 ? train : test}, gen);
      points_[s] = centres.index_select(0, labels_[s]) + at::randn({labels_[s].size(0), dims}, gen);
    }
    info_.input_shape = {dims};
    info_.num_classes = classes;
    info_.description = std::to_string(classes) + " clusters in " + std::to_string(dims) + " dimensions (the program's own data)";
  }
  const tetra::core::DataInfo& info() const override { return info_; }
  int64_t size(tetra::core::Split split) const override { return points_[at(split)].size(0); }
  tetra::core::Batch get(tetra::core::Split split, const torch::Tensor& indices) const override {
    return {points_[at(split)].index_select(0, indices), labels_[at(split)].index_select(0, indices)};
  }

 private:
  static int at(tetra::core::Split split) { return split == tetra::core::Split::kTrain ? 0 : 1; }
  at::Tensor points_[2], labels_[2];
  tetra::core::DataInfo info_;
};

// x + W2 tanh(W1 x): a layer the model zoo does not have.
struct ResidualImpl : torch::nn::Module {
  explicit ResidualImpl(int64_t width)
      : inner(register_module("inner", torch::nn::Linear(width, width))),
        outer(register_module("outer", torch::nn::Linear(width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + outer(torch::tanh(inner(x))); }
  torch::nn::Linear inner, outer;
};
TORCH_MODULE(Residual);

// Linear in, `blocks` residual layers of `width`, Linear out: what a pipeline cuts into
// stages, layer by layer.
inline torch::nn::Sequential residual_model(const tetra::core::DataInfo& data, int64_t width, int blocks) {
  torch::nn::Sequential model(torch::nn::Linear(data.input_shape.at(0), width));
  for (int b = 0; b < blocks; ++b) model->push_back(Residual(width));
  model->push_back(torch::nn::Linear(width, data.num_classes));
  return model;
}

}  // namespace own
