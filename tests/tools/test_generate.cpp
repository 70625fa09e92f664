// The GPT leaves tetra (issue 48): `ckpt export --format hf` writes Hugging Face's GPT-2,
// whose logits an independent GPT-2 forward in PyTorch (Debian's python3-torch, written here
// from GPT-2's published architecture, nothing of tetra's) matches; `generate` samples text
// with a key-value cache, the same for a seed every time and from every layout's checkpoint.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "collectives/build_config.h"
#include "core/model_io.h"
#include "core/models.h"
#include "core/runtime.h"
#include "tests/tools/spawn.h"

namespace fs = std::filesystem;
using namespace tetra;
using testing_tools::Outcome;
using testing_tools::slurp;

namespace {

const std::string kBin = TETRA_BIN_DIR;

Outcome run_in(const fs::path& cwd, const std::string& exe, const std::vector<std::string>& args, bool split = false) {
  std::string command = "cd '" + cwd.string() + "' && exec '" + exe + "'";
  for (const std::string& a : args) command += " '" + a + "'";
  const pid_t pid = testing_tools::spawn_tool("/bin/sh", {"-c", command}, cwd / "out.log", split ? cwd / "err.log" : fs::path());
  Outcome r;
  r.status = testing_tools::wait_status(pid);
  r.out = slurp(cwd / "out.log");
  if (split) r.err = slurp(cwd / "err.log");
  return r;
}

// A small gpt GPT-2 can hold (no head bias), dropout on, AdamW: 40 steps.
const char* kJob =
    "name: lm\n"
    "model: {type: gpt, layers: 2, heads: 4, d_model: 32, head_bias: false, dropout: 0.1}\n"
    "data: {type: text, path: /usr/share/common-licenses/GPL-3, seq_len: 48, batch_size: 8, eval_samples: 8}\n"
    "optimizer: {type: adamw, lr: 3.0e-3}\n"
    "train: {max_steps: 40, eval_every: 0, seed: 5, threads: 1}\n"
    "log: {progress: off}\n";

fs::path trained(const std::string& name, const std::vector<std::string>& extra = {}, int np = 1) {
  const fs::path d = testing_tools::fresh_dir("generate", name);
  std::ofstream(d / "job.yaml") << kJob;
  std::vector<std::string> args = {"job.yaml"};
  args.insert(args.end(), extra.begin(), extra.end());
  Outcome r = np == 1 ? run_in(d, kBin + "/train", args)
                      : run_in(d, TETRA_MPIEXEC, testing_tools::mpirun_args(np, kBin + "/train", args));
  EXPECT_EQ(r.status, 0) << r.out;
  return d;
}

bool have_torch(std::string& why) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0) return true;
  why = "no torch for /usr/bin/python3 (Debian's python3-torch; tools/setup.sh installs it)";
  return false;
}


}  // namespace

