// What tetra writes, read by Python: Debian's torch (python3-torch, for /usr/bin/python3)
// loads the safetensors export and a checkpoint's shards with nothing of tetra's, by the
// format's own rules (an 8-byte little-endian header length, a JSON header of dtype, shape
// and byte offsets, the raw little-endian bytes), and the export's config.json says how
// the model is built (Note [Export config]). Without python3-torch the cases skip and say so.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/job_file.h"
#include "core/job_spec.h"
#include "core/runtime.h"
#include "core/safetensors.h"
#include "core/trainer.h"

namespace fs = std::filesystem;
using namespace tetra;

namespace {

// argv: export.safetensors config.json checkpoint_dir. Loads the export and every
// model/ tensor of the checkpoint (its parts reassembled from the rank files by the
// index of meta.json), checks that they are equal and that config.json lists every
// tensor with its shape and dtype, and prints {name: [shape, dtype, sum]} of the export.
const char* kReader = R"(import json, struct, sys
import torch

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}

def read_safetensors(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = bytearray(data[8 + n:])
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        begin, end = h["data_offsets"]
        t = torch.frombuffer(body, dtype=DTYPES[h["dtype"]], count=(end - begin) // torch.tensor([], dtype=DTYPES[h["dtype"]]).element_size(), offset=begin) if end > begin else torch.empty(0, dtype=DTYPES[h["dtype"]])
        out[name] = t.reshape(h["shape"]).clone()
    return out, header.get("__metadata__", {})

export, metadata = read_safetensors(sys.argv[1])
config = json.load(open(sys.argv[2]))
assert metadata.get("framework") == "tetra", metadata
assert set(config["tensors"]) == set(export), (sorted(config["tensors"]), sorted(export))
for name, t in export.items():
    assert list(t.shape) == config["tensors"][name]["shape"], name
named = [p for layer in config["layers"] for p in layer["parameters"]]
assert sorted(named) == sorted(export), (named, sorted(export))

meta = json.load(open(sys.argv[3] + "/meta.json"))
files = {f: read_safetensors(sys.argv[3] + "/" + f)[0] for f in meta["files"]}
compared = 0
for key, entry in meta["index"].items():
    if not key.startswith("model/"):
        continue
    flat = torch.cat([files[p["file"]][key].reshape(-1) for p in entry["parts"]]) if entry["parts"] else torch.empty(0)
    t = flat.reshape(entry["shape"])
    name = key[len("model/"):]
    assert torch.equal(t, export[name]), name
    compared += 1
assert compared == len(export), (compared, len(export))
print(json.dumps({name: [list(t.shape), str(t.dtype), float(t.double().sum())] for name, t in export.items()}))
)";

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Trains `yaml` (12 steps, its final weights exported to `export_path`), then reads the
// export, its config and the final checkpoint in Python; compares what Python summed with
// what tetra's own loader reads. Returns the config.
nlohmann::json expect_python_reads(const std::string& yaml, const fs::path& d, const std::string& export_name,
                                   const std::string& config_name) {
  core::set_threads(1);
  const fs::path exported = d / export_name;
  {
    core::Trainer t(core::parse_job_string(yaml, "py", {"checkpoint.dir=" + (d / "ckpt").string(),
                                                        "checkpoint.safetensors=" + exported.string()},
                                           core::SectionRegistry{})
                        .spec);
    t.run();
  }
  const fs::path config = d / config_name;
  EXPECT_TRUE(fs::exists(config)) << config;
  fs::path ckpt;
  for (const auto& e : fs::directory_iterator(d / "ckpt"))
    if (e.path().filename().string().rfind("step-", 0) == 0 && e.path() > ckpt) ckpt = e.path();
  std::ofstream(d / "read.py") << kReader;
  const std::string cmd = "/usr/bin/python3 '" + (d / "read.py").string() + "' '" + exported.string() + "' '" +
                          config.string() + "' '" + ckpt.string() + "' >'" + (d / "py.json").string() + "' 2>'" +
                          (d / "py.err").string() + "'";
  if (std::system(cmd.c_str()) != 0) {
    ADD_FAILURE() << "Python could not read what tetra wrote:\n" << slurp(d / "py.err");
    return {};
  }
  const auto seen = nlohmann::json::parse(slurp(d / "py.json"));
  const core::TensorMap ours = core::load_safetensors(exported.string());
  EXPECT_EQ(seen.size(), ours.size());
  for (const auto& [name, t] : ours) {
    if (!seen.contains(name)) {
      ADD_FAILURE() << "Python did not see " << name;
      continue;
    }
    EXPECT_EQ(seen[name][0].get<std::vector<int64_t>>(), t.sizes().vec()) << name;
    const double sum = t.to(torch::kDouble).sum().item<double>();
    EXPECT_NEAR(seen[name][2].get<double>(), sum, 1e-9 * std::max(1.0, std::abs(sum))) << name;
  }
  return nlohmann::json::parse(slurp(config));
}

bool have_torch(std::string& why) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0) return true;
  why = "no torch for /usr/bin/python3 (Debian's python3-torch; tools/setup.sh installs it)";
  return false;
}

