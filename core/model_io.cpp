#include "core/model_io.h"

#include <torch/torch.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "collectives/error.h"
#include "core/checkpoint.h"
#include "core/identity.h"
#include "core/init.h"
#include "core/models.h"
#include "core/text.h"

namespace tetra::core {

namespace fs = std::filesystem;
using tetra::detail::concat;

namespace {

// A run folder's weights: its newest checkpoint, else its safetensors export (the job's
// checkpoint.dir and checkpoint.safetensors, in the folder: Note [One run folder]).
std::string run_folder_weights(const fs::path& run) {
  YAML::Node job;
  try {
    job = YAML::LoadFile((run / "job.yaml").string());
  } catch (const std::exception& e) {
    throw Error(concat((run / "job.yaml").string(), ": ", e.what()));
  }
  auto key = [&](const char* name, const std::string& fallback) {
    const YAML::Node ck = job["checkpoint"];
    if (!ck || !ck.IsMap() || !ck[name] || ck[name].IsNull()) return fallback;
    return ck[name].as<std::string>();
  };
  const std::string dir = key("dir", "ckpt"), exported = key("safetensors", "");
  std::string said;
  if (!dir.empty()) {
    const std::string d = in_run_folder(run.string(), dir);
    if (fs::is_directory(d) && !CheckpointStore(d, 1).list().empty()) return d;
    said = "no checkpoint in " + d;
  } else {
    said = "checkpoints off (checkpoint.dir: \"\")";
  }
  if (!exported.empty()) {
    const std::string f = in_run_folder(run.string(), exported);
    if (fs::exists(f)) return f;
    said += ", no export at " + f;
  }
  throw Error(concat("run folder ", run.string(), " has no weights to read (", said,
                     "): give a checkpoint folder or a safetensors export instead"));
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(concat("cannot read ", path));
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw Error(concat(path, " is not JSON: ", e.what()));
  }
}

}  // namespace

ModelSpec model_spec_of(const nlohmann::json& model) {
  ModelSpec m;
  m.type = model.value("type", std::string());
  if (m.type == "gpt") {
    m.layers = model.at("layers").get<int64_t>();
    m.heads = model.at("heads").get<int64_t>();
    m.d_model = model.at("d_model").get<int64_t>();
    m.d_ff = model.value("d_ff", int64_t{0});
    m.head_bias = model.value("head_bias", true);
  } else if (m.type == "mlp" || m.type == "cnn") {
    m.hidden = model.at("hidden").get<std::vector<int64_t>>();
    m.activation = model.value("activation", m.activation);
    if (m.type == "cnn") m.channels = model.at("channels").get<std::vector<int64_t>>();
  } else {
    throw Error(concat("the model is ", m.type.empty() ? std::string("not described") : "\"" + m.type + "\"",
                       ": tetra builds mlp, cnn and gpt (a program's own model needs the program)"));
  }
  m.dropout = model.value("dropout", 0.0);
  return m;
}

DataInfo data_info_of(const nlohmann::json& description) {
  const nlohmann::json& model = description.at("model");
  const nlohmann::json& input = description.at("input");
  DataInfo d;
  d.input_shape = input.at("shape").get<std::vector<int64_t>>();
  d.num_classes = input.at("classes").get<int64_t>();
  d.language_model = input.value("language_model", false);
  if (d.language_model) d.seq_len = model.value("seq_len", d.input_shape.empty() ? 0 : d.input_shape.back());
  d.preprocessing = input.value("preprocessing", nlohmann::json());
  return d;
}

LoadedModel load_model(const std::string& path) {
  const fs::path p(path);
  if (!fs::exists(p)) throw Error(concat(path, " does not exist (a run folder, a checkpoint or a safetensors export)"));
  LoadedModel out;
  out.source = fs::is_directory(p) && fs::exists(p / "job.yaml") && !fs::exists(p / "meta.json")
                   ? run_folder_weights(p)
                   : path;
  CheckpointReader r = CheckpointReader::weights_of(out.source);
  out.step = r.step();
  if (fs::is_directory(out.source)) {
    // A checkpoint carries its description (Note [Export config]); weights_of's reader
    // keeps the checkpoint's meta and its step folder.
    out.source = r.folder();
    if (!r.meta().contains("export"))
      throw Error(concat("checkpoint ", r.folder(), " predates model descriptions in checkpoints: ",
                         "tetra cannot tell which model its tensors belong to"));
    out.description = r.meta()["export"];
  } else {
    const std::string config = export_config_path(out.source);
    if (!fs::exists(config))
      throw Error(concat(out.source, " has no ", config, " beside it: the description of its model"));
    out.description = read_json(config);
  }
  if (!out.description.contains("model") || !out.description.contains("input"))
    throw Error(concat(out.source, ": its description has no model or input section"));
  out.spec = model_spec_of(out.description["model"]);
  out.data = data_info_of(out.description);
  // Shapes, then each tensor's storage the checkpoint's (no initial draw to overwrite).
  out.model = model_shapes(out.spec, out.data);
  std::set<std::string> expected;
  for (const auto& param : out.model->named_parameters()) {
    const std::string name = "model/" + param.key();
    expected.insert(name);
    r.expect_shape(name, param.value().sizes(), "model parameter " + param.key());
  }
  for (const auto& param : out.model->named_parameters())
    place(param.value(), r.read("model/" + param.key()).to(param.value().scalar_type()).contiguous());
  for (const auto& b : out.model->buffers())
    TETRA_CHECK(!b.is_meta(), "the model has a buffer a checkpoint does not hold: ", describe(out.model));
  std::string extra;
  for (const auto& n : r.names())
    if (n.rfind("model/", 0) == 0 && expected.count(n) == 0) extra += (extra.empty() ? "" : ", ") + n.substr(6);
  if (!extra.empty())
    throw Error(concat(out.source, " holds tensors the model described beside it has not: ", extra));
  out.model->eval();
  return out;
}

