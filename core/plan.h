// The plan: a job's validated composition of strategies, in one place.
//
// Built from a job spec (parsed YAML, or the C++ builder), before anything runs and
// without communicating. It holds the mesh with every axis — pipeline and data across
// processes, replica across the threads of one process — the strategies in their
// composition order with the reason for each place, and the arithmetic every rank will
// do (how the global batch splits). The trainer, `train --check`, `train --dry-run` and
// `topo --plan` all read this one object, so they cannot disagree, and every cross-field
// rule is checked here once, with its whole equation in the message.
//
// Core names no strategy. A plugin says what its section does to the plan through
// StrategyConfig::role() (the axis it works over, the data ranks it adds, how it splits a
// rank's batch); the plan composes those roles.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/job_spec.h"
#include "core/mesh.h"

namespace tetra::core {

struct StrategyConfig;

// The order strategies compose in, outermost first — the order the trainer attaches
// them and the order --dry-run lists them:
//   pipeline  splits the model into stages, so each later strategy sees one stage's
//             layers and parameters;
//   replica   runs that stage on R threads of each process, each one a data rank, so the
//             data group becomes (data processes x R) wide;
//   tensor    splits the stage's layers' matrices over the tensor group, so the data
//             strategy sees each rank's parts (and averages them within each slice);
//   data      averages the gradients over that group (data_parallel), or shards them and
//             the optimizer state over it (zero, which then owns the axis's gradients).
inline const std::vector<std::string> kCompositionOrder = {"pipeline", "replica", "tensor", "data"};

// What a plugin section contributes to the plan (StrategyConfig::role).
struct StrategyRole {
  std::string axis;  // the mesh axis it works over: pipeline | replica | tensor | data
  std::string why;   // one line: what it does at its place in the composition
  // Synchronises the gradients of `axis` (data_parallel), or owns the model state there
  // and therefore synchronises them itself (zero). One synchroniser per axis: an owner
  // takes the axis over a plain synchroniser, which the plan then leaves out.
  bool syncs_gradients = false;
  bool owns_model_state = false;
  // Needs its axis wider than one rank ("zero needs a data group"); `key` names the
  // setting that asks for it, for the message.
  bool needs_group = false;
  std::string needs_group_key;
  // Replica threads per process (replicate): each is a data rank; `replicas_key` names
  // the setting in messages ("replicate.replicas").
  int replicas = 1;
  std::string replicas_key;
  // Pieces each data rank's batch is split into, and the key that sets it (the pipeline's
  // micro_batches); 0 = this strategy does not split the batch (train.accumulation_steps
  // then does).
  int64_t micro_batches = 0;
  std::string micro_batches_key;
};

// One strategy at its place in the composition.
struct PlanStep {
  std::string section;  // the job-spec section ("pipeline", "zero", ...)
  StrategyRole role;
  std::shared_ptr<const StrategyConfig> config;
  bool active = true;        // false: left out (see `note`)
  std::string note;          // why it is left out, or what it takes over
};

class Plan {
 public:
  // Throws tetra::ConfigError carrying every issue (see issues()).
  explicit Plan(JobSpec spec);

  // Every cross-field rule the spec breaks, in a fixed order; empty when it is sound.
  static std::vector<PlanIssue> issues(const JobSpec& spec);

  const JobSpec& spec() const { return spec_; }
  // The processes: pipeline x data (what mpirun -np must give).
  const MeshSpec& processes() const { return spec_.mesh; }
  int process_count() const { return spec_.mesh.world_size(); }
  // Replica threads per process (1 without replication).
  int replicas() const { return replicas_; }
  int pipeline_stages() const { return spec_.mesh.size("pipeline"); }
  // Ranks of one data group: data processes x replicas.
  int data_ranks() const { return spec_.mesh.size("data") * replicas_; }
  // Model replicas training at once: every process's replicas (pipeline stages count once).
  int total_replicas() const { return process_count() * replicas_; }
  // How each data rank's share of the global batch is split: the pipeline's micro-batches
  // or train.accumulation_steps.
  int64_t micro_batches() const { return micro_batches_; }
  const std::string& micro_batches_key() const { return micro_batches_key_; }
  int64_t rank_batch() const { return spec_.data.batch_size / data_ranks(); }
  int64_t micro_batch_size() const { return rank_batch() / micro_batches_; }
  // "256 = 2 data ranks (mesh.data 1 x replicate.replicas 2) x 4 micro-batches x 32"
  std::string batch_equation() const;
  // The strategies in kCompositionOrder (inactive ones included, with their note).
  const std::vector<PlanStep>& composition() const { return steps_; }
  // The active strategies' configs, in composition order (what the trainer builds).
  std::vector<std::shared_ptr<const StrategyConfig>> strategies() const;
  // The "composition" lines of --dry-run.
  std::string describe_composition() const;

  // Throws ConfigError with the whole equation when the processes do not fit the launch:
  // "mesh pipeline=2 x data=2 = 4 processes, but the world has 3 (mpirun -np 3)".
  void check_world(int world_size, const std::string& origin = "") const;

 private:
  JobSpec spec_;
  int replicas_ = 1;
  int64_t micro_batches_ = 1;
  std::string micro_batches_key_ = "train.accumulation_steps";
  std::vector<PlanStep> steps_;
};

}  // namespace tetra::core