fs::path fresh(const std::string& name) {
  const fs::path d = fs::path(testing::TempDir()) / ("export_python_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

}  // namespace

// A gpt exported as model.safetensors: config.json beside it (the Hugging Face layout)
// gives the architecture with d_ff resolved, the context and vocabulary, and the layers.
TEST(ExportInPython, GptExportAndCheckpointLoadInTorchAndConfigSaysHowToBuildIt) {
  std::string why;
  if (!have_torch(why)) GTEST_SKIP() << why;
  const fs::path d = fresh("gpt");
  const nlohmann::json config = expect_python_reads(R"(
model: {type: gpt, layers: 2, heads: 2, d_model: 32}
data: {type: text, path: /usr/share/common-licenses/GPL-3, seq_len: 32, batch_size: 8, eval_samples: 8}
optimizer: {type: adamw, lr: 1.0e-3}
train: {max_steps: 12, eval_every: 0, seed: 2, threads: 1}
log: {metrics: "", progress: off}
)",
                                                    d, "model.safetensors", "config.json");
  if (config.empty()) return;
  EXPECT_EQ(config["model"]["type"], "gpt");
  EXPECT_EQ(config["model"]["layers"], 2);
  EXPECT_EQ(config["model"]["d_ff"], 128);  // 4 x d_model, resolved
  EXPECT_EQ(config["model"]["seq_len"], 32);
  EXPECT_EQ(config["model"]["vocab"], 256);
  EXPECT_EQ(config["input"]["language_model"], true);
  EXPECT_EQ(config["layers"].size(), 4u);  // embedding, 2 blocks, head
  EXPECT_EQ(config["step"], 12);
}

// Another file name keeps its own NAME.config.json; a classifier's says its input shape.
TEST(ExportInPython, MlpExportUnderItsOwnNameLoadsInTorch) {
  std::string why;
  if (!have_torch(why)) GTEST_SKIP() << why;
  const fs::path d = fresh("mlp");
  const nlohmann::json config = expect_python_reads(R"(
model: {type: mlp, hidden: [32]}
data: {type: fashion-mnist, batch_size: 32, eval_samples: 100}
optimizer: {type: sgd, lr: 0.05}
train: {max_steps: 12, eval_every: 0, seed: 2, threads: 1}
log: {metrics: "", progress: off}
)",
                                                    d, "mlp.safetensors", "mlp.config.json");
  if (config.empty()) return;
  EXPECT_EQ(config["model"]["hidden"], nlohmann::json::array({32}));
  EXPECT_EQ(config["input"]["shape"], nlohmann::json::array({1, 28, 28}));
  EXPECT_EQ(config["input"]["classes"], 10);
  EXPECT_EQ(config["weights"], "mlp.safetensors");
}
