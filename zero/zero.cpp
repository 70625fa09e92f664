#include "zero/zero.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <sstream>
#include <unordered_map>

#include "collectives/error.h"
#include "core/bucketer.h"
#include "core/fields.h"
#include "core/models.h"
#include "core/telemetry.h"
#include "hardware/topology.h"

namespace tetra::zero {

using hardware::ByteDigits;
using hardware::format_bytes;

namespace {

using collectives::AllgatherOptions;
using collectives::CommunicatorPtr;
using collectives::ReduceOp;
using collectives::ReduceScatterOptions;
using collectives::WorkPtr;
using core::GradientBuckets;

// Every unit is padded to a multiple of N x kAlign elements: each rank's chunk then starts
// on a 64-byte boundary (fp32) and every rank owns exactly the same number of elements.
constexpr int64_t kAlign = 16;
// Stage 1's staging chunks: one filling while one is on the wire.
constexpr int kPoolSize = 2;
// Stages 2 and 3: whole units of gradients on their way to the reduce-scatter. One: a
// unit's gradients wait for the one before to leave (its reduce-scatter runs while the
// next layer's backward computes, and is done by the time that layer's gradients are);
// each more would be a whole unit of memory, the largest layer's, on every rank.
constexpr int kGradPool = 1;

int64_t storage_bytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
}

// Points a buffer's storage at `bytes` (or at nothing) and keeps the tensor and every view
// of it (FSDP's "free the unsharded flat parameter"): the parameters that view it keep
// their shapes, and autograd's saved references see the values again once the bytes come
// back. The bytes come from a pool that outlives the views' use: a gather into the same
// memory as last time costs nothing to map, where fresh memory made each all-gather 10x
// slower here (both ranks faulting in, and Open MPI's shared-memory path attaching, new
// pages on every op).
void point_storage(const at::Tensor& t, void* bytes) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  // Not owning (the pool frees it), on the tensor's device: a CUDA unit's bytes are the GPU's.
  s->set_data_ptr(at::DataPtr(bytes, t.device()));
  s->set_nbytes(bytes ? static_cast<size_t>(t.numel()) * t.element_size() : 0);
}

// A flat tensor of n elements with no bytes behind it (point_storage lends it some):
// ZeRO-3's whole unit, of which a rank holds only its chunk. Its storage claims the size
// (null data) until point_storage says otherwise, so that views of it can be cut first.
at::Tensor unallocated(int64_t n, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options);
  t.storage().unsafeGetStorageImpl()->set_nbytes(static_cast<size_t>(n) * t.element_size());
  t.unsafeGetTensorImpl()->set_sizes_contiguous({n});
  return t;
}

class Zero;

// Identity on the way forward; on the way back it runs before the wrapped layer's own
// backward (the gradient of the layer's output arrives here first), which is when ZeRO-3
// gathers that layer's parameters again.
struct BeforeLayerBackward : torch::autograd::Function<BeforeLayerBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, int64_t owner, int64_t unit) {
    ctx->saved_data["owner"] = owner;
    ctx->saved_data["unit"] = unit;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

// A layer of the model's sequence under ZeRO-3. It registers the wrapped layer's own
// parameters, buffers and children under their own names, so the model's names stay
// the single-process names ("3.weight", "2.attn.qkv.weight").
class GatheredLayerImpl : public torch::nn::Module {
 public:
  GatheredLayerImpl(torch::nn::AnyModule inner, Zero* owner, int unit)
      : torch::nn::Module("ZeroGathered"), inner_(std::move(inner)), owner_(owner), unit_(unit) {
    auto m = inner_.ptr();
    for (const auto& c : m->named_children()) register_module(c.key(), c.value());
    for (const auto& p : m->named_parameters(false)) register_parameter(p.key(), p.value(), p.value().requires_grad());
    for (const auto& b : m->named_buffers(false)) register_buffer(b.key(), b.value());
  }
  at::Tensor forward(at::Tensor x);
  // The wrapped module is not a child (its children are): pass train/eval on to it.
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    inner_.ptr()->train(on);
  }
  void pretty_print(std::ostream& os) const override {
    os << "ZeroGathered(";
    inner_.ptr()->pretty_print(os);
    os << ")";
  }

 private:
  torch::nn::AnyModule inner_;
  Zero* owner_;
  int unit_;
};
TORCH_MODULE(GatheredLayer);

class Zero final : public core::Strategy, public core::ModelStateOwner {
 public:
  explicit Zero(Options o) : opt_(std::move(o)), parts_(Parts::of(opt_.stage)) {}
  ~Zero() override {
    try {
      drain();
      for (auto& u : units_)
        if (u.work) u.work->wait();
    } catch (...) {
    }
  }
  std::string name() const override { return "zero"; }

  void attach(core::TrainState& state) override;
  void before_backward(bool last) override { sync_ = last; }
  void finish_gradients() override;
  double reduce_grad_norm_sq(double local) override {
    if (!host_) return local;
    at::Tensor t = at::full({1}, local, at::kDouble);
    host_->allreduce(t, sum_opts())->wait();
    return t.item<double>();
  }

  // ModelStateOwner
  void zero_grad() override;
  double grad_norm_sq() override;
  void scale_gradients(double factor) override;
  std::vector<std::string> nonfinite_gradients() override;
  void step(double lr) override;
  void save_state(core::Checkpoint& ckpt) override;
  void load_state(const core::CheckpointReader& reader) override;
  void gather_parameters(core::TensorMap& out) override;
  core::ModelStateBytes memory() const override;

  // ZeRO-3, from the layer wrappers.
  at::Tensor run_layer(int unit, torch::nn::AnyModule& inner, const at::Tensor& x);
  void before_layer_backward(int unit);

