// Optimizer steps against numbers worked out by hand, against torch::optim, and the fused
// one-pass update (fused_update) against the ATen ops it replaces (reference_update).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "collectives/error.h"
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

// ---- fused_update against reference_update ---------------------------------------------

namespace {

struct Case {
  std::string name;
  OptimizerSpec spec;
};

std::vector<Case> update_cases() {
  auto make = [](std::string name, std::string type, double momentum, bool nesterov, double wd) {
    OptimizerSpec s = spec_of(type);
    s.momentum = momentum;
    s.nesterov = nesterov;
    s.weight_decay = wd;
    return Case{std::move(name), s};
  };
  return {make("sgd", "sgd", 0, false, 0),
          make("sgd_wd", "sgd", 0, false, 0.05),
          make("sgd_momentum", "sgd", 0.9, false, 0),
          make("sgd_nesterov", "sgd", 0.9, true, 0),
          make("sgd_nesterov_wd", "sgd", 0.9, true, 0.05),
          make("sgd_momentum_wd", "sgd", 0.8, false, 0.05),
          make("adam", "adam", 0, false, 0),
          make("adam_wd", "adam", 0, false, 0.05),
          make("adamw", "adamw", 0, false, 0),
          make("adamw_wd", "adamw", 0, false, 0.05)};
}

// The slots `spec` needs for a range like `p`. The momentum slot starts as NaN: a first
// (fresh) update must write it without reading it.
UpdateSlots slots_for(const OptimizerSpec& spec, const torch::Tensor& p) {
  UpdateSlots s;
  if (spec.type != "sgd") {
    s.exp_avg = torch::zeros_like(p);
    s.exp_avg_sq = torch::zeros_like(p);
  } else if (spec.momentum != 0) {
    s.momentum = torch::full_like(p, std::numeric_limits<double>::quiet_NaN());
    s.fresh_momentum = true;
  }
  return s;
}

// max |a - b| / max(|b|, rms(b)) over the elements: relative, except that an element
// near zero is measured on its tensor's scale. (With ATen's default-capability kernels
// fused_update is bit-exact; its AVX2/AVX-512 kernels fuse some multiply-adds that
// fused_update rounds twice, and a cancellation to near zero, as in b1 m + (1 - b1) d,
// magnifies that last-bit difference relative to the result.)
double max_rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  torch::Tensor ad = a.to(torch::kDouble), bd = b.to(torch::kDouble);
  const double rms = bd.square().mean().sqrt().item<double>();
  return ((ad - bd).abs() / bd.abs().clamp_min(rms)).max().item<double>();
}

double tolerance(torch::Dtype dtype) { return dtype == torch::kFloat ? 1e-6 : 1e-12; }

double lr_at(int step) { return 0.01 * (1 - 0.02 * step); }

}  // namespace

TEST(FusedUpdate, MatchesReferenceOver20Steps) {
  for (torch::Dtype dtype : {torch::kFloat, torch::kDouble}) {
    for (int64_t n : {1, 7, 1001, 100003}) {
      for (const Case& c : update_cases()) {
        SCOPED_TRACE(c.name + " n=" + std::to_string(n) +
                     (dtype == torch::kFloat ? " float" : " double"));
        torch::manual_seed(static_cast<uint64_t>(n));
        torch::Tensor p0 = torch::randn({n}, dtype);
        torch::Tensor fused = p0.clone(), ref = p0.clone();
        UpdateSlots fs = slots_for(c.spec, p0), rs = slots_for(c.spec, p0);
        for (int step = 1; step <= 20; ++step) {
          torch::Tensor g = torch::randn({n}, dtype);
          fused_update(c.spec, lr_at(step), step, fused, g, fs);
          reference_update(c.spec, lr_at(step), step, ref, g, rs);
          fs.fresh_momentum = rs.fresh_momentum = false;
        }
        const double tol = tolerance(dtype);
        EXPECT_FALSE(torch::equal(fused, p0));
        EXPECT_LE(max_rel_diff(fused, ref), tol);
        if (fs.momentum.defined()) {
          EXPECT_LE(max_rel_diff(fs.momentum, rs.momentum), tol);
        }
        if (fs.exp_avg.defined()) {
          EXPECT_LE(max_rel_diff(fs.exp_avg, rs.exp_avg), tol);
          EXPECT_LE(max_rel_diff(fs.exp_avg_sq, rs.exp_avg_sq), tol);
        }
      }
    }
  }
}

