// What a run's checkpoints and exports say of it: Note [Checkpoint identity] and Note
// [Export config] (identity.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "core/checkpoint.h"
#include "core/data.h"
#include "core/job_spec.h"
#include "core/safetensors.h"

namespace tetra::core {

// One run's description, from its spec, its data and its model as built (before a
// pipeline keeps its stage's layers).
struct RunIdentity {
  const JobSpec& spec;
  const DataInfo& data;
  bool custom_model = false;   // the program brought its own model (TrainerOptions::model)
  nlohmann::json layers;       // the whole model's, in order: index, layer text, parameters
  int64_t parameters = 0;      // the whole model's parameter count

  // The model section with its defaults resolved ("custom" for a program's own).
  nlohmann::json model(bool with_dropout) const;
  // What must match to resume a checkpoint.
  nlohmann::json identity() const;
  // What may change across a resume, and is listed when it does.
  nlohmann::json settings() const;
  // Note [Export config]: what config.json beside an export says.
  nlohmann::json export_description() const;
  // The meta a checkpoint carries of the run (job, identity, fingerprint, settings,
  // export, and the batch and optimizer it was stepped with).
  void describe(nlohmann::json& meta, int64_t steps_per_epoch, int data_parallel_ranks) const;
  // Refuses (ConfigError) a checkpoint of another job or model, or of another batch size,
  // epoch length or optimizer, before any tensor is read; returns the settings that
  // changed since it was written ("key was -> now, ..."; "" when none did).
  std::string check_resumable(const CheckpointReader& ckpt, int64_t steps_per_epoch) const;
};

// What differs between two identities (or any two JSON values), key by key, in one line:
// "model.hidden [1024,1024] there, [512] here, ..."; "" when they are equal.
std::string differences(const nlohmann::json& theirs, const nlohmann::json& ours);

// A short, stable name for an identity: 16 hex digits of the SHA-256 of its JSON.
std::string fingerprint(const nlohmann::json& identity);

// config.json beside a safetensors export (Note [Export config]): `description` (a
// trainer's, or a checkpoint's meta "export") with the file's name, its tensors' shapes
// and dtypes and the step added. model.safetensors -> config.json; NAME.safetensors ->
// NAME.config.json. Throws tetra::Error when it cannot be written.
void write_export_config(const std::string& safetensors_path, nlohmann::json description, const TensorMap& weights,
                         int64_t step);
std::string export_config_path(const std::string& safetensors_path);

}  // namespace tetra::core
