#include "core/identity.h"

#include <filesystem>
#include <set>

#include "collectives/auth.h"
#include "core/models.h"
#include "core/runtime.h"

namespace tetra::core {

namespace fs = std::filesystem;

// Note [Export config]: beside the safetensors export, what it takes to use the weights
// without the job file or tetra: the model section with its defaults resolved, the input
// it was built for and how a raw example becomes that input (DataInfo::preprocessing:
// Fashion-MNIST's scaling and normalisation, text's byte vocabulary and sequence length),
// every layer in order (its text is torch.nn's repr, so a reader builds the same
// nn.Sequential) with its parameter names, and each tensor's shape and dtype. The Hugging
// Face layout when the export is model.safetensors (config.json beside it); for another
// name, NAME.config.json beside NAME.safetensors, so that two exports in one folder keep
// their own. Every checkpoint carries the same description (meta "export"), so that
// `ckpt export` writes the config too.
nlohmann::json RunIdentity::export_description() const {
  const DataInfo& info = data;
  return {{"framework", "tetra"},
          {"job", spec.name},
          {"model", model(/*with_dropout=*/true)},
          {"input", {{"shape", info.input_shape},
                     {"dtype", info.language_model ? "int64 token ids (bytes, 0-255)" : "float32"},
                     {"classes", info.num_classes},
                     {"language_model", info.language_model},
                     {"preprocessing", info.preprocessing.is_null()
                                           ? nlohmann::json("unknown: the program's own dataset")
                                           : info.preprocessing}}},
          {"output", info.language_model ? "logits [N, seq_len, vocab] over the next byte"
                                         : "logits [N, classes]; the prediction is their argmax"},
          {"layers", layers},
          {"parameters", parameters},
          {"how", "the layers in order form the model; the tensor names are the layers' (index.parameter), as "
                  "torch.nn.Sequential.state_dict() names them. An mlp's and a cnn's layer texts are torch.nn's "
                  "reprs (Linear(in_features=784, ...), ReLU(), ...); a gpt's blocks are tetra's (core/layers.h). "
                  "tetra's C++ zoo builds it as core::build_model(ModelSpec from \"model\", DataInfo from "
                  "\"input\")"}};
}

std::string export_config_path(const std::string& safetensors_path) {
  const fs::path st(safetensors_path);
  return (st.parent_path() / (st.stem() == "model" ? std::string("config.json") : st.stem().string() + ".config.json"))
      .string();
}

void write_export_config(const std::string& safetensors_path, nlohmann::json description, const TensorMap& weights,
                         int64_t step) {
  const fs::path st(safetensors_path);
  const std::string path = export_config_path(safetensors_path);
  nlohmann::json tensors = nlohmann::json::object();
  for (const auto& [name, t] : weights)
    tensors[name] = {{"shape", t.sizes().vec()}, {"dtype", safetensors_dtype_name(t.scalar_type())}};
  description["weights"] = st.filename().string();
  description["tensors"] = tensors;
  description["step"] = step;
  write_file_atomic(path, description.dump(1) + "\n");
}

// Note [Checkpoint identity]: what makes a checkpoint's state mean something, and so must
// match to resume it: the job's name, the model (its section, but dropout, which changes
// no tensor), the data's shapes (an example's shape, the classes or vocabulary; not its
// path, as a moved dataset is the same, nor whether the program or the job made it), and
// the parameter count. The layout (mesh, ZeRO stage, pipeline cut) is not in it:
// checkpoints reshard. What may change across a resume (the optimizer's settings, the
// schedule, dropout, precision) is recorded as settings and listed when it differs.
nlohmann::json RunIdentity::model(bool with_dropout) const {
  nlohmann::json model;
  if (custom_model) {
    model["type"] = "custom";
    return model;
  }
  const ModelSpec& m = spec.model;
  const DataInfo& info = data;
  model["type"] = m.type;
  if (m.type == "gpt") {
    model.update({{"layers", m.layers}, {"heads", m.heads}, {"d_model", m.d_model},
                  {"d_ff", m.d_ff > 0 ? m.d_ff : 4 * m.d_model}, {"seq_len", info.seq_len}, {"vocab", info.num_classes}});
    // Only when off: a checkpoint written before the option has the same identity.
    if (!m.head_bias) model["head_bias"] = false;
  } else {
    model.update({{"hidden", m.hidden}, {"activation", m.activation}});
    if (m.type == "cnn") model["channels"] = m.channels;
  }
  if (with_dropout) model["dropout"] = m.dropout;
  return model;
}

// nlohmann sorts keys, so equal identities hash alike.
std::string fingerprint(const nlohmann::json& identity) {
  return collectives::to_hex(collectives::sha256(identity.dump())).substr(0, 16);
}

namespace {

// Appends "key theirs there, ours here" to `out` for each value under `at` (a key path,
// a.b) that differs, descending into objects (in key order); a missing one is "(none)".
void list_differences(const nlohmann::json& theirs, const nlohmann::json& ours, const std::string& at,
                      std::string& out) {
  if (theirs.is_object() && ours.is_object()) {
    std::set<std::string> keys;
    for (const auto& [k, v] : theirs.items()) keys.insert(k);
    for (const auto& [k, v] : ours.items()) keys.insert(k);
    for (const std::string& k : keys)
      list_differences(theirs.contains(k) ? theirs.at(k) : nlohmann::json(), ours.contains(k) ? ours.at(k) : nlohmann::json(),
                       at.empty() ? k : at + "." + k, out);
    return;
  }
  if (theirs == ours) return;
  auto text = [](const nlohmann::json& v) { return v.is_null() ? std::string("(none)") : v.dump(); };
  out += (out.empty() ? "" : ", ") + at + " " + text(theirs) + " there, " + text(ours) + " here";
}
}  // namespace

std::string differences(const nlohmann::json& theirs, const nlohmann::json& ours) {
  std::string out;
  list_differences(theirs, ours, "", out);
  return out;
}

nlohmann::json RunIdentity::identity() const {
  const DataInfo& info = data;
  return {{"model", model(/*with_dropout=*/false)},
          {"data", {{"input_shape", info.input_shape}, {"classes", info.num_classes},
                    {"language_model", info.language_model}}},
          {"parameters", parameters}};
}

nlohmann::json RunIdentity::settings() const {
  const OptimizerSpec& o = spec.optimizer;
  const ScheduleSpec& s = spec.schedule;
  nlohmann::json j = {{"optimizer.lr", o.lr},
                      {"optimizer.weight_decay", o.weight_decay},
                      {"optimizer.clip_grad_norm", o.clip_grad_norm},
                      {"schedule.type", s.type},
                      {"schedule.warmup_steps", s.warmup_steps},
                      {"schedule.min_lr", s.min_lr},
                      {"schedule.decay_steps", s.decay_steps},
                      {"model.dropout", spec.model.dropout},
                      {"train.precision", to_string(spec.train.precision)},
                      {"train.accumulation_steps", spec.train.accumulation_steps},
                      {"train.recompute", to_string(spec.train.recompute)}};
  if (o.type == "sgd") {
    j["optimizer.momentum"] = o.momentum;
    j["optimizer.nesterov"] = o.nesterov;
  } else {
    j["optimizer.betas"] = {o.beta1, o.beta2};
    j["optimizer.eps"] = o.eps;
  }
  return j;
}

std::string RunIdentity::check_resumable(const CheckpointReader& ckpt, int64_t steps_per_epoch) const {
  const nlohmann::json& meta = ckpt.meta();
  auto expect = [&](const char* key, const nlohmann::json& now) {
    if (meta.contains(key) && meta[key] != now)
      throw ConfigError("checkpoint " + ckpt.folder() + " was written with " + key + " = " + meta[key].dump() +
                        ", this job has " + now.dump() + " (--set checkpoint.resume=never starts afresh)");
  };
  // Note [Checkpoint identity]: another job's, or another model's, is refused before any
  // tensor is read.
  if (meta.contains("job") && meta["job"].is_string() && meta["job"].get<std::string>() != spec.name)
    throw ConfigError("checkpoint " + ckpt.folder() + " belongs to job \"" + meta["job"].get<std::string>() +
                      "\", and this job is \"" + spec.name + "\": resuming it would go on with that job's run. "
                      "--set name=" + meta["job"].get<std::string>() + " goes on with that job; a checkpoint of "
                      "this job's own, or checkpoint.resume=never, starts this one");
  if (const nlohmann::json ours = this->identity(); meta.contains("fingerprint") && meta["fingerprint"] != fingerprint(ours)) {
    // what differs, key by key: model.hidden [1024,1024] there, [512] here
    const std::string list = differences(meta.contains("identity") ? meta["identity"] : nlohmann::json(), ours);
    throw ConfigError("checkpoint " + ckpt.folder() + " holds another model or data (" +
                      (list.empty() ? "its fingerprint differs" : list) +
                      "). --set checkpoint.resume=never starts afresh, and its saves then replace these "
                      "checkpoints; a new name keeps both runs");
  }
  // What may differ, listed in one line by the run.
  std::string changes;
  if (meta.contains("settings") && meta["settings"].is_object()) {
    const nlohmann::json now = settings();
    for (const auto& [key, was] : meta["settings"].items())
      if (now.contains(key) && now[key] != was)
        changes += (changes.empty() ? "" : ", ") + key + " " + was.dump() + " -> " + now[key].dump();
  }
  expect("batch_size", spec.data.batch_size);
  expect("steps_per_epoch", steps_per_epoch);
  expect("optimizer", spec.optimizer.type);
  return changes;
}

void RunIdentity::describe(nlohmann::json& meta, int64_t steps_per_epoch, int data_parallel_ranks) const {
  meta["job"] = spec.name;
  meta["identity"] = identity();
  meta["fingerprint"] = fingerprint(meta["identity"]);
  meta["settings"] = settings();
  meta["export"] = export_description();  // for `ckpt export`
  meta["batch_size"] = spec.data.batch_size;
  meta["steps_per_epoch"] = steps_per_epoch;
  meta["optimizer"] = spec.optimizer.type;
  meta["mesh"] = spec.mesh.str();  // informative: any layout resumes it
  meta["data_parallel_ranks"] = data_parallel_ranks;
}

}  // namespace tetra::core