 private:
  enum class Held { kFree, kGathering, kGathered };
  struct Unit {
    int64_t shard_offset = 0;  // where this rank's chunk lives in the shard buffers
    int64_t chunk = 0;         // padded / N
    at::Tensor full;           // the whole unit's parameters (stage 3: bytes only while gathered)
    at::Tensor full_grad;      // stage 1: the whole unit's gradients (.grad views)
    Held held = Held::kGathered;
    WorkPtr work;              // stage 3: the gather in flight
    at::Tensor gathered_in;    // stage 3: the pool buffer its bytes live in while gathered
    bool launched = false;     // its reduce-scatter was issued this step
  };
  // A few flat buffers that ops borrow in turn; borrowing waits for the oldest op.
  struct Pool {
    std::vector<at::Tensor> buffers;
    std::vector<WorkPtr> works;
    std::vector<std::function<void()>> after;
    size_t next = 0;
  };

  collectives::AllreduceOptions sum_opts() const {
    collectives::AllreduceOptions o;
    o.timeout = timeout_;
    return o;
  }
  at::Tensor param_chunk(int u) {
    Unit& un = units_[u];
    return parts_.parameters ? param_shard_.narrow(0, un.shard_offset, un.chunk)
                           : un.full.narrow(0, rank_ * un.chunk, un.chunk);
  }
  at::Tensor grad_chunk(int u) {
    Unit& un = units_[u];
    return !parts_.gradients ? un.full_grad.narrow(0, rank_ * un.chunk, un.chunk)
                           : grad_shard_.narrow(0, un.shard_offset, un.chunk);
  }
  // Borrows buffer i of `pool` (waiting for the op that last used it).
  int borrow(Pool& pool);
  void settle(Pool& pool, int i);
  void drain();
  void on_ready(int slot);
  void reduce(int u);
  void gather(int u);
  void issue_gather(int u);
  void release(int u);
  void wrap_layers(core::TrainState& state, const std::vector<int>& unit_layer);
  // For each parameter of unit u: [a, b) the part of it inside this rank's chunk, in the
  // parameter's flattened elements, and where that part starts in the chunk.
  struct Piece {
    int slot;
    int64_t begin, count, chunk_pos;
  };
  std::vector<Piece> pieces(int u) const;
  // The optimizer state's flat shard buffers by their checkpoint suffix (undefined when
  // the optimizer keeps no such slot).
  std::vector<std::pair<std::string, at::Tensor>> optimizer_slots() const {
    return {{"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}, {"momentum", momentum_}};
  }

  // Under tensor parallelism (Note [ZeRO over tensor slices]): a parameter split over the
  // tensor group, nullptr when it is whole.
  const core::Placement* split_of(const core::NamedParam& p) const {
    const core::Placement* at = weights_ ? weights_->placement(p.name) : nullptr;
    return at && at->is_split() ? at : nullptr;
  }
  void save_split(core::Checkpoint& ckpt, int u);

  Options opt_;
  Parts parts_;  // what is sharded (Note [ZeRO's parts]): the code asks these, not the stage
  const core::Materializer* weights_ = nullptr;
  CommunicatorPtr tensor_comm_;  // the tensor axis' group (null without one)
  int tensor_rank_ = 0;
  const core::JobSpec* spec_ = nullptr;
  core::Trace* trace_ = nullptr;
  CommunicatorPtr comm_, gather_comm_;
  CommunicatorPtr host_;  // the data axis' host plane (Note [Two planes])
  at::TensorOptions options_;  // the units' dtype on this rank's device (Note [One device])
  collectives::Duration timeout_ = collectives::kDefaultTimeout;
  int rank_ = 0, size_ = 1;
  bool sync_ = false;
  GradientBuckets buckets_;
  std::vector<Unit> units_;
  int64_t shard_numel_ = 0;
  at::Tensor param_shard_, grad_shard_;   // stage 3 / stages 2 and 3
  at::Tensor exp_avg_, exp_avg_sq_, momentum_;
  Pool grad_pool_;     // stages 2, 3: whole unit gradients on their way to the reduce-scatter
  Pool staging_pool_;  // stage 1: a reduce-scatter's chunk on its way into the gradient
  // Stage 3: buffers (of the largest unit) that gathered units borrow; grows to the most
  // ever gathered at once (the running layer, its prefetches, one on its way back).
  std::vector<at::Tensor> gather_free_;
  int64_t gather_buffers_ = 0;
  int64_t steps_ = 0;
};

at::Tensor GatheredLayerImpl::forward(at::Tensor x) { return owner_->run_layer(unit_, inner_, x); }

torch::autograd::variable_list BeforeLayerBackward::backward(torch::autograd::AutogradContext* ctx,
                                                             torch::autograd::variable_list grads) {
  auto* owner = reinterpret_cast<Zero*>(ctx->saved_data["owner"].toInt());
  owner->before_layer_backward(static_cast<int>(ctx->saved_data["unit"].toInt()));
  return {grads[0], at::Tensor(), at::Tensor()};
}

// ---- attach ----------------------------------------------------------------------------

void Zero::attach(core::TrainState& state) {
  spec_ = &state.spec;
  trace_ = &state.trace;
  weights_ = state.weights;
  if (state.mesh && state.mesh->size("tensor") > 1) {
    tensor_comm_ = state.mesh->axis("tensor");
    tensor_rank_ = tensor_comm_->rank();
  }
  timeout_ = collectives::Duration(static_cast<int64_t>(state.spec.collectives.timeout_s * 1000));
  if (state.mesh && state.mesh->size("data") > 1) {
    comm_ = state.mesh->axis("data");
    rank_ = comm_->rank();
    size_ = comm_->size();
    host_ = state.mesh->host("data");  // Note [Two planes]: the norm's partial sums
    core::check_same_job(*host_, state, "zero");
    core::broadcast_from_first(*comm_, state);
    // Stage 3's gathers get a communicator (and progress thread) of their own, so a
    // prefetch never queues behind a gradient reduce-scatter.
    if (parts_.parameters) gather_comm_ = comm_->split(0, rank_, comm_->name() + " / zero gathers");
  }
  at::NoGradGuard no_grad;
  const int64_t pad = size_ * kAlign;
  std::vector<int> unit_layer;
  if (parts_.parameters) {
    // One unit per layer of the sequence that has parameters, in forward order.
    std::unordered_map<const void*, const core::NamedParam*> by_impl;
    for (const auto& p : state.params) by_impl[p.tensor.unsafeGetTensorImpl()] = &p;
    std::vector<std::vector<core::NamedParam>> groups;
    int index = 0;
    for (const auto& layer : *state.model) {
      std::vector<core::NamedParam> group;
      for (const auto& t : layer.ptr()->parameters()) {
        auto it = by_impl.find(t.unsafeGetTensorImpl());
        TETRA_CHECK(it != by_impl.end(), "zero: a parameter of layer ", index, " is not among the trained parameters");
        group.push_back(*it->second);
      }
      if (!group.empty()) unit_layer.push_back(index);
      groups.push_back(std::move(group));
      ++index;
    }
    buckets_ = GradientBuckets::by_groups(groups, pad);
  } else {
    buckets_ = GradientBuckets::by_size(state.params, static_cast<int64_t>(opt_.bucket_mb * 1024 * 1024), pad);
  }
  auto& bks = buckets_.buckets();
  if (bks.empty()) throw ConfigError("zero: the model has no parameters to train");
  const at::ScalarType dtype = bks.front().dtype;
  for (const auto& b : bks)
    if (b.dtype != dtype)
      throw ConfigError("zero: the parameters have several dtypes; ZeRO shards one dtype (they are " +
                        std::string(c10::toString(dtype)) + " and " + c10::toString(b.dtype) + ")");
  const auto options = at::TensorOptions().dtype(dtype).device(state.device);  // Note [One device]
  options_ = options;

  // The flat layout: every unit a flat buffer the unit's parameters are views of, this
  // rank's chunks back to back in the shard buffers. The parameters arrive as shapes (Note
  // [Layout-invariant initialisation]) and are created here, in their final place: stages
  // 1 and 2 draw each unit whole; stage 3 draws only this rank's chunk of each unit, into
  // its shard, and the unit's buffer gets bytes only while the unit is gathered. A
  // program's model that came with its values is copied in the same way.
  units_.resize(bks.size());
  for (size_t u = 0; u < bks.size(); ++u) {
    units_[u].chunk = bks[u].padded / size_;
    units_[u].shard_offset = shard_numel_;
    shard_numel_ += units_[u].chunk;
  }
  if (parts_.parameters) param_shard_ = at::zeros({shard_numel_}, options);  // the padding stays zero
  for (size_t u = 0; u < bks.size(); ++u) {
    Unit& un = units_[u];
    if (parts_.parameters) {
      un.full = unallocated(bks[u].padded, options);
      at::Tensor chunk = param_chunk(static_cast<int>(u));
      for (const Piece& pc : pieces(static_cast<int>(u)))
        state.weights->fill(buckets_.slots()[pc.slot].param, pc.begin, chunk.narrow(0, pc.chunk_pos, pc.count));
      un.held = Held::kFree;
    } else {
      un.full = at::zeros({bks[u].padded}, options);
      for (int s : bks[u].slots) {
        const auto& sl = buckets_.slots()[s];
        state.weights->fill(sl.param, 0, un.full.narrow(0, sl.offset, sl.numel));
      }
    }
    for (int s : bks[u].slots) {
      auto& sl = buckets_.slots()[s];
      core::place(sl.param.tensor, un.full.narrow(0, sl.offset, sl.numel).view(sl.param.tensor.sizes()));
    }
    if (un.held == Held::kFree) point_storage(un.full, nullptr);  // the views are cut: no bytes until gathered
  }
  if (!parts_.gradients) {
    std::vector<at::Tensor> buffers;
    for (auto& un : units_) {
      un.full_grad = at::zeros_like(un.full);
      buffers.push_back(un.full_grad);
    }
    buckets_.bind_views(buffers);
  } else {
    grad_shard_ = at::zeros({shard_numel_}, options);
    for (auto& sl : buckets_.slots()) sl.param.tensor.mutable_grad() = at::Tensor();
    for (int i = 0; i < kGradPool; ++i) grad_pool_.buffers.push_back(at::empty({buckets_.max_padded()}, options));
  }
  if (!parts_.gradients && size_ > 1) {
    int64_t max_chunk = 0;
    for (auto& un : units_) max_chunk = std::max(max_chunk, un.chunk);
    for (int i = 0; i < kPoolSize; ++i) staging_pool_.buffers.push_back(at::empty({max_chunk}, options));
  }
  for (Pool* p : {&grad_pool_, &staging_pool_}) {
    p->works.resize(p->buffers.size());
    p->after.resize(p->buffers.size());
  }
  const auto& o = state.spec.optimizer;
  if (o.type != "sgd") {
    exp_avg_ = at::zeros({shard_numel_}, options);
    exp_avg_sq_ = at::zeros({shard_numel_}, options);
  } else if (o.momentum != 0) {
    momentum_ = at::zeros({shard_numel_}, options);
  }
  buckets_.hook([this](int s) { on_ready(s); });
  if (parts_.parameters) wrap_layers(state, unit_layer);
}

void Zero::wrap_layers(core::TrainState& state, const std::vector<int>& unit_layer) {
  torch::nn::Sequential wrapped;
  auto names = state.model->named_children();
  size_t u = 0;
  int index = 0;
  for (auto& layer : *state.model) {
    const std::string& name = names[index].key();
    if (u < unit_layer.size() && unit_layer[u] == index) {
      wrapped->push_back(std::string(name), GatheredLayer(layer, this, static_cast<int>(u)));
      ++u;
    } else {
      wrapped->push_back(std::string(name), layer);
    }
    ++index;
  }
  if (!state.model->is_training()) wrapped->eval();
  state.model = wrapped;
}

// ---- stage 3: gathering layers -----------------------------------------------------------

void Zero::issue_gather(int u) {
  Unit& un = units_[u];
  if (gather_free_.empty()) {
    gather_free_.push_back(at::empty({buckets_.max_padded()}, options_));
    ++gather_buffers_;
  }
  un.gathered_in = gather_free_.back();
  gather_free_.pop_back();
  point_storage(un.full, un.gathered_in.data_ptr());
  at::Tensor mine = param_shard_.narrow(0, un.shard_offset, un.chunk);
  if (!gather_comm_) {
    un.full.copy_(mine);
    un.held = Held::kGathered;
    return;
  }
  AllgatherOptions o;
  o.timeout = timeout_;
  un.work = gather_comm_->allgather(mine, un.full, o);
  un.held = Held::kGathering;
}

void Zero::gather(int u) {
  Unit& un = units_[u];
  if (un.held == Held::kFree) issue_gather(u);
  if (un.held == Held::kGathering) {
    un.work->wait();
    un.work.reset();
    un.held = Held::kGathered;
  }
}

void Zero::release(int u) {
  Unit& un = units_[u];
  if (!parts_.parameters || un.held == Held::kFree) return;
  if (un.work) {  // never free bytes an op is still writing
    un.work->wait();
    un.work.reset();
  }
  point_storage(un.full, nullptr);
  gather_free_.push_back(std::move(un.gathered_in));
  un.held = Held::kFree;
}

at::Tensor Zero::run_layer(int u, torch::nn::AnyModule& inner, const at::Tensor& x) {
  gather(u);
  for (int k = 1; k <= opt_.prefetch && u + k < static_cast<int>(units_.size()); ++k)
    if (units_[u + k].held == Held::kFree) issue_gather(u + k);
  at::Tensor y = inner.forward(x);
  const bool backward_follows = at::GradMode::is_enabled() && y.requires_grad();
  if (backward_follows)
    y = BeforeLayerBackward::apply(y, reinterpret_cast<int64_t>(this), static_cast<int64_t>(u));
  // The last layer's backward is the next thing to run: freeing it would gather it again
  // at once. It stays until its gradients are taken.
  if (!(backward_follows && u == static_cast<int>(units_.size()) - 1)) release(u);
  return y;
}

void Zero::before_layer_backward(int u) {
  gather(u);
  for (int k = 1; k <= opt_.prefetch && u - k >= 0; ++k)
    if (units_[u - k].held == Held::kFree) issue_gather(u - k);
}

// ---- gradients -------------------------------------------------------------------------

int Zero::borrow(Pool& pool) {
  const int i = static_cast<int>(pool.next++ % pool.buffers.size());
  settle(pool, i);
  return i;
}

void Zero::settle(Pool& pool, int i) {
  if (pool.works[i]) {
    pool.works[i]->wait();
    pool.works[i].reset();
  }
  if (pool.after[i]) {
    auto fn = std::move(pool.after[i]);
    pool.after[i] = nullptr;
    fn();
  }
}

void Zero::drain() {
  for (Pool* p : {&grad_pool_, &staging_pool_})
    for (size_t i = 0; i < p->buffers.size(); ++i) settle(*p, static_cast<int>(i));
}

void Zero::on_ready(int slot) {
  const int u = buckets_.slots()[slot].bucket;
  // Stages 1 and 2 act only on the step's last backward (the others accumulate); stage 3
  // also frees a layer after each backward.
  if (!parts_.parameters && (!sync_ || !opt_.overlap)) return;
  if (!parts_.gradients) buckets_.bind(slot);
  if (!buckets_.mark(slot)) return;
  // The unit's gradients are complete for this backward.
  at::NoGradGuard no_grad;
  if (sync_ && (opt_.overlap || parts_.parameters)) reduce(u);
  if (parts_.parameters && !sync_) {
    buckets_.reset_bucket(u);
    release(u);
  }
}

// The unit's average gradient lands in this rank's chunk.
void Zero::reduce(int u) {
  Unit& un = units_[u];
  if (un.launched) return;
  un.launched = true;
  ReduceScatterOptions o;
  o.op = ReduceOp::kAvg;
  o.timeout = timeout_;
  if (!parts_.gradients) {
    if (!comm_) return;  // one rank: the whole gradient is the chunk
    // Into a staging buffer (a reduce-scatter cannot write inside its own input), then
    // into the chunk of the unit's gradient that this rank steps.
    const int i = borrow(staging_pool_);
    at::Tensor out = staging_pool_.buffers[i].narrow(0, 0, un.chunk);
    staging_pool_.works[i] = comm_->reduce_scatter(un.full_grad, out, o);
    staging_pool_.after[i] = [this, u, out] { grad_chunk(u).copy_(out); };
    return;
  }
  const int i = borrow(grad_pool_);
  const auto& b = buckets_.buckets()[u];
  at::Tensor flat = grad_pool_.buffers[i].narrow(0, 0, b.padded);
  buckets_.take_gradients(u, flat);
  if (parts_.parameters) release(u);  // its backward is over
  if (!comm_) {
    grad_chunk(u).copy_(flat);
    return;
  }
  grad_pool_.works[i] = comm_->reduce_scatter(flat, grad_chunk(u), o);
}

void Zero::finish_gradients() {
  sync_ = false;
  at::NoGradGuard no_grad;
  // Units not yet on their way: overlap off, or parameters that got no gradient.
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].launched) continue;
    if (!parts_.gradients)
      for (int s : buckets_.buckets()[u].slots) buckets_.bind(s);
    reduce(static_cast<int>(u));
  }
  drain();
  for (size_t u = 0; u < units_.size(); ++u) {
    units_[u].launched = false;
    release(static_cast<int>(u));
  }
  buckets_.reset();
}

