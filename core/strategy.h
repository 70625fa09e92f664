// The strategy-plugin interface.
//
// A strategy owns one mesh axis and hooks the phases of a training step. The trainer
// knows only this interface; plugins register their YAML section (SectionRegistry) and
// build their Strategy from the parsed config. Hooks default to doing nothing, so a
// strategy overrides only the phases it changes.
//
// The phases of one step, in order:
//   attach(state)            once, after the model and optimizer exist (broadcast, hooks)
//   before_backward(last)    before each micro-batch's backward; `last` ends the step
//   finish_gradients()       after the last backward: on return gradients are global
//   (clip, optimizer step)
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "core/job_spec.h"
#include "core/mesh.h"
#include "core/optim.h"
#include "core/report.h"

namespace tetra::core {

// What a strategy may see and change.
struct TrainState {
  const JobSpec& spec;
  torch::nn::Sequential& model;
  std::vector<NamedParam>& params;
  const Mesh* mesh;  // nullptr for a single process
  Trace& trace;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;
  virtual void attach(TrainState& state) {}
  virtual void before_backward(bool last_micro_batch) {}
  virtual void finish_gradients() {}
  // Seconds spent waiting on communication in finish_gradients over the run, and in
  // communication in all (for "how much did backward hide").
  virtual double wait_seconds() const { return 0; }
  virtual double comm_seconds() const { return 0; }
};

// A plugin section that builds a strategy.
struct StrategyConfig : PluginConfig {
  virtual std::unique_ptr<Strategy> build() const = 0;
};

}  // namespace tetra::core
