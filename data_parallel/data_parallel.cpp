#include "data_parallel/data_parallel.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <sstream>

#include "collectives/error.h"
#include "collectives/topology_gather.h"
#include "core/bucketer.h"
#include "core/fields.h"

namespace tetra::data_parallel {

namespace {

using collectives::AllreduceOptions;
using collectives::Communicator;
using collectives::CommunicatorPtr;
using collectives::ReduceOp;
using collectives::WorkPtr;

class DataParallel final : public core::Strategy {
 public:
  explicit DataParallel(Options o) : opt_(std::move(o)) {}
  std::string name() const override { return "data_parallel"; }

  std::string decision() const override {
    if (!comm_ || hosts_.hosts.size() <= 1) return "";
    const std::string where =
        std::to_string(comm_->size()) + " data ranks on " + std::to_string(hosts_.hosts.size()) + " hosts";
    if (over_ != comm_)
      return "data_parallel: hierarchical allreduce over " + where + " (" + std::to_string(hosts_.ranks_per_host()) +
             " per host): reduce-scatter inside each host, allreduce across hosts, allgather inside" +
             (opt_.hierarchical == Hierarchy::kAuto ? "; on by itself because the data group spans hosts" : "");
    return "data_parallel: flat allreduce over " + where +
           (opt_.hierarchical == Hierarchy::kOff ? " (data_parallel.hierarchical: off)"
                                                  : hosts_.ranks_per_host() <= 0 ? " (hierarchical needs the same number of ranks on every host)"
                                                                   : " (one rank per host: nothing to reduce inside a host)");
  }

  void attach(core::TrainState& state) override {
    if (!state.mesh || state.mesh->size("data") == 1) return;  // one rank: nothing to do
    comm_ = state.mesh->axis("data");
    trace_ = &state.trace;
    timeout_ = collectives::Duration(static_cast<int64_t>(state.spec.collectives.timeout_s * 1000));
    core::check_same_job(*state.mesh->host("data"), state, "data_parallel");
    state.weights->create_all(*state.model);  // every rank holds the whole model
    core::broadcast_from_first(*comm_, state);
    // Hierarchy lives in collectives, and hosts in the mesh: one allreduce per bucket, over
    // the data group or, when it spans hosts, over the mesh's hierarchical communicator.
    hosts_ = state.mesh->hosts("data");
    over_ = comm_;
    if (hierarchical(opt_.hierarchical, hosts_)) over_ = state.mesh->hierarchical("data", hosts_, timeout_);
    // reduce_scatter (hierarchical) needs equal chunks: pad each bucket to the host size.
    grads_ = core::GradientBuckets::by_size(state.params, static_cast<int64_t>(opt_.bucket_mb * 1024 * 1024),
                                            over_ != comm_ ? hosts_.ranks_per_host() : 1);
    buckets_.resize(grads_.buckets().size());
    std::vector<at::Tensor> buffers;
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const auto& gb = grads_.buckets()[b];
      buckets_[b].buffer = at::zeros({gb.padded}, at::TensorOptions().dtype(gb.dtype).device(state.device));
      buffers.push_back(buckets_[b].buffer);
    }
    grads_.bind_views(buffers);
    if (opt_.overlap) grads_.hook([this](int s) { on_ready(s); });
  }

  void before_backward(bool last) override { sync_ = last; }

  void finish_gradients() override {
    if (!comm_ || opt_.compute_only) return;
    sync_ = false;
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < buckets_.size(); ++i) {
      if (buckets_[i].launched) continue;
      // No overlap, or parameters that got no gradient this step.
      for (int s : grads_.buckets()[i].slots) grads_.bind(s);
      launch(buckets_[i]);
    }
    for (size_t i = 0; i < buckets_.size(); ++i) {
      Bucket& b = buckets_[i];
      for (auto& w : b.works) w->wait();
      trace_works(b, i, over_ != comm_ ? "allreduce (hierarchical)" : "allreduce");
    }
    // Each .grad is a view of its bucket: the average is in place already, unless it
    // travelled compressed.
    for (auto& b : buckets_) {
      if (b.wire.defined()) b.buffer.copy_(b.wire);
      b.launched = false;
      b.works.clear();
    }
    grads_.reset();
  }


 private:
  // What a bucket of the shared layout (grads_) needs for its communication.
  struct Bucket {
    at::Tensor buffer, wire;  // buffer: the gradients (their .grad are views of it)
    bool launched = false;
    double issued_us = 0;
    std::vector<WorkPtr> works;
  };

