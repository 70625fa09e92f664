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
  Group(collectives::CommunicatorPtr comm, collectives::Duration timeout)
      : comm_(std::move(comm)), timeout_(timeout) {
    TETRA_CHECK(comm_ != nullptr, "tensor_group: no communicator");
  }
  int size() const override { return comm_->size(); }
  int rank() const override { return comm_->rank(); }
  at::Tensor copy(const at::Tensor& x) override;
  at::Tensor reduce(const at::Tensor& x) override;
  at::Tensor gather(const at::Tensor& x, int64_t dim) override;
  at::Tensor scatter(const at::Tensor& x, int64_t dim) override;
  void allreduce(at::Tensor& t, collectives::ReduceOp op) override {
    collectives::AllreduceOptions o;
    o.op = op;
    o.timeout = timeout_;
    comm_->allreduce(t, o)->wait();
  }

  // The sum over the group, out of place.
  at::Tensor sum(const at::Tensor& x) {
    at::Tensor out = x.contiguous().clone();
    collectives::AllreduceOptions o;
    o.timeout = timeout_;
    comm_->allreduce(out, o)->wait();
    return out;
  }
  // The blocks of every rank stacked along dim (this rank's at rank()).
  at::Tensor all_gather(const at::Tensor& x, int64_t dim) {
    at::Tensor front = x.movedim(dim, 0).contiguous();
    std::vector<int64_t> sizes = front.sizes().vec();
    sizes[0] *= size();
    at::Tensor out = at::empty(sizes, front.options());
    collectives::AllgatherOptions o;
    o.timeout = timeout_;
    comm_->allgather(front, out, o)->wait();
    return out.movedim(0, dim).contiguous();
  }
  // The sum over the group of x, this rank's block of it along dim.
  at::Tensor reduce_scatter(const at::Tensor& x, int64_t dim) {
    const int64_t n = x.size(dim);
    TETRA_CHECK(n % size() == 0, comm_->name(), ": ", size(), " tensor-parallel ranks do not divide dimension ",
                dim, " of ", x.sizes());
    at::Tensor front = x.movedim(dim, 0).contiguous();
    std::vector<int64_t> sizes = front.sizes().vec();
    sizes[0] /= size();
    at::Tensor out = at::empty(sizes, front.options());
    collectives::ReduceScatterOptions o;
    o.timeout = timeout_;
    comm_->reduce_scatter(front, out, o)->wait();
    return out.movedim(0, dim).contiguous();
  }

 private:
  collectives::CommunicatorPtr comm_;
  collectives::Duration timeout_;
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

int64_t handle(Group* g) { return reinterpret_cast<int64_t>(g); }

at::Tensor Group::copy(const at::Tensor& x) { return size() == 1 ? x : Copy::apply(x, handle(this)); }
at::Tensor Group::reduce(const at::Tensor& x) { return size() == 1 ? x : Reduce::apply(x, handle(this)); }
at::Tensor Group::gather(const at::Tensor& x, int64_t dim) {
  return size() == 1 ? x : Gather::apply(x, handle(this), dim < 0 ? dim + x.dim() : dim);
}
at::Tensor Group::scatter(const at::Tensor& x, int64_t dim) {
  return size() == 1 ? x : Scatter::apply(x, handle(this), dim < 0 ? dim + x.dim() : dim);
}

}  // namespace

std::shared_ptr<core::TensorGroup> tensor_group(collectives::CommunicatorPtr comm, collectives::Duration timeout) {
  return std::make_shared<Group>(std::move(comm), timeout);
}

}  // namespace tetra::tensor_parallel
