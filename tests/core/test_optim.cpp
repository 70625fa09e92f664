// Optimizer steps against numbers worked out by hand, and against torch::optim.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "core/optim.h"

using namespace tetra::core;

namespace {

// One scalar parameter p = 1 with a fixed gradient.
struct Scalar {
  torch::Tensor p = torch::ones({1}, torch::requires_grad());
  std::vector<NamedParam> params() { return {{"p", p}}; }
  void set_grad(double g) { p.mutable_grad() = torch::full({1}, g); }
  double value() const { return p.item<double>(); }
};

OptimizerSpec spec_of(const std::string& type) {
  OptimizerSpec s;
  s.type = type;
  s.lr = 0.1;
  return s;
}

}  // namespace

TEST(Optimizer, SgdMomentumByHand) {
  Scalar x;
  auto s = spec_of("sgd");
  s.momentum = 0.9;
  Optimizer opt(s, x.params());
  x.set_grad(0.5);
  opt.step(0.1);  // buf = 0.5; p = 1 - 0.1 * 0.5
  EXPECT_NEAR(x.value(), 0.95, 1e-7);
  x.set_grad(0.5);
  opt.step(0.1);  // buf = 0.9 * 0.5 + 0.5 = 0.95; p = 0.95 - 0.095
  EXPECT_NEAR(x.value(), 0.855, 1e-7);
}

TEST(Optimizer, SgdNesterovAndWeightDecayByHand) {
  Scalar x;
  auto s = spec_of("sgd");
  s.momentum = 0.9;
  s.nesterov = true;
  s.weight_decay = 0.1;
  Optimizer opt(s, x.params());
  x.set_grad(0.5);
  // d = 0.5 + 0.1 * 1 = 0.6; buf = 0.6; d = 0.6 + 0.9 * 0.6 = 1.14; p = 1 - 0.114
  opt.step(0.1);
  EXPECT_NEAR(x.value(), 0.886, 1e-7);
}

TEST(Optimizer, AdamFirstStepIsLrTimesSign) {
  Scalar x;
  Optimizer opt(spec_of("adam"), x.params());
  x.set_grad(0.5);
  // m^ = g, v^ = g^2: p = 1 - 0.1 * 0.5 / (0.5 + 1e-8)
  opt.step(0.1);
  EXPECT_NEAR(x.value(), 1 - 0.1 * 0.5 / (0.5 + 1e-8), 1e-7);
  x.set_grad(-0.25);
  // m = 0.9 * 0.05 - 0.025 = 0.02; v = 0.999 * 0.00025 + 0.001 * 0.0625 = 0.00031225
  const double m = 0.9 * 0.05 + 0.1 * -0.25, v = 0.999 * 0.001 * 0.25 + 0.001 * 0.0625;
  const double expect = x.value() - 0.1 * (m / (1 - 0.81)) / (std::sqrt(v / (1 - 0.998001)) + 1e-8);
  opt.step(0.1);
  EXPECT_NEAR(x.value(), expect, 1e-6);
}

TEST(Optimizer, AdamWDecaysDecoupled) {
  Scalar x;
  auto s = spec_of("adamw");
  s.weight_decay = 0.1;
  Optimizer opt(s, x.params());
  x.set_grad(0.5);
  opt.step(0.1);  // p = 1 * (1 - 0.01) - 0.1 * 1
  EXPECT_NEAR(x.value(), 0.89, 1e-7);
}