void Zero::zero_grad() {
  at::NoGradGuard no_grad;
  if (!parts_.gradients) {
    for (auto& un : units_) un.full_grad.zero_();
    for (size_t s = 0; s < buckets_.slots().size(); ++s) buckets_.bind(static_cast<int>(s));
  } else {
    for (auto& sl : buckets_.slots()) sl.param.tensor.mutable_grad() = at::Tensor();
  }
}

double Zero::grad_norm_sq() {
  at::NoGradGuard no_grad;
  double sq = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    at::Tensor chunk = grad_chunk(static_cast<int>(u));
    if (!tensor_comm_) {
      const double n = chunk.norm().item<double>();
      sq += n * n;
      continue;
    }
    // Every tensor rank holds a whole parameter: its gradient counts on tensor rank 0 only
    // (the strategy's reduce_grad_norm_sq sums the group), a split one's part on each.
    for (const Piece& pc : pieces(static_cast<int>(u))) {
      if (tensor_rank_ != 0 && !split_of(buckets_.slots()[pc.slot].param)) continue;
      const double n = chunk.narrow(0, pc.chunk_pos, pc.count).norm().item<double>();
      sq += n * n;
    }
  }
  return sq;
}

void Zero::scale_gradients(double factor) {
  at::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) grad_chunk(static_cast<int>(u)).mul_(factor);
}

