// A trained model out of tetra: loaded whole from what a run wrote (for `generate` and
// evaluation), and written as Hugging Face's GPT-2 (Note [GPT-2 export]).
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "core/data.h"
#include "core/job_spec.h"
#include "core/safetensors.h"

namespace tetra::core {

// A model of the zoo with the weights a run wrote, whole, on the CPU, in eval mode.
struct LoadedModel {
  torch::nn::Sequential model;
  ModelSpec spec;               // from the description's "model"
  DataInfo data;                // its input: shape, classes or vocabulary, seq_len
  nlohmann::json description;   // Note [Export config]: the model, its input, the layers
  std::string source;           // what was read: a step folder, or a safetensors file
  int64_t step = 0;
};

// `path`: a run folder (runs/NAME: its newest checkpoint, else its safetensors export), a
// checkpoint (a step folder or a folder of them, any layout), or a tetra safetensors export
// with its config (NAME.config.json or config.json beside it). A tetra::Error names what
// is missing or does not match (a tensor's name or shape).
LoadedModel load_model(const std::string& path);

// ModelSpec and DataInfo from a description's "model" section (Note [Export config]).
ModelSpec model_spec_of(const nlohmann::json& model);
DataInfo data_info_of(const nlohmann::json& description);

// Note [GPT-2 export] (model_io.cpp): the Hugging Face folder of a gpt: config.json
// (model_type gpt2), model.safetensors under GPT-2's names, and the byte vocabulary as
// GPT-2's tokenizer files. A ConfigError when the model is not one GPT-2 can hold (not a
// gpt; an output layer with a bias: model.head_bias false builds it without). Returns the
// files written.
std::vector<std::string> write_gpt2(const LoadedModel& loaded, const std::string& folder);

// GPT-2's tensors of a gpt's weights (single-process names), and its config.json.
TensorMap gpt2_tensors(const TensorMap& weights, const ModelSpec& spec);
nlohmann::json gpt2_config(const ModelSpec& spec, const DataInfo& data);

}  // namespace tetra::core