TEST(FusedUpdate, UpdatesExactlyItsSliceOfAFlatBuffer) {
  // A ZeRO shard: elements [5, 1006) of flat buffers of 3000, at an offset that no SIMD
  // width divides.
  const int64_t total = 3000, begin = 5, len = 1001;
  for (const Case& c : update_cases()) {
    SCOPED_TRACE(c.name);
    torch::manual_seed(11);
    torch::Tensor pbuf = torch::randn({total}), gbuf = torch::randn({total});
    torch::Tensor abuf = torch::randn({total}), bbuf = torch::rand({total});  // slots: any state
    const torch::Tensor p0 = pbuf.clone(), g0 = gbuf.clone(), a0 = abuf.clone(), b0 = bbuf.clone();
    auto slice = [&](const torch::Tensor& t) { return t.narrow(0, begin, len); };
    UpdateSlots fs, rs;
    if (c.spec.type != "sgd") {
      fs.exp_avg = slice(abuf);
      fs.exp_avg_sq = slice(bbuf);
      rs.exp_avg = slice(a0).clone();
      rs.exp_avg_sq = slice(b0).clone();
    } else if (c.spec.momentum != 0) {
      fs.momentum = slice(abuf);
      rs.momentum = slice(a0).clone();
    }
    torch::Tensor ref = slice(p0).clone();
    for (int step = 1; step <= 3; ++step) {
      fused_update(c.spec, lr_at(step), step, slice(pbuf), slice(gbuf), fs);
      reference_update(c.spec, lr_at(step), step, ref, slice(g0), rs);
    }
    EXPECT_LE(max_rel_diff(slice(pbuf), ref), 1e-6);
    if (rs.momentum.defined()) {
      EXPECT_LE(max_rel_diff(slice(abuf), rs.momentum), 1e-6);
    }
    if (rs.exp_avg.defined()) {
      EXPECT_LE(max_rel_diff(slice(abuf), rs.exp_avg), 1e-6);
      EXPECT_LE(max_rel_diff(slice(bbuf), rs.exp_avg_sq), 1e-6);
    }
    // Nothing around the range moved, and the gradient is only read.
    const std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers = {
        {pbuf, p0}, {abuf, a0}, {bbuf, b0}};
    for (const auto& [now, before] : buffers) {
      EXPECT_TRUE(torch::equal(now.narrow(0, 0, begin), before.narrow(0, 0, begin)));
      EXPECT_TRUE(torch::equal(now.narrow(0, begin + len, total - begin - len),
                               before.narrow(0, begin + len, total - begin - len)));
    }
    EXPECT_TRUE(torch::equal(gbuf, g0));
    if (c.spec.type == "sgd" && c.spec.momentum == 0) {
      EXPECT_TRUE(torch::equal(abuf, a0));
    }
  }
}

TEST(FusedUpdate, SplittingAcrossThreadsChangesNoBit) {
  // A long range at an odd offset of a flat buffer, updated at 1 and at 3 intra-op
  // threads: each chunk must land on its own elements, so the results are identical.
  const int64_t total = 250007, begin = 3, len = 200003;
  const int threads_before = at::get_num_threads();
  for (const Case& c : update_cases()) {
    SCOPED_TRACE(c.name);
    torch::manual_seed(13);
    const torch::Tensor p0 = torch::randn({total}), a0 = torch::randn({total}),
                        b0 = torch::rand({total});
    torch::Tensor results[2];
    for (int threads : {1, 3}) {
      at::set_num_threads(threads);
      torch::Tensor pbuf = p0.clone(), abuf = a0.clone(), bbuf = b0.clone();
      auto slice = [&](const torch::Tensor& t) { return t.narrow(0, begin, len); };
      UpdateSlots s;
      if (c.spec.type != "sgd") {
        s.exp_avg = slice(abuf);
        s.exp_avg_sq = slice(bbuf);
      } else if (c.spec.momentum != 0) {
        s.momentum = slice(abuf);
      }
      torch::manual_seed(17);
      for (int step = 1; step <= 3; ++step)
        fused_update(c.spec, lr_at(step), step, slice(pbuf), slice(torch::randn({total})), s);
      results[threads == 1 ? 0 : 1] = torch::cat({pbuf, abuf, bbuf});
      EXPECT_TRUE(torch::equal(pbuf.narrow(0, begin + len, total - begin - len),
                               p0.narrow(0, begin + len, total - begin - len)));
    }
    EXPECT_TRUE(torch::equal(results[0], results[1]));
  }
  at::set_num_threads(threads_before);
}

TEST(FusedUpdate, FallsBackOnNonContiguousTensors) {
  // A transposed parameter is not one range: the update is reference_update's, bit for bit.
  for (const Case& c : update_cases()) {
    SCOPED_TRACE(c.name);
    torch::manual_seed(5);
    torch::Tensor base = torch::randn({9, 7});
    torch::Tensor fused = base.clone().t(), ref = base.clone().t();
    ASSERT_FALSE(fused.is_contiguous());
    UpdateSlots fs = slots_for(c.spec, fused), rs = slots_for(c.spec, ref);
    for (int step = 1; step <= 3; ++step) {
      torch::Tensor g = torch::randn({9, 7}).t();
      fused_update(c.spec, lr_at(step), step, fused, g, fs);
      reference_update(c.spec, lr_at(step), step, ref, g, rs);
      fs.fresh_momentum = rs.fresh_momentum = false;
    }
    EXPECT_TRUE(torch::equal(fused, ref));
  }
}