std::vector<std::string> Zero::nonfinite_gradients() {
  at::NoGradGuard no_grad;
  // One sum over the gradients this rank owns first: a NaN or an infinity anywhere makes
  // it non-finite (so may finite values that overflow it; the exact pass clears those).
  double total = 0;
  if (!parts_.gradients) {
    std::vector<at::Tensor> sums;
    for (size_t u = 0; u < units_.size(); ++u) sums.push_back(grad_chunk(static_cast<int>(u)).sum());
    if (!sums.empty()) total = at::stack(sums).sum().item<double>();
  } else if (grad_shard_.defined()) {
    total = grad_shard_.sum().item<double>();
  }
  std::vector<std::string> out;
  if (std::isfinite(total)) return out;
  for (size_t k = 0; k < units_.size(); ++k) {
    const int u = static_cast<int>(k);
    at::Tensor grads = grad_chunk(u);
    for (const Piece& pc : pieces(u))
      if (!at::isfinite(grads.narrow(0, pc.chunk_pos, pc.count)).all().item<bool>())
        out.push_back(buckets_.slots()[pc.slot].param.name);
  }
  return out;
}

void Zero::step(double lr) {
  at::NoGradGuard no_grad;
  ++steps_;
  std::vector<WorkPtr> gathers;
  for (size_t k = 0; k < units_.size(); ++k) {
    const int u = static_cast<int>(k);
    Unit& un = units_[u];
    core::UpdateSlots slots;
    if (exp_avg_.defined()) {
      slots.exp_avg = exp_avg_.narrow(0, un.shard_offset, un.chunk);
      slots.exp_avg_sq = exp_avg_sq_.narrow(0, un.shard_offset, un.chunk);
    }
    if (momentum_.defined()) {
      slots.momentum = momentum_.narrow(0, un.shard_offset, un.chunk);
      slots.fresh_momentum = steps_ == 1;
    }
    at::Tensor p = param_chunk(u);
    core::fused_update(spec_->optimizer, lr, steps_, p, grad_chunk(u), slots);
    if (parts_.parameters || !comm_) continue;
    // Every rank's updated chunk into every rank's whole parameters, in place (the chunk
    // is this rank's part of the unit), while the next unit steps.
    AllgatherOptions o;
    o.timeout = timeout_;
    gathers.push_back(comm_->allgather(p, un.full, o));
  }
  for (auto& w : gathers) w->wait();
}

