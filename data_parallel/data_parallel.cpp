#include "data_parallel/data_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>

#include "collectives/error.h"
#include "hardware/host.h"

namespace tetra::data_parallel {

namespace {

using collectives::AllreduceOptions;
using collectives::Communicator;
using collectives::CommunicatorPtr;
using collectives::ReduceOp;
using collectives::WorkPtr;
using Clock = std::chrono::steady_clock;

int64_t mix(int64_t h, int64_t v) {
  uint64_t x = static_cast<uint64_t>(h) ^ (static_cast<uint64_t>(v) + 0x9E3779B97F4A7C15ULL + (static_cast<uint64_t>(h) << 6));
  return static_cast<int64_t>(x >> 1);
}
int64_t mix(int64_t h, const std::string& s) { return mix(h, static_cast<int64_t>(std::hash<std::string>{}(s) >> 1)); }

// Runs `fn` after autograd accumulated a parameter's gradient into .grad (a post hook on
// the parameter's AccumulateGrad node, as PyTorch's DDP reducer does). `alive` turns it
// off when the strategy is gone but a graph still holds the node.
struct AfterAccumulate final : torch::autograd::FunctionPostHook {
  AfterAccumulate(std::shared_ptr<std::atomic<bool>> alive, std::function<void()> fn)
      : alive_(std::move(alive)), fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (alive_->load(std::memory_order_acquire)) fn_();
    return outputs;
  }

 private:
  std::shared_ptr<std::atomic<bool>> alive_;
  std::function<void()> fn_;
};

class DataParallel final : public core::Strategy {
 public:
  explicit DataParallel(Options o) : opt_(std::move(o)) {}
  ~DataParallel() override { alive_->store(false, std::memory_order_release); }
  std::string name() const override { return "data_parallel"; }

  void attach(core::TrainState& state) override {
    if (!state.mesh || state.mesh->size("data") == 1) return;  // one rank: nothing to do
    comm_ = state.mesh->axis("data");
    trace_ = &state.trace;
    check_consistency(state);
    broadcast_state(state);
    make_buckets(state);
    setup_hierarchy();
    bind_gradients();
    if (opt_.overlap) {
      for (size_t i = 0; i < slots_.size(); ++i) {
        Slot& sl = slots_[i];
        sl.accumulator = torch::autograd::impl::grad_accumulator(sl.param);
        TETRA_CHECK(sl.accumulator, "data_parallel: parameter has no gradient accumulator");
        sl.accumulator->add_post_hook(std::make_unique<AfterAccumulate>(alive_, [this, i] { on_ready(i); }));
      }
    }
  }

  void before_backward(bool last) override { sync_ = last; }

  void finish_gradients() override {
    if (!comm_ || opt_.skip_allreduce) return;
    sync_ = false;
    at::NoGradGuard no_grad;
    for (auto& b : buckets_) {
      if (b.launched) continue;
      // No overlap, or parameters that got no gradient this step.
      for (int s : b.slots) bind(s);
      launch(b);
    }
    const auto t0 = Clock::now();
    complete_hierarchy();
    for (size_t i = 0; i < buckets_.size(); ++i) {
      Bucket& b = buckets_[i];
      for (auto& w : b.works) w->wait();
      trace_works(b, i, hier_ ? "allgather (host)" : "allreduce");
    }
    wait_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
    // Each .grad is a view of its bucket: the average is in place already, unless it
    // travelled compressed or the hierarchy summed it.
    for (auto& b : buckets_) {
      if (b.wire.defined()) b.buffer.copy_(b.wire);
      if (hier_) b.buffer.div_(comm_->size());
      b.launched = false;
      b.pending = static_cast<int>(b.slots.size());
      std::fill(b.filled.begin(), b.filled.end(), false);
      b.works.clear();
    }
  }

  double wait_seconds() const override { return wait_s_; }

