#include "tensor_parallel/mappings.h"

#include <torch/torch.h>

#include "collectives/error.h"

namespace tetra::tensor_parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the autograd functions reach through their saved int64 (as ZeRO's hooks do): the
// group outlives every graph its layers build, since the layers hold it.
class Group final : public core::TensorGroup {
 public:
  Group(collectives::CommunicatorPtr comm, collectives::Duration timeout, bool overlap)
      : comm_(std::move(comm)), timeout_(timeout), overlap_(overlap) {
    TETRA_CHECK(comm_ != nullptr, "tensor_group: no communicator");
  }
  int size() const override { return comm_->size(); }
  int rank() const override { return comm_->rank(); }
  at::Tensor copy(const at::Tensor& x) override;
  at::Tensor reduce(const at::Tensor& x) override;
  at::Tensor gather(const at::Tensor& x, int64_t dim) override;
  at::Tensor scatter(const at::Tensor& x, int64_t dim) override;
  at::Tensor column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t seq_dim) override;
  void allreduce(at::Tensor& t, collectives::ReduceOp op) override { start_allreduce(t, op)->wait(); }

  // The sum over the group, out of place.
  at::Tensor sum(const at::Tensor& x) {
    at::Tensor out = x.contiguous().clone();
    start_allreduce(out)->wait();
    return out;
  }
  // The blocks of every rank stacked along dim (this rank's at rank()).
  at::Tensor all_gather(const at::Tensor& x, int64_t dim) {
    at::Tensor front = x.movedim(dim, 0).contiguous();
    std::vector<int64_t> sizes = front.sizes().vec();
    sizes[0] *= size();
    at::Tensor out = front.new_empty(sizes);
    collectives::AllgatherOptions o;
    o.timeout = timeout_;
    comm_->allgather(front, out, o)->wait();
    return out.movedim(0, dim).contiguous();
  }
  // The sum over the group of x, this rank's block of it along dim.
  at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim) {
    at::Tensor out;
    collectives::WorkPtr work = start_reduce_scatter(x, dim, out);
    work->wait();
    return out.movedim(0, dim).contiguous();
  }
  // Started, not awaited (the overlapped backward waits later): `inout`, or `out` in the
  // reduce-scatter's dim-first layout (movedim(0, dim) after), is written when the work is done.
  collectives::WorkPtr start_allreduce(at::Tensor& inout, collectives::ReduceOp op = collectives::ReduceOp::kSum) {
    collectives::AllreduceOptions o;
    o.op = op;
    o.timeout = timeout_;
    return comm_->allreduce(inout, o);
  }
  collectives::WorkPtr start_reduce_scatter(const at::Tensor& x, int64_t dim, at::Tensor& out) {
    const int64_t n = x.size(dim);
    TETRA_CHECK(n % size() == 0, comm_->name(), ": ", size(), " tensor-parallel ranks do not divide dimension ",
                dim, " of ", x.sizes());
    at::Tensor front = x.movedim(dim, 0).contiguous();
    std::vector<int64_t> sizes = front.sizes().vec();
    sizes[0] /= size();
    out = front.new_empty(sizes);
    collectives::ReduceScatterOptions o;
    o.timeout = timeout_;
    return comm_->reduce_scatter(front, out, o);
  }

 private:
  collectives::CommunicatorPtr comm_;
  collectives::Duration timeout_;
  bool overlap_;
};

Group* group_of(AutogradContext* ctx) { return reinterpret_cast<Group*>(ctx->saved_data["group"].toInt()); }

// f: identity forward, sum backward.
struct Copy : torch::autograd::Function<Copy> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {group_of(ctx)->sum(grads[0]), at::Tensor()};
  }
};

// g: sum forward, identity backward.
struct Reduce : torch::autograd::Function<Reduce> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, int64_t group) {
    (void)ctx;
    return reinterpret_cast<Group*>(group)->sum(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    (void)ctx;
    return {grads[0], at::Tensor()};
  }
};

// Sequence parallelism's all-gather along dim; backward: reduce-scatter.
struct Gather : torch::autograd::Function<Gather> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, int64_t group, int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return reinterpret_cast<Group*>(group)->all_gather(x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {group_of(ctx)->reduce_scatter(grads[0], ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor()};
  }
};

