// `ckpt` as a user runs it: a checkpoint written as ZeRO shards by three thread-ranks is
// shown (step, ranks, files, tensors, parts) and exported as one safetensors file of whole
// tensors; bad paths exit 2 with "ckpt: error:" naming them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "collectives/local.h"
#include "core/checkpoint.h"
#include "core/safetensors.h"
#include "tests/tools/spawn.h"

namespace fs = std::filesystem;
using namespace tetra::core;

namespace {

const std::string kCkpt = std::string(TETRA_BIN_DIR) + "/ckpt";

using tetra::testing_tools::Outcome;
using tetra::testing_tools::slurp;

fs::path fresh_dir(const std::string& name) { return tetra::testing_tools::fresh_dir("tetra_ckpt_tool", name); }

Outcome run(const fs::path& dir, const std::vector<std::string>& args) {
  return tetra::testing_tools::run_tool(kCkpt, dir, args);
}

// A small model's state as one process names it.
TensorMap originals() {
  torch::manual_seed(5);
  TensorMap t;
  t["model/0.weight"] = torch::randn({6, 5});
  t["model/0.bias"] = torch::randn({6});
  t["model/2.weight"] = torch::randn({3, 6}).to(torch::kBFloat16);
  t["optim/0.weight.exp_avg"] = torch::randn({6, 5});
  t["optim/step"] = torch::tensor({int64_t{40}});
  return t;
}

// Three thread-ranks save it as ZeRO-style shards: each a contiguous third of the
// concatenated elements of the float tensors (so slices straddle tensor boundaries
// unevenly), the rest whole on rank 0.
fs::path write_sharded(const fs::path& dir, const TensorMap& ref) {
  std::string folder;
  tetra::collectives::run_local_ranks(3, [&](int rank, tetra::collectives::Communicator& world) {
    Checkpoint c;
    c.step = 40;
    c.epoch = 3;
    c.step_in_epoch = 1;
    c.meta["job"] = "tool";
    const std::vector<std::string> sharded = {"model/0.weight", "model/0.bias",
                                              "optim/0.weight.exp_avg"};
    int64_t total = 0;
    for (const auto& n : sharded) total += ref.at(n).numel();
    const int64_t lo = total * rank / 3, hi = total * (rank + 1) / 3;
    int64_t at = 0;
    for (const auto& n : sharded) {
      const torch::Tensor& t = ref.at(n);
      const int64_t b = std::max(lo, at), e = std::min(hi, at + t.numel());
      if (b < e)
        c.slices[n] =
            Slice{t.sizes().vec(), b - at, t.reshape({-1}).slice(0, b - at, e - at).clone()};
      at += t.numel();
    }
    if (rank == 0) {
      c.tensors["model/2.weight"] = ref.at("model/2.weight");
      c.tensors["optim/step"] = ref.at("optim/step");
    }
    std::string f = CheckpointStore(dir.string(), 2).save(c, &world);
    if (rank == 0) folder = f;
  });
  return folder;
}

}  // namespace