 private:
  struct Slot {
    at::Tensor param;
    at::Tensor view;  // the parameter's slot of its bucket, shaped like it: its .grad
    std::shared_ptr<torch::autograd::Node> accumulator;  // kept alive: it carries the hook
    int bucket = 0;
    int64_t offset = 0, numel = 0;
  };
  struct Bucket {
    std::vector<int> slots;  // consecutive slot indices
    std::vector<bool> filled;
    at::Tensor buffer, wire, chunk;
    int pending = 0;
    bool launched = false;
    double issued_us = 0;
    std::vector<WorkPtr> works;
  };

  // Every rank must train the same model on the same job: a cheap fingerprint of the
  // parameter shapes and of the settings that change the arithmetic, compared across ranks.
  void check_consistency(core::TrainState& state) {
    int64_t shapes = 17, job = 31;
    for (const auto& p : state.params) {
      shapes = mix(shapes, p.name);
      for (int64_t d : p.tensor.sizes()) shapes = mix(shapes, d);
    }
    const auto& s = state.spec;
    job = mix(job, s.model.type);
    job = mix(job, s.data.batch_size);
    job = mix(job, s.train.seed);
    job = mix(job, s.train.accumulation_steps);
    job = mix(job, s.optimizer.type);
    job = mix(job, static_cast<int64_t>(s.optimizer.lr * 1e12));
    at::Tensor mine = at::tensor({shapes, job}, at::kLong), all = at::empty({2 * comm_->size()}, at::kLong);
    comm_->allgather(mine, all)->wait();
    auto a = all.accessor<int64_t, 1>();
    for (int r = 1; r < comm_->size(); ++r) {
      if (a[2 * r] != a[0])
        throw ConfigError("data_parallel: data rank " + std::to_string(r) + " built a model of other shapes than data rank 0 "
                          "(every rank must run the same job file)");
      if (a[2 * r + 1] != a[1])
        throw ConfigError("data_parallel: data rank " + std::to_string(r) + " runs other settings (model, batch, seed, "
                          "accumulation or optimizer) than data rank 0 (every rank must run the same job and --set)");
    }
  }

  // Parameters and buffers start as data rank 0's.
  void broadcast_state(core::TrainState& state) {
    at::NoGradGuard no_grad;
    std::vector<WorkPtr> works;
    for (auto& p : state.params) works.push_back(comm_->broadcast(p.tensor.detach()));
    for (auto b : state.model->buffers()) works.push_back(comm_->broadcast(b));
    for (auto& w : works) w->wait();
  }

  // Buckets of ~bucket_mb in reverse order of the parameters (backward's order).
  void make_buckets(core::TrainState& state) {
    const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(opt_.bucket_mb * 1024 * 1024));
    int64_t used = cap;  // start a new bucket at once
    for (auto it = state.params.rbegin(); it != state.params.rend(); ++it) {
      if (!it->tensor.requires_grad()) continue;
      const int64_t bytes = it->tensor.numel() * it->tensor.element_size();
      const bool same_dtype = !buckets_.empty() && !buckets_.back().slots.empty() &&
                              slots_[buckets_.back().slots.front()].param.scalar_type() == it->tensor.scalar_type();
      if (used + bytes > cap || !same_dtype) {
        buckets_.emplace_back();
        used = 0;
      }
      Slot s;
      s.param = it->tensor;
      s.bucket = static_cast<int>(buckets_.size()) - 1;
      s.offset = used / it->tensor.element_size();
      s.numel = it->tensor.numel();
      buckets_.back().slots.push_back(static_cast<int>(slots_.size()));
      slots_.push_back(s);
      used += bytes;
    }
    for (auto& b : buckets_) {
      int64_t numel = 0;
      for (int s : b.slots) numel += slots_[s].numel;
      b.buffer = at::zeros({numel}, slots_[b.slots.front()].param.options().requires_grad(false));
      b.filled.assign(b.slots.size(), false);
      b.pending = static_cast<int>(b.slots.size());
    }
  }