TEST(FusedUpdate, MissingSlotOrMismatchedSizeIsAnError) {
  torch::Tensor p = torch::zeros({4}), g = torch::ones({4});
  UpdateSlots none;
  OptimizerSpec adam = spec_of("adam");
  EXPECT_THROW(fused_update(adam, 0.1, 1, p, g, none), tetra::Error);
  OptimizerSpec momentum = spec_of("sgd");
  momentum.momentum = 0.9;
  EXPECT_THROW(fused_update(momentum, 0.1, 1, p, g, none), tetra::Error);
  UpdateSlots short_slot;
  short_slot.momentum = torch::zeros({3});
  EXPECT_THROW(fused_update(momentum, 0.1, 1, p, g, short_slot), tetra::Error);
  EXPECT_THROW(fused_update(spec_of("sgd"), 0.1, 1, p, torch::ones({5}), none), tetra::Error);
  OptimizerSpec unknown = spec_of("lion");
  EXPECT_THROW(fused_update(unknown, 0.1, 1, p, g, none), tetra::Error);
}

TEST(Optimizer, StepMatchesReferenceUpdateOnAModel) {
  // Optimizer::step (fused) against reference_update driven by hand with the same lazy
  // state; one parameter never gets a gradient and must be left alone, without state.
  for (const Case& c : update_cases()) {
    SCOPED_TRACE(c.name);
    torch::manual_seed(7);
    torch::nn::Sequential model(torch::nn::Linear(6, 9), torch::nn::Tanh(),
                                torch::nn::Linear(9, 3));
    std::vector<NamedParam> mine;
    for (auto& p : model->named_parameters()) mine.push_back({p.key(), p.value()});
    torch::Tensor unused = torch::randn({5}, torch::requires_grad());
    const torch::Tensor unused0 = unused.detach().clone();
    mine.push_back({"unused", unused});
    std::vector<torch::Tensor> ref;
    for (size_t i = 0; i + 1 < mine.size(); ++i) ref.push_back(mine[i].tensor.detach().clone());
    std::vector<UpdateSlots> ref_slots(ref.size());
    Optimizer opt(c.spec, mine);
    for (int step = 1; step <= 6; ++step) {
      opt.zero_grad();
      model->forward(torch::randn({16, 6})).pow(2).mean().backward();
      opt.step(lr_at(step));
      for (size_t i = 0; i < ref.size(); ++i) {
        if (step == 1) ref_slots[i] = slots_for(c.spec, ref[i]);
        reference_update(c.spec, lr_at(step), step, ref[i], mine[i].tensor.grad(), ref_slots[i]);
        ref_slots[i].fresh_momentum = false;
      }
    }
    auto state = opt.state_dict();
    for (size_t i = 0; i < ref.size(); ++i) {
      SCOPED_TRACE(mine[i].name);
      EXPECT_LE(max_rel_diff(mine[i].tensor, ref[i]), 1e-6);
      const std::string& n = mine[i].name;
      if (ref_slots[i].momentum.defined()) {
        EXPECT_LE(max_rel_diff(state.at(n + ".momentum"), ref_slots[i].momentum), 1e-6);
      }
      if (ref_slots[i].exp_avg.defined()) {
        EXPECT_LE(max_rel_diff(state.at(n + ".exp_avg"), ref_slots[i].exp_avg), 1e-6);
        EXPECT_LE(max_rel_diff(state.at(n + ".exp_avg_sq"), ref_slots[i].exp_avg_sq), 1e-6);
      }
    }
    EXPECT_TRUE(torch::equal(unused.detach(), unused0));
    for (const auto& [key, value] : state)
      EXPECT_EQ(key.rfind("unused", 0), std::string::npos) << key;
    const size_t per_param = c.spec.type != "sgd" ? 2 : c.spec.momentum != 0 ? 1 : 0;
    EXPECT_EQ(state.size(), 1 + per_param * ref.size());
  }
}

TEST(Optimizer, SgdMomentumStateRoundTrip) {
  // A restored momentum buffer is continued (buf = m buf + d), not restarted.
  auto s = spec_of("sgd");
  s.momentum = 0.9;
  Scalar x, y;
  Optimizer a(s, x.params());
  x.set_grad(0.5);
  a.step(0.1);
  Optimizer b(s, y.params());
  b.load_state_dict(a.state_dict());
  {
    torch::NoGradGuard g;
    y.p.copy_(x.p);
  }
  x.set_grad(0.5);
  y.set_grad(0.5);
  a.step(0.1);
  b.step(0.1);
  EXPECT_NEAR(y.value(), 0.855, 1e-7);
  EXPECT_EQ(x.value(), y.value());
}