// ---- checkpoints -----------------------------------------------------------------------

std::vector<Zero::Piece> Zero::pieces(int u) const {
  std::vector<Piece> out;
  const auto& b = buckets_.buckets()[u];
  const int64_t lo = rank_ * units_[u].chunk, hi = lo + units_[u].chunk;
  for (int s : b.slots) {
    const auto& sl = buckets_.slots()[s];
    const int64_t a = std::max(lo, sl.offset), e = std::min(hi, sl.offset + sl.numel);
    if (a < e) out.push_back({s, a - sl.offset, e - a, a - lo});
  }
  return out;
}

// Note [ZeRO over tensor slices]
// Under tensor parallelism ZeRO shards each tensor slice's parameters over its data ranks:
// a split parameter's flat buffer holds this rank's part (Note [Placements]), and the
// same chunk of it on every tensor rank of the slice. Whole parameters (the norms, the
// positions) are on every tensor rank; their gradients count once in the norm. A
// checkpoint stays layout-free: a whole parameter's shards are written by tensor rank 0's
// slice, and a split one is assembled (its chunks over the data ranks, then its parts
// over the tensor group; one parameter at a time) and written as D x T contiguous
// ranges of the whole tensor, one per rank of the slice's ranks, so every rank writes its
// share and nobody holds the whole model. A resume reads each whole tensor its pieces
// come from and takes its part of it.
void Zero::save_split(core::Checkpoint& ckpt, int u) {
  const auto& bucket = buckets_.buckets()[u];
  bool any = false;
  for (int s : bucket.slots) any = any || split_of(buckets_.slots()[s].param);
  if (!any) return;  // the same on every rank of the slice: the layouts are equal
  const Unit& un = units_[u];
  // The unit's flat buffer of parameters, and of each optimizer slot, whole over the data ranks.
  auto full = [&](const at::Tensor& chunk) {
    if (!comm_) return chunk.clone();
    at::Tensor out = chunk.new_empty({un.chunk * size_});
    AllgatherOptions o;
    o.timeout = timeout_;
    comm_->allgather(chunk.contiguous(), out, o)->wait();
    return out;
  };
  std::vector<std::pair<std::string, at::Tensor>> flats = {{"", full(param_chunk(u))}};
  for (const auto& [key, t] : optimizer_slots())
    if (t.defined()) flats.push_back({key, full(t.narrow(0, un.shard_offset, un.chunk))});
  const int64_t writers = static_cast<int64_t>(size_) * tensor_comm_->size();
  const int64_t me = static_cast<int64_t>(rank_) * tensor_comm_->size() + tensor_rank_;
  for (int s : bucket.slots) {
    const auto& sl = buckets_.slots()[s];
    const core::Placement* at = split_of(sl.param);
    if (!at) continue;
    for (const auto& [key, flat] : flats) {
      at::Tensor whole = core::gather_whole(*tensor_comm_, *at, flat.narrow(0, sl.offset, sl.numel), timeout_).reshape({-1});
      const int64_t n = whole.numel(), begin = n * me / writers, end = n * (me + 1) / writers;
      if (begin == end) continue;
      const std::string name = key.empty() ? "model/" + sl.param.name : "optim/" + sl.param.name + "." + key;
      ckpt.slices[name] = {at->whole_shape(), begin, whole.narrow(0, begin, end - begin).clone()};
    }
  }
}