TEST(CkptTool, ShowsAShardedCheckpoint) {
  fs::path d = fresh_dir("show");
  const TensorMap ref = originals();
  const fs::path step = write_sharded(d / "ckpt", ref);

  Outcome o = run(d, {"show", (d / "ckpt").string()});  // the folder of steps: its newest
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  EXPECT_NE(o.out.find(step.string()), std::string::npos) << o.out;
  // Epochs from 1, as train's progress line counts them (issue 33, item 7): meta.json's 3 is the fourth.
  EXPECT_NE(o.out.find("step 40, epoch 4 (1 step into it)"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("written by 3 ranks"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("\"job\":\"tool\""), std::string::npos) << o.out;
  for (const char* f :
       {"rank-00000.safetensors", "rank-00001.safetensors", "rank-00002.safetensors"})
    EXPECT_NE(o.out.find(f), std::string::npos) << o.out;
  // One row per tensor: name, dtype, shape, bytes, parts.
  auto row_of = [&](const std::string& name) {
    size_t at = o.out.find("  " + name + " ");
    EXPECT_NE(at, std::string::npos) << name << "\n" << o.out;
    return at == std::string::npos ? std::string() : o.out.substr(at, o.out.find('\n', at) - at);
  };
  const std::string w = row_of("model/0.weight");
  EXPECT_NE(w.find("F32"), std::string::npos) << w;
  EXPECT_NE(w.find("[6, 5]"), std::string::npos) << w;
  EXPECT_NE(w.find(" 120 "), std::string::npos) << w;
  const std::string w2 = row_of("model/2.weight");
  EXPECT_NE(w2.find("BF16"), std::string::npos) << w2;
  EXPECT_NE(w2.find(" 36 "), std::string::npos) << w2;
  EXPECT_EQ(w2.back(), '1') << w2;  // whole on rank 0: one part
  const std::string m = row_of("optim/0.weight.exp_avg");
  EXPECT_EQ(m.back(), '2') << m;  // 30 + 6 + 30 = 66 elements, thirds of 22: ranks 1 and 2
  EXPECT_EQ(o.out.find("rank-00001.safetensors  [0, "), std::string::npos)
      << "parts only with --parts";

  o = run(d, {"show", step.string(), "--parts"});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  EXPECT_NE(o.out.find("rank-00000.safetensors  [0, 22)"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("rank-00001.safetensors  [22, 30)"), std::string::npos)
      << o.out;  // model/0.weight
  EXPECT_NE(o.out.find("rank-00001.safetensors  [0, 6)"), std::string::npos)
      << o.out;  // model/0.bias
  EXPECT_NE(o.out.find("rank-00002.safetensors  [8, 30)"), std::string::npos)
      << o.out;  // the moments
}

TEST(CkptTool, ExportsWholeTensors) {
  fs::path d = fresh_dir("export");
  const TensorMap ref = originals();
  const fs::path step = write_sharded(d / "ckpt", ref);

  // Default: the model's weights, under the names a single process's model uses.
  const fs::path weights = d / "weights.safetensors";
  Outcome o = run(d, {"export", step.string(), "-o", weights.string()});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  EXPECT_NE(o.out.find("3 tensors"), std::string::npos) << o.out;
  std::map<std::string, std::string> md;
  TensorMap got = load_safetensors(weights.string(), &md);
  ASSERT_EQ(got.size(), 3u);
  for (const char* n : {"0.weight", "0.bias", "2.weight"}) {
    ASSERT_TRUE(got.count(n)) << n;
    const torch::Tensor& want = ref.at(std::string("model/") + n);
    EXPECT_EQ(got[n].scalar_type(), want.scalar_type()) << n;
    EXPECT_EQ(got[n].sizes(), want.sizes()) << n;
    EXPECT_TRUE(torch::equal(got[n], want)) << n;
  }
  EXPECT_EQ(md["format"], "pt");
  EXPECT_EQ(md["step"], "40");

  // --all: every tensor under its checkpoint name.
  const fs::path everything = d / "all.safetensors";
  o = run(d, {"export", (d / "ckpt").string(), "--all", "-o", everything.string()});
  ASSERT_EQ(o.status, 0) << o.out << o.err;
  got = load_safetensors(everything.string());
  ASSERT_EQ(got.size(), ref.size());
  for (const auto& [n, t] : ref) EXPECT_TRUE(torch::equal(got.at(n), t)) << n;
}

TEST(CkptTool, BadPathsExit2NamingThem) {
  fs::path d = fresh_dir("bad");
  const std::string missing = (d / "nothing").string();
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"show", missing},
        {"export", missing, "-o", (d / "x.safetensors").string()}}) {
    Outcome o = run(d, args);
    EXPECT_EQ(o.status, 2) << o.out << o.err;
    EXPECT_NE(o.err.find("ckpt: error:"), std::string::npos) << o.err;
    EXPECT_NE(o.err.find(missing), std::string::npos) << o.err;
  }
  EXPECT_FALSE(fs::exists(d / "x.safetensors"));

  // A damaged rank file (it holds only optimizer state): show opens no rank file, the
  // weights export needs none of it, --all names it.
  const fs::path step = write_sharded(d / "ckpt", originals());
  const fs::path f2 = step / "rank-00002.safetensors";
  std::ofstream(f2, std::ios::trunc) << "not safetensors";
  Outcome o = run(d, {"show", step.string()});
  EXPECT_EQ(o.status, 0) << o.out << o.err;
  o = run(d, {"export", step.string(), "-o", (d / "w.safetensors").string()});
  EXPECT_EQ(o.status, 0) << o.out << o.err;
  o = run(d, {"export", step.string(), "--all", "-o", (d / "x.safetensors").string()});
  EXPECT_EQ(o.status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find("ckpt: error:"), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("checkpoint " + step.string() + " is damaged (rank-00002.safetensors: "), std::string::npos)
      << o.err;
  EXPECT_EQ(o.err.find("terminate"), std::string::npos) << o.err;
  EXPECT_FALSE(fs::exists(d / "x.safetensors"));
  std::ofstream(step / "meta.json", std::ios::trunc) << "{ damaged";
  o = run(d, {"show", step.string()});
  EXPECT_EQ(o.status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find((step / "meta.json").string()), std::string::npos) << o.err;

  o = run(d, {});  // no subcommand
  EXPECT_EQ(o.status, 2) << o.out << o.err;
}

TEST(CkptTool, VerifyChecksEveryFileOfEveryCheckpointAndNamesTheDamage) {
  fs::path d = fresh_dir("verify");
  const fs::path step = write_sharded(d / "ckpt", originals());
  Outcome o = run(d, {"verify", step.string()});
  EXPECT_EQ(o.status, 0) << o.out << o.err;
  EXPECT_NE(o.out.find("ok       " + step.string()), std::string::npos) << o.out;

  // A second, older checkpoint; then one flipped byte in the newest's rank 1 file.
  const fs::path older = d / "ckpt" / "step-00000039";
  fs::copy(step, older);
  std::string bytes = slurp(step / "rank-00001.safetensors");
  bytes[bytes.size() - 2] ^= 0x01;
  std::ofstream(step / "rank-00001.safetensors", std::ios::binary | std::ios::trunc) << bytes;
  o = run(d, {"verify", (d / "ckpt").string()});  // a folder: every checkpoint in it
  EXPECT_EQ(o.status, 1) << o.out << o.err;
  EXPECT_NE(o.out.find("ok       " + older.string()), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("DAMAGED  checkpoint " + step.string() + " is damaged (rank-00001.safetensors: CRC-32C 0x"),
            std::string::npos)
      << o.out;
  EXPECT_NE(o.out.find("2 checkpoints, 1 damaged"), std::string::npos) << o.out;

  fs::remove(older / "rank-00002.safetensors");  // a missing shard
  o = run(d, {"verify", older.string()});
  EXPECT_EQ(o.status, 1) << o.out << o.err;
  EXPECT_NE(o.out.find("(rank-00002.safetensors: missing)"), std::string::npos) << o.out;

  o = run(d, {"verify", (d / "nothing").string()});
  EXPECT_EQ(o.status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find((d / "nothing").string()), std::string::npos) << o.err;
}