// Sequence parallelism's reduce-scatter along dim; backward: all-gather.
struct Scatter : torch::autograd::Function<Scatter> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, int64_t group, int64_t dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["dim"] = dim;
    return reinterpret_cast<Group*>(group)->reduce_scatter(x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {group_of(ctx)->all_gather(grads[0], ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor()};
  }
};

// Note [Overlapped input gradient]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A column-parallel Linear's backward needs two products of the output gradient dy: the
// input gradient dy W (a partial sum, to be summed over the group: copy's backward, or
// reduce-scattered along the sequence: gather's) and the weight gradient dy^T x. The
// second does not need the first's sum, so, as Megatron's
// LinearWithGradAccumulationAndAsyncCommunication does, the sum starts on the
// communicator's progress thread as soon as dy W is computed, and dy^T x (and the bias
// gradient) run meanwhile; the backward waits only before it returns. The arithmetic is
// the unfused layer's: the same products, the same sum. The forward's collectives have
// nothing to overlap with (the next op needs their result), so they are not fused.
struct ColumnLinear : torch::autograd::Function<ColumnLinear> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, at::Tensor w, at::Tensor b, int64_t group,
                            int64_t seq_dim) {
    Group* g = reinterpret_cast<Group*>(group);
    const at::Tensor input = seq_dim >= 0 ? g->all_gather(x, seq_dim) : x;
    ctx->saved_data["group"] = group;
    ctx->saved_data["seq_dim"] = seq_dim;
    ctx->saved_data["bias"] = b.defined();
    ctx->save_for_backward({input, w});
    return at::linear(input, w, b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Group* g = group_of(ctx);
    const int64_t seq_dim = ctx->saved_data["seq_dim"].toInt();
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor dy = grads[0].contiguous();
    // Under autocast the forward multiplied in dy's dtype (bf16); each gradient goes back
    // in its tensor's own dtype, as autocast's casts would hand it back.
    const at::ScalarType dt = dy.scalar_type();
    // A zero-bubble pipeline asks for the input's gradient (B) and the weights' (W) in two
    // passes (Note [B and W on the autograd graph]): each computes only its own.
    at::Tensor dx, out;
    collectives::WorkPtr work;
    if (ctx->needs_input_grad(0)) {
      dx = dy.matmul(w.to(dt)).to(input.scalar_type());  // this rank's share of the input gradient
      work = seq_dim >= 0 ? g->start_reduce_scatter(dx, seq_dim, out) : g->start_allreduce(dx);
    }
    // Meanwhile: the weight's (and bias') gradients, from this rank's own products.
    const at::Tensor dy2 = dy.reshape({-1, dy.size(-1)});
    at::Tensor dw, db;
    if (ctx->needs_input_grad(1)) dw = dy2.t().mm(input.reshape({-1, input.size(-1)}).to(dt)).to(w.scalar_type());
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) db = dy2.sum(0).to(w.scalar_type());
    if (work) {
      work->wait();
      if (seq_dim >= 0) dx = out.movedim(0, seq_dim).contiguous();
    }
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

int64_t handle(Group* g) { return reinterpret_cast<int64_t>(g); }

at::Tensor Group::column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t seq_dim) {
  if (!overlap_ || size() == 1) return TensorGroup::column_linear(x, w, b, seq_dim);
  return ColumnLinear::apply(x, w, b, handle(this), seq_dim < 0 ? -1 : seq_dim);
}

at::Tensor Group::copy(const at::Tensor& x) { return size() == 1 ? x : Copy::apply(x, handle(this)); }
at::Tensor Group::reduce(const at::Tensor& x) { return size() == 1 ? x : Reduce::apply(x, handle(this)); }
at::Tensor Group::gather(const at::Tensor& x, int64_t dim) {
  return size() == 1 ? x : Gather::apply(x, handle(this), dim < 0 ? dim + x.dim() : dim);
}
at::Tensor Group::scatter(const at::Tensor& x, int64_t dim) {
  return size() == 1 ? x : Scatter::apply(x, handle(this), dim < 0 ? dim + x.dim() : dim);
}

}  // namespace

std::shared_ptr<core::TensorGroup> tensor_group(collectives::CommunicatorPtr comm, collectives::Duration timeout,
                                                bool overlap) {
  return std::make_shared<Group>(std::move(comm), timeout, overlap);
}

}  // namespace tetra::tensor_parallel