// ---- GPT-2 ------------------------------------------------------------------------------

// Note [GPT-2 export]
// tetra's gpt is GPT-2's architecture (Radford et al. 2019; Hugging Face's GPT2LMHeadModel):
// learned positional embeddings added to the token embeddings, pre-LayerNorm blocks (eps
// 1e-5) of causal self-attention scaled by 1/sqrt(head dim) with one fused query/key/value
// projection (queries, keys, values in that order, heads contiguous in each), a 4x MLP, a
// final LayerNorm and a linear layer to the vocabulary. Three things differ, and each is
// said or removed:
//  - the MLP's GELU is the exact one (erf); GPT-2's is the tanh approximation. config.json
//    says "activation_function": "gelu", which Hugging Face's GPT-2 runs as the exact one.
//  - the output layer is a weight of its own, not the token table (GPT-2 ties them):
//    "tie_word_embeddings": false, and lm_head.weight is written.
//  - the output layer has a bias by default; GPT-2's lm_head has none and nothing in its
//    config adds one, so a model with it is refused, and model.head_bias: false builds the
//    gpt without it (a run with it can start one without it: checkpoint.init_from with
//    init_strict: false leaves the bias behind).
// Hugging Face's Conv1D keeps a weight as [in, out], torch's Linear as [out, in]: the
// block's four matrices are written transposed. The vocabulary is bytes (data.type text):
// GPT-2's byte-level tokenizer files with no merges hold it, each byte one token whose id
// is its value, which is what tetra feeds the model.
TensorMap gpt2_tensors(const TensorMap& weights, const ModelSpec& spec) {
  TensorMap out;
  std::set<std::string> used;
  auto take = [&](const std::string& name) {
    auto it = weights.find(name);
    if (it == weights.end()) throw Error(concat("the gpt's weights have no ", name, " (a gpt of ", spec.layers, " blocks has)"));
    used.insert(name);
    return it->second.contiguous();
  };
  out["transformer.wte.weight"] = take("0.tok.weight");
  out["transformer.wpe.weight"] = take("0.pos");
  for (int64_t b = 0; b < spec.layers; ++b) {
    const std::string ours = std::to_string(b + 1) + ".", theirs = "transformer.h." + std::to_string(b) + ".";
    // (tetra's name, GPT-2's, whether it is a Conv1D weight: [in, out], transposed)
    static const struct {
      const char *ours, *theirs;
      bool conv1d;
    } kBlock[] = {{"ln1.weight", "ln_1.weight", false},      {"ln1.bias", "ln_1.bias", false},
                  {"qkv.weight", "attn.c_attn.weight", true}, {"qkv.bias", "attn.c_attn.bias", false},
                  {"proj.weight", "attn.c_proj.weight", true}, {"proj.bias", "attn.c_proj.bias", false},
                  {"ln2.weight", "ln_2.weight", false},      {"ln2.bias", "ln_2.bias", false},
                  {"fc1.weight", "mlp.c_fc.weight", true},    {"fc1.bias", "mlp.c_fc.bias", false},
                  {"fc2.weight", "mlp.c_proj.weight", true},  {"fc2.bias", "mlp.c_proj.bias", false}};
    for (const auto& t : kBlock) {
      const at::Tensor w = take(ours + t.ours);
      out[theirs + t.theirs] = t.conv1d ? w.t().contiguous() : w;
    }
  }
  const std::string head = std::to_string(spec.layers + 1) + ".";
  out["transformer.ln_f.weight"] = take(head + "ln.weight");
  out["transformer.ln_f.bias"] = take(head + "ln.bias");
  out["lm_head.weight"] = take(head + "out.weight");
  std::string left;
  for (const auto& [name, t] : weights)
    if (used.count(name) == 0) left += (left.empty() ? "" : ", ") + name;
  if (!left.empty())
    throw ConfigError(concat("GPT-2 has no place for ", left,
                             (weights.count(head + "out.bias") ? " (the output layer's bias: GPT-2's lm_head has none; "
                                                                 "train with model.head_bias: false)"
                                                               : "")));
  return out;
}

