// ckpt — looks into a tetra checkpoint and turns it into one safetensors file, whatever
// layout (world size, ZeRO shards, pipeline cut) wrote it.
//
//   ckpt show PATH [--parts]                      step, ranks, files, every tensor
//   ckpt export PATH -o OUT.safetensors [--all]   consolidated whole tensors
//   ckpt export PATH --format hf -o FOLDER        a gpt as Hugging Face's GPT-2
//   ckpt verify PATH                              every file's size and CRC-32C
//
// PATH is a step folder (runs/job/ckpt/step-00000500) or a folder of them (its newest;
// `verify` checks every one of them).
// `export` writes the model's weights by default: the tensors named "model/...", without
// that prefix (the names the trainer's checkpoint.safetensors export uses, which any
// safetensors reader loads into the same model); `--all` writes every tensor (optimizer
// state, RNG) under its checkpoint name. Tensors are read one at a time, from the byte
// ranges of the rank files that hold them. `--format hf` writes a gpt as a Hugging Face
// GPT-2 folder (config.json, model.safetensors under GPT-2's names, the byte vocabulary
// as GPT-2's tokenizer files: Note [GPT-2 export] in core/model_io.cpp); PATH may also be
// a run folder or a tetra export there.
//
// Exit status: 0 done; 1 `verify` found a damaged checkpoint (each named, with the file
// and what differs); 2 the command line, the checkpoint or the output is wrong (the
// message, "ckpt: error: ...", names the file).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include "collectives/error.h"
#include "core/checkpoint.h"
#include "core/model_io.h"
#include "core/safetensors.h"
#include "core/text.h"
#include "core/trainer.h"
#include "hardware/topology.h"

namespace {

namespace fs = std::filesystem;
using tetra::core::CheckpointReader;
using tetra::core::CheckpointStore;
using tetra::core::range_str;
using tetra::core::shape_str;


// "312 B" below a KiB, where the kWhole style would say "0 KiB".
std::string size_text(int64_t bytes) {
  using tetra::hardware::ByteDigits;
  return bytes < 1024 ? std::to_string(bytes) + " B" : tetra::hardware::format_bytes(bytes, ByteDigits::kWhole);
}

int64_t tensor_bytes(const CheckpointReader& r, const std::string& name) {
  return r.numel(name) * static_cast<int64_t>(c10::elementSize(r.dtype(name)));
}

int show(const std::string& path, bool parts) {
  CheckpointReader r(path);
  std::printf("checkpoint %s\n", r.folder().c_str());
  // Epochs counted from 1, as train's progress line counts them (meta.json keeps the
  // trainer's own count, from 0).
  std::printf("  step %lld, epoch %lld (%lld step%s into it), format %d, written by %d rank%s\n",
              static_cast<long long>(r.step()), static_cast<long long>(r.epoch() + 1),
              static_cast<long long>(r.step_in_epoch()), r.step_in_epoch() == 1 ? "" : "s", r.format(), r.world(),
              r.world() == 1 ? "" : "s");
  if (!r.meta().empty()) {
    nlohmann::json meta = r.meta();
    const bool described = meta.contains("export");
    meta.erase("export");  // the layers, for `export`'s config.json: long, and said below
    std::printf("  meta %s\n", meta.dump().c_str());
    if (described) std::printf("  export: the model's description is here (`ckpt export` writes it as the config)\n");
  }

  int64_t total = 0;
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& f : r.files()) {
    std::error_code ec;
    const auto size = fs::file_size(fs::path(r.folder()) / f, ec);
    if (!ec) total += static_cast<int64_t>(size);
    files.emplace_back(f, ec ? "missing" : size_text(static_cast<int64_t>(size)));
  }
  std::printf("files: %zu, %s\n", files.size(), size_text(total).c_str());
  size_t w = 0;
  for (const auto& [f, s] : files) w = std::max(w, f.size());
  for (const auto& [f, s] : files)
    std::printf("  %-*s  %s\n", static_cast<int>(w), f.c_str(), s.c_str());

  struct Row {
    std::string name, dtype, shape, bytes, parts;
  };
  std::vector<Row> rows = {{"name", "dtype", "shape", "bytes", "parts"}};
  int64_t tensor_total = 0;
  const auto names = r.names();
  for (const auto& n : names) {
    const int64_t bytes = tensor_bytes(r, n);
    tensor_total += bytes;
    rows.push_back({n, tetra::core::safetensors_dtype_name(r.dtype(n)), shape_str(r.shape(n)),
                    std::to_string(bytes), std::to_string(r.parts(n).size())});
  }
  size_t wn = 0, wd = 0, ws = 0, wb = 0;
  for (const auto& row : rows) {
    wn = std::max(wn, row.name.size());
    wd = std::max(wd, row.dtype.size());
    ws = std::max(ws, row.shape.size());
    wb = std::max(wb, row.bytes.size());
  }
  std::printf("tensors: %zu, %s\n", names.size(), size_text(tensor_total).c_str());
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    std::printf("  %-*s  %-*s  %-*s  %*s  %s\n", static_cast<int>(wn), row.name.c_str(),
                static_cast<int>(wd), row.dtype.c_str(), static_cast<int>(ws), row.shape.c_str(),
                static_cast<int>(wb), row.bytes.c_str(), row.parts.c_str());
    if (parts && i > 0)
      for (const auto& p : r.parts(row.name))
        std::printf("      %s  %s\n", p.file.c_str(), range_str(p.begin, p.end).c_str());
  }
  return 0;
}