  // Whether the data group's allreduce goes through its hosts, by data_parallel.hierarchical
  // (auto: when it spans hosts with several of its ranks on each). Every rank decides alike:
  // the host map is the same on all.
  static bool hierarchical(Hierarchy mode, const collectives::HostMap& hosts) {
    const bool fits = core::hierarchical_fits(hosts);
    if (mode == Hierarchy::kOn && !fits)
      throw ConfigError("data_parallel.hierarchical: on needs the same number (> 1) of data ranks on each of more "
                        "than one host; the data group runs " + hosts.describe());
    return mode == Hierarchy::kOn || (mode == Hierarchy::kAuto && fits);
  }

  // After autograd accumulated slot i's gradient (hooked only with overlap).
  void on_ready(int i) {
    if (!sync_ || opt_.compute_only) return;  // accumulate-only micro-batch: no communication
    at::NoGradGuard no_grad;
    Bucket& b = buckets_[grads_.slots()[i].bucket];
    if (b.launched) return;
    grads_.bind(i);
    if (grads_.mark(i)) launch(b);
  }

  void launch(Bucket& b) {
    b.launched = true;
    b.issued_us = trace_->enabled() ? trace_->now_us() : 0;
    at::Tensor t = b.buffer;
    if (opt_.compression != Compression::kNone) {
      b.wire = b.buffer.to(opt_.compression == Compression::kFp16 ? at::kHalf : at::kBFloat16);
      t = b.wire;
    }
    AllreduceOptions o;
    o.op = ReduceOp::kAvg;
    b.works.push_back(over_->allreduce(t, o));
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

  Options opt_;
  CommunicatorPtr comm_;
  CommunicatorPtr over_;  // what each bucket's allreduce goes over: comm_, or hierarchical
  collectives::HostMap hosts_;  // where the data group runs
  collectives::Duration timeout_ = collectives::kDefaultTimeout;
  core::Trace* trace_ = nullptr;
  bool sync_ = false;
  core::GradientBuckets grads_;  // the layout, the hooks, the .grad views (core's bucketer)
  std::vector<Bucket> buckets_;
};

}  // namespace

std::unique_ptr<core::Strategy> Options::build() const { return std::make_unique<DataParallel>(*this); }

// The buckets attach() lays out, each allreduced once a step. The gradients are views of
// the buckets (counted as gradients, as Trainer::memory() counts them), so data
// parallelism adds no buffer of its own to the model state.
void Options::estimate(const core::PlanInput& input, core::RankEstimate& rank) const {
  rank.hierarchical_data = hierarchical != Hierarchy::kOff;
  rank.hierarchical_data_required = hierarchical == Hierarchy::kOn;
  const int n = input.plan.data_ranks();
  if (n == 1) return;
  const core::GradientBuckets layout =
      core::GradientBuckets::by_size(rank.params(), static_cast<int64_t>(bucket_mb * 1024 * 1024), 1);
  collectives::Traffic& t = rank.traffic["data"];
  for (const auto& b : layout.buckets()) {
    const int64_t e = compression == Compression::kNone ? static_cast<int64_t>(c10::elementSize(b.dtype)) : 2;
    t.record(collectives::Traffic::kAllreduce, b.padded * e, n);
  }
  if (hierarchical == Hierarchy::kOn)
    rank.notes.push_back("data_parallel.hierarchical on: counted as one flat allreduce per bucket (the hosts are known at launch)");
}

const std::vector<std::string>& compression_names() {
  static const std::vector<std::string> names = {"none", "fp16", "bf16"};
  return names;
}
const std::vector<std::string>& hierarchy_names() {
  static const std::vector<std::string> names = {"auto", "on", "off"};
  return names;
}

namespace {

// The `data_parallel` section's keys, declared once (Note [Fields declared once]).
template <class V>
void data_parallel_fields(V& v, Options& o) {
  v.positive("bucket_mb", o.bucket_mb);
  v.boolean("overlap", o.overlap);
  v.word("compression", o.compression, compression_names());
  v.word("hierarchical", o.hierarchical, hierarchy_names());
}
const auto kFields = [](auto& v, Options& o) { data_parallel_fields(v, o); };

}  // namespace

YAML::Node Options::to_yaml() const { return core::fields::write(*this, Options{}, kFields); }

core::StrategyRole Options::role(const core::JobSpec&) const {
  core::StrategyRole r;
  r.axis = "data";
  std::ostringstream mb;
  mb << bucket_mb;
  r.why = "averages the gradients over the data group (allreduce in " + mb.str() + " MiB buckets" +
          (overlap ? ", during backward" : ", after backward") +
          (compression == Compression::kNone ? std::string() : ", sent as " + compression_names()[static_cast<size_t>(compression)]) + ")";
  r.syncs_gradients = true;
  return r;
}

void register_data_parallel(core::SectionRegistry& registry) {
  // Always on here: the plan leaves it out when the data group has one rank.
  core::register_section<Options>(registry, "data_parallel", kFields, "data");
}

}  // namespace tetra::data_parallel
