// Megatron's building blocks (Note [Tensor-parallel maps], core/tensor_group.h; Note
// [Placements], core/placement.h): a column-parallel Linear followed by a row-parallel one,
// each rank holding its parts drawn as the whole layers' elements, computes what the two
// whole Linears compute — outputs, the input's gradient, and each weight's gradient as the
// part of the whole gradient — on T thread ranks over the local backend; and the sequence-
// parallel maps are each other's conjugates.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "collectives/local.h"
#include "core/init.h"
#include "core/layers.h"
#include "tensor_parallel/mappings.h"

using namespace tetra;
using namespace tetra::core;

namespace {

constexpr int64_t kIn = 8, kHidden = 12, kRows = 5;
constexpr uint64_t kSeed = 3;

at::Tensor input() {
  at::Tensor x = at::empty({kRows, kIn});
  draw(Init::normal(0, 1), 9, "input", 0, x);
  return x;
}

struct Whole {
  at::Tensor y, x_grad, w1_grad, b1_grad, w2_grad, b2_grad;
};

// The one-process reference: Linear -> gelu -> Linear, a loss that weighs every output.
Whole whole_pair() {
  torch::nn::Sequential m(Linear(kIn, kHidden), torch::nn::Functional(torch::gelu, "none"), Linear(kHidden, kIn));
  Materializer(*m, kSeed).create_all(*m);
  at::Tensor x = input().requires_grad_(true);
  at::Tensor y = m->forward(x);
  (y * at::arange(y.numel(), at::kFloat).view_as(y).cos()).sum().backward();
  auto p = m->named_parameters();
  return {y.detach(), x.grad(), p["0.weight"].grad(), p["0.bias"].grad(), p["2.weight"].grad(), p["2.bias"].grad()};
}

TEST(TensorParallelLinear, AColumnThenRowPairComputesTheWholePair) {
  const Whole whole = whole_pair();
  for (int t : {1, 2, 3, 4}) {
    SCOPED_TRACE("T = " + std::to_string(t));
    std::mutex mu;
    collectives::run_local_ranks(t, [&](int rank, collectives::Communicator& comm) {
      const TensorSlot slot{t, rank};
      ParallelLinear first(kIn, kHidden, ParallelLinearImpl::Split::kColumn, slot);
      ParallelLinear second(kHidden, kIn, ParallelLinearImpl::Split::kRow, slot);
      torch::nn::Sequential m(first, torch::nn::Functional(torch::gelu, "none"), second);
      Materializer(*m, kSeed).create_all(*m);
      auto group = tensor_parallel::tensor_group(comm.shared_from_this());
      first->bind(group);
      second->bind(group);

      at::Tensor x = input().requires_grad_(true);
      at::Tensor y = m->forward(x);
      (y * at::arange(y.numel(), at::kFloat).view_as(y).cos()).sum().backward();

      const int64_t h = kHidden / t;
      std::lock_guard<std::mutex> lock(mu);
      SCOPED_TRACE("rank " + std::to_string(rank));
      EXPECT_TRUE(at::allclose(y.detach(), whole.y, 1e-5, 1e-6)) << (y - whole.y).abs().max();
      EXPECT_TRUE(at::allclose(x.grad(), whole.x_grad, 1e-5, 1e-6)) << (x.grad() - whole.x_grad).abs().max();
      EXPECT_TRUE(at::allclose(first->weight.grad(), whole.w1_grad.narrow(0, rank * h, h), 1e-5, 1e-6));
      EXPECT_TRUE(at::allclose(first->bias.grad(), whole.b1_grad.narrow(0, rank * h, h), 1e-5, 1e-6));
      EXPECT_TRUE(at::allclose(second->weight.grad(), whole.w2_grad.narrow(1, rank * h, h), 1e-5, 1e-6));
      EXPECT_TRUE(at::allclose(second->bias.grad(), whole.b2_grad, 1e-5, 1e-6));  // whole on every rank
    });
  }
}

TEST(TensorParallelLinear, PartsHoldTheWholeLayersBytesAndShapesOnlyGivesTheShapes) {
  Linear whole(kIn, kHidden);
  torch::nn::Sequential w(whole);
  Materializer(*w, kSeed).create_all(*w);
  for (int rank = 0; rank < 3; ++rank) {
    // A fused projection of 3 stacked blocks (query, key, value), each split by rows.
    ParallelLinear part(kIn, kHidden, ParallelLinearImpl::Split::kColumn, TensorSlot{2, rank % 2}, true,
                        std::optional<Init>(), std::optional<Init>(), int64_t{3});
    torch::nn::Sequential p(part);
    Materializer(*p, kSeed).create_all(*p);
    const int r = rank % 2;
    const at::Tensor expect = whole->weight.view({3, 4, kIn}).narrow(1, 2 * r, 2).reshape({6, kIn});
    EXPECT_TRUE(at::equal(part->weight, expect)) << "part " << r;
    EXPECT_TRUE(at::equal(part->bias, whole->bias.view({3, 4}).narrow(1, 2 * r, 2).reshape({6})));
    // Unbound, it computes its block's shape (nothing communicated).
    EXPECT_EQ(part->forward(at::zeros({kRows, kIn})).sizes(), (std::vector<int64_t>{kRows, 6}));
  }
  ParallelLinear row(kHidden, kIn, ParallelLinearImpl::Split::kRow, TensorSlot{4, 1});
  torch::nn::Sequential r(row);
  Materializer(*r, kSeed).create_all(*r);
  EXPECT_EQ(row->forward(at::zeros({kRows, kHidden / 4})).sizes(), (std::vector<int64_t>{kRows, kIn}));
  std::ostringstream printed;
  row->pretty_print(printed);
  EXPECT_EQ(printed.str(), "RowParallelLinear(in_features=12, out_features=8, bias=true, part 1 of 4)");
  EXPECT_THROW(ParallelLinear(kHidden, kIn, ParallelLinearImpl::Split::kRow, TensorSlot{5, 0}), tetra::Error);
}

TEST(TensorParallelMaps, GatherAndScatterAreConjugates) {
  const int t = 3;
  collectives::run_local_ranks(t, [&](int rank, collectives::Communicator& comm) {
    auto group = tensor_parallel::tensor_group(comm.shared_from_this());
    auto block = [](int r) { return at::arange(8, at::kFloat).view({2, 1, 4}) + 100 * r; };
    // gather along 1: every rank's block in rank order; backward sums the gradient over the
    // group and hands each rank its block.
    at::Tensor x = block(rank).requires_grad_(true);
    at::Tensor y = group->gather(x, 1);
    EXPECT_TRUE(at::equal(y, at::cat({block(0), block(1), block(2)}, 1)));
    const at::Tensor c = at::arange(y.numel(), at::kFloat).view_as(y);
    (y * c).sum().backward();
    EXPECT_TRUE(at::equal(x.grad(), t * c.narrow(1, rank, 1)));
    // scatter along 2 (of 6): the sum over the group, this rank's block; backward gathers.
    at::Tensor z = (at::arange(12, at::kFloat).view({2, 1, 6}) * (rank + 1)).requires_grad_(true);
    at::Tensor s = group->scatter(z, 2);
    EXPECT_TRUE(at::equal(s, (at::arange(12, at::kFloat).view({2, 1, 6}) * 6).narrow(2, 2 * rank, 2)));
    auto weight = [](int r) { return at::full({2, 1, 2}, static_cast<float>(r + 1)); };
    (s * weight(rank)).sum().backward();
    EXPECT_TRUE(at::equal(z.grad(), at::cat({weight(0), weight(1), weight(2)}, 2)));
  });
}

// Note [Vocabulary-parallel loss]: the loss, the logits' gradient and the argmax of logits
// split by vocabulary are one process's, without the logits ever gathered.
TEST(VocabParallel, CrossEntropyAndArgmaxFollowTheWholeVocabulary) {
  constexpr int64_t kTokens = 7, kVocab = 12;
  at::Tensor logits = at::empty({kTokens, kVocab});
  draw(Init::normal(0, 3), 5, "logits", 0, logits);
  logits[2][7] = logits[2][3] = logits[2].max().item<float>() + 1;  // a tie, across blocks at T = 2 and 3
  const at::Tensor targets = at::tensor({0, 11, 3, 7, 5, 6, 9}, at::kLong);
  const at::Tensor weights = at::arange(1, kTokens + 1, at::kFloat);
  at::Tensor whole = logits.clone().requires_grad_(true);
  const at::Tensor whole_loss = at::cross_entropy_loss(whole, targets, {}, at::Reduction::None);
  (whole_loss * weights).sum().backward();
  const at::Tensor whole_argmax = logits.argmax(1);
  for (int t : {1, 2, 3, 4}) {
    SCOPED_TRACE("T = " + std::to_string(t));
    std::mutex mu;
    collectives::run_local_ranks(t, [&](int rank, collectives::Communicator& comm) {
      auto group = tensor_parallel::tensor_group(comm.shared_from_this());
      const int64_t part = kVocab / t, begin = rank * part;
      at::Tensor mine = logits.narrow(1, begin, part).clone().requires_grad_(true);
      const at::Tensor loss = vocab_cross_entropy(*group, mine, targets, begin);
      (loss * weights).sum().backward();
      const at::Tensor argmax = vocab_argmax(*group, mine, begin);
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_TRUE(at::allclose(loss.detach(), whole_loss.detach(), 1e-5, 1e-6)) << loss << whole_loss;
      EXPECT_TRUE(at::allclose(mine.grad(), whole.grad().narrow(1, begin, part), 1e-5, 1e-6));
      EXPECT_TRUE(at::equal(argmax, whole_argmax)) << argmax << whole_argmax;
    });
  }
}

TEST(VocabParallel, AnEmbeddingSplitByRowsLooksUpTheWholeTable) {
  constexpr int64_t kNum = 12, kDim = 4;
  Embedding whole(kNum, kDim);
  torch::nn::Sequential w(whole);
  Materializer(*w, kSeed).create_all(*w);
  const at::Tensor ids = at::tensor({0, 11, 5, 6, 6, 3}, at::kLong).view({2, 3});
  at::Tensor table = whole->weight.detach().clone().requires_grad_(true);
  const at::Tensor expect = at::embedding(table, ids);
  (expect * at::arange(expect.numel(), at::kFloat).view_as(expect)).sum().backward();
  for (int t : {2, 3}) {
    SCOPED_TRACE("T = " + std::to_string(t));
    std::mutex mu;
    collectives::run_local_ranks(t, [&](int rank, collectives::Communicator& comm) {
      ParallelEmbedding part(kNum, kDim, TensorSlot{t, rank});
      torch::nn::Sequential p(part);
      Materializer(*p, kSeed).create_all(*p);
      part->bind(tensor_parallel::tensor_group(comm.shared_from_this()));
      const at::Tensor got = part->forward(ids);
      (got * at::arange(got.numel(), at::kFloat).view_as(got)).sum().backward();
      const int64_t rows = kNum / t;
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_TRUE(at::equal(part->weight.detach(), whole->weight.narrow(0, rank * rows, rows)));
      EXPECT_TRUE(at::allclose(got, expect)) << got << expect;
      EXPECT_TRUE(at::allclose(part->weight.grad(), table.grad().narrow(0, rank * rows, rows)));
    });
  }
}

}  // namespace
