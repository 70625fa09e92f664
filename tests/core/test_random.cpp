// Dropout keyed by (seed, step, global sample, layer, element) — Note [Layout-invariant
// dropout]: the same key draws the same mask, a batch cut into pieces draws the rows of the
// whole batch (forward and gradient), different keys draw different masks, the kept
// fraction is 1 - p, eval is the identity, bf16 works, and a forgotten key is an error.
#include "core/random.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <thread>

#include "collectives/error.h"
#include "core/models.h"
#include "tests/common/data_infos.h"

using namespace tetra::core;

namespace {

using tetra::testing_data::text_info;

ModelSpec gpt_spec(double dropout) {
  ModelSpec s;
  s.type = "gpt";
  s.layers = 2;
  s.heads = 2;
  s.d_model = 16;
  s.dropout = dropout;
  return s;
}

// The mask a Dropout applied: its output over its input (x has no zeros).
torch::Tensor kept(const torch::Tensor& out) { return out.ne(0); }

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const tetra::Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(Dropout, SameKeyDrawsTheSameMask) {
  Dropout drop(0.3, 5);
  const torch::Tensor x = torch::rand({8, 6, 5}) + 1;
  torch::Tensor a, b;
  {
    RandomContext::Scope scope(7, 3, 0);
    a = drop(x);
    b = drop(x);
  }
  EXPECT_TRUE(torch::equal(a, b));
  Dropout same_layer(0.3, 5);  // another module with the same id and key
  RandomContext::Scope scope(7, 3, 0);
  EXPECT_TRUE(torch::equal(same_layer(x), a));
  // Kept elements are scaled by 1 / (1 - p), dropped ones are 0.
  EXPECT_TRUE(torch::allclose(a.masked_select(kept(a)), x.masked_select(kept(a)) / 0.7));
}

TEST(Dropout, TwoPiecesOfABatchDrawTheRowsOfTheWholeBatch) {
  Dropout drop(0.4, 2);
  const torch::Tensor x = torch::rand({8, 3, 7}) + 1;
  const torch::Tensor upstream = torch::randn({8, 3, 7});
  auto run = [&](int64_t begin, int64_t end) {
    torch::Tensor in = x.slice(0, begin, end).detach().requires_grad_(true);
    RandomContext::Scope scope(11, 4, begin);  // row 0 of this piece is row `begin` of the batch
    torch::Tensor out = drop(in);
    out.backward(upstream.slice(0, begin, end));
    return std::make_pair(out.detach(), in.grad());
  };
  auto [whole, whole_grad] = run(0, 8);
  auto [first, first_grad] = run(0, 4);
  auto [second, second_grad] = run(4, 8);
  EXPECT_TRUE(torch::equal(torch::cat({first, second}), whole));
  EXPECT_TRUE(torch::equal(torch::cat({first_grad, second_grad}), whole_grad));
  // The gradient takes the forward's mask and scale.
  EXPECT_TRUE(torch::allclose(whole_grad, upstream * kept(whole) / 0.6));
  // Uneven pieces too (a rank's slice cut again into micro-batches).
  auto [a, a_grad] = run(0, 3);
  auto [b, b_grad] = run(3, 8);
  EXPECT_TRUE(torch::equal(torch::cat({a, b}), whole));
}

TEST(Dropout, GptSplitIntoTwoForwardsFollowsTheWholeBatch) {
  // Every dropout of the GPT (embedding, attention, both residuals of each block) keys by
  // the global row, so two half-batch forwards compute the rows of the whole one.
  torch::manual_seed(3);
  torch::nn::Sequential gpt = build_model(gpt_spec(0.3), text_info(8), 1);
  gpt->train();
  const torch::Tensor tokens = torch::randint(0, 256, {8, 8}, torch::kLong);
  auto forward = [&](int64_t begin, int64_t end) {
    RandomContext::Scope scope(1, 9, begin);
    return gpt->forward(tokens.slice(0, begin, end));
  };
  const torch::Tensor whole = forward(0, 8);
  torch::Tensor halves = torch::cat({forward(0, 4), forward(4, 8)});
  EXPECT_TRUE(torch::allclose(halves, whole, 1e-5, 1e-6)) << (halves - whole).abs().max();
  // And it does drop: another step differs, eval differs from training.
  RandomContext::Scope next(1, 10, 0);
  EXPECT_FALSE(torch::allclose(gpt->forward(tokens), whole));
  gpt->eval();
  EXPECT_FALSE(torch::allclose(gpt->forward(tokens), whole));
}

// Dropout inside a tensor-parallel region (an attention's heads, a column-parallel
// Linear's block of features): each rank's mask is its part of the mask one process draws,
// whatever dimension the part is cut along (Note [Placements]).
TEST(Dropout, APartOfATensorDrawsItsPartOfTheWholeMask) {
  const RandomContext context{3, 8, 5, true};
  const std::vector<int64_t> sample = {4, 3, 6};  // heads x seq x seq, say
  const torch::Tensor whole = dropout_mask(context, 2, 0.4, {5, 4, 3, 6}, torch::kFloat);
  for (int dim : {0, 1, 2})
    for (int parts : {1, 3, 2})
      for (int index = 0; index < parts; ++index) {
        if (sample[static_cast<size_t>(dim)] % parts) continue;
        const Placement part = Placement::split(sample, dim, parts, index);
        std::vector<int64_t> shape = part.local();
        shape.insert(shape.begin(), 5);
        const int64_t block = sample[static_cast<size_t>(dim)] / parts;
        EXPECT_TRUE(at::equal(dropout_mask(context, 2, 0.4, shape, torch::kFloat, &part),
                              whole.narrow(dim + 1, index * block, block)))
            << part.str();
      }
}

TEST(Dropout, MasksDifferAcrossStepsLayersSamplesAndSeeds) {
  const std::vector<int64_t> shape = {4, 256};
  auto mask = [&](uint64_t seed, int64_t step, int64_t first, int64_t layer) {
    return dropout_mask(RandomContext{seed, step, first, true}, layer, 0.5, shape, torch::kFloat);
  };
  const torch::Tensor m = mask(1, 0, 0, 0);
  EXPECT_FALSE(torch::equal(m, mask(1, 1, 0, 0))) << "step";
  EXPECT_FALSE(torch::equal(m, mask(1, 0, 0, 1))) << "layer";
  EXPECT_FALSE(torch::equal(m, mask(2, 0, 0, 0))) << "seed";
  EXPECT_FALSE(torch::equal(m[0], m[1])) << "rows";
  EXPECT_FALSE(torch::equal(m.slice(1, 0, 128), m.slice(1, 128, 256))) << "elements";
  // A row's mask depends on its place in the global batch only.
  EXPECT_TRUE(torch::equal(mask(1, 0, 1, 0).slice(0, 0, 3), m.slice(0, 1, 4)));
  EXPECT_TRUE(torch::equal(mask(1, 0, 100, 0)[0], mask(1, 0, 97, 0)[3]));
}

TEST(Dropout, KeepsOneMinusPOfTheElements) {
  const int64_t rows = 64, per_row = 16384;  // 2^20 elements: 5 sigma is under 0.0025
  for (double p : {0.1, 0.5, 0.9}) {
    torch::Tensor m = dropout_mask(RandomContext{5, 2, 0, true}, 3, p, {rows, per_row}, torch::kFloat);
    torch::Tensor keep = m.ne(0).to(torch::kDouble);
    EXPECT_NEAR(keep.mean().item<double>(), 1 - p, 0.0025) << "p " << p;
    EXPECT_NEAR(m.to(torch::kDouble).mean().item<double>(), 1.0, 0.0025 / (1 - p)) << "p " << p;  // unbiased
    // Neighbours (the two halves of one hash) are independent: both kept (1-p)^2 of the time.
    torch::Tensor pairs = keep.view({rows, per_row / 2, 2});
    EXPECT_NEAR((pairs.select(2, 0) * pairs.select(2, 1)).mean().item<double>(), (1 - p) * (1 - p), 0.0035)
        << "p " << p;
    // Rows too: no row keeps far more than another.
    torch::Tensor per = keep.mean(1);
    EXPECT_LT((per - (1 - p)).abs().max().item<double>(), 6 * std::sqrt(p * (1 - p) / per_row)) << "p " << p;
  }
}

TEST(Dropout, EvalAndZeroPAreTheIdentityWithoutAKey) {
  const torch::Tensor x = torch::randn({4, 10});
  Dropout drop(0.5, 0);
  drop->eval();
  EXPECT_TRUE(torch::equal(drop(x), x));
  Dropout none(0.0);  // no id, no key: p = 0 draws nothing
  EXPECT_TRUE(torch::equal(none(x), x));
}

TEST(Dropout, TrainingWithoutAKeyOrAnIdIsAClearError) {
  const torch::Tensor x = torch::randn({4, 10});
  Dropout drop(0.5, 0);
  const std::string no_key = error_of([&] { drop(x); });
  EXPECT_NE(no_key.find("RandomContext::Scope"), std::string::npos) << no_key;
  EXPECT_NE(no_key.find("eval()"), std::string::npos) << no_key;
  Dropout unnumbered(0.5);
  RandomContext::Scope scope(1, 0, 0);
  const std::string no_id = error_of([&] { unnumbered(x); });
  EXPECT_NE(no_id.find("number_dropout_layers"), std::string::npos) << no_id;
  EXPECT_NE(error_of([] { Dropout always(1.0, 0); }).find("[0, 1)"), std::string::npos);
}

TEST(Dropout, Bf16DrawsTheSameMaskAsFloat) {
  Dropout drop(0.25, 1);
  const torch::Tensor x = torch::rand({6, 40}) + 1;
  RandomContext::Scope scope(2, 1, 10);
  torch::Tensor f = drop(x);
  torch::Tensor xb = x.to(torch::kBFloat16).requires_grad_(true);
  torch::Tensor b = drop(xb);
  EXPECT_EQ(b.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(kept(b), kept(f)));
  EXPECT_TRUE(torch::allclose(b.to(torch::kFloat), f, 1e-2, 1e-2));
  b.sum().backward();
  EXPECT_EQ(xb.grad().scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(xb.grad().ne(0), kept(f)));
}

TEST(Dropout, ScopesNestAndEachThreadHasItsOwn) {
  EXPECT_FALSE(RandomContext::current().active);
  {
    RandomContext::Scope outer(3, 4, 5);
    EXPECT_TRUE(RandomContext::current().active);
    {
      RandomContext::Scope inner(RandomContext::current().offset(16));
      EXPECT_EQ(RandomContext::current().first_sample, 21);
      EXPECT_EQ(RandomContext::current().step, 4);
      bool other_thread_active = true;
      std::thread([&] { other_thread_active = RandomContext::current().active; }).join();
      EXPECT_FALSE(other_thread_active);  // a replica thread keys its own forwards
    }
    EXPECT_EQ(RandomContext::current().first_sample, 5);
  }
  EXPECT_FALSE(RandomContext::current().active);
}

TEST(Dropout, BuiltModelsNumberTheirDropoutsAndClonesKeepTheIds) {
  torch::nn::Sequential gpt = build_model(gpt_spec(0.1), text_info(8), 1);
  std::vector<int64_t> ids;
  for (const auto& m : gpt->modules())
    if (auto* d = m->as<DropoutImpl>()) ids.push_back(d->layer());
  // Embedding, then attention, projection and MLP dropouts of each of the 2 blocks.
  EXPECT_EQ(ids, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(gpt->clone());
  ASSERT_TRUE(copy);
  const torch::Tensor tokens = torch::randint(0, 256, {2, 8}, torch::kLong);
  RandomContext::Scope scope(1, 0, 0);
  EXPECT_TRUE(torch::equal(copy->forward(tokens), gpt->forward(tokens)));

  ModelSpec mlp;
  mlp.type = "mlp";
  mlp.hidden = {8, 8, 8};
  mlp.dropout = 0.2;
  DataInfo flat;
  flat.input_shape = {5};
  flat.num_classes = 2;
  ids.clear();
  for (const auto& m : build_model(mlp, flat, 1)->modules())
    if (auto* d = m->as<DropoutImpl>()) ids.push_back(d->layer());
  EXPECT_EQ(ids, (std::vector<int64_t>{0, 1, 2}));
  // A Sequential of one's own.
  torch::nn::Sequential own(torch::nn::Linear(5, 5), Dropout(0.1), torch::nn::Linear(5, 5), Dropout(0.1));
  EXPECT_EQ(number_dropout_layers(*own, 10), 12);
  EXPECT_EQ(own[3]->as<DropoutImpl>()->layer(), 11);
}