void Zero::save_state(core::Checkpoint& ckpt) {
  at::NoGradGuard no_grad;
  const auto state = optimizer_slots();
  for (size_t k = 0; k < units_.size(); ++k) {
    const int u = static_cast<int>(k);
    const Unit& un = units_[u];
    at::Tensor params = param_chunk(u);
    if (tensor_comm_) save_split(ckpt, u);
    for (const Piece& pc : pieces(u)) {
      const auto& sl = buckets_.slots()[pc.slot];
      if (tensor_comm_ && (split_of(sl.param) || tensor_rank_ != 0)) continue;  // above, or tensor rank 0's
      const std::vector<int64_t> shape = sl.param.tensor.sizes().vec();
      ckpt.slices["model/" + sl.param.name] = {shape, pc.begin, params.narrow(0, pc.chunk_pos, pc.count).clone()};
      for (const auto& [key, t] : state)
        if (t.defined())
          ckpt.slices["optim/" + sl.param.name + "." + key] = {
              shape, pc.begin, t.narrow(0, un.shard_offset + pc.chunk_pos, pc.count).clone()};
    }
  }
  if (rank_ == 0) ckpt.tensors["optim/__step__"] = torch::tensor(steps_, torch::kInt64);
}

void Zero::load_state(const core::CheckpointReader& reader) {
  at::NoGradGuard no_grad;
  // Every check first: a mismatch changes nothing.
  int64_t steps = 0;
  if (reader.contains("optim/__step__")) steps = reader.read("optim/__step__").item<int64_t>();
  const auto state = optimizer_slots();
  for (const auto& sl : buckets_.slots()) {
    const core::Placement* at = split_of(sl.param);
    const at::IntArrayRef shape = at ? at::IntArrayRef(at->whole_shape()) : sl.param.tensor.sizes();
    reader.expect_shape("model/" + sl.param.name, shape, "model parameter " + sl.param.name);
    if (steps > 0 && sl.param.tensor.requires_grad())
      for (const auto& [key, t] : state)
        if (t.defined())
          reader.expect_shape("optim/" + sl.param.name + "." + key, shape, "the optimizer state of " + sl.param.name);
  }
  // Elements [begin, begin + count) of what this rank holds of `name` (a split parameter's
  // part: Note [ZeRO over tensor slices]).
  auto read = [&](const std::string& name, const core::NamedParam& p, int64_t begin, int64_t count) {
    const core::Placement* at = split_of(p);
    if (!at) return reader.read_flat(name, begin, count);
    return core::part_of(*at, reader.read(name), p.tensor).reshape({-1}).narrow(0, begin, count);
  };
  for (size_t k = 0; k < units_.size(); ++k) {
    const int u = static_cast<int>(k);
    const Unit& un = units_[u];
    at::Tensor params = param_chunk(u);
    for (const Piece& pc : pieces(u)) {
      const auto& sl = buckets_.slots()[pc.slot];
      params.narrow(0, pc.chunk_pos, pc.count).copy_(read("model/" + sl.param.name, sl.param, pc.begin, pc.count));
      for (const auto& [key, t] : state) {
        if (!t.defined()) continue;
        at::Tensor dst = t.narrow(0, un.shard_offset + pc.chunk_pos, pc.count);
        const std::string name = "optim/" + sl.param.name + "." + key;
        if (reader.contains(name))
          dst.copy_(read(name, sl.param, pc.begin, pc.count));
        else
          dst.zero_();
      }
    }
    if (!parts_.parameters) {
      // Stages 1 and 2 keep the whole parameters: read the rest of them too.
      for (int s : buckets_.buckets()[u].slots) {
        const auto& sl = buckets_.slots()[s];
        const std::string name = "model/" + sl.param.name;
        sl.param.tensor.detach().copy_(read(name, sl.param, 0, sl.numel).view(sl.param.tensor.sizes()));
      }
    }
  }
  steps_ = steps;
}

