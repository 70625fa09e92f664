// Replication, TF-Replicator's programming model: R replicas of the model as threads of
// each process.
//
// Each replica is a data-parallel rank. Inside a process the replicas talk over shared
// memory (the `local` backend); across processes each replica index has its own
// communicator (a duplicate of the process world), and the two compose into one
// hierarchical communicator (collectives/hierarchical.h: reduce inside, allreduce across,
// broadcast inside). The data group is therefore data processes x R wide, and data
// parallelism and ZeRO run over it unchanged: neither knows replicas exist.
//
// Two ways in:
//   - `replicate: {replicas: R}` in a job: train() runs one Trainer per replica thread.
//   - a loop of your own: Replicator::run(input_fn, step_fn) calls input_fn(ctx) for each
//     replica's data and step_fn(ctx, batch) on every replica at once; ctx has the
//     replica's id and cross-replica ops (all_reduce sum/mean, all_gather, broadcast);
//     run returns one result per replica of this process, and reduce() combines them
//     over every replica of the job.
//
// Where the replicas run comes from the machine, not from the user: each gets
// usable cores / (processes on the host x R) intra-op threads, and when every replica can
// have whole cores of its own, its thread is pinned to them (consecutive cores, which
// share caches) — Note [Replica placement] in replicate.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/communicator.h"
#include "core/job_spec.h"
#include "core/strategy.h"
#include "core/trainer.h"

namespace tetra::replicate {

// The `replicate` section.
// It makes the ranks the job trains as (core::RankMaker, Note [Ranks a plan makes]).
struct Options : core::StrategyConfig, core::RankMaker {
  int replicas = 2;  // replica threads per process; each is a data rank
  // Replicas set up the launch, not a phase of the step: no Strategy to attach.
  std::unique_ptr<core::Strategy> build() const override { return nullptr; }
  core::TrainResult train(const core::JobSpec& spec, core::TrainerOptions options, const AfterRun& after) const override;
  core::StrategyRole role(const core::JobSpec& job) const override;
  std::string plan(const core::PlanInput& input) const override;
  YAML::Node to_yaml() const override;
};

// Registers the `replicate` section (owner of the `replica` axis).
void register_replicate(core::SectionRegistry& registry);

// Where one replica runs: its intra-op threads and the CPUs its thread is pinned to
// (empty: not pinned, with `why`).
struct Placement {
  int threads = 1;
  std::vector<int> cpus;
  std::string why;  // when not pinned
};
// The placement of `replicas` replica threads in this process, from the CPUs it may use
// (sched_getaffinity) grouped into cores (hwloc), and the processes the launcher put on
// this host (`local_processes`; 0 = as the launcher says). `threads` > 0 overrides the
// threads per replica (train.threads).
std::vector<Placement> place_replicas(int replicas, int threads = 0, int local_processes = 0);

// The replica threads of one process and their communicators.
class ReplicaSet {
 public:
  // Collective over `process_world` (nullptr: this process alone): duplicates it once per
  // replica index and makes the shared-memory group of the R replicas. Call from one
  // thread, in the same order on every process. `process_host`: the process world's host
  // plane when it carries device tensors only (Note [Two planes]), duplicated the same way.
  ReplicaSet(int replicas, collectives::CommunicatorPtr process_world, int threads = 0,
             collectives::CommunicatorPtr process_host = nullptr);
  ~ReplicaSet();
  ReplicaSet(const ReplicaSet&) = delete;
  ReplicaSet& operator=(const ReplicaSet&) = delete;

  int replicas() const { return static_cast<int>(local_.size()); }
  int processes() const { return processes_; }
  int process_rank() const { return process_rank_; }
  // Replica r's communicator over the processes (a duplicate of the process world) and
  // its rank in the shared-memory group of this process's replicas.
  const collectives::CommunicatorPtr& world(int r) const { return worlds_[static_cast<size_t>(r)]; }
  // Its host plane's duplicate; nullptr when world(r) carries host tensors too.
  const collectives::CommunicatorPtr& host_world(int r) const { return host_worlds_[static_cast<size_t>(r)]; }
  const collectives::CommunicatorPtr& local(int r) const { return local_[static_cast<size_t>(r)]; }
  const std::vector<Placement>& placement() const { return placement_; }