TEST(Optimizer, MatchesTorchOptimOnAModel) {
  for (std::string type : {"sgd", "adam", "adamw"}) {
    torch::manual_seed(3);
    torch::nn::Linear a(8, 4), b(8, 4);
    {
      torch::NoGradGuard guard;
      b->weight.copy_(a->weight);
      b->bias.copy_(a->bias);
    }
    OptimizerSpec s = spec_of(type);
    s.lr = 0.01;
    s.weight_decay = 0.05;
    s.momentum = type == "sgd" ? 0.9 : 0.0;
    std::vector<NamedParam> ps;
    for (auto& p : a->named_parameters()) ps.push_back({p.key(), p.value()});
    Optimizer mine(s, ps);
    std::unique_ptr<torch::optim::Optimizer> ref;
    if (type == "sgd")
      ref = std::make_unique<torch::optim::SGD>(
          b->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9).weight_decay(0.05));
    else if (type == "adam")
      ref = std::make_unique<torch::optim::Adam>(b->parameters(),
                                                 torch::optim::AdamOptions(0.01).weight_decay(0.05));
    else
      ref = std::make_unique<torch::optim::AdamW>(b->parameters(),
                                                  torch::optim::AdamWOptions(0.01).weight_decay(0.05));
    for (int i = 0; i < 5; ++i) {
      torch::Tensor x = torch::randn({16, 8});
      mine.zero_grad();
      ref->zero_grad();
      a->forward(x).pow(2).mean().backward();
      b->forward(x).pow(2).mean().backward();
      mine.step(0.01);
      ref->step();
    }
    EXPECT_TRUE(torch::allclose(a->weight, b->weight, 1e-6, 1e-7)) << type;
    EXPECT_TRUE(torch::allclose(a->bias, b->bias, 1e-6, 1e-7)) << type;
  }
}

TEST(Optimizer, StateRoundTrip) {
  Scalar x, y;
  Optimizer a(spec_of("adam"), x.params());
  for (int i = 0; i < 3; ++i) {
    x.set_grad(0.1 * (i + 1));
    a.step(0.1);
  }
  Optimizer b(spec_of("adam"), y.params());
  b.load_state_dict(a.state_dict());
  {
    torch::NoGradGuard g;
    y.p.copy_(x.p);
  }
  x.set_grad(0.7);
  y.set_grad(0.7);
  a.step(0.1);
  b.step(0.1);
  EXPECT_EQ(x.value(), y.value());
  EXPECT_EQ(b.steps(), 4);
}

TEST(Optimizer, ClipGradNorm) {
  torch::Tensor a = torch::zeros({2}, torch::requires_grad()), b = torch::zeros({1}, torch::requires_grad());
  a.mutable_grad() = torch::tensor({3.0f, 0.0f});
  b.mutable_grad() = torch::tensor({4.0f});
  std::vector<NamedParam> ps = {{"a", a}, {"b", b}};
  EXPECT_NEAR(clip_grad_norm(ps, 1.0), 5.0, 1e-6);
  EXPECT_NEAR(grad_norm(ps), 1.0, 1e-5);
  EXPECT_NEAR(clip_grad_norm(ps, 10.0), 1.0, 1e-5);  // under the bound: unchanged
  EXPECT_NEAR(grad_norm(ps), 1.0, 1e-5);
}

TEST(LrSchedule, WarmupThenCosineAndLinear) {
  ScheduleSpec s;
  s.type = "cosine";
  s.warmup_steps = 10;
  s.min_lr = 0.0;
  LrSchedule cos(s, 1.0, 110);
  EXPECT_NEAR(cos.at(0), 0.1, 1e-12);
  EXPECT_NEAR(cos.at(9), 1.0, 1e-12);
  EXPECT_NEAR(cos.at(10), 1.0, 1e-12);
  EXPECT_NEAR(cos.at(60), 0.5, 1e-12);
  EXPECT_NEAR(cos.at(110), 0.0, 1e-12);
  s.type = "linear";
  s.min_lr = 0.2;
  LrSchedule lin(s, 1.0, 110);
  EXPECT_NEAR(lin.at(60), 0.6, 1e-12);
  EXPECT_NEAR(lin.at(500), 0.2, 1e-12);
  s.type = "constant";
  s.warmup_steps = 0;
  EXPECT_EQ(LrSchedule(s, 0.3, 5).at(4), 0.3);
}
