#include "replicate/replicate.h"

#include <ATen/ATen.h>
#include <sched.h>

#include <algorithm>
#include <map>
#include <sstream>

#include "collectives/error.h"
#include "collectives/hierarchical.h"
#include "collectives/local.h"
#include "core/config.h"
#include "core/fields.h"
#include "core/runtime.h"
#include "hardware/host.h"
#include "hardware/topology.h"

namespace tetra::replicate {

using collectives::CommunicatorPtr;

// ---- the section -------------------------------------------------------------------------

core::StrategyRole Options::role(const core::JobSpec&) const {
  core::StrategyRole r;
  r.axis = "replica";
  r.why = "runs " + std::to_string(replicas) + " replicas of it as threads of each process, each a data rank";
  r.replicas = replicas;
  r.replicas_key = "replicate.replicas";
  return r;
}

std::string Options::plan(const core::PlanInput& input) const {
  std::ostringstream os;
  const int procs = input.plan.process_count();
  os << "replicate: " << replicas << " replica threads per process x " << procs << " process" << (procs == 1 ? "" : "es")
     << " = " << replicas * procs << " replicas; inside a process they reduce over shared memory, across processes "
     << "each replica index allreduces over its own communicator\n";
  // On one host: --dry-run runs before any launch, so it plans for all processes here.
  const std::vector<Placement> where = place_replicas(replicas, input.spec.train.threads, procs);
  os << "  each process" << (procs > 1 ? " (all " + std::to_string(procs) + " on this host)" : std::string()) << ":\n";
  for (size_t r = 0; r < where.size(); ++r) {
    os << "    replica " << r << ": " << where[r].threads << " thread" << (where[r].threads == 1 ? "" : "s");
    if (where[r].cpus.empty())
      os << ", not pinned (" << where[r].why << ")";
    else
      os << ", pinned to CPUs " << hardware::format_cpu_list(where[r].cpus);
    os << "\n";
  }
  return os.str();
}

namespace {

// The `replicate` section's key, declared once (Note [Fields declared once]).
template <class V>
void replicate_fields(V& v, Options& o) {
  v.integer("replicas", o.replicas, 1, 1024, core::fields::kAlways);
}
const auto kFields = [](auto& v, Options& o) { replicate_fields(v, o); };

}  // namespace

YAML::Node Options::to_yaml() const { return core::fields::write(*this, Options{}, kFields); }

void register_replicate(core::SectionRegistry& registry) {
  core::register_section<Options>(
      registry, "replicate", kFields, "replica",
      [](core::Section&, const core::JobSpec&, const Options& o, bool given) {
        return given && o.replicas != 1;  // else off: one rank per process
      },
      // absent: one rank per process (the struct's 2 is for the C++ builder)
      [](Options& o, const core::JobSpec&) { o.replicas = 1; });
}

// ---- placement ---------------------------------------------------------------------------

// Note [Replica placement]
// A replica is a thread that runs its own forward and backward, with intra-op threads
// of its own (OpenMP makes a pool per thread that starts a parallel region). Two replicas
// on one core take turns and lose each other's caches, so each gets whole cores: the
// process's allowed CPUs (sched_getaffinity, which mpirun's binding narrows) grouped
// into cores by hwloc, split into R runs of consecutive cores (neighbours share caches
// and a NUMA node). The replica thread pins itself once, when it starts; the OpenMP
// threads it starts inherit the mask. With fewer cores than replicas nobody is pinned: the
// scheduler spreads them better than a fixed overlap would.
std::vector<Placement> place_replicas(int replicas, int threads, int local_processes) {
  replicas = std::max(1, replicas);
  if (local_processes <= 0) local_processes = core::local_ranks_from_env();
  std::vector<Placement> out(static_cast<size_t>(replicas));
  const int per = threads > 0 ? threads
                              : std::max(1, hardware::usable_cores() / (local_processes * replicas));
  for (auto& p : out) p.threads = per;

  const std::vector<int> allowed = hardware::parse_cpu_list(hardware::affinity_cpus());
  std::vector<std::vector<int>> cores;  // allowed PUs, per core
  const hardware::HostTopology host = hardware::discover_host();
  for (const hardware::Core& c : host.cores) {
    std::vector<int> pus;
    for (int pu : hardware::parse_cpu_list(c.pus))
      if (std::find(allowed.begin(), allowed.end(), pu) != allowed.end()) pus.push_back(pu);
    if (!pus.empty()) cores.push_back(pus);
  }
  if (cores.empty())  // no hwloc: a PU is a core
    for (int pu : allowed) cores.push_back({pu});
  std::string why;
  if (local_processes > 1 && allowed.size() >= static_cast<size_t>(hardware::host_cores()))
    why = std::to_string(local_processes) + " processes on this host share its CPUs (bind them, e.g. mpirun --bind-to socket)";
  else if (cores.size() < static_cast<size_t>(replicas))
    why = std::to_string(cores.size()) + " core" + (cores.size() == 1 ? "" : "s") + " for " + std::to_string(replicas) +
          " replicas";
  if (!why.empty()) {
    for (auto& p : out) p.why = why;
    return out;
  }
  const size_t per_replica = cores.size() / static_cast<size_t>(replicas);
  for (size_t r = 0; r < out.size(); ++r)
    for (size_t c = r * per_replica; c < (r + 1) * per_replica; ++c)
      out[r].cpus.insert(out[r].cpus.end(), cores[c].begin(), cores[c].end());
  return out;
}

namespace {

void pin_this_thread(const std::vector<int>& cpus) {
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  sched_setaffinity(0, sizeof(set), &set);  // best effort: a refusal leaves it unpinned
}

std::string describe_exception(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

// ---- the replica threads -----------------------------------------------------------------

ReplicaSet::ReplicaSet(int replicas, CommunicatorPtr process_world, int threads, CommunicatorPtr process_host) {
  if (replicas < 1) throw ConfigError("replicate.replicas must be >= 1, got " + std::to_string(replicas));
  if (process_world) {
    processes_ = process_world->size();
    process_rank_ = process_world->rank();
  }
  // One communicator over the processes per replica index: replica r of every process
  // meets there, and its collectives never wait behind another replica's.
  for (int r = 0; r < replicas; ++r)
    worlds_.push_back(process_world
                          ? process_world->split(0, process_world->rank(), process_world->name() + " / replica " + std::to_string(r))
                          : collectives::make_local_group(1, "replica " + std::to_string(r) + " (one process)")[0]);
  const bool own_host = process_host && process_host != process_world;
  for (int r = 0; r < replicas; ++r)
    host_worlds_.push_back(own_host ? process_host->split(0, process_host->rank(),
                                                          process_host->name() + " / replica " + std::to_string(r))
                                    : nullptr);
  local_ = collectives::make_local_group(replicas, "replicas of process " + std::to_string(process_rank_));
  // Flight-recorder dumps name each replica by its process too (Note [Flight recorder]).
  for (int r = 0; r < replicas; ++r)
    local_[static_cast<size_t>(r)]->recorder()->set_owner("rank " + std::to_string(process_rank_) + " replica " +
                                                          std::to_string(r));
  placement_ = place_replicas(replicas, threads);
  for (int r = 0; r < replicas; ++r) threads_.emplace_back([this, r] { worker(r); });
}

ReplicaSet::~ReplicaSet() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ReplicaSet::worker(int r) {
  const Placement& p = placement_[static_cast<size_t>(r)];
  pin_this_thread(p.cpus);
  at::set_num_threads(p.threads);
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      job = job_;
    }
    try {
      (*job)(r);
    } catch (...) {
      std::exception_ptr e = std::current_exception();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = e;
      }
      // Release the other replicas from the collectives they wait in.
      collectives::abort_local_group(*local_[static_cast<size_t>(r)],
                                     "replica " + std::to_string(r) + " failed: " + describe_exception(e));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--running_ == 0) done_cv_.notify_all();
    }
  }
}