void Zero::gather_parameters(core::TensorMap& out) {
  at::NoGradGuard no_grad;
  for (size_t k = 0; k < units_.size(); ++k) {
    const int u = static_cast<int>(k);
    const bool was_free = parts_.parameters && units_[u].held == Held::kFree;
    if (parts_.parameters) gather(u);
    if (rank_ == 0)
      for (int s : buckets_.buckets()[u].slots) {
        const auto& sl = buckets_.slots()[s];
        out[sl.param.name] = sl.param.tensor.detach().clone();
      }
    if (was_free) release(u);
  }
}

core::ModelStateBytes Zero::memory() const {
  core::ModelStateBytes m;
  for (const auto& un : units_) {
    if (!parts_.parameters) m.parameters += storage_bytes(un.full);  // stage 3: the gather pool's bytes, below
    m.gradients += storage_bytes(un.full_grad);
  }
  m.parameters += storage_bytes(param_shard_);
  m.gradients += storage_bytes(grad_shard_);
  m.optimizer = storage_bytes(exp_avg_) + storage_bytes(exp_avg_sq_) + storage_bytes(momentum_);
  for (const Pool* p : {&grad_pool_, &staging_pool_})
    for (const auto& b : p->buffers) m.buffers += storage_bytes(b);
  if (gather_buffers_ > 0) m.buffers += gather_buffers_ * buckets_.max_padded() * units_.front().full.element_size();
  return m;
}

}  // namespace

// ---- the job spec ----------------------------------------------------------------------

Parts Parts::of(int stage) { return {stage >= 1, stage >= 2, stage >= 3}; }

std::string Parts::what() const {
  std::string s = optimizer ? "the optimizer state" : "nothing";
  if (gradients) s += ", the gradients";
  if (parameters) s += ", the parameters";
  return s;
}

std::unique_ptr<core::Strategy> Options::build() const { return std::make_unique<Zero>(*this); }

namespace {

// Stage 3: how many gather buffers a run ends up with (Zero::gather_buffers_) — replays
// run_layer and before_layer_backward over `micro` micro-batches one after another, a
// layer's buffer coming back once its gradients are taken (autograd accumulates a
// layer's gradients before it reaches the layer below).
int64_t simulate_gather_buffers(int units, int prefetch, int64_t micro) {
  std::vector<bool> held(static_cast<size_t>(units), false);
  int64_t buffers = 0, free = 0;
  auto issue = [&](int u) {
    if (held[u]) return;
    if (free == 0) ++buffers; else --free;
    held[u] = true;
  };
  auto release = [&](int u) {
    if (!held[u]) return;
    held[u] = false;
    ++free;
  };
  for (int64_t m = 0; m < micro; ++m) {
    for (int u = 0; u < units; ++u) {
      issue(u);
      for (int k = 1; k <= prefetch && u + k < units; ++k) issue(u + k);
      if (u != units - 1) release(u);  // the last layer stays for its backward
    }
    for (int u = units - 1; u >= 0; --u) {
      issue(u);
      for (int k = 1; k <= prefetch && u - k >= 0; ++k) issue(u - k);
      release(u);
    }
  }
  return buffers;
}

// Note [One memory model]: the bytes of a rank's model state as attach() lays it out
// (units of `padded` elements, each split over n ranks) and Zero::memory() counts them;
// what --dry-run prints and the memory tests hold a run to, to the byte. With nothing
// sharded it is what the rank would hold without ZeRO.
core::ModelStateBytes state_bytes(const std::vector<int64_t>& padded, int n, Parts parts, int64_t slots,
                                  int64_t element, int64_t micro, int prefetch) {
  int64_t whole = 0, shard = 0, max_padded = 0, max_chunk = 0;
  for (const int64_t u : padded) {
    whole += u;
    shard += u / n;
    max_padded = std::max(max_padded, u);
    max_chunk = std::max(max_chunk, u / n);
  }
  core::ModelStateBytes m;
  m.parameters = (parts.parameters ? shard : whole) * element;
  m.gradients = (parts.gradients ? shard : whole) * element;
  m.optimizer = slots * (parts.optimizer ? shard : whole) * element;
  if (!parts.optimizer) return m;  // no ZeRO: no buffers of its own
  if (parts.gradients) m.buffers += kGradPool * max_padded * element;      // gradients on their way
  else if (n > 1) m.buffers += kPoolSize * max_chunk * element;            // reduce-scatters' chunks
  if (parts.parameters)
    m.buffers += simulate_gather_buffers(static_cast<int>(padded.size()), prefetch, micro) * max_padded * element;
  return m;
}

}  // namespace