nlohmann::json gpt2_config(const ModelSpec& spec, const DataInfo& data) {
  const int64_t d_ff = spec.d_ff > 0 ? spec.d_ff : 4 * spec.d_model;
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", data.num_classes},
          {"n_positions", data.seq_len},
          {"n_ctx", data.seq_len},
          {"n_embd", spec.d_model},
          {"n_layer", spec.layers},
          {"n_head", spec.heads},
          {"n_inner", d_ff},
          {"activation_function", "gelu"},
          {"resid_pdrop", spec.dropout},
          {"embd_pdrop", spec.dropout},
          {"attn_pdrop", spec.dropout},
          {"layer_norm_epsilon", 1e-5},
          {"initializer_range", 0.02},
          {"scale_attn_weights", true},
          {"scale_attn_by_inverse_layer_idx", false},
          {"reorder_and_upcast_attn", false},
          {"tie_word_embeddings", false},
          {"use_cache", true},
          {"bos_token_id", nullptr},
          {"eos_token_id", nullptr},
          {"torch_dtype", "float32"},
          {"tetra_differences_from_gpt2",
           {"activation_function gelu: the exact GELU (GPT-2's is gelu_new, the tanh approximation)",
            "tie_word_embeddings false: lm_head is a weight of its own, not the token table",
            "vocabulary: the 256 bytes, each byte's token id its value (no merges, no <|endoftext|>)"}}};
}

namespace {

// GPT-2's bytes_to_unicode: the printable bytes map to themselves, the rest to 256 + n in
// order, so that every byte is a visible character of the vocabulary.
std::vector<std::string> byte_characters() {
  std::vector<int> printable;
  for (int b = '!'; b <= '~'; ++b) printable.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) printable.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) printable.push_back(b);
  std::vector<int> code(256, -1);
  for (int b : printable) code[static_cast<size_t>(b)] = b;
  int n = 0;
  for (int b = 0; b < 256; ++b)
    if (code[static_cast<size_t>(b)] < 0) code[static_cast<size_t>(b)] = 256 + n++;
  std::vector<std::string> out;
  for (int c : code) {  // UTF-8 of a code point below 0x800
    std::string s;
    if (c < 0x80) {
      s += static_cast<char>(c);
    } else {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    out.push_back(s);
  }
  return out;
}

}  // namespace

std::vector<std::string> write_gpt2(const LoadedModel& loaded, const std::string& folder) {
  if (loaded.spec.type != "gpt")
    throw ConfigError(concat("--format hf writes GPT-2, and ", loaded.source, " holds a model.type ", loaded.spec.type,
                             " (the default safetensors export takes any model)"));
  if (loaded.data.num_classes != 256 || !loaded.data.language_model)
    throw ConfigError(concat("--format hf writes the byte vocabulary of data.type text; ", loaded.source, " has ",
                             loaded.data.num_classes, " tokens"));
  if (loaded.spec.head_bias)
    throw ConfigError(concat(loaded.source, ": the gpt's output layer has a bias (model.head_bias: true, the default), "
                             "and GPT-2's lm_head has none, nor a setting for one: its logits would differ. Train with "
                             "model.head_bias: false (a run can start from this one's weights with checkpoint.init_from "
                             "and checkpoint.init_strict: false, which leaves the bias behind)"));
  TensorMap weights;
  for (const auto& p : loaded.model->named_parameters()) weights[p.key()] = p.value().detach();
  const TensorMap gpt2 = gpt2_tensors(weights, loaded.spec);
  fs::create_directories(folder);
  std::vector<std::string> written;
  auto file = [&](const std::string& name) {
    written.push_back((fs::path(folder) / name).string());
    return written.back();
  };
  save_safetensors(file("model.safetensors"), gpt2,
                   {{"format", "pt"}, {"framework", "tetra"}, {"step", std::to_string(loaded.step)}});
  nlohmann::json config = gpt2_config(loaded.spec, loaded.data);
  config["tetra"] = {{"source", loaded.source}, {"step", loaded.step}, {"model", loaded.description["model"]}};
  write_file_atomic(file("config.json"), config.dump(2) + "\n");
  // The byte vocabulary as GPT-2's tokenizer files.
  const std::vector<std::string> chars = byte_characters();
  nlohmann::json vocab = nlohmann::json::object();
  for (size_t b = 0; b < chars.size(); ++b) vocab[chars[b]] = static_cast<int64_t>(b);
  write_file_atomic(file("vocab.json"), vocab.dump() + "\n");
  write_file_atomic(file("merges.txt"), "#version: 0.2\n");
  const nlohmann::json tokenizer = {{"tokenizer_class", "GPT2Tokenizer"},
                                    {"model_max_length", loaded.data.seq_len},
                                    {"add_prefix_space", false},
                                    {"bos_token", nullptr},
                                    {"eos_token", nullptr},
                                    {"unk_token", nullptr},
                                    {"pad_token", nullptr}};
  write_file_atomic(file("tokenizer_config.json"), tokenizer.dump(2) + "\n");
  const nlohmann::json generation = {{"_from_model_config", true}, {"do_sample", true}, {"max_length", loaded.data.seq_len}};
  write_file_atomic(file("generation_config.json"), generation.dump(2) + "\n");
  return written;
}

}  // namespace tetra::core