void ReplicaSet::run(const std::function<void(int replica)>& fn) {
  std::unique_lock<std::mutex> lock(mu_);
  job_ = &fn;
  error_ = nullptr;
  running_ = replicas();
  ++generation_;
  cv_.notify_all();
  done_cv_.wait(lock, [&] { return running_ == 0; });
  job_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

core::TrainResult Options::train(const core::JobSpec& spec, core::TrainerOptions options, const AfterRun& after) const {
  return replicate::train(spec, std::move(options), after);
}

core::TrainResult train(const core::JobSpec& spec, core::TrainerOptions options, const AfterRun& after) {
  auto cfg = spec.plugin<Options>("replicate");
  const int R = cfg ? cfg->replicas : 1;
  ReplicaSet set(R, options.world, spec.train.threads, options.host);
  // One copy of the data per process, read by every replica (Fashion-MNIST is 190 MB).
  if (!options.data) options.data = core::make_dataset(spec.data, spec.train.seed);
  std::vector<core::TrainResult> results(static_cast<size_t>(R));
  set.run([&](int r) {
    core::TrainerOptions o = options;
    o.world = set.world(r);
    o.host = set.host_world(r);
    o.replica = set.local(r);
    core::Trainer trainer(spec, o);
    results[static_cast<size_t>(r)] = trainer.run();
    if (after) after(r, trainer, results[static_cast<size_t>(r)]);
  });
  return results[0];
}

// ---- the Replicator ----------------------------------------------------------------------

at::Tensor ReplicaContext::all_reduce(const at::Tensor& value, collectives::ReduceOp op) const {
  at::Tensor out = value.contiguous().clone();
  collectives::AllreduceOptions o;
  o.op = op;
  group_->allreduce(out, o)->wait();
  return out;
}

at::Tensor ReplicaContext::all_reduce_sum(const at::Tensor& value) const {
  return all_reduce(value, collectives::ReduceOp::kSum);
}

at::Tensor ReplicaContext::all_reduce_mean(const at::Tensor& value) const {
  return all_reduce(value, collectives::ReduceOp::kAvg);
}

at::Tensor ReplicaContext::all_gather(const at::Tensor& value) const {
  at::Tensor in = value.contiguous();
  std::vector<int64_t> shape = {num_replicas_};
  shape.insert(shape.end(), in.sizes().begin(), in.sizes().end());
  at::Tensor out = at::empty(shape, in.options());
  group_->allgather(in.reshape({-1}), out.view({-1}))->wait();
  return out;
}

at::Tensor ReplicaContext::broadcast(const at::Tensor& value, int root) const {
  if (root < 0 || root >= num_replicas_)
    throw CommError("broadcast: root replica " + std::to_string(root) + " is not one of the " +
                                 std::to_string(num_replicas_) + " replicas");
  at::Tensor out = value.contiguous().clone();
  collectives::BroadcastOptions o;
  o.root = root;
  group_->broadcast(out, o)->wait();
  return out;
}

Replicator::Replicator(ReplicatorOptions options)
    : set_(options.replicas > 0 ? options.replicas
                                : std::max<int>(1, static_cast<int>(hardware::parse_cpu_list(hardware::affinity_cpus()).size()) /
                                                       core::local_ranks_from_env()),
           options.world, options.threads) {
  const int R = set_.replicas();
  contexts_.resize(static_cast<size_t>(R));
  const std::string name = "replicas (" + std::to_string(set_.processes()) + " process" +
                           (set_.processes() == 1 ? "" : "es") + " x " + std::to_string(R) + ")";
  // Each replica composes its own group, on its own thread (a collective set-up).
  set_.run([&](int r) {
    contexts_[static_cast<size_t>(r)] = std::make_unique<ReplicaContext>(
        set_.process_rank() * R + r, R * set_.processes(), r, collectives::make_hierarchical(set_.local(r), set_.world(r), name));
  });
}

at::Tensor Replicator::reduce(collectives::ReduceOp op, const PerReplica<at::Tensor>& values) {
  if (static_cast<int>(values.values.size()) != local_replicas())
    throw CommError("Replicator::reduce: got " + std::to_string(values.values.size()) +
                                 " values for " + std::to_string(local_replicas()) + " replicas");
  std::vector<at::Tensor> out(values.values.size());
  set_.run([&](int r) { out[static_cast<size_t>(r)] = contexts_[static_cast<size_t>(r)]->all_reduce(values.values[static_cast<size_t>(r)], op); });
  return out[0];
}

double Replicator::reduce(collectives::ReduceOp op, const PerReplica<double>& values) {
  PerReplica<at::Tensor> t;
  for (double v : values.values) t.values.push_back(at::full({1}, v, at::kDouble));
  return reduce(op, t).item<double>();
}

}  // namespace tetra::replicate