  // Runs fn(r) on every replica's thread at once (each pinned once, when it started) and
  // waits for all. When one throws, the replicas' shared group is aborted so that the
  // others leave their collectives with an error naming it instead of waiting for a
  // timeout; the first exception is rethrown here.
  void run(const std::function<void(int replica)>& fn);

 private:
  void worker(int r);

  std::vector<collectives::CommunicatorPtr> worlds_, host_worlds_, local_;
  std::vector<Placement> placement_;
  int processes_ = 1, process_rank_ = 0;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int running_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

// Trains `spec` (its replicate section says R) on R replica threads of this process;
// `options.world` is the process world (nullptr: one process). Every replica builds its
// own Trainer; they follow one process's loss. `after` (optional) runs on each replica's
// thread once its run ended (collective calls such as Trainer::weights() are allowed).
// Returns replica 0's result.
using AfterRun = core::RankMaker::AfterRun;
core::TrainResult train(const core::JobSpec& spec, core::TrainerOptions options, const AfterRun& after = {});

// ---- the Replicator: TF-Replicator's API for loops of your own --------------------------

// What a replica sees inside Replicator::run.
class ReplicaContext {
 public:
  ReplicaContext(int replica_id, int num_replicas, int local_id, collectives::CommunicatorPtr group)
      : replica_id_(replica_id), num_replicas_(num_replicas), local_id_(local_id), group_(std::move(group)) {}
  // 0 .. num_replicas-1 over the whole job: process rank x R + this process's replica.
  int replica_id() const { return replica_id_; }
  int num_replicas() const { return num_replicas_; }
  // This replica's index among its process's replicas.
  int local_replica_id() const { return local_id_; }

  // Cross-replica ops: collective over every replica of the job (each must call them
  // in the same order). They return new tensors; `value` is left as it was.
  at::Tensor all_reduce_sum(const at::Tensor& value) const;
  at::Tensor all_reduce_mean(const at::Tensor& value) const;  // floating dtypes
  at::Tensor all_reduce(const at::Tensor& value, collectives::ReduceOp op) const;
  // Every replica's `value` stacked along a new first dimension, in replica_id order.
  at::Tensor all_gather(const at::Tensor& value) const;
  // Replica `root`'s `value` on every replica (the others pass a tensor of the same
  // shape and dtype, whose values are ignored).
  at::Tensor broadcast(const at::Tensor& value, int root = 0) const;
  // The communicator itself, for what the ops above do not cover.
  collectives::Communicator& group() const { return *group_; }

 private:
  int replica_id_, num_replicas_, local_id_;
  collectives::CommunicatorPtr group_;
};

// One value per replica of this process, in local replica order.
template <typename T>
struct PerReplica {
  std::vector<T> values;
};

struct ReplicatorOptions {
  int replicas = 0;  // per process; 0 = one per core this process may use
  collectives::CommunicatorPtr world;  // the process world; nullptr = this process alone
  int threads = 0;   // intra-op threads per replica; 0 = from the topology
};

class Replicator {
 public:
  // Collective over options.world.
  explicit Replicator(ReplicatorOptions options = {});
  int num_replicas() const { return set_.replicas() * set_.processes(); }
  int local_replicas() const { return set_.replicas(); }

  // input_fn(ctx) -> Batch for each replica, then step_fn(ctx, batch) -> Result on every
  // replica at once. Both run on the replica's own thread.
  template <typename Batch, typename Result>
  PerReplica<Result> run(const std::function<Batch(ReplicaContext&)>& input_fn,
                         const std::function<Result(ReplicaContext&, Batch&)>& step_fn) {
    PerReplica<Result> out;
    out.values.resize(static_cast<size_t>(local_replicas()));
    set_.run([&](int r) {
      ReplicaContext& ctx = *contexts_[static_cast<size_t>(r)];
      Batch batch = input_fn(ctx);
      out.values[static_cast<size_t>(r)] = step_fn(ctx, batch);
    });
    return out;
  }
  // Combines per-replica tensors over every replica of the job (collective over the
  // processes): kSum, kAvg (the mean over num_replicas()), kMin, kMax, kProd.
  at::Tensor reduce(collectives::ReduceOp op, const PerReplica<at::Tensor>& values);
  double reduce(collectives::ReduceOp op, const PerReplica<double>& values);

 private:
  ReplicaSet set_;
  std::vector<std::unique_ptr<ReplicaContext>> contexts_;
};

}  // namespace tetra::replicate