// The layout attach() builds, from the same bucketer, and what memory() then counts.
void Options::estimate(const core::PlanInput& input, core::RankEstimate& rank) const {
  const Parts parts = Parts::of(stage);
  const int n = input.plan.data_ranks();
  const int64_t pad = n * kAlign;
  GradientBuckets layout;
  if (parts.parameters) {  // a unit per layer
    std::vector<std::vector<core::NamedParam>> groups;
    for (int l : rank.layers) groups.push_back(rank.layer_params[static_cast<size_t>(l)]);
    layout = GradientBuckets::by_groups(groups, pad);
  } else {
    layout = GradientBuckets::by_size(rank.params(), static_cast<int64_t>(bucket_mb * 1024 * 1024), pad);
  }
  const auto& units = layout.buckets();
  if (units.empty()) return;
  const int64_t e = static_cast<int64_t>(c10::elementSize(units.front().dtype));
  std::vector<int64_t> padded;
  for (const auto& u : units) padded.push_back(u.padded);
  const auto& o = input.spec.optimizer;
  const int64_t micro = input.plan.micro_batches();
  rank.state = state_bytes(padded, n, parts, core::optimizer_slots(o), e, micro, prefetch);
  rank.updated_elements = 0;  // each rank updates its shard of every unit
  for (int64_t p : padded) rank.updated_elements += p / n;
  if (parts.parameters && input.plan.pipeline_stages() > 1)
    rank.notes.push_back("zero stage 3 under a pipeline: gathers and their buffers counted as if the micro-batches ran one after another");
  if (n == 1) return;  // nothing travels
  collectives::Traffic& t = rank.traffic["data"];
  collectives::Traffic& chained = rank.chained["data"];
  // A reduce-scatter is issued when a unit's backward ends: after compute, it waits for
  // the ranks whose backward ends later.
  for (const auto& u : units) t.record(collectives::Traffic::kReduceScatter, u.padded * e, n);
  // Stage 3 gathers each layer for its forward and again for its backward, but the last,
  // which stays from its forward to its backward; stages 1 and 2 once, after the step.
  // With prefetch, every gather but the forward's first is issued before an earlier
  // layer computes (the backward's first before the last layer's backward), so the ranks'
  // skew is spent computing: chained.
  for (size_t k = 0; k < units.size(); ++k) {
    const int64_t gathers = !parts.parameters ? 1 : k + 1 == units.size() ? micro : 2 * micro;
    for (int64_t g = 0; g < gathers; ++g) {
      t.record(collectives::Traffic::kAllgather, units[k].padded * e, n);
      const bool forward_first = k == 0 && (units.size() == 1 || g % 2 == 0);
      if (parts.parameters && prefetch > 0 && !forward_first)
        chained.record(collectives::Traffic::kAllgather, units[k].padded * e, n);
    }
  }
  if (o.clip_grad_norm > 0) t.record(collectives::Traffic::kAllreduce, 8, n);  // the gradient norm's part
}

std::string Options::plan(const core::PlanInput& input) const {
  const int n = input.plan.data_ranks();
  const int pp = input.plan.pipeline_stages();
  const int64_t psi = core::parameter_count(*input.model);
  const Parts parts = Parts::of(stage);
  std::ostringstream os;
  os << "zero: stage " << stage << " over " << n << " data rank" << (n == 1 ? "" : "s");
  if (n == 1) os << " (one data rank: nothing to shard, every rank holds the whole state)";
  if (!parts.parameters)
    os << ", reduce-scatter units of " << bucket_mb << " MiB" << (overlap ? " during backward" : " after backward");
  else
    os << ", a unit per layer, " << prefetch << " layer" << (prefetch == 1 ? "" : "s") << " prefetched";
  os << "\n";
  // The exact bytes, units padded as the run pads them, are the estimate's (below); this
  // line is what sharding saves, at a glance.
  const core::ModelStateBytes whole = state_bytes({psi / pp}, n, Parts{}, core::optimizer_slots(input.spec.optimizer), 4, 1, 0);
  os << "  model state per rank: in the estimate below; without ZeRO each rank would hold parameters "
     << format_bytes(whole.parameters, ByteDigits::kWhole) << " + gradients "
     << format_bytes(whole.gradients, ByteDigits::kWhole) << " + optimizer state "
     << format_bytes(whole.optimizer, ByteDigits::kWhole) << (pp > 1 ? " (a stage's share)" : "") << "\n";
  os << "  communication buffers: " << (parts.gradients ? "a unit (gradients on their way)" : "2 chunks of a unit")
     << (parts.parameters ? ", and the layers gathered at the moment (1 + prefetch)" : "") << "\n";
  return os.str();
}

core::StrategyRole Options::role(const core::JobSpec&) const {
  core::StrategyRole r;
  r.axis = "data";
  r.why = "shards " + Parts::of(stage).what() + " over the data group (stage " + std::to_string(stage) + ")";
  r.syncs_gradients = true;
  r.owns_model_state = true;
  r.needs_group = true;
  r.needs_group_key = "zero.stage";
  return r;
}

namespace {

// The `zero` section's keys, declared once (Note [Fields declared once], core/fields.h).
template <class V>
void zero_fields(V& v, Options& o) {
  v.integer("stage", o.stage, 0, 3, core::fields::kAlways);
  v.positive("bucket_mb", o.bucket_mb);
  v.boolean("overlap", o.overlap);
  v.integer("prefetch", o.prefetch, 0, 64);
}
const auto kFields = [](auto& v, Options& o) { zero_fields(v, o); };

}  // namespace

YAML::Node Options::to_yaml() const { return core::fields::write(*this, Options{}, kFields); }

void register_zero(core::SectionRegistry& registry) {
  core::register_section<Options>(registry, "zero", kFields, "",
                                  [](core::Section&, const core::JobSpec&, const Options& o, bool) {
                                    return o.stage != 0;  // 0, off: the data_parallel plugin allreduces
                                  });
}

}  // namespace tetra::zero