  void setup_hierarchy() {
    const int n = comm_->size();
    int per_host = opt_.ranks_per_host;
    int64_t color = 0;
    if (per_host > 0) {
      color = comm_->rank() / per_host;
    } else {
      at::Tensor mine = at::full({1}, static_cast<int64_t>(std::hash<std::string>{}(hardware::hostname()) >> 1), at::kLong);
      at::Tensor all = at::empty({n}, at::kLong);
      comm_->allgather(mine, all)->wait();
      std::vector<int64_t> hosts(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + n);
      std::vector<int64_t> distinct = hosts;
      std::sort(distinct.begin(), distinct.end());
      distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
      color = std::find(distinct.begin(), distinct.end(), hosts[comm_->rank()]) - distinct.begin();
      per_host = static_cast<int>(std::count(hosts.begin(), hosts.end(), hosts[comm_->rank()]));
      const int hosts_n = static_cast<int>(distinct.size());
      for (int64_t h : distinct)
        if (std::count(hosts.begin(), hosts.end(), h) != per_host) per_host = -1;  // uneven: flat only
      if (opt_.hierarchical == "auto") hier_ = hosts_n > 1 && per_host > 1;
    }
    if (opt_.hierarchical == "on") {
      if (per_host <= 1 || n % per_host != 0)
        throw ConfigError("data_parallel.hierarchical: on needs the same number (> 1) of data ranks on every host");
      hier_ = true;
    }
    if (opt_.hierarchical == "off") hier_ = false;
    if (opt_.hierarchical == "auto" && opt_.ranks_per_host > 0) hier_ = n / per_host > 1 && per_host > 1;
    // Every rank splits (collective), even when the mode stays flat.
    intra_ = comm_->split(static_cast<int>(color), comm_->rank(), comm_->name() + " / host");
    inter_ = comm_->split(intra_->rank(), static_cast<int>(color), comm_->name() + " / across hosts");
    if (hier_) {
      // reduce_scatter needs equal chunks: pad each bucket to a multiple of the host size.
      for (auto& b : buckets_) {
        const int64_t k = intra_->size();
        const int64_t padded = (b.buffer.numel() + k - 1) / k * k;
        if (padded != b.buffer.numel()) {
          at::Tensor nb = at::zeros({padded}, b.buffer.options());
          b.buffer = nb;
        }
      }
    }
  }

  // Gradient as bucket view: every .grad is its slot of a bucket, so autograd accumulates
  // straight into the buffer the allreduce sends, and the average lands where the
  // optimizer reads it. No copy in, no copy out.
  void bind_gradients() {
    at::NoGradGuard no_grad;
    for (auto& sl : slots_) sl.view = buckets_[sl.bucket].buffer.narrow(0, sl.offset, sl.numel).view(sl.param.sizes());
    for (size_t s = 0; s < slots_.size(); ++s) bind(static_cast<int>(s));
  }

  // Makes slot s's .grad its bucket view again if something replaced it (or left it
  // undefined: a parameter that got no gradient contributes zeros).
  void bind(int s) {
    Slot& sl = slots_[s];
    at::Tensor& g = sl.param.mutable_grad();
    if (g.defined() && g.data_ptr() == sl.view.data_ptr()) return;
    if (g.defined()) sl.view.copy_(g);
    else sl.view.zero_();
    g = sl.view;
  }

  // After autograd accumulated slot i's gradient (hooked only with overlap).
  void on_ready(size_t i) {
    if (!sync_ || opt_.skip_allreduce) return;  // accumulate-only micro-batch: no communication
    at::NoGradGuard no_grad;
    const Slot& sl = slots_[i];
    Bucket& b = buckets_[sl.bucket];
    const size_t k = i - static_cast<size_t>(b.slots.front());
    if (b.launched || b.filled[k]) return;
    bind(static_cast<int>(i));
    b.filled[k] = true;
    if (--b.pending == 0) launch(b);
  }