// The export's logits in the independent GPT-2 equal tetra's own forward of the checkpoint
// (1e-4), for a sequence of the whole context.
TEST(HfExport, Gpt2ForwardInPyTorchMatchesTetrasLogits) {
  std::string why;
  if (!have_torch(why)) GTEST_SKIP() << why;
  const fs::path d = trained("hf");
  const Outcome r = run_in(d, kBin + "/ckpt", {"export", "runs/lm", "--format", "hf", "-o", "hf"});
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* f : {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json"})
    EXPECT_TRUE(fs::exists(d / "hf" / f)) << f;
  const auto config = nlohmann::json::parse(slurp(d / "hf" / "config.json"));
  EXPECT_EQ(config["model_type"], "gpt2");
  EXPECT_EQ(config["n_layer"], 2);
  EXPECT_EQ(config["n_positions"], 48);
  EXPECT_EQ(config["vocab_size"], 256);
  EXPECT_EQ(config["tie_word_embeddings"], false);
  EXPECT_EQ(config["activation_function"], "gelu");

  const std::string text = "You may convey verbatim copies of the Program's source code";  // 48 bytes kept
  std::vector<int64_t> ids;
  for (unsigned char c : text.substr(0, 48)) ids.push_back(c);
  std::ofstream(d / "tokens.json") << nlohmann::json(ids).dump();
  // tests/tools/gpt2_reference.py: GPT-2 from the folder alone, in float64.
  const std::string cmd = "/usr/bin/python3 '" + std::string(TETRA_SOURCE_DIR) + "/tests/tools/gpt2_reference.py' '" +
                          (d / "hf").string() + "' '" +
                          (d / "tokens.json").string() + "' '" + (d / "logits.json").string() + "' 2>'" +
                          (d / "py.err").string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(d / "py.err");
  const auto theirs = nlohmann::json::parse(slurp(d / "logits.json"));

  core::set_threads(1);
  core::LoadedModel ours = core::load_model((d / "runs/lm").string());
  torch::NoGradGuard no_grad;
  const torch::Tensor logits = ours.model->forward(torch::tensor(ids, torch::kLong).unsqueeze(0))[0].to(torch::kDouble);
  ASSERT_EQ(theirs.size(), ids.size());
  double worst = 0;
  for (size_t t = 0; t < ids.size(); ++t)
    for (int64_t v = 0; v < 256; ++v)
      worst = std::max(worst, std::abs(theirs[t][static_cast<size_t>(v)].get<double>() - logits[static_cast<int64_t>(t)][v].item<double>()));
  EXPECT_LT(worst, 1e-4) << "the largest difference of a logit";
  EXPECT_GT(logits.abs().max().item<double>(), 1.0) << "trained logits, not all near zero";
}

// GPT-2's lm_head has no bias: a gpt with one is refused, naming the option that builds it
// without, and nothing is written.
TEST(HfExport, AHeadBiasIsRefusedNamingTheOption) {
  const fs::path d = trained("bias", {"--set", "model.head_bias=true", "--set", "train.max_steps=2"});
  const Outcome r = run_in(d, kBin + "/ckpt", {"export", "runs/lm", "--format", "hf", "-o", "hf"});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("model.head_bias: false"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(d / "hf" / "model.safetensors"));
}

// The cache gives the full forward's logits at every position.
TEST(Generate, TheKeyValueCacheGivesTheFullForwardsLogits) {
  core::set_threads(1);
  core::ModelSpec spec;
  spec.type = "gpt";
  spec.layers = 2;
  spec.heads = 4;
  spec.d_model = 32;
  core::DataInfo data;
  data.input_shape = {24};
  data.num_classes = 256;
  data.language_model = true;
  data.seq_len = 24;
  torch::nn::Sequential model = core::build_model(spec, data, 7);
  model->eval();
  const torch::Tensor tokens = torch::randint(0, 256, {24}, torch::kLong);
  torch::Tensor full;
  {
    torch::NoGradGuard no_grad;
    full = model->forward(tokens.unsqueeze(0))[0];
  }
  core::GptDecoder decoder(model);
  EXPECT_EQ(decoder.context(), 24);
  // 5 at once, then one at a time.
  torch::Tensor last = decoder.next(tokens.slice(0, 0, 5));
  EXPECT_TRUE(torch::allclose(last, full[4], 1e-5, 1e-5));
  for (int64_t t = 5; t < 24; ++t) {
    last = decoder.next(tokens.slice(0, t, t + 1));
    EXPECT_TRUE(torch::allclose(last, full[t], 1e-5, 1e-5)) << "position " << t;
  }
  EXPECT_EQ(decoder.length(), 24);
  EXPECT_THROW(decoder.next(tokens.slice(0, 0, 1)), std::exception);  // the context is full
}

// A seed gives the same text twice; from the checkpoints of one process, of two data ranks
// under ZeRO-3 and of a two-stage pipeline (the same training within float rounding), the
// same text; another seed another text. tokens/s is printed.
TEST(Generate, ASeedGivesTheSameTextEveryTimeAndFromEveryLayout) {
  const fs::path one = trained("one");
  const fs::path zero3 = trained("zero3", {"--set", "zero.stage=3"}, 2);
  const fs::path piped = trained("piped", {"--set", "mesh.pipeline=2", "--set", "pipeline.micro_batches=4"}, 2);
  auto generate = [](const fs::path& d, const std::string& seed, const std::string& from) {
    const Outcome r = run_in(d, kBin + "/generate", {from, "--prompt", "This License", "--tokens", "80", "--seed", seed,
                                                     "--top-k", "40", "--temperature", "0.8", "--threads", "1"},
                             /*split=*/true);
    EXPECT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.err.find("tokens/s"), std::string::npos) << r.err;
    return r.out;
  };
  const std::string text = generate(one, "11", "runs/lm");
  ASSERT_EQ(text.size(), std::string("This License").size() + 80 + 1) << text;  // prompt, 80 bytes, a newline
  EXPECT_EQ(text.rfind("This License", 0), 0u);
  EXPECT_EQ(generate(one, "11", "runs/lm"), text);
  EXPECT_EQ(generate(one, "11", "runs/lm/ckpt"), text);  // the checkpoint folder itself
  EXPECT_EQ(generate(zero3, "11", "runs/lm"), text) << "zero-3 over 2 ranks";
  EXPECT_EQ(generate(piped, "11", "runs/lm"), text) << "pipeline 2";
  EXPECT_NE(generate(one, "12", "runs/lm"), text);

  const Outcome missing = run_in(one, kBin + "/generate", {"runs/nothing", "--prompt", "x"}, true);
  EXPECT_EQ(missing.status, 2);
  EXPECT_NE(missing.err.find("runs/nothing does not exist"), std::string::npos) << missing.err;
}
