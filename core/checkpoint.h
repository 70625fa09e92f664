// Checkpoints: a folder per step, written so that a kill at any moment leaves the last
// good one intact.
//
//   <dir>/step-00000500/meta.json          step, epoch, position, job, world, files
//   <dir>/step-00000500/rank-00000.safetensors
//
// A checkpoint is assembled in a hidden temporary folder (".step-00000500.tmp"), every
// file fsynced, then renamed into place and the parent fsynced: a folder named step-*
// is always complete. The newest `keep` are kept. Tensors are stored by name
// ("model/3.weight", "optim/3.weight.exp_avg", "rng/cpu") so that later layouts
// (pipeline stages, ZeRO shards) can map them to their own ranks.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/safetensors.h"

namespace tetra::core {

struct Checkpoint {
  int64_t step = 0;           // optimizer steps completed
  int64_t epoch = 0;          // epoch of the next step
  int64_t step_in_epoch = 0;  // index within that epoch of the next step
  TensorMap tensors;          // this rank's tensors
  nlohmann::json meta = nlohmann::json::object();  // anything else (metrics, job name)
};

class CheckpointStore {
 public:
  CheckpointStore(std::string dir, int64_t keep);

  // Writes `ckpt` as this rank's part (rank 0 of 1 for a single process) and returns the
  // checkpoint's folder. Removes the oldest beyond `keep` and stale temporary folders.
  std::string save(const Checkpoint& ckpt);

  // The newest complete checkpoint in the folder, if any.
  std::optional<std::string> latest() const;
  // Every complete checkpoint, oldest first.
  std::vector<std::string> list() const;

  // Loads a checkpoint folder (or, given the store's folder or a parent of step-*
  // folders, its newest). A missing or damaged checkpoint is a tetra::Error naming it.
  static Checkpoint load(const std::string& path);
  // Resolves what `checkpoint.resume` points at: a step folder, or a folder of them.
  static std::optional<std::string> resolve(const std::string& path);

  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  int64_t keep_;
};

}  // namespace tetra::core
