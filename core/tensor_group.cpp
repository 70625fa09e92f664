#include "core/tensor_group.h"

#include <torch/torch.h>

#include <climits>

#include "collectives/error.h"
#include "core/init.h"

namespace tetra::core {

namespace {

class ShapesOnly final : public TensorGroup {
 public:
  ShapesOnly(int size, int rank) : size_(size), rank_(rank) {
    TETRA_CHECK(size >= 1 && rank >= 0 && rank < size, "tensor group: rank ", rank, " of ", size,
                " does not exist");
  }
  int size() const override { return size_; }
  int rank() const override { return rank_; }
  at::Tensor copy(const at::Tensor& x) override { return x; }
  at::Tensor reduce(const at::Tensor& x) override { return x; }
  at::Tensor gather(const at::Tensor& x, int64_t dim) override {
    if (size_ == 1) return x;
    std::vector<at::Tensor> parts(static_cast<size_t>(size_), x);
    return at::cat(parts, dim);
  }
  at::Tensor scatter(const at::Tensor& x, int64_t dim) override {
    if (size_ == 1) return x;
    const int64_t n = x.size(dim);
    TETRA_CHECK(n % size_ == 0, "tensor group: ", size_, " ranks do not divide dimension ", dim, " of ",
                x.sizes());
    return x.narrow(dim, rank_ * (n / size_), n / size_);
  }
  void allreduce(at::Tensor& t, collectives::ReduceOp op) override { (void)t, (void)op; }

 private:
  int size_, rank_;
};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabCrossEntropy : torch::autograd::Function<VocabCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor logits, at::Tensor targets, int64_t group,
                            int64_t vocab_begin) {
    auto& g = *reinterpret_cast<TensorGroup*>(group);
    at::Tensor z = logits.to(at::kFloat);
    at::Tensor max = std::get<0>(z.max(1));
    g.allreduce(max, collectives::ReduceOp::kMax);
    z = z - max.unsqueeze(1);
    const int64_t part = z.size(1);
    const at::Tensor local = targets - vocab_begin;
    const at::Tensor here = local.ge(0).logical_and(local.lt(part));
    const at::Tensor index = local.clamp(0, part - 1).unsqueeze(1);
    at::Tensor exp = z.exp();
    at::Tensor packed = at::stack({exp.sum(1), z.gather(1, index).squeeze(1) * here});  // [2, N]
    g.allreduce(packed, collectives::ReduceOp::kSum);
    const at::Tensor sum = packed[0];
    exp.div_(sum.unsqueeze(1));  // the softmax, this rank's block of it
    ctx->save_for_backward({exp, index, here});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return sum.log() - packed[1];
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();
    grad.scatter_add_(1, saved[1], -saved[2].to(at::kFloat).unsqueeze(1));
    grad.mul_(grads[0].unsqueeze(1));
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_cross_entropy(TensorGroup& group, const at::Tensor& logits, const at::Tensor& targets,
                               int64_t vocab_begin) {
  TETRA_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
              "vocab_cross_entropy: logits [N, V/T] and targets [N], got ", logits.sizes(), " and ", targets.sizes());
  return VocabCrossEntropy::apply(logits, targets, reinterpret_cast<int64_t>(&group), vocab_begin);
}

at::Tensor vocab_argmax(TensorGroup& group, const at::Tensor& logits, int64_t vocab_begin) {
  at::NoGradGuard no_grad;
  const at::Tensor z = logits.to(at::kFloat);
  const at::Tensor max = z.amax(1), where = z.argmax(1);
  at::Tensor best = max.clone();
  group.allreduce(best, collectives::ReduceOp::kMax);
  // Each row's first index that reaches the maximum, or past the vocabulary on a rank that
  // holds none: the smallest over the group is the whole vocabulary's first.
  at::Tensor index = at::where(max.eq(best), where + vocab_begin, at::full_like(where, INT64_MAX));
  group.allreduce(index, collectives::ReduceOp::kMin);
  return index;
}

at::Tensor TensorGroup::column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t seq_dim) {
  return at::linear(seq_dim >= 0 ? gather(x, seq_dim) : copy(x), w, b);
}

at::Tensor gather_whole(collectives::Communicator& group, const Placement& at, const at::Tensor& part,
                        collectives::Duration timeout) {
  const at::Tensor mine = part.detach().contiguous().view({-1});
  at::Tensor all = mine.new_empty({mine.numel() * group.size()});
  collectives::AllgatherOptions o;
  o.timeout = timeout;
  group.allgather(mine, all, o)->wait();
  return whole_of(at, all.chunk(group.size()));
}

std::shared_ptr<TensorGroup> shapes_only(int size, int rank) { return std::make_shared<ShapesOnly>(size, rank); }

}  // namespace tetra::core