int export_weights(const std::string& path, const std::string& output, bool all) {
  CheckpointReader r(path);
  const std::string prefix = "model/";
  tetra::core::TensorMap out;
  int64_t bytes = 0;
  for (const auto& n : r.names()) {
    const bool model = n.rfind(prefix, 0) == 0;
    if (!all && !model) continue;
    const std::string key = all ? n : n.substr(prefix.size());
    out.emplace(key, r.read(n));
    bytes += tensor_bytes(r, n);
  }
  if (out.empty())
    throw tetra::Error("checkpoint " + r.folder() + " has no tensor named " + prefix +
                       "... (--all exports every tensor)");
  tetra::core::save_safetensors(
      output, out, {{"format", "pt"}, {"framework", "tetra"}, {"step", std::to_string(r.step())}});
  std::printf("ckpt: wrote %zu tensors (%s) of step %lld to %s\n", out.size(),
              size_text(bytes).c_str(), static_cast<long long>(r.step()), output.c_str());
  // Note [Export config]: the checkpoint's description of its model and input, beside
  // the weights, as train's own export writes it. (--all's names are not the model's.)
  const std::string config = tetra::core::export_config_path(output);
  if (all) {
    std::printf("ckpt: no config with --all (its tensors are the checkpoint's, not a model's)\n");
  } else if (r.meta().contains("export") && r.meta()["export"].is_object()) {
    tetra::core::write_export_config(output, r.meta()["export"], out, r.step());
    std::printf("ckpt: wrote %s (the model's layers, its input and preprocessing)\n", config.c_str());
  } else {
    std::fprintf(stderr, "ckpt: warning: %s predates model descriptions in checkpoints: no %s was written\n",
                 r.folder().c_str(), config.c_str());
  }
  return 0;
}

int export_hf(const std::string& path, const std::string& output) {
  const tetra::core::LoadedModel loaded = tetra::core::load_model(path);
  const std::vector<std::string> files = tetra::core::write_gpt2(loaded, output);
  std::printf("ckpt: wrote step %lld of %s as GPT-2 (Hugging Face) to %s:\n", static_cast<long long>(loaded.step),
              loaded.source.c_str(), output.c_str());
  for (const auto& f : files) std::printf("  %s\n", f.c_str());
  std::printf("ckpt: transformers.GPT2LMHeadModel.from_pretrained(\"%s\") loads it; config.json names what differs "
              "from GPT-2\n", output.c_str());
  return 0;
}

// Checks meta.json and every file of the checkpoint at `path`, or of every checkpoint in
// the folder `path`: 0 when all are intact, 1 when any is damaged.
int verify(const std::string& path) {
  std::vector<std::string> folders;
  if (fs::exists(fs::path(path) / "meta.json")) {
    folders.push_back(path);
  } else {
    folders = CheckpointStore(path, 1).list();
    if (folders.empty())
      throw tetra::Error("no checkpoint at " + path + " (expected a step-* folder with meta.json)");
  }
  int damaged = 0;
  for (const auto& folder : folders) {
    try {
      CheckpointReader(folder).verify();
      std::printf("ok       %s\n", folder.c_str());
    } catch (const tetra::Error& e) {
      ++damaged;
      std::printf("DAMAGED  %s\n", e.what());
    }
  }
  std::printf("ckpt: %zu checkpoint%s, %d damaged\n", folders.size(), folders.size() == 1 ? "" : "s",
              damaged);
  return damaged ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ckpt: looks into a tetra checkpoint and exports it as one safetensors file",
               "ckpt"};
  app.require_subcommand(1);
  std::string path, output, format = "tetra";
  bool parts = false, all = false;

  CLI::App* show_cmd =
      app.add_subcommand("show", "step, ranks, files and every tensor of a checkpoint");
  show_cmd->add_option("path", path, "a step-* folder, or a folder of them (its newest)")
      ->required();
  show_cmd->add_flag("--parts", parts, "each tensor's parts: the file and element range of each");

  CLI::App* export_cmd = app.add_subcommand("export", "whole tensors into one safetensors file");
  export_cmd->add_option("path", path, "a step-* folder, or a folder of them (its newest)")
      ->required();
  export_cmd->add_option("-o,--output", output, "the safetensors file to write (--format hf: the folder)")->required();
  export_cmd->add_option("--format", format, "tetra (default: one safetensors file and its config) or hf (a gpt as "
                                             "Hugging Face's GPT-2 folder)")
      ->check(CLI::IsMember({"tetra", "hf"}));
  export_cmd->add_flag(
      "--all", all,
      "every tensor under its checkpoint name (default: the model/ tensors, without the prefix)");

  CLI::App* verify_cmd =
      app.add_subcommand("verify", "every file's size and CRC-32C (exit 1 when damaged)");
  verify_cmd->add_option("path", path, "a step-* folder, or a folder of them (each one)")
      ->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  try {
    if (show_cmd->parsed()) return show(path, parts);
    if (verify_cmd->parsed()) return verify(path);
    if (format == "hf") {
      if (all) throw tetra::Error("--all exports a checkpoint's every tensor, --format hf a model's weights: one or the other");
      return export_hf(path, output);
    }
    return export_weights(path, output, all);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckpt: error: %s\n", e.what());
    return 2;
  }
}