  void launch(Bucket& b) {
    b.launched = true;
    b.issued_us = trace_->enabled() ? trace_->now_us() : 0;
    at::Tensor t = b.buffer;
    if (opt_.compression != "none") {
      b.wire = b.buffer.to(opt_.compression == "fp16" ? at::kHalf : at::kBFloat16);
      t = b.wire;
    }
    if (!hier_) {
      AllreduceOptions o;
      o.op = ReduceOp::kAvg;
      b.works.push_back(comm_->allreduce(t, o));
      return;
    }
    // Phase 1 of the hierarchy now; the rest in complete_hierarchy().
    // (Separate chunk buffer: MPI forbids overlapping input and output.)
    const int64_t chunk = t.numel() / intra_->size();
    if (!b.chunk.defined() || b.chunk.numel() != chunk || b.chunk.scalar_type() != t.scalar_type())
      b.chunk = at::empty({chunk}, t.options());
    b.works.push_back(intra_->reduce_scatter(t, b.chunk));
  }

  // The "comm data" track: each op of bucket i from the moment the communicator's
  // progress thread began it to its end (after wait(), so both times are known); the
  // time it queued behind earlier ops is an argument.
  void trace_works(const Bucket& b, size_t i, const char* op) {
    if (!trace_->enabled()) return;
    for (const auto& w : b.works) {
      const double begin = trace_->us_at(w->started_at()), end = trace_->us_at(w->finished_at());
      trace_->span("comm data", std::string(op) + " bucket " + std::to_string(i), begin, end,
                   {{"bytes", b.buffer.numel() * b.buffer.element_size()},
                    {"queued_us", std::max(0.0, begin - b.issued_us)}});
    }
  }

  void complete_hierarchy() {
    if (!hier_) return;
    // Each phase is issued for every bucket before the next phase waits, so the phases
    // of different buckets overlap.
    for (size_t i = 0; i < buckets_.size(); ++i) {
      Bucket& b = buckets_[i];
      for (auto& w : b.works) w->wait();
      trace_works(b, i, "reduce_scatter (host)");
      b.works.clear();
      b.works.push_back(inter_->allreduce(b.chunk));
    }
    for (size_t i = 0; i < buckets_.size(); ++i) {
      Bucket& b = buckets_[i];
      for (auto& w : b.works) w->wait();
      trace_works(b, i, "allreduce (across hosts)");
      b.works.clear();
      b.works.push_back(intra_->allgather(b.chunk, b.wire.defined() ? b.wire : b.buffer));
    }
  }

  Options opt_;
  CommunicatorPtr comm_, intra_, inter_;
  core::Trace* trace_ = nullptr;
  bool hier_ = false;
  bool sync_ = false;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  double wait_s_ = 0;
  std::shared_ptr<std::atomic<bool>> alive_ = std::make_shared<std::atomic<bool>>(true);
};

}  // namespace

std::unique_ptr<core::Strategy> Options::build() const { return std::make_unique<DataParallel>(*this); }

void register_data_parallel(core::SectionRegistry& registry) {
  registry.add(
      "data_parallel",
      [](core::Section& s, const core::JobSpec& job) -> std::shared_ptr<const core::PluginConfig> {
        auto o = std::make_shared<Options>();
        const bool given = !s.keys().empty();
        o->bucket_mb = s.positive_number("bucket_mb", o->bucket_mb);
        o->overlap = s.boolean("overlap", o->overlap);
        o->compression = s.choice("compression", o->compression, {"none", "fp16", "bf16"});
        o->hierarchical = s.choice("hierarchical", o->hierarchical, {"auto", "on", "off"});
        o->ranks_per_host = static_cast<int>(s.integer("ranks_per_host", 0, 0, 1 << 20));
        o->skip_allreduce = s.boolean("skip_allreduce", false);
        s.finish();
        if (!given && job.mesh.size("data") == 1) return nullptr;  // off: one data rank
        return o;
      },
      "data");
}

}  // namespace tetra::data_parallel
