// What a plugin section declares for the plan, on one process and before anything runs:
// its role (core/plan.h), the lines and the per-rank estimate `train --dry-run` prints,
// and the Strategy it builds. core/plan.cpp reads sections through this header alone: the
// runtime side of a strategy (core/strategy.h) includes it, never the other way round.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "collectives/communicator.h"
#include "core/data.h"
#include "core/job_spec.h"
#include "core/model_state.h"
#include "core/models.h"
#include "core/plan.h"

namespace tetra::core {

class Strategy;

// Note [Per-rank estimate]
// What one rank of the plan will hold and send, worked out on one process without
// communicating (train --dry-run, and the test that holds it to a real run). Core starts
// every rank as the whole model on one rank: fp32 parameters, their gradients, the
// optimizer's slots (sgd 0, or 1 with momentum; adamw 2), no buffers, the activations of
// one micro-batch, and the trainer's own traffic (the step's loss averaged over the data
// axis). Then each active strategy refines it in composition order
// (StrategyConfig::estimate): the pipeline keeps its stage's layers and parameters and
// sets the activations by schedule and checkpointing, ZeRO shards and adds its buffers,
// data parallelism adds its allreduce. Model state counts what ModelStateBytes counts,
// by the same layout code the strategies run, so the two agree to the byte; traffic is
// one step's, per mesh axis, in the convention of Note [Traffic counters].
struct RankEstimate {
  int rank = 0;                      // the process (its replica threads, if any, estimate alike)
  std::map<std::string, int> coord;  // its coordinate on each axis of the plan's processes
  std::vector<int> layers;           // the model's layers this rank runs, in its order
  // Every layer's parameters (the whole model's tensors, named as one process names them),
  // by layer index; a rank trains those of `layers`.
  std::vector<std::vector<NamedParam>> layer_params;
  // The parameters this rank trains: those of `layers`, in order.
  std::vector<NamedParam> params() const;
  ModelStateBytes state;
  // Elements the optimizer updates on this rank each step (the cost model times that
  // update): the trainable parameters it holds, or under ZeRO its shard of them.
  int64_t updated_elements = 0;
  int64_t activations = 0;  // saved for backward at the peak (an estimate: not measured)
  std::map<std::string, collectives::Traffic> traffic;  // per mesh axis, one step
  // Of `traffic`, the ops issued before the compute they overlap (ZeRO-3's prefetched
  // gathers), so that no rank is late to them: the cost model prices them chained (Note
  // [Fitted collectives]).
  std::map<std::string, collectives::Traffic> chained;
  std::vector<std::string> notes;                       // what an estimate assumed
  // What the cost model reads of the plan beside bytes (set by the strategies' estimate,
  // so that no tool looks into a plugin's options):
  bool hierarchical_data = false;  // the data axis may reduce inside each host first
  // ... and must: the run stops at attach where a data group does not fit its hosts
  // (data_parallel.hierarchical on; core::hierarchical_fits).
  bool hierarchical_data_required = false;
  int virtual_stages = 1;          // pipeline chunks per rank
  // The pipeline schedule's idle fraction of a step, as its simulator finds it with a
  // backward of two forwards (B = W = one under the zero-bubble schedules); -1: no pipeline.
  double pipeline_bubble = -1;
  // The schedule's kind (pipeline.schedule: "1f1b", "zbh1", ...; "" without a pipeline),
  // for a cost model that simulates it again with measured times.
  std::string pipeline_schedule;
  // Parameters, gradients and optimizer slots of `params` held whole, as the trainer's
  // own optimizer holds them (buffers untouched).
  void replicated_state(const JobSpec& spec);
};

// What `train --dry-run` shows a strategy.
struct PlanInput {
  const Plan& plan;
  const JobSpec& spec;
  torch::nn::Sequential& model;  // the whole model, as shapes (nothing created)
  const Dataset& data;
  // One training sample run through the model at the job's precision (probe_layers), taken
  // once for everything the plan works out.
  const LayerProbe& probe;
};

// A plugin section that builds a strategy.
struct StrategyConfig : PluginConfig {
  virtual std::unique_ptr<Strategy> build() const = 0;
  // What the section does to the plan: its axis, its place, the ranks and batch pieces
  // it adds (core/plan.h). `job` is the spec the section was parsed with.
  virtual StrategyRole role(const JobSpec& job) const = 0;
  // The rules this strategy adds to the composition's (Plan::issues), each at the key to
  // change: what the job asks of it that it cannot do.
  virtual std::vector<PlanIssue> issues(const JobSpec& job) const { return {}; }
  // The rules that need the model (as shapes) and a sample of the data, such as whether
  // each pipeline stage fits pipeline.memory_gb: `train --check` and the dry run ask them,
  // on one process; the run meets the same rule where it applies it.
  virtual std::vector<PlanIssue> model_issues(const PlanInput& input) const { return {}; }
  // How this rank's model is built under the strategy (tensor parallelism's sequence
  // split): the trainer asks every strategy before it builds the model's shapes.
  virtual void shape_model(TensorSlot& slot) const {}
  // Lines `train --dry-run` prints for this strategy ("" for none), computed on one
  // process without communicating.
  virtual std::string plan(const PlanInput& input) const { return ""; }
  // Refines this rank's estimate (Note [Per-rank estimate]), on one process without
  // communicating. A strategy that changes nothing a rank holds or sends leaves it.
  virtual void estimate(const PlanInput& input, RankEstimate& rank) const {}
  // The section as the keys its parser reads, leaving out those at their defaults: the C++
  // Plan builder writes it and parses it back, so a job built in code passes the same
  // checks, with the same messages, as a file.
  virtual YAML::Node to_yaml() const = 0;
};

// What the active strategies' model_issues find, one "error: key: message" line each
// (prefixed with the job file's path when it has one); "" when nothing: what `train
// --check` and the tuner ask of a plan once the model's shapes are known.
std::string model_problems(const PlanInput& input);

// Every process rank's estimate: core's start, refined by the active strategies in
// composition order.
std::vector<RankEstimate> estimate_ranks(const PlanInput& input);
// The --dry-run table (one row per rank) with the convention it counts bytes in.
std::string estimate_table(const Plan& plan, const std::vector<RankEstimate>& ranks);
// The same for --json: an array of per-rank objects.
nlohmann::json estimate_json(const std::vector<RankEstimate>& ranks);

}  // namespace tetra::core
