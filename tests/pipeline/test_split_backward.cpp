// The backward split into B and W (Note [B and W on the autograd graph]) is real and
// exact: after B the input's gradient is the fused backward's and no weight has a gradient
// yet; after W every weight's gradient is the fused backward's, bit for bit. On a stage
// whose input needs no gradient (the first) B computes the activations' part and W the
// rest; a weight used twice in a stage gets both uses' gradients at W.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "pipeline/split_backward.h"

using tetra::pipeline::SplitBackward;

namespace {

torch::nn::Sequential stage() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(),
                               torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})), torch::nn::Linear(16, 4));
}

// The fused backward's gradients of `model` (by parameter) and of the input.
std::pair<std::vector<at::Tensor>, at::Tensor> fused(torch::nn::Sequential model, const at::Tensor& x0,
                                                     const at::Tensor& gy, bool input_grad) {
  at::Tensor x = x0.clone().requires_grad_(input_grad);
  model->forward(x).backward(gy);
  std::vector<at::Tensor> g;
  for (const auto& p : model->parameters()) g.push_back(p.grad().clone());
  return {g, input_grad ? x.grad() : at::Tensor()};
}

}  // namespace

TEST(SplitBackward, BGivesTheInputGradientAloneAndWTheWeightsExactly) {
  const at::Tensor x0 = torch::randn({5, 8}), gy = torch::randn({5, 4});
  for (bool input_grad : {true, false}) {
    SCOPED_TRACE(input_grad ? "a middle stage" : "the first stage");
    const auto [want, want_dx] = fused(stage(), x0, gy, input_grad);
    torch::nn::Sequential model = stage();
    at::Tensor x = x0.clone().requires_grad_(input_grad);
    at::Tensor y = model->forward(x);
    SplitBackward split;
    const at::Tensor dx = split.input_pass(y, gy, x);
    EXPECT_FALSE(split.fused());
    y = at::Tensor();  // the executor drops the output after B
    if (input_grad) {
      ASSERT_TRUE(dx.defined());
      EXPECT_TRUE(torch::equal(dx, want_dx));
    } else {
      EXPECT_FALSE(dx.defined());
    }
    for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined()) << "a weight's gradient ran in B";
    split.weight_pass();
    const auto params = model->parameters();
    ASSERT_EQ(params.size(), want.size());
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(params[i].grad().defined()) << "parameter " << i;
      EXPECT_TRUE(torch::equal(params[i].grad(), want[i])) << "parameter " << i;
    }
  }
}

TEST(SplitBackward, TiedWeightsAreSplitWithBothUsesSummed) {
  torch::manual_seed(3);
  torch::nn::Linear lin(6, 6);
  const at::Tensor x0 = torch::randn({3, 6}), gy = torch::randn({3, 6});
  at::Tensor x = x0.clone().requires_grad_(true);
  lin->forward(lin->forward(x)).backward(gy);
  const at::Tensor want = lin->weight.grad().clone(), want_dx = x.grad().clone();
  lin->zero_grad(/*set_to_none=*/true);
  at::Tensor x2 = x0.clone().requires_grad_(true);
  SplitBackward split;
  const at::Tensor dx = split.input_pass(lin->forward(lin->forward(x2)), gy, x2);
  EXPECT_FALSE(split.fused());
  EXPECT_FALSE(lin->weight.grad().defined());
  split.weight_pass();
  EXPECT_TRUE(torch::equal(dx, want_dx));
  // Two contributions summed: the order may differ from the fused backward's by rounding.
  EXPECT_TRUE(torch::allclose(lin->weight.grad(), want, 1e-6, 1e-7));
}
