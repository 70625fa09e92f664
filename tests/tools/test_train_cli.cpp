// `train` as a user runs it: exit codes, compiler-style errors, and a run killed with
// SIGKILL mid-training that resumes and follows the uninterrupted run exactly.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "collectives/build_config.h"
#include "core/safetensors.h"
#include "hardware/env.h"
#include "tests/tools/spawn.h"

namespace fs = std::filesystem;

namespace {

const std::string kTrain = std::string(TETRA_BIN_DIR) + "/train";

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::path(testing::TempDir()) / ("tetra_cli_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

struct Outcome {
  int status = -1;
  std::string out;  // stdout and stderr together
};

// Starts `exe args...` with stdout and stderr both going to `log`.
pid_t spawn_program(const std::string& exe, const std::vector<std::string>& args, const fs::path& log) {
  return tetra::testing_tools::spawn_tool(exe, args, log);
}

pid_t spawn(const std::vector<std::string>& args, const fs::path& log) { return spawn_program(kTrain, args, log); }

using tetra::testing_tools::slurp;

// Runs `exe args...` to its end; its exit status and everything it printed.
Outcome run_program(const std::string& exe, const std::vector<std::string>& args) {
  fs::path log = fs::path(testing::TempDir()) / ("tetra_cli_" + std::to_string(::getpid()) + ".log");
  pid_t pid = spawn_program(exe, args, log);
  Outcome r;
  r.status = tetra::testing_tools::wait_status(pid);
  r.out = slurp(log);
  return r;
}

Outcome run(const std::vector<std::string>& args) { return run_program(kTrain, args); }

fs::path write_job(const fs::path& dir, const std::string& name, const std::string& text) {
  fs::path p = dir / name;
  std::ofstream(p) << text;
  return p;
}

// `job` with its run folder, checkpoints and metrics under `dir` (dir/ckpt, dir/m.jsonl).
std::vector<std::string> run_args(const std::string& job, const fs::path& dir) {
  return {job, "--set", "checkpoint.dir=" + (dir / "ckpt").string(), "--set",
          "log.metrics=" + (dir / "m.jsonl").string(), "--set", "log.dir=" + dir.string()};
}

// Waits (up to three minutes) until `path` exists: a checkpoint a running job wrote.
void wait_for(const fs::path& path) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(3);
  while (!fs::exists(path) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
}

// step -> loss of the train records (a later record of a step replaces an earlier one).
std::map<int64_t, double> losses(const fs::path& metrics) {
  std::map<int64_t, double> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto rec = nlohmann::json::parse(line);
    if (!rec.value("eval", false)) out[rec["step"].get<int64_t>()] = rec["loss"].get<double>();
  }
  return out;
}

}  // namespace

TEST(TrainCli, MalformedJobIsACompilerStyleErrorWithExit2) {
  fs::path d = fresh_dir("bad");
  fs::path job = write_job(d, "job.yaml",
                           "model: {type: mlp}\n"
                           "optimizer:\n"
                           "  lr: fast\n"
                           "  tyep: adam\n");
  Outcome r = run({job.string(), "--check"});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find(job.string() + ":3:7: error: optimizer.lr: expected a number, got \"fast\""),
            std::string::npos) << r.out;
  EXPECT_NE(r.out.find(job.string() + ":4:3: error: optimizer.tyep: unknown key; did you mean \"type\"?"),
            std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("terminate"), std::string::npos) << r.out;
}

TEST(TrainCli, BrokenYamlMissingFileAndBadFlagsExit2) {
  fs::path d = fresh_dir("broken");
  fs::path job = write_job(d, "job.yaml", "model: {type: mlp\ndata: [\n");
  Outcome r = run({job.string()});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find(job.string() + ":"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("error: invalid YAML"), std::string::npos) << r.out;

  r = run({(d / "nope.yaml").string()});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("nope.yaml"), std::string::npos) << r.out;

  r = run({"--no-such-flag", job.string()});
  EXPECT_EQ(r.status, 2) << r.out;

  fs::path ok = write_job(d, "ok.yaml", "data: {type: fashion-mnist, path: /no/such/folder}\n");
  r = run({ok.string(), "--set", "train.max_steps=1"});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("/no/such/folder"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("dataset-fashion-mnist"), std::string::npos) << r.out;
}

// Issue 33, item 7: `train configs/dp.yaml --np 2` wanted two processes; --np only plans
// them (a --dry-run option), and the run used to fail on the mesh instead. It now says
// how to launch, before anything runs, exit 2.
TEST(TrainCli, NpWithoutDryRunSaysHowToLaunch) {
  const std::string dp = std::string(TETRA_SOURCE_DIR) + "/configs/dp.yaml";
  Outcome r = run({dp, "--np", "2"});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("train: error: --np is an option of --dry-run"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("mpirun -np 2 train " + dp), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("mesh data=2"), std::string::npos) << r.out;
  r = run({dp, "--json"});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--json is an option of --dry-run"), std::string::npos) << r.out;
}

// Issue 33, item 7: the mesh's check against the world and a checkpoint's shape check
// had neither the "train: error:" prefix every other error has nor a hint a
// command-line user can type: both now say `--set ...`.
TEST(TrainCli, MeshAndCheckpointShapeErrorsHaveThePrefixAndSetHints) {
  fs::path d = fresh_dir("prefix");
  const std::string dp = std::string(TETRA_SOURCE_DIR) + "/configs/dp.yaml";
  Outcome r = run({dp, "--set", "mesh.data=2", "--set", "log.dir=" + (d / "dp").string()});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("train: error: mesh data=2 = 2 ranks, but the world has 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("mpirun -np 2 train ..."), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--set mesh.data=1"), std::string::npos) << r.out;

  const std::string job = write_job(d, "job.yaml", R"(
model: {type: mlp, hidden: [32]}
data: {type: synthetic, batch_size: 16}
train: {max_steps: 2, threads: 1}
log: {progress: off, metrics: ""}
)").string();
  const std::vector<std::string> where = {"--set", "checkpoint.dir=" + (d / "ckpt").string(), "--set",
                                          "log.dir=" + (d / "run").string()};
  std::vector<std::string> first = {job};
  first.insert(first.end(), where.begin(), where.end());
  ASSERT_EQ(run(first).status, 0);
  std::vector<std::string> wider = {job, "--set", "model.hidden=[48]", "--set", "train.max_steps=4"};
  wider.insert(wider.end(), where.begin(), where.end());
  r = run(wider);
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("train: error: checkpoint "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--set checkpoint.resume=never starts afresh"), std::string::npos) << r.out;
}

// Issue 28, item 9: a run folder that cannot be written is the job's to change: exit 2
// naming log.dir, before anything trains (it was exit 1 from the metrics file), and
// --check finds it too. /proc takes no new entry, even from root.
TEST(TrainCli, AnUnwritableLogDirIsExit2NamingIt) {
  const fs::path d = fresh_dir("unwritable");
  const std::string job = write_job(d, "job.yaml", R"(
model: {type: mlp, hidden: [32]}
data: {type: synthetic, batch_size: 16}
train: {max_steps: 2, threads: 1}
log: {progress: off, dir: /proc/tetra-no-such/run}
checkpoint: {dir: ""}
)").string();
  for (const std::vector<std::string>& args : {std::vector<std::string>{job}, std::vector<std::string>{job, "--check"}}) {
    const Outcome r = run(args);
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_NE(r.out.find("train: error: log.dir: /proc/tetra-no-such/run cannot be written"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("step 1"), std::string::npos) << r.out;
  }
}

// Issue 28, item 7: train.device: cuda on a machine without CUDA (this one) is exit 2
// naming the device and what is missing, before anything trains, in a run and in --check;
// --schema and --list-keys know the key and its words. Skipped where a GPU is usable.
TEST(TrainCli, CudaWithoutAGpuIsExit2NamingWhatIsMissing) {
  const fs::path d = fresh_dir("cuda");
  const std::string job = write_job(d, "job.yaml", R"(
model: {type: mlp, hidden: [32]}
data: {type: synthetic, batch_size: 16}
train: {max_steps: 2, threads: 1, device: cuda}
log: {progress: off}
)").string();
  const Outcome r = run({job, "--set", "log.dir=" + (d / "run").string()});
  if (r.status == 0) GTEST_SKIP() << "a GPU is usable here: " << r.out;
  EXPECT_EQ(r.status, 2) << r.out;
  const bool no_cuda = r.out.find("train: error: train.device: cuda, but this tetra is built against a LibTorch "
                                  "without CUDA") != std::string::npos;
  const bool no_gpu = r.out.find("train: error: train.device: cuda, but no GPU is visible") != std::string::npos;
  EXPECT_TRUE(no_cuda || no_gpu) << r.out;
  EXPECT_NE(r.out.find("set train.device=cpu"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("step 1"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(d / "run" / "metrics.jsonl"));
  const Outcome check = run({job, "--check", "--set", "log.dir=" + (d / "run").string()});
  EXPECT_EQ(check.status, 2) << check.out;
  EXPECT_NE(check.out.find("train.device: cuda, but"), std::string::npos) << check.out;
  // The CPU is the default, and a word that is not a device is a config error with the choices.
  const Outcome typo = run({job, "--check", "--set", "train.device=gpu"});
  EXPECT_EQ(typo.status, 2) << typo.out;
  EXPECT_NE(typo.out.find("cpu"), std::string::npos) << typo.out;
  EXPECT_NE(typo.out.find("cuda"), std::string::npos) << typo.out;
  const Outcome schema = run({"--schema"});
  ASSERT_EQ(schema.status, 0) << schema.out;
  const nlohmann::json j = nlohmann::json::parse(schema.out);
  const nlohmann::json device = j["properties"]["train"]["properties"]["device"];
  // The words, and null (a key left empty takes the default), as every word-valued key.
  EXPECT_EQ(device["enum"], nlohmann::json({"cpu", "cuda", nullptr})) << device.dump();
  EXPECT_EQ(device["default"], "cpu") << device.dump();
  const Outcome keys = run({"--list-keys"});
  EXPECT_NE(keys.out.find("train.device"), std::string::npos) << keys.out;
}

// Issue 33, item 7: configs/zero.yaml promised "10 bytes per parameter instead of 16"
// while its 25 MB units held the model's gradients whole (ZeRO-2 then saved nothing on
// them). Its dry run, which equals the run to the byte, now keeps the promise as the
// comment states it: 10 bytes per parameter plus the one unit on its way (the largest
// layer, 1024 x 1024 floats), and buffers never above the gradients a rank would hold
// without ZeRO.
TEST(TrainCli, ZeroConfigHoldsWhatItsCommentPromises) {
  const std::string zero = std::string(TETRA_SOURCE_DIR) + "/configs/zero.yaml";
  Outcome r = run({zero, "--dry-run", "--json"});
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json plan = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  const double params = plan["parameters"].get<double>();
  ASSERT_EQ(plan["estimate"].size(), 2u);
  for (const auto& rank : plan["estimate"]) {
    const auto& b = rank["bytes"];
    const double state = b["parameters"].get<double>() + b["gradients"].get<double>() + b["optimizer"].get<double>() +
                         b["buffers"].get<double>();
    EXPECT_LE(b["buffers"].get<double>(), 4.0 * 1024 * 1024) << b.dump();
    EXPECT_LE(state, 10 * params + 4.0 * 1024 * 1024 + 4096) << b.dump();
    EXPECT_LT(state, 16 * params * 0.8) << b.dump();
  }
}

TEST(TrainCli, SetOverridesAndPrintConfigShowsDefaults) {
  fs::path d = fresh_dir("print");
  fs::path job = write_job(d, "job.yaml", "model: {type: mlp}\n");
  Outcome r = run({job.string(), "--set", "optimizer.lr=0.05", "--set", "model.hidden=[64]", "--print-config"});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("lr: 0.05"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("eps:"), std::string::npos) << r.out;         // a default
  EXPECT_NE(r.out.find("accumulation_steps: 1"), std::string::npos) << r.out;
  // --set before the job file takes one value and leaves the job to the positional.
  r = run({"--set", "optimizer.lr=0.07", job.string(), "--print-config"});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("lr: 0.07"), std::string::npos) << r.out;
  r = run({job.string(), "--set", "optimizer.lr=fast", "--check"});
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("--set optimizer.lr=fast: error: optimizer.lr: expected a number"), std::string::npos)
      << r.out;
}

// Issue 48, item 7: collectives.check was accepted but missing from --schema, --list-keys
// and --print-config; --print-config left out the strategies a job does not use, though
// it prints every key. Now the key is in all three, and a left-out strategy's section is
// printed as comments (as keys it would turn the strategy on), and log.dir left unset
// says where it goes.
TEST(TrainCli, EveryKeyIsInTheSchemaTheKeyListAndPrintConfig) {
  fs::path d = fresh_dir("everykey");
  fs::path job = write_job(d, "job.yaml", "name: every\nmodel: {type: mlp}\n");
  const Outcome keys = run({"--list-keys"});
  ASSERT_EQ(keys.status, 0) << keys.out;
  EXPECT_NE(keys.out.find("\ncollectives.check\n"), std::string::npos) << keys.out;
  EXPECT_NE(keys.out.find("\nmesh.data=auto\n"), std::string::npos) << keys.out;
  const Outcome schema = run({"--schema"});
  ASSERT_EQ(schema.status, 0) << schema.out;
  const nlohmann::json s = nlohmann::json::parse(schema.out);
  EXPECT_EQ(s["properties"]["collectives"]["properties"]["check"]["type"], nlohmann::json({"boolean", "null"}));
  EXPECT_EQ(s["properties"]["mesh"]["properties"]["data"]["default"], "auto");
  const Outcome printed = run({job.string(), "--print-config"});
  ASSERT_EQ(printed.status, 0) << printed.out;
  EXPECT_NE(printed.out.find("  check: ~\n"), std::string::npos) << printed.out;
  EXPECT_NE(printed.out.find("  data: auto\n"), std::string::npos) << printed.out;
  EXPECT_NE(printed.out.find("# log.dir ~ (unset) follows the name: this run's folder is runs/every"), std::string::npos)
      << printed.out;
  EXPECT_NE(printed.out.find("# Left out of this job"), std::string::npos) << printed.out;
  EXPECT_NE(printed.out.find("# zero:\n#   stage: "), std::string::npos) << printed.out;
  // What --print-config prints is a job file that parses as the same job.
  write_job(d, "printed.yaml", printed.out);
  const Outcome again = run({(d / "printed.yaml").string(), "--print-config"});
  ASSERT_EQ(again.status, 0) << again.out;
  EXPECT_EQ(again.out, printed.out);
}

// Issue 48, item 3 (Note [Auto axis]): mesh.data is auto unless given, the world over the
// other axes' product; --dry-run --np sizes it the same way; one auto axis at most; a
// world the other axes do not divide is an error that names the equation.
TEST(TrainCli, TheDataAxisSizesItselfForTheDryRunsWorld) {
  fs::path d = fresh_dir("autoaxis");
  const std::string dp = std::string(TETRA_SOURCE_DIR) + "/configs/dp.yaml";
  Outcome r = run({dp, "--dry-run", "--np", "4"});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("mesh data=4 = 4 processes"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("256 global = 4 data-parallel ranks"), std::string::npos) << r.out;
  const std::string pp = write_job(d, "pp.yaml", "model: {type: mlp, hidden: [64, 64, 64]}\ndata: {batch_size: 96}\n"
                                                 "mesh: {pipeline: 2}\n").string();
  r = run({pp, "--dry-run", "--np", "6"});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("mesh pipeline=2 x data=3 = 6 processes"), std::string::npos) << r.out;
  r = run({pp, "--dry-run", "--np", "3"});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("error: mesh.data: auto: data = world / (pipeline=2) = 3 / 2, which is not a whole number of "
                       "ranks: the world has 3 (--np 3)"),
            std::string::npos)
      << r.out;
  r = run({pp, "--check", "--set", "mesh.pipeline=auto", "--set", "mesh.data=auto"});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("only one axis may be auto, and pipeline and data are"), std::string::npos) << r.out;
  r = run({pp, "--check", "--set", "mesh.data=atuo"});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("mesh.data: expected an integer or auto, got \"atuo\"; did you mean \"auto\"?"),
            std::string::npos)
      << r.out;
  // Another axis auto: data is then 1 unless given.
  r = run({pp, "--dry-run", "--np", "4", "--set", "mesh.pipeline=auto", "--set", "mesh.data=2"});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("mesh pipeline=2 x data=2 = 4 processes"), std::string::npos) << r.out;
}

TEST(TrainCli, KilledRunResumesAndFollowsTheUninterruptedRun) {
  fs::path d = fresh_dir("kill");
  const std::string job = write_job(d, "job.yaml", R"(
model: {type: mlp, hidden: [256, 256], dropout: 0.1}
data: {type: fashion-mnist, batch_size: 64, eval_samples: 1000}
optimizer: {type: adamw, lr: 1.0e-3}
schedule: {type: cosine, warmup_steps: 10}
train: {max_steps: 400, seed: 3, threads: 1}
checkpoint: {every_steps: 50, keep: 2}
log: {every: 1, progress: plain}
)").string();
  auto args = [&](const std::string& sub) { return run_args(job, d / sub); };
  Outcome whole = run(args("whole"));
  ASSERT_EQ(whole.status, 0) << whole.out;

  // Start the same job and SIGKILL it once its second checkpoint is on disk.
  pid_t pid = spawn(args("killed"), d / "killed.log");
  wait_for(d / "killed" / "ckpt" / "step-00000100" / "meta.json");
  kill(pid, SIGKILL);
  int st = 0;
  waitpid(pid, &st, 0);
  ASSERT_TRUE(WIFSIGNALED(st)) << "the run finished before it could be killed: " << slurp(d / "killed.log");

  Outcome resumed = run(args("killed"));
  ASSERT_EQ(resumed.status, 0) << resumed.out;
  EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << resumed.out;

  auto a = losses(d / "whole" / "m.jsonl"), b = losses(d / "killed" / "m.jsonl");
  ASSERT_EQ(a.size(), 400u);
  ASSERT_EQ(b.size(), 400u);
  for (const auto& [step, loss] : a) EXPECT_EQ(b[step], loss) << "step " << step;
}

// The real multi-process path: `mpirun -np N train` with mesh {data: N} follows the
// single-process run of the same job at every step (relative 1e-5, fp32).
namespace {

// mpirun's arguments for `train args...` on np local ranks (as root too: CI runs as root).
std::vector<std::string> mpi_args(int np, const std::vector<std::string>& args) {
  return tetra::testing_tools::mpirun_args(np, kTrain, args);
}

Outcome run_mpi(int np, const std::vector<std::string>& args) { return run_program(TETRA_MPIEXEC, mpi_args(np, args)); }

// `many` adds settings for the mpirun side only (the mesh and its strategies), `both`
// for both runs (the optimizer, say).
void expect_mpi_follows_single(int np, const std::string& batch, std::vector<std::string> many_sets = {},
                               const std::vector<std::string>& both = {}) {
  fs::path d = fresh_dir("mpi" + std::to_string(np));
  const std::string job = write_job(d, "job.yaml", R"(
model: {type: mlp, hidden: [128, 64]}
data: {type: fashion-mnist, eval_samples: 900}
optimizer: {type: adamw, lr: 2.0e-3}
train: {max_steps: 30, seed: 2, threads: 1}
data_parallel: {bucket_mb: 0.1}
checkpoint: {dir: ""}
log: {every: 1, progress: plain}
)").string();
  std::vector<std::string> one_args = {job, "--set", "data.batch_size=" + batch, "--set",
                                       "log.metrics=" + (d / "one.jsonl").string(), "--set", "log.dir=" + (d / "one").string()};
  for (const auto& kv : both) {
    one_args.push_back("--set");
    one_args.push_back(kv);
    many_sets.push_back(kv);
  }
  Outcome one = run(one_args);
  ASSERT_EQ(one.status, 0) << one.out;
  if (many_sets.size() == both.size()) many_sets.push_back("mesh.data=" + std::to_string(np));
  std::vector<std::string> args = {job, "--set", "data.batch_size=" + batch, "--set",
                                   "log.metrics=" + (d / "many.jsonl").string(), "--set", "log.dir=" + (d / "many").string()};
  for (const auto& kv : many_sets) {
    args.push_back("--set");
    args.push_back(kv);
  }
  Outcome many = run_mpi(np, args);
  ASSERT_EQ(many.status, 0) << many.out;
  EXPECT_NE(many.out.find("mpirun, world " + std::to_string(np)), std::string::npos) << many.out;
  auto a = losses(d / "one.jsonl"), b = losses(d / "many.jsonl");
  ASSERT_EQ(a.size(), 30u);
  ASSERT_EQ(b.size(), 30u);
  for (const auto& [step, loss] : a) EXPECT_NEAR(b[step], loss, 1e-5 * loss) << "step " << step;
}

}  // namespace

// Under a real torchrun (Debian's python3-torch), `--no_python`, gloo: with its static
// rendezvous the agent already serves the store on MASTER_PORT and the ranks join it as
// clients (TORCHELASTIC_USE_AGENT_STORE); with --standalone rank 0 serves its own. Both
// follow one process with plain SGD, and the banner says how the ranks were found.
// (`-r 1 -t 1`: torchrun 1.13 on Python 3.11 cannot parse its own default of 0 there.
// TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: from 2.4 torchrun's c10d rendezvous, which
// --standalone uses, hands the ranks its own store unless told not to; 1.13 never did.)
TEST(TrainTorchrun, BothRendezvousFollowOneProcessWithPlainSgd) {
  const std::string torchrun = "/usr/bin/torchrun";
  if (::access(torchrun.c_str(), X_OK) != 0) GTEST_SKIP() << "no torchrun (Debian's python3-torch; tools/setup.sh installs it)";
  fs::path d = fresh_dir("torchrun");
  const std::string job = write_job(d, "job.yaml", R"(
model: {type: mlp, hidden: [64]}
data: {type: synthetic, batch_size: 64, classes: 10}
optimizer: {type: sgd, lr: 0.1}
train: {max_steps: 12, seed: 4, threads: 1}
collectives: {backend: gloo, timeout_s: 60}
checkpoint: {dir: ""}
log: {every: 1, progress: plain}
)").string();
  auto metrics = [&](const std::string& tag) {
    return std::vector<std::string>{"--set", "log.metrics=" + (d / (tag + ".jsonl")).string(), "--set",
                                    "checkpoint.safetensors=" + (d / (tag + ".safetensors")).string(), "--set",
                                    "log.dir=" + (d / tag).string()};
  };
  std::vector<std::string> one_args = {job};
  for (const auto& a : metrics("one")) one_args.push_back(a);
  Outcome one = run(one_args);
  ASSERT_EQ(one.status, 0) << one.out;
  const auto a = losses(d / "one.jsonl");
  const auto wa = tetra::core::load_safetensors((d / "one.safetensors").string());
  struct Case {
    std::string tag;
    std::vector<std::string> rendezvous;
    std::string banner;
  };
  const std::string port = std::to_string(tetra::testing_tools::free_port());
  setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1", 1);
  for (const Case& c : {Case{"static", {"--nnodes", "1", "--master_port", port}, "torchrun's agent's)"},
                        Case{"standalone", {"--standalone"}, "rank 0's)"}}) {
    std::vector<std::string> args = c.rendezvous;
    for (const char* x : {"--nproc_per_node", "2", "-r", "1", "-t", "1", "--no_python"}) args.push_back(x);
    args.push_back(kTrain);
    args.push_back(job);
    for (const auto& x : metrics(c.tag)) args.push_back(x);
    for (const char* x : {"--set", "mesh.data=2"}) args.push_back(x);
    Outcome many = run_program(torchrun, args);
    ASSERT_EQ(many.status, 0) << c.tag << "\n" << many.out;
    EXPECT_NE(many.out.find("torchrun, world 2, local ranks 2 (RANK, WORLD_SIZE; store at "), std::string::npos) << many.out;
    EXPECT_NE(many.out.find(c.banner), std::string::npos) << many.out;
    const auto b = losses(d / (c.tag + ".jsonl"));
    ASSERT_EQ(b.size(), a.size()) << many.out;
    for (const auto& [step, loss] : a) EXPECT_NEAR(b.at(step), loss, 1e-5 * loss) << c.tag << ", step " << step;
    const auto wb = tetra::core::load_safetensors((d / (c.tag + ".safetensors")).string());
    ASSERT_EQ(wa.size(), wb.size());
    for (const auto& [key, t] : wa)
      EXPECT_LE((wb.at(key) - t).abs().max().item<double>(), 1e-5 * std::max(1.0, t.abs().max().item<double>()))
          << c.tag << ": " << key;
  }
}

// Issue 33, item 5: `mpirun -np 2 train job.yaml > f 2>&1` with log.progress left to
// auto. Open MPI gives each rank a pseudo-terminal even when mpirun's own output is a
// file, so a rank cannot tell a person from a file by isatty(): under a launcher the live
// line is off unless asked for (log.progress: line). The file holds plain lines, no
// carriage returns or escape codes, and the progress of rank 0 alone. Item 7 on the same
// run: the closing summary names the per-rank traces, not a t.json that does not exist.
TEST(TrainMpi, RedirectedOutputUnderMpirunIsPlainLinesFromRankZero) {
  fs::path d = fresh_dir("mpi_plain");
  const std::string job = write_job(d, "job.yaml", R"(
model: {type: mlp, hidden: [16]}
data: {type: synthetic, batch_size: 32}
optimizer: {type: sgd, lr: 0.05}
train: {max_steps: 6, threads: 1}
mesh: {data: 2}
checkpoint: {dir: ""}
log: {every: 1, metrics: ""}
)").string();
  Outcome many = run_mpi(2, {job, "--set", "log.dir=" + (d / "run").string(), "--set",
                             "log.trace=" + (d / "t.json").string()});
  ASSERT_EQ(many.status, 0) << many.out;
  // Item 7: the summary names the traces that exist (one per rank), not t.json.
  EXPECT_NE(many.out.find("trace        " + (d / "t.rank0.json").string() + ", one per rank"), std::string::npos)
      << many.out;
  EXPECT_TRUE(fs::exists(d / "t.rank1.json"));
  EXPECT_EQ(many.out.find('\r'), std::string::npos) << many.out;
  EXPECT_EQ(many.out.find("\x1b["), std::string::npos) << many.out;
  size_t lines = 0;
  for (size_t at = many.out.find("step 6/6"); at != std::string::npos; at = many.out.find("step 6/6", at + 1)) ++lines;
  EXPECT_EQ(lines, 1u) << "the last step's progress line, once (rank 0's):\n" << many.out;
  EXPECT_NE(many.out.find("step 1/6"), std::string::npos) << many.out;
}

TEST(TrainMpi, TwoProcessesFollowOneProcess) { expect_mpi_follows_single(2, "128"); }
TEST(TrainMpi, ThreeProcessesFollowOneProcess) { expect_mpi_follows_single(3, "192"); }

// Pipelines as separate processes: activations and gradients over MPI point-to-point.
TEST(TrainMpi, PipelineOfTwoStagesFollowsOneProcess) {
  expect_mpi_follows_single(2, "128", {"mesh.pipeline=2", "pipeline.schedule=1f1b", "pipeline.micro_batches=4"});
}
TEST(TrainMpi, InterleavedPipelineWithCheckpointingFollowsOneProcess) {
  expect_mpi_follows_single(2, "128", {"mesh.pipeline=2", "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2",
                                       "pipeline.micro_batches=4", "pipeline.checkpoint=always"});
}
// The zero-bubble schedules over MPI: ZBV's V sends activations and gradients both ways
// between the two ranks; zbh1 x data 2 with ZeRO-2 (its hooks fire at the last W), plain SGD.
TEST(TrainMpi, ZeroBubblePipelinesFollowOneProcess) {
  expect_mpi_follows_single(2, "128", {"mesh.pipeline=2", "pipeline.schedule=zbv", "pipeline.micro_batches=4"},
                            {"optimizer.type=sgd", "optimizer.lr=0.05"});
  expect_mpi_follows_single(4, "128", {"mesh.pipeline=2", "mesh.data=2", "pipeline.schedule=zbh1",
                                       "pipeline.micro_batches=4", "zero.stage=2"},
                            {"optimizer.type=sgd", "optimizer.lr=0.05"});
}
TEST(TrainMpi, PipelineTimesDataOnFourProcessesFollowsOneProcess) {
  expect_mpi_follows_single(4, "128", {"mesh.pipeline=2", "mesh.data=2", "pipeline.schedule=1f1b", "pipeline.micro_batches=4",
                                       "pipeline.balance=by_time"});
}

// ZeRO over real processes, plain SGD without clipping (a sum instead of an average
// would double every step), an odd world, and inside a pipeline's data groups.
TEST(TrainMpi, ZeroStagesOnTwoProcessesFollowOneProcessWithPlainSgd) {
  for (const char* stage : {"zero.stage=1", "zero.stage=2", "zero.stage=3"})
    expect_mpi_follows_single(2, "128", {"mesh.data=2", stage}, {"optimizer.type=sgd", "optimizer.lr=0.05"});
}
TEST(TrainMpi, ZeroThreeOnThreeProcessesFollowsOneProcess) {
  expect_mpi_follows_single(3, "192", {"mesh.data=3", "zero.stage=3", "zero.prefetch=2"});
}
TEST(TrainMpi, PipelineTimesZeroOnFourProcessesFollowsOneProcess) {
  for (const char* stage : {"zero.stage=1", "zero.stage=3"})
    expect_mpi_follows_single(4, "128", {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4", stage},
                              {"optimizer.clip_grad_norm=0.5"});
}

// Tensor parallelism over real processes (issue 29): a GPT split over two tensor ranks,
// each its heads, its MLP columns and rows and its block of the vocabulary, joined by MPI
// allreduces forward and backward; plain SGD, dropout on. The losses and the exported
// whole weights (assembled from the parts) are one process's.
TEST(TrainMpi, TensorParallelGptOnTwoProcessesFollowsOneProcessWithPlainSgd) {
  fs::path d = fresh_dir("mpi_tensor");
  {
    std::ofstream text(d / "text.txt");
    for (int i = 0; i < 300; ++i) text << "a tensor-parallel line " << i << " for the small gpt. ";
  }
  const std::string job = write_job(d, "job.yaml", R"(
model: {type: gpt, layers: 2, d_model: 32, heads: 4, dropout: 0.1}
data: {type: text, seq_len: 16, batch_size: 8, eval_samples: 32}
optimizer: {type: sgd, lr: 0.05}
train: {max_steps: 10, seed: 3, threads: 1}
checkpoint: {dir: ""}
log: {every: 1, progress: plain}
)").string();
  auto args = [&](const std::string& tag) {
    return std::vector<std::string>{job, "--set", "data.path=" + (d / "text.txt").string(), "--set",
                                    "log.metrics=" + (d / (tag + ".jsonl")).string(), "--set",
                                    "checkpoint.safetensors=" + (d / (tag + ".safetensors")).string(), "--set",
                                    "log.dir=" + (d / tag).string()};
  };
  Outcome one = run(args("one"));
  ASSERT_EQ(one.status, 0) << one.out;
  const auto a = losses(d / "one.jsonl");
  const auto wa = tetra::core::load_safetensors((d / "one.safetensors").string());
  ASSERT_EQ(a.size(), 10u);
  // Tensor 2 alone; then sequence-parallel (MPI's all-gathers and reduce-scatters) x data 2
  // under ZeRO-3, four processes.
  const std::vector<std::pair<int, std::vector<std::string>>> layouts = {
      {2, {"mesh.tensor=2"}}, {4, {"mesh.tensor=2", "tensor.sequence_parallel=true", "mesh.data=2", "zero.stage=3"}}};
  for (const auto& [np, sets] : layouts) {
    const std::string tag = "many" + std::to_string(np);
    SCOPED_TRACE(tag);
    std::vector<std::string> many_args = args(tag);
    for (const auto& s : sets) many_args.insert(many_args.end(), {"--set", s});
    Outcome many = run_mpi(np, many_args);
    ASSERT_EQ(many.status, 0) << many.out;
    // The model is counted whole (its parts are one model): the same count as one process's.
    const size_t at = one.out.find("model gpt, ");
    ASSERT_NE(at, std::string::npos) << one.out;
    const std::string count = one.out.substr(at, one.out.find(" parameters", at) - at);
    EXPECT_NE(many.out.find(count + " parameters"), std::string::npos) << count << "\n" << many.out;
    const auto b = losses(d / (tag + ".jsonl"));
    ASSERT_EQ(b.size(), 10u);
    for (const auto& [step, loss] : a) EXPECT_NEAR(b.at(step), loss, 1e-5 * loss) << "step " << step;
    const auto wb = tetra::core::load_safetensors((d / (tag + ".safetensors")).string());
    ASSERT_EQ(wa.size(), wb.size());
    for (const auto& [key, t] : wa) {
      ASSERT_TRUE(wb.at(key).sizes().equals(t.sizes())) << key;
      EXPECT_LE((wb.at(key) - t).abs().max().item<double>(), 1e-5 * std::max(1.0, t.abs().max().item<double>())) << key;
    }
  }
}

// Replicas as threads inside real processes: the data group is processes x replicas,
// inside over shared memory, across over MPI. Plain SGD without clipping.
TEST(TrainMpi, ReplicasTimesDataProcessesFollowOneProcessWithPlainSgd) {
  expect_mpi_follows_single(2, "128", {"mesh.data=2", "replicate.replicas=2"}, {"optimizer.type=sgd", "optimizer.lr=0.05"});
}
// The composition the plan exists for: pipeline 2 x data 2 x ZeRO-1 x 2 replicas, 8
// replicas in 4 processes.
TEST(TrainMpi, EightReplicasInFourProcessesFollowOneProcess) {
  expect_mpi_follows_single(4, "128", {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4", "zero.stage=1",
                                       "replicate.replicas=2"});
}

// --check and --dry-run read the same plan as the trainer: a data-parallel batch that
// does not split over mesh.data is an error before launch (it used to pass --check).
TEST(TrainCli, CheckRejectsABatchThatDoesNotSplitOverTheDataGroup) {
  fs::path d = fresh_dir("plancheck");
  const std::string job = write_job(d, "job.yaml", "data: {batch_size: 96}\nmesh: {data: 5}\ntrain: {max_steps: 1}\n").string();
  for (const char* mode : {"--check", "--dry-run"}) {
    Outcome r = run({job, mode});
    EXPECT_EQ(r.status, 2) << mode << "\n" << r.out;
    EXPECT_NE(r.out.find("job.yaml:1:8: error: data.batch_size: data.batch_size 96 does not split into 5 data-parallel "
                         "ranks x 1 micro-batch: 96 / 5 = 19.20 samples each; make the global batch a multiple of 5"),
              std::string::npos)
        << mode << "\n" << r.out;
  }
  Outcome z = run({job, "--check", "--set", "mesh.data=1", "--set", "zero.stage=1"});
  EXPECT_EQ(z.status, 2) << z.out;
  EXPECT_NE(z.out.find("zero.stage: zero shards the optimizer state over the data group (stage 1), so it needs more than "
                       "one rank on the data axis"),
            std::string::npos)
      << z.out;
}

TEST(TrainCli, ThreeDAndReplicaConfigsAreValidAndTheDryRunShowsTheComposition) {
  for (const char* cfg : {"3d.yaml", "replicas.yaml"}) {
    Outcome r = run({std::string(TETRA_SOURCE_DIR) + "/configs/" + cfg, "--check"});
    EXPECT_EQ(r.status, 0) << cfg << "\n" << r.out;
  }
  Outcome r = run({std::string(TETRA_SOURCE_DIR) + "/configs/3d.yaml", "--dry-run", "--set", "replicate.replicas=2"});
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* want : {"world      mesh pipeline=2 x data=2 = 4 processes (launch with mpirun -np 4) x 2 replica threads",
                           "batch      32 global = 4 data-parallel ranks (mesh.data 2 x replicate.replicas 2) x 4 "
                           "micro-batches (pipeline.micro_batches) x 2",
                           "composition (outermost first)", "1. pipeline", "2. replicate", "3. data_parallel", "4. zero",
                           "data_parallel  data      x4   off: zero synchronises the data axis's gradients instead",
                           "zero: stage 1 over 4 data ranks"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  Outcome one = run({std::string(TETRA_SOURCE_DIR) + "/configs/replicas.yaml", "--dry-run"});
  ASSERT_EQ(one.status, 0) << one.out;
  EXPECT_NE(one.out.find("world      1 process x 2 replica threads"), std::string::npos) << one.out;
  EXPECT_NE(one.out.find("    replica 1: "), std::string::npos) << one.out;
}

// --ranks-per-host says where the processes will run: the data groups (consecutive
// ranks) stay inside a host, the pipeline crosses between hosts.
TEST(TrainCli, DryRunWithRanksPerHostShowsWhichAxesStayInsideAHost) {
  const std::string cfg = std::string(TETRA_SOURCE_DIR) + "/configs/3d.yaml";
  Outcome r = run({cfg, "--dry-run", "--np", "4", "--ranks-per-host", "2"});
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* want : {"hosts      2 x 2 processes (consecutive ranks share a host",
                           "  pipeline  x2   across 2 hosts (1 rank of each group per host)",
                           "  data      x2   inside a host (every group on one host)",
                           "  3     3        1     1         1     0"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  Outcome one = run({cfg, "--dry-run", "--np", "4", "--ranks-per-host", "1"});
  ASSERT_EQ(one.status, 0) << one.out;
  EXPECT_NE(one.out.find("  data      x2   across 2 hosts (1 rank of each group per host)"), std::string::npos) << one.out;
  Outcome j = run({cfg, "--dry-run", "--json", "--np", "4", "--ranks-per-host", "2"});
  ASSERT_EQ(j.status, 0) << j.out;
  const nlohmann::json plan = nlohmann::json::parse(j.out.substr(j.out.find('{')));
  EXPECT_EQ(plan["hosts"]["count"], 2);
  EXPECT_EQ(plan["ranks"][2]["host"], 1);
}

// The tensor axis in the plan: which slices each tensor rank holds, its column in the
// rank tables, its bytes per step, its price at the inside-host link, and a warning when
// its groups would cross hosts.
TEST(TrainCli, DryRunShowsTheTensorAxis) {
  const std::string cfg = std::string(TETRA_SOURCE_DIR) + "/configs/tensor-gpt.yaml";
  Outcome r = run({cfg, "--dry-run", "--set", "tensor.sequence_parallel=true"});
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* want :
       {"1. tensor         tensor    x2   splits each block's matrices over the tensor group",
        "sequence-parallel: an all-gather and a reduce-scatter each way per block half",
        "tensor: 2 tensor ranks per slice (the innermost axis: adjacent ranks, one host's fastest links), "
        "sequence-parallel (norms, dropouts and the residual on blocks of 32 tokens)",
        "  tensor rank 1: heads 2-3 of 4, MLP hidden 256-511 of 512, vocabulary 128-255 of 256",
        "  split: 855808 of 867328 parameters (98.7%), 1/2 on each rank",
        "total 439424 params (tensor rank 0's parts of the split layers)",
        "  rank    pipeline data  tensor     params", "sent/tensor", "  3       0        1     1      ",
        "  rank  process  host  pipeline  data  tensor replica", "  tensor       ", "ring of 2 inside a host"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  Outcome apart = run({cfg, "--dry-run", "--np", "4", "--ranks-per-host", "1"});
  ASSERT_EQ(apart.status, 0) << apart.out;
  EXPECT_NE(apart.out.find("  tensor    x2   across 2 hosts (1 rank of each group per host); warning: mesh.tensor 2 is "
                           "more than the 1 ranks of a host"),
            std::string::npos)
      << apart.out;
}

// The plan ends with the cost model's step (Note [Cost model]) on a calibration's links:
// data parallelism across 2 hosts reduces hierarchically and beats the flat ring on a
// slow link between hosts; compute is the FLOPs over the calibrated rate.
TEST(TrainCli, DryRunPredictsAStepOnTheCalibrationsLinks) {
  const fs::path d = fresh_dir("cost");
  const fs::path cal = d / "cal.json";
  std::ofstream(cal) << R"({"format": "tetra calibration 1", "intra_host": {"alpha_us": 1, "beta_gbytes_per_s": 10},
                            "inter_host": {"alpha_us": 10, "beta_gbytes_per_s": 0.1}, "compute": {"gflops_per_s": 10}})";
  const fs::path job = d / "job.yaml";
  std::ofstream(job) << "name: cost\nmodel: {type: mlp, hidden: [256]}\n"
                        "data: {type: synthetic, batch_size: 64, shape: [100], classes: 10}\n"
                        "mesh: {data: 4}\n";
  auto plan = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {job.string(), "--dry-run", "--json", "--np", "4", "--calibration", cal.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    Outcome r = run(args);
    EXPECT_EQ(r.status, 0) << r.out;
    return nlohmann::json::parse(r.out.substr(r.out.find('{')))["cost"];
  };
  const nlohmann::json hier = plan({"--ranks-per-host", "2"});
  const nlohmann::json flat = plan({"--ranks-per-host", "2", "--set", "data_parallel.hierarchical=off"});
  const nlohmann::json inside = plan({"--ranks-per-host", "4"});
  // 3 ranks on one host and 1 on the other: the run's data group reduces flat (Note [One
  // host map]: hierarchical_fits on the group's map), and so does the prediction.
  const nlohmann::json uneven = plan({"--ranks-per-host", "3"});
  // 16 samples per rank, forward 2 x (100 x 256 + 256 x 10) FLOPs each, backward twice that.
  const double flops = 3 * 2.0 * (100 * 256 + 256 * 10) * 16;
  EXPECT_NEAR(hier["compute_s"].get<double>(), flops / 10e9, 1e-12);
  auto data_how = [](const nlohmann::json& c) {
    for (const auto& a : c["axes"])
      if (a["axis"] == "data") return a["how"].get<std::string>();
    return std::string("none");
  };
  EXPECT_EQ(data_how(hier), "hierarchical (2 hosts x 2) across hosts");
  EXPECT_EQ(data_how(flat), "ring of 4 across hosts");
  EXPECT_EQ(data_how(inside), "ring of 4 inside a host");
  EXPECT_EQ(data_how(uneven), "ring of 4 across hosts");
  EXPECT_LT(hier["step_s"].get<double>(), flat["step_s"].get<double>());
  EXPECT_LT(inside["step_s"].get<double>(), hier["step_s"].get<double>());
  EXPECT_GT(inside["efficiency"].get<double>(), 0);
  EXPECT_LE(inside["efficiency"].get<double>(), 1);
  Outcome text = run({job.string(), "--dry-run", "--np", "4", "--ranks-per-host", "2", "--calibration", cal.string()});
  EXPECT_NE(text.out.find("cost model (Note [Cost model]; calibration " + cal.string()), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("predicted:"), std::string::npos) << text.out;
  // hierarchical on where the hosts do not fit it: the run's ConfigError at attach, said
  // by the plan as a warning (the launch may place the ranks otherwise).
  const std::string stops = "warning: data_parallel.hierarchical on needs the same number (> 1) of data ranks on each "
                            "of more than one host, and a data group runs host 0: ranks 0-2, host 1: rank 3: the run "
                            "stops at attach; set it to auto";
  for (const char* per_host : {"2", "3"}) {
    Outcome on = run({job.string(), "--dry-run", "--np", "4", "--ranks-per-host", per_host, "--calibration",
                      cal.string(), "--set", "data_parallel.hierarchical=on"});
    EXPECT_EQ(on.status, 0) << on.out;
    EXPECT_EQ(on.out.find(stops) != std::string::npos, std::string(per_host) == "3") << on.out;
  }
  Outcome missing = run({job.string(), "--dry-run", "--calibration", (d / "nope.json").string()});
  EXPECT_EQ(missing.status, 2) << missing.out;
  EXPECT_NE(missing.out.find("nope.json: cannot read it"), std::string::npos) << missing.out;
}

// Issue 47, item 4: a dry run of a cuda job times nothing on a GPU (it builds nothing on a
// device), so this host's CPU does not price it: without a calibration file it is the
// GPU-cluster defaults, and the plan says why (a calibration file measured on its GPUs
// still decides).
TEST(TrainCli, DryRunOfACudaJobIsPricedOnTheGpuDefaultsAndSaysSo) {
  const fs::path d = fresh_dir("cuda_dry_run");
  const fs::path job = write_job(d, "job.yaml",
                                 "name: gpus\nmodel: {type: mlp, hidden: [32]}\n"
                                 "data: {type: synthetic, batch_size: 64, shape: [100], classes: 10}\n"
                                 "train: {threads: 1, device: cuda}\nmesh: {data: 4}\n");
  const Outcome json = run({job.string(), "--dry-run", "--json", "--np", "4"});
  ASSERT_EQ(json.status, 0) << json.out;
  const nlohmann::json cost = nlohmann::json::parse(json.out.substr(json.out.find('{')))["cost"];
  EXPECT_DOUBLE_EQ(cost["calibration"]["compute"]["gflops_per_s"].get<double>(), 150000) << cost.dump();
  EXPECT_NE(cost["calibration"].dump().find("the GPU-cluster defaults, as train.device is cuda and no --calibration "
                                            "file measured its GPUs"),
            std::string::npos)
      << cost.dump();
  const Outcome text = run({job.string(), "--dry-run", "--np", "4"});
  EXPECT_NE(text.out.find("cost model (Note [Cost model]; the GPU-cluster defaults, as train.device is cuda"),
            std::string::npos)
      << text.out;
  // The same job on the CPU is this host's to price.
  const Outcome here = run({job.string(), "--dry-run", "--np", "4", "--set", "train.device=cpu"});
  EXPECT_NE(here.out.find("this machine, measured"), std::string::npos) << here.out;
}

// Issue 33, item 6: without a calibration the dry run prices the step on this machine
// (Note [This machine's figures]): compute from the layers it times, a measured local
// pair inside the host, and the GPU-cluster defaults across hosts only when the layout
// spans hosts, named as assumed. One rank is "1 rank"; a tiny model's efficiency is
// not "0%".
TEST(TrainCli, DryRunWithoutACalibrationDescribesThisMachine) {
  const fs::path d = fresh_dir("this_machine");
  const fs::path job = write_job(d, "job.yaml",
                                 "name: here\nmodel: {type: mlp, hidden: [32]}\n"
                                 "data: {type: synthetic, batch_size: 64, shape: [100], classes: 10}\n"
                                 "train: {threads: 1}\nmesh: {data: 4}\n");
  auto cost = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {job.string(), "--dry-run", "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    Outcome r = run(args);
    EXPECT_EQ(r.status, 0) << r.out;
    return nlohmann::json::parse(r.out.substr(r.out.find('{')))["cost"];
  };
  const nlohmann::json here = cost({"--np", "4"});
  const std::string measured = here["calibration"].dump();
  EXPECT_NE(measured.find("this machine, measured"), std::string::npos) << measured;
  EXPECT_NE(measured.find("across hosts not used (every rank on this host)"), std::string::npos) << measured;
  // A CPU core, not a GPU: well under a TFLOP/s, and more than nothing.
  const double gflops = here["calibration"]["compute"]["gflops_per_s"].get<double>();
  EXPECT_GT(gflops, 0.01);
  EXPECT_LT(gflops, 1000);
  EXPECT_GT(here["efficiency"].get<double>(), 0);
  const nlohmann::json spans = cost({"--np", "4", "--ranks-per-host", "2"});
  EXPECT_NE(spans["calibration"].dump().find("across hosts assumed: the GPU-cluster defaults"), std::string::npos)
      << spans["calibration"].dump();
  const nlohmann::json cluster = cost({"--np", "4", "--calibration", "gpu-cluster"});
  EXPECT_DOUBLE_EQ(cluster["calibration"]["compute"]["gflops_per_s"].get<double>(), 150000);
  EXPECT_NE(cluster["calibration"].dump().find("as --calibration gpu-cluster asks"), std::string::npos);

  Outcome text = run({job.string(), "--dry-run", "--np", "4"});
  EXPECT_EQ(text.out.find("efficiency 0%"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("cost model (Note [Cost model]; this machine, measured"), std::string::npos) << text.out;
  Outcome one = run({job.string(), "--dry-run", "--set", "mesh.data=1"});
  EXPECT_EQ(one.status, 0) << one.out;
  EXPECT_NE(one.out.find("samples/s on 1 rank\n"), std::string::npos) << one.out;
  EXPECT_EQ(one.out.find("1 ranks"), std::string::npos) << one.out;

  // Issue 48, item 6 (Note [Figures with their spread]): the compute timed three times,
  // the median round priced, the spread and the machine's load said (before: one timing,
  // and a busy machine's figures given as a quiet one's).
  EXPECT_EQ(here["rounds_samples_per_s"].size(), 3u) << here.dump();
  std::vector<double> rounds = here["rounds_samples_per_s"].get<std::vector<double>>();
  std::sort(rounds.begin(), rounds.end());
  EXPECT_DOUBLE_EQ(here["samples_per_s"].get<double>(), rounds[1]);
  EXPECT_NE(text.out.find("  spread       this machine's compute timed 3 times: "), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("  machine      "), std::string::npos) << text.out;
  EXPECT_FALSE(cluster.contains("rounds_samples_per_s"));  // nothing timed here: no rounds
  // A machine kept busy (two spinning processes per core) says so.
  std::vector<pid_t> spinners;
  for (int i = 0; i < 4; ++i)
    if (const pid_t p = fork(); p == 0) {
      for (volatile unsigned long x = 0;; x = x + 1) {
      }
    } else {
      spinners.push_back(p);
    }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  Outcome busy = run({job.string(), "--dry-run", "--np", "4"});
  for (pid_t p : spinners) {
    kill(p, SIGKILL);
    waitpid(p, nullptr, 0);
  }
  EXPECT_NE(busy.out.find("  machine      busy: "), std::string::npos) << busy.out;
  EXPECT_NE(busy.out.find("figures timed here are pessimistic for a quiet machine"), std::string::npos) << busy.out;
}

// --dry-run --np N lays out every rank without communicating, and checks the mesh fits
// N; --json is the same plan for tools.
TEST(TrainCli, DryRunWithNpLaysOutEveryRankAndJsonSaysTheSame) {
  const std::string cfg = std::string(TETRA_SOURCE_DIR) + "/configs/3d.yaml";
  Outcome r = run({cfg, "--dry-run", "--np", "4", "--set", "replicate.replicas=2"});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("ranks      8 (4 processes x 2 replicas)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  7     3        0     1         1     1        1        "), std::string::npos) << r.out;
  // The per-rank estimate, with the convention its bytes per step are counted in.
  EXPECT_NE(r.out.find("estimate   per rank (per process: each of its replica threads alike)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ring allreduce 2(n-1)/n x B"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("sent/pipeline"), std::string::npos) << r.out;
  Outcome bad = run({cfg, "--dry-run", "--np", "3"});
  EXPECT_EQ(bad.status, 2) << bad.out;
  EXPECT_NE(bad.out.find("mesh pipeline=2 x data=2 = 4 ranks, but the world has 3 (--np 3)"), std::string::npos) << bad.out;
  Outcome j = run({cfg, "--dry-run", "--json", "--np", "4", "--set", "replicate.replicas=2"});
  ASSERT_EQ(j.status, 0) << j.out;
  const nlohmann::json plan = nlohmann::json::parse(j.out.substr(j.out.find('{')));
  EXPECT_EQ(plan["processes"], 4);
  EXPECT_EQ(plan["mesh"]["pipeline"], 2);
  EXPECT_EQ(plan["mesh"]["replica"], 2);
  EXPECT_EQ(plan["batch"]["data_ranks"], 4);
  EXPECT_EQ(plan["batch"]["micro_batch_size"], 2);
  ASSERT_EQ(plan["ranks"].size(), 8u);
  EXPECT_EQ(plan["ranks"][5]["pipeline"], 1);
  EXPECT_EQ(plan["ranks"][5]["data"], 0);
  EXPECT_EQ(plan["ranks"][5]["replica"], 1);
  ASSERT_EQ(plan["composition"].size(), 4u);
  EXPECT_EQ(plan["composition"][0]["section"], "pipeline");
  EXPECT_EQ(plan["composition"][2]["active"], false);
  ASSERT_EQ(plan["estimate"].size(), 4u);  // one per process: its replicas estimate alike
  for (const auto& e : plan["estimate"]) {
    EXPECT_GT(e["bytes"]["parameters"].get<int64_t>(), 0) << e;
    EXPECT_GT(e["bytes_per_step"]["pipeline"]["sent"].get<int64_t>(), 0) << e;
    EXPECT_GT(e["bytes_per_step"]["data"]["payload"]["reduce_scatter"].get<int64_t>(), 0) << e;
  }
}

// train runs the replicas a job asks for as threads of the process (it used to run the
// job as one rank per process, silently), and topo --plan reads the job into the same
// plan as train, with the same messages.
TEST(TrainCli, TrainRunsReplicasAsThreadsAndTopoPlanReadsTheSamePlan) {
  const std::string cfg = std::string(TETRA_SOURCE_DIR) + "/configs/replicas.yaml";
  Outcome r = run({cfg, "--set", "train.max_steps=3", "--set", "data.eval_samples=100", "--set", "checkpoint.dir=",
                   "--set", "log.metrics=", "--set", "log.progress=plain"});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("1 process x 2 replica threads"), std::string::npos) << r.out;
  const std::string topo = std::string(TETRA_BIN_DIR) + "/topo";
  Outcome t = run_program(topo, {"--plan", std::string(TETRA_SOURCE_DIR) + "/configs/3d.yaml"});
  ASSERT_EQ(t.status, 0) << t.out;
  for (const char* want : {"plan: mesh pipeline=2 x data=2 = 4 processes", "pipeline (pipeline): splits the model into 2 stages",
                           "data_parallel (data): off: zero synchronises", "zero (data): shards the optimizer state",
                           "axis data (size 2): 2 groups"})
    EXPECT_NE(t.out.find(want), std::string::npos) << want << "\n" << t.out;
  // The tensor axis is the innermost: its groups are adjacent ranks, inside a host.
  Outcome tp = run_program(topo, {"--plan", std::string(TETRA_SOURCE_DIR) + "/configs/tensor-gpt.yaml"});
  ASSERT_EQ(tp.status, 0) << tp.out;
  EXPECT_NE(tp.out.find("axis tensor (size 2): 2 groups, each inside one host: [0 1] [2 3]"), std::string::npos) << tp.out;
  fs::path d = fresh_dir("topoplan");
  const std::string job = write_job(d, "job.yaml", "data: {batch_size: 96}\nmesh: {data: 5}\n").string();
  Outcome bad = run_program(topo, {"--plan", job});
  EXPECT_EQ(bad.status, 2) << bad.out;
  EXPECT_NE(bad.out.find("job.yaml:1:8: error: data.batch_size: data.batch_size 96 does not split into 5"), std::string::npos)
      << bad.out;
}

// Every benchmark and `topo` name the BLAS that LibTorch's matrix products run on: the
// library serving sgemm_, not whichever BLAS happens to be loaded (OpenBLAS's is, for
// LAPACK, whatever libblas.so.3 points to). Under another libblas.so.3 on the library path
// the description follows it.
TEST(TrainCli, TopoNamesTheBlasThatServesTheMatrixProducts) {
  const std::string topo = std::string(TETRA_BIN_DIR) + "/topo";
  auto blas_of = [&](const char* library_path) {
    if (library_path) setenv("LD_LIBRARY_PATH", library_path, 1);
    Outcome r = run_program(topo, {"--json"});
    if (library_path) unsetenv("LD_LIBRARY_PATH");
    EXPECT_EQ(r.status, 0) << r.out;
    const size_t at = r.out.find("\"blas\": \"");
    return at == std::string::npos ? r.out : r.out.substr(at + 9, r.out.find('"', at + 9) - at - 9);
  };
  std::error_code ec;
  const std::string system = fs::canonical("/usr/lib/x86_64-linux-gnu/libblas.so.3", ec).string();
  if (system.find("openblas") != std::string::npos) {
    EXPECT_EQ(blas_of(nullptr).rfind("OpenBLAS ", 0), 0u) << system;
  }
  if (fs::exists("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3")) {
    EXPECT_EQ(blas_of("/usr/lib/x86_64-linux-gnu/blas").rfind("reference BLAS (slow", 0), 0u);
  }
  if (fs::exists("/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3")) {
    EXPECT_EQ(blas_of("/usr/lib/x86_64-linux-gnu/blis-pthread"), "BLIS (/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3)");
  }
}

TEST(TrainCli, ZeroConfigsAreValidAndTheDryRunShowsTheShardedState) {
  for (const char* cfg : {"zero.yaml", "zero3-gpt.yaml"}) {
    Outcome r = run({std::string(TETRA_SOURCE_DIR) + "/configs/" + cfg, "--check"});
    EXPECT_EQ(r.status, 0) << cfg << "\n" << r.out;
  }
  Outcome r = run({std::string(TETRA_SOURCE_DIR) + "/configs/zero.yaml", "--dry-run", "--np", "2"});
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("zero: stage 2 over 2 data ranks"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model state per rank"), std::string::npos) << r.out;
  Outcome bad = run({std::string(TETRA_SOURCE_DIR) + "/configs/zero.yaml", "--check", "--set", "zero.stage=4"});
  EXPECT_EQ(bad.status, 2) << bad.out;
  EXPECT_NE(bad.out.find("zero.stage"), std::string::npos) << bad.out;
}

TEST(TrainMpi, APipelineWithMoreStagesThanLayersIsOneClearErrorAndExit2) {
  fs::path d = fresh_dir("mpipp");
  const std::string job = write_job(d, "job.yaml", R"(
model: {type: mlp, hidden: []}
mesh: {pipeline: 2}
pipeline: {schedule: interleaved_1f1b, virtual_stages: 2, micro_batches: 2}
train: {max_steps: 1}
checkpoint: {dir: ""}
log: {metrics: ""}
)").string();
  Outcome r = run_mpi(2, {job});
  EXPECT_EQ(r.status, 2) << r.out;
  const std::string msg = "the model has 2 layers, fewer than the 4 stages (pipeline 2 x virtual_stages 2)";
  const size_t at = r.out.find(msg);
  EXPECT_NE(at, std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(msg, at + 1), std::string::npos) << "printed once, by rank 0:\n" << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
}

// Issue 48, item 3: `mpirun -np 4 train configs/dp.yaml` (an example of `train --help`)
// failed with "mesh data=2 = 2 ranks, but the world has 4"; its data axis is now auto and
// it trains on 4 data ranks. Under 3 ranks a pipeline of 2 is the equation's error, exit 2.
TEST(TrainMpi, FourProcessesTrainTheDataParallelConfigOnFourDataRanks) {
  fs::path d = fresh_dir("dp4");
  const std::string dp = std::string(TETRA_SOURCE_DIR) + "/configs/dp.yaml";
  Outcome r = run_mpi(4, {dp, "--set", "train.max_steps=2", "--set", "log.dir=" + (d / "run").string(), "--set",
                          "checkpoint.dir=", "--set", "data.eval_samples=200", "--set", "log.progress=plain"});
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json summary = nlohmann::json::parse(slurp(d / "run/summary.json"));
  EXPECT_EQ(summary["mesh"], nlohmann::json({{"data", 4}})) << summary.dump();
  EXPECT_EQ(summary["world"], 4);
  EXPECT_EQ(summary["final_step"], 2);
  EXPECT_NE(slurp(d / "run/job.yaml").find("  data: auto\n"), std::string::npos);  // runs again on any world

  const std::string pp = write_job(d, "pp.yaml", "model: {type: mlp, hidden: [32, 32]}\nmesh: {pipeline: 2}\n"
                                                 "train: {max_steps: 1}\n").string();
  r = run_mpi(3, {pp, "--set", "log.dir=" + (d / "pp").string()});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("mesh.data: auto: data = world / (pipeline=2) = 3 / 2, which is not a whole number of ranks"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
}

// Issue 48, item 4: fine-tuning from a ZeRO-3 checkpoint of 2 ranks into a data-parallel
// run on 3 starts from exactly those weights: its first loss is the source run's loss at
// the step after that checkpoint, on the same batch (no shuffling, and an epoch of two
// steps, so that the source's step 3 and the new run's step 1 read the same samples).
TEST(TrainMpi, FineTuningFromZeroThreeOnTwoRanksIntoThreeDataRanksStartsFromThoseWeights) {
  fs::path d = fresh_dir("initfrom");
  const std::string job = write_job(d, "job.yaml", R"(
model: {type: mlp, hidden: [64]}
data: {type: synthetic, batch_size: 48, train_samples: 96, test_samples: 96, shuffle: false}
optimizer: {type: sgd, lr: 0.1}
train: {max_steps: 4, seed: 5, threads: 1}
checkpoint: {every_steps: 2}
log: {every: 1, progress: plain}
)").string();
  Outcome src = run_mpi(2, {job, "--set", "name=src", "--set", "log.dir=" + (d / "src").string(), "--set", "zero.stage=3"});
  ASSERT_EQ(src.status, 0) << src.out;
  Outcome ft = run_mpi(3, {job, "--set", "name=ft", "--set", "log.dir=" + (d / "ft").string(), "--set",
                           "checkpoint.init_from=" + (d / "src/ckpt/step-00000002").string(), "--set", "train.max_steps=1"});
  ASSERT_EQ(ft.status, 0) << ft.out;
  EXPECT_NE(ft.out.find("weights from " + (d / "src/ckpt/step-00000002").string() + " (job \"src\", step 2)"),
            std::string::npos)
      << ft.out;
  const auto source = losses(d / "src/metrics.jsonl");
  const auto tuned = losses(d / "ft/metrics.jsonl");
  ASSERT_TRUE(source.count(3) && tuned.count(1)) << ft.out;
  EXPECT_NEAR(tuned.at(1), source.at(3), 1e-5 * std::fabs(source.at(3)));
  EXPECT_GT(std::fabs(tuned.at(1) - source.at(1)), 1e-3);  // not the drawn weights'
}

TEST(TrainMpi, AMeshThatDoesNotFitTheWorldIsOneClearErrorAndExit2) {
  fs::path d = fresh_dir("mpifit");
  // A batch that splits over 3 data ranks: the mesh is the only mistake.
  const std::string job = write_job(d, "job.yaml", "data: {batch_size: 192}\nmesh: {data: 3}\ntrain: {max_steps: 1}\n").string();
  Outcome r = run_mpi(2, {job});
  EXPECT_NE(r.out.find("mesh data=3 = 3 ranks, but the world has 2"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;  // no crash
  EXPECT_NE(r.status, 0);
}

// A data-parallel run under mpirun with one rank SIGKILLed after a checkpoint: mpirun
// ends the job (no hang), the checkpoint on disk is whole, and the job resumes from it
// both on the same two ranks (following the uninterrupted run exactly) and on one
// process (the state is replicated, so any number of data ranks can take it up).
namespace {

// The pids of the processes running `exe` that descend from `ancestor` (mpirun's ranks,
// directly or under a wrapper shell; their comm reads "exe" after train's re-exec, so the
// binary is what identifies them).
std::vector<pid_t> descendants_running(pid_t ancestor, const fs::path& exe) {
  std::error_code ec;
  const fs::path want = fs::canonical(exe, ec);
  auto parent = [](pid_t pid) {
    const std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
    const size_t close = stat.rfind(')');
    int ppid = -1;
    if (close == std::string::npos || std::sscanf(stat.c_str() + close + 2, "%*c %d", &ppid) != 1) return -1;
    return ppid;
  };
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    if (fs::read_symlink(e.path() / "exe", ec) != want) continue;
    const pid_t pid = std::stoi(name);
    for (pid_t p = parent(pid), k = 0; p > 1 && k < 4; p = parent(p), ++k)
      if (p == ancestor) {
        out.push_back(pid);
        break;
      }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Waits up to `limit` for `pid` (mpirun, or train); if it is still running then, kills
// it and every train under it and fails with `what` and its log. Its exit status (128 +
// the signal that ended it), or -1 when it had to be killed.
int wait_or_kill(pid_t pid, const fs::path& log, std::chrono::seconds limit, const std::string& what) {
  int st = 0;
  pid_t got = 0;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while ((got = waitpid(pid, &st, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (got == 0) {
    for (pid_t r : descendants_running(pid, kTrain)) kill(r, SIGKILL);
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    ADD_FAILURE() << what << ": " << slurp(log);
    return -1;
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace

TEST(TrainMpi, KilledRankEndsTheJobAndTheCheckpointResumesOnTwoRanksAndOnOne) {
  fs::path d = fresh_dir("mpikill");
  const std::string job = write_job(d, "job.yaml", R"(
model: {type: mlp, hidden: [128, 64]}
data: {type: fashion-mnist, batch_size: 128, eval_samples: 500}
optimizer: {type: adamw, lr: 2.0e-3}
schedule: {type: cosine, warmup_steps: 5}
train: {max_steps: 160, seed: 4, threads: 1}
checkpoint: {every_steps: 40, keep: 2}
log: {every: 1, progress: plain}
)").string();
  auto args = [&](const std::string& sub) { return run_args(job, d / sub); };
  auto with_mesh = [](std::vector<std::string> a) {
    a.insert(a.end(), {"--set", "mesh.data=2"});
    return a;
  };
  Outcome whole = run_mpi(2, with_mesh(args("whole")));
  ASSERT_EQ(whole.status, 0) << whole.out;

  pid_t mpirun = spawn_program(TETRA_MPIEXEC, mpi_args(2, with_mesh(args("killed"))), d / "killed.log");
  const fs::path ckpt = d / "killed" / "ckpt";
  wait_for(ckpt / "step-00000040" / "meta.json");
  std::vector<pid_t> ranks = descendants_running(mpirun, kTrain);
  ASSERT_EQ(ranks.size(), 2u) << slurp(d / "killed.log");
  kill(ranks.back(), SIGKILL);  // one of the two ranks (the later-started process)
  // mpirun must notice and end the job: wait at most a minute.
  const int status = wait_or_kill(mpirun, d / "killed.log", std::chrono::minutes(1),
                                  "mpirun did not end the job within a minute of a rank's death");
  ASSERT_NE(status, -1);
  const std::string killed_log = slurp(d / "killed.log");
  ASSERT_NE(status, 0) << "the run finished before it could be killed: " << killed_log;
  EXPECT_EQ(killed_log.find("terminate called"), std::string::npos) << killed_log;
  // What the killed run left, for the one-process resume below.
  fs::create_directories(d / "one");
  fs::copy(ckpt, d / "one" / "ckpt", fs::copy_options::recursive);

  Outcome resumed = run_mpi(2, with_mesh(args("killed")));
  ASSERT_EQ(resumed.status, 0) << resumed.out;
  EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << resumed.out;
  auto a = losses(d / "whole" / "m.jsonl"), b = losses(d / "killed" / "m.jsonl");
  ASSERT_EQ(a.size(), 160u);
  ASSERT_EQ(b.size(), 160u);
  for (const auto& [step, loss] : a) EXPECT_EQ(b[step], loss) << "step " << step;

  Outcome one = run(args("one"));
  ASSERT_EQ(one.status, 0) << one.out;
  EXPECT_NE(one.out.find("resumed from"), std::string::npos) << one.out;
  auto c = losses(d / "one" / "m.jsonl");
  ASSERT_GE(c.size(), 40u);  // the killed run checkpointed at 40 at least, so 41..160 ran here
  ASSERT_LE(c.size(), 120u);
  for (const auto& [step, loss] : c) EXPECT_NEAR(loss, a[step], 1e-5 * a[step]) << "step " << step;
}

// Preemption (README "Faults"): SIGTERM to one rank of a real `mpirun -np 2` job — as
// Slurm signals each task — makes every rank finish its step, write that step's
// checkpoint and exit 4; the same command resumes it to the weights of the run nobody
// stopped. A second signal ends a process at once. (A SIGTERM to mpirun itself: README
// "Faults"; not tested here.)
namespace {

const char* kPreemptJob = R"(
model: {type: mlp, hidden: [64]}
data: {type: synthetic, shape: [784], classes: 10, train_samples: 8192, test_samples: 256, batch_size: 64}
optimizer: {type: adamw, lr: 1.0e-3}
schedule: {type: cosine, warmup_steps: 10}
train: {max_steps: 400, seed: 6, threads: 1}
log: {every: 1, progress: plain}
)";

// Waits (up to three minutes) until the metrics file holds `steps` train records.
void wait_for_steps(const fs::path& metrics, size_t steps) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(3);
  while (std::chrono::steady_clock::now() < deadline) {
    if (fs::exists(metrics)) {
      std::ifstream in(metrics);
      std::string line;
      size_t n = 0;
      while (std::getline(in, line)) n += line.find("\"eval\"") == std::string::npos && !line.empty();
      if (n >= steps) return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// "train: preempted at step N (SIGTERM); checkpoint DIR; ..." -> N (-1 when absent).
int64_t preempted_step(const std::string& out) {
  const size_t at = out.find("train: preempted at step ");
  return at == std::string::npos ? -1 : std::stoll(out.substr(at + 25));
}

void expect_same_weights(const fs::path& a, const fs::path& b, double rel) {
  const tetra::core::TensorMap wa = tetra::core::load_safetensors(a.string()), wb = tetra::core::load_safetensors(b.string());
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [name, t] : wa) {
    ASSERT_TRUE(wb.count(name)) << name;
    if (rel == 0)
      EXPECT_TRUE(torch::equal(t, wb.at(name))) << name;
    else
      EXPECT_LE((t - wb.at(name)).abs().max().item<double>(), rel * std::max(1.0, t.abs().max().item<double>())) << name;
  }
}

}  // namespace

TEST(TrainMpi, SigtermToOneRankStopsEveryRankAtACheckpointThatResumesExactly) {
  fs::path d = fresh_dir("preempt");
  const std::string job = write_job(d, "job.yaml", kPreemptJob).string();
  auto args = [&](const std::string& sub) {
    std::vector<std::string> a = run_args(job, d / sub);
    a.insert(a.end(), {"--set", "mesh.data=2", "--set", "checkpoint.safetensors=" + (d / sub / "w.safetensors").string()});
    return a;
  };
  Outcome whole = run_mpi(2, args("whole"));
  ASSERT_EQ(whole.status, 0) << whole.out;

  // Each rank under a shell that records its exit status (and exits 0, so that mpirun
  // lets every rank finish on its own); the shell ignores the signal, train handles it.
  std::vector<std::string> wrapped = {"sh", "-c", "trap '' TERM INT; \"$@\"; echo $? > " + d.string() +
                                                      "/status.$OMPI_COMM_WORLD_RANK",
                                      "sh", kTrain};
  for (const auto& a : args("stopped")) wrapped.push_back(a);
  std::vector<std::string> mpi = mpi_args(2, {});
  mpi.pop_back();  // mpi_args ends with the train binary: the shell runs it here
  mpi.insert(mpi.end(), wrapped.begin(), wrapped.end());
  const fs::path log = d / "stopped.log";
  pid_t mpirun = spawn_program(TETRA_MPIEXEC, mpi, log);
  wait_for_steps(d / "stopped" / "m.jsonl", 5);
  std::vector<pid_t> ranks = descendants_running(mpirun, kTrain);
  ASSERT_EQ(ranks.size(), 2u) << slurp(log);
  kill(ranks.back(), SIGTERM);  // one rank only
  wait_or_kill(mpirun, log, std::chrono::minutes(3), "the job did not end within three minutes of the signal");
  const std::string out = slurp(log);
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(slurp(d / ("status." + std::to_string(r))), "4\n") << "rank " << r << "\n" << out;
  const int64_t step = preempted_step(out);
  ASSERT_GT(step, 0) << out;
  ASSERT_LT(step, 400) << out;
  char folder[32];
  std::snprintf(folder, sizeof folder, "step-%08lld", static_cast<long long>(step));
  const fs::path ckpt = d / "stopped" / "ckpt" / folder;
  EXPECT_NE(out.find("train: preempted at step " + std::to_string(step) + " (SIGTERM); checkpoint " + ckpt.string() +
                     "; run the same command again to resume"),
            std::string::npos)
      << out;
  EXPECT_TRUE(fs::exists(ckpt / "meta.json")) << out;
  EXPECT_EQ(losses(d / "stopped" / "m.jsonl").rbegin()->first, step) << "the metrics end at the agreed step";
  EXPECT_EQ(out.find("terminate called"), std::string::npos) << out;

  Outcome resumed = run_mpi(2, args("stopped"));
  ASSERT_EQ(resumed.status, 0) << resumed.out;
  EXPECT_NE(resumed.out.find("resumed from " + ckpt.string()), std::string::npos) << resumed.out;
  expect_same_weights(d / "whole" / "w.safetensors", d / "stopped" / "w.safetensors", 0);
}

// Two signals before the step ends: out at once, with 128 + the second, and no checkpoint
// of a preemption.
TEST(TrainCli, ASecondSignalExitsAtOnce) {
  fs::path d = fresh_dir("second");
  const std::string job = write_job(d, "job.yaml", kPreemptJob).string();
  const fs::path log = d / "run.log";
  pid_t pid = spawn(run_args(job, d / "run"), log);
  wait_for_steps(d / "run" / "m.jsonl", 3);
  kill(pid, SIGINT);
  kill(pid, SIGTERM);
  const int status = wait_or_kill(pid, log, std::chrono::minutes(3), "train did not end within three minutes of two signals");
  EXPECT_TRUE(status == 128 + SIGINT || status == 128 + SIGTERM) << status << "\n" << slurp(log);
  EXPECT_EQ(slurp(log).find("train: preempted"), std::string::npos) << slurp(log);
}

// `train --schema` is made from what the parsers read (Note [Schema]): an independent
// validator (python3-jsonschema, Draft 7, for Debian's /usr/bin/python3) accepts every
// file of configs/ with it, and each mistake below is rejected by both the schema and
// `train --check` (exit 2): an unknown section, an unknown or misspelt key, a wrong
// type, a number out of range, a word that is not one of the choices, a list where a
// word goes. A pipeline.balance list (explicit counts) is valid to both, and so is `key: ~`
// (null reads as the key left out).
TEST(TrainCli, SchemaAcceptsEveryConfigAndRejectsWhatTheParserRejects) {
  if (std::system("/usr/bin/python3 -c 'import jsonschema, yaml' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "no python3-jsonschema or python3-yaml for /usr/bin/python3 (tools/setup.sh installs them)";
  const fs::path d = fresh_dir("schema");
  const Outcome schema = run({"--schema"});
  ASSERT_EQ(schema.status, 0) << schema.out;
  std::ofstream(d / "schema.json") << schema.out;
  std::ofstream(d / "validate.py") << R"(import json, sys, yaml, jsonschema
schema = json.load(open(sys.argv[1]))
jsonschema.Draft7Validator.check_schema(schema)
v = jsonschema.Draft7Validator(schema)
print(json.dumps({f: [e.message for e in v.iter_errors(yaml.safe_load(open(f)) or {})] for f in sys.argv[2:]}))
)";
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(fs::path(TETRA_SOURCE_DIR) / "configs"))
    if (e.path().extension() == ".yaml") files.push_back(e.path().string());
  ASSERT_GE(files.size(), 8u);
  const std::vector<std::string> good = {
      write_job(d, "explicit_balance.yaml",
                "model: {type: mlp, hidden: [64, 48, 32]}\nmesh: {pipeline: 2}\npipeline: {balance: [3, 5]}\n")
          .string(),
      // `key: ~` is the key left out (its default), for a word, a number, a list and a section.
      write_job(d, "nulls_are_defaults.yaml",
                "model: {type: ~, hidden: ~}\noptimizer: {lr: ~, type: sgd}\nschedule: ~\ntrain: {max_steps: ~}\n")
          .string(),
      write_job(d, "auto_and_check.yaml", "mesh: {data: auto, pipeline: 1}\ncollectives: {check: true}\nlog: {dir: ~}\n")
          .string()};
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"unknown_section.yaml", "modle: {type: mlp}\n"},
      {"misspelt_key.yaml", "model: {type: mlp, hiden: [64]}\n"},
      {"wrong_type.yaml", "train: {max_steps: ten}\n"},
      {"out_of_range.yaml", "data: {batch_size: 0}\n"},
      {"not_a_choice.yaml", "optimizer: {type: adamm}\n"},
      {"nonpositive_lr.yaml", "optimizer: {lr: 0}\n"},
      {"list_for_a_word.yaml", "pipeline: {schedule: [1f1b]}\n"},
      {"word_for_a_section.yaml", "zero: 3\n"},
      {"not_auto.yaml", "mesh: {data: atuo}\n"},
      {"no_ranks.yaml", "mesh: {data: 0}\n"},
      {"check_a_word.yaml", "collectives: {check: often}\n"},
  };
  std::vector<std::string> bad_files;
  for (const auto& [name, text] : bad) {
    bad_files.push_back(write_job(d, name, text).string());
    const Outcome check = run({bad_files.back(), "--check"});
    EXPECT_EQ(check.status, 2) << name << ": the parser accepted it:\n" << check.out;
  }
  for (const auto& f : good) {
    const Outcome check = run({f, "--check"});
    EXPECT_EQ(check.status, 0) << f << "\n" << check.out;
  }
  std::string cmd = "/usr/bin/python3 '" + (d / "validate.py").string() + "' '" + (d / "schema.json").string() + "'";
  for (const auto& f : files) cmd += " '" + f + "'";
  for (const auto& f : good) cmd += " '" + f + "'";
  for (const auto& f : bad_files) cmd += " '" + f + "'";
  cmd += " >'" + (d / "verdicts.json").string() + "' 2>'" + (d / "validate.err").string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << tetra::testing_tools::slurp(d / "validate.err");
  const auto verdicts = nlohmann::json::parse(tetra::testing_tools::slurp(d / "verdicts.json"));
  for (const auto& f : files) EXPECT_EQ(verdicts[f], nlohmann::json::array()) << f;
  for (const auto& f : good) EXPECT_EQ(verdicts[f], nlohmann::json::array()) << f;
  for (const auto& f : bad_files) EXPECT_NE(verdicts[f], nlohmann::json::array()) << f << ": the schema accepted it";
}

// --version says what was built: the project's version and commit from CMake (not a
// literal in the code), LibTorch's version, and each collectives backend with whether it
// is usable here; the banner of a run carries the same version.
TEST(TrainCli, VersionComesFromTheBuild) {
  const Outcome v = run({"--version"});
  ASSERT_EQ(v.status, 0) << v.out;
  EXPECT_EQ(v.out.rfind(std::string("train (tetra ") + TETRA_VERSION, 0), 0u) << v.out;
  // The commit of the build, not of the last configure (issue 28, item 9): the tree's HEAD
  // now, as the suite runs after its build. (Not this test binary's own TETRA_GIT_COMMIT:
  // an incremental build relinks train at a new commit without relinking every test.)
  const Outcome head = run_program("/bin/sh", {"-c", std::string("git -C '") + TETRA_SOURCE_DIR +
                                                         "' rev-parse --short=12 HEAD 2>/dev/null"});
  if (head.status == 0 && head.out.size() >= 12) {
    EXPECT_NE(v.out.find("commit " + head.out.substr(0, 12)), std::string::npos) << v.out << " at " << head.out;
  }
  EXPECT_NE(v.out.find("LibTorch "), std::string::npos) << v.out;
  EXPECT_NE(v.out.find("  mpi: Open MPI"), std::string::npos) << v.out;
  EXPECT_NE(v.out.find("  gloo: "), std::string::npos) << v.out;
}

// `train --help-env` prints every declared environment variable (Note [Knobs declared
// once]), needs no job, and `--help` points at it.
TEST(TrainCli, HelpEnvListsEveryDeclaredVariable) {
  const Outcome h = run({"--help-env"});
  ASSERT_EQ(h.status, 0) << h.out;
  EXPECT_EQ(h.out, tetra::env::help_text());
  for (const tetra::env::Knob* k : tetra::env::knobs())
    EXPECT_NE(h.out.find(std::string("\n  ") + k->name + "  "), std::string::npos) << k->name << " missing:\n" << h.out;
  EXPECT_LT(h.out.find("TETRA_JOB_SECRET"), h.out.find("OMPI_COMM_WORLD_RANK")) << "tetra's own come first";
  const Outcome help = run({"--help"});
  ASSERT_EQ(help.status, 0) << help.out;
  EXPECT_NE(help.out.find("--help-env"), std::string::npos) << help.out;
}

// tools/completion/train.bash in a real bash: after --set the keys come from this
// train's --list-keys (the parsers' own), a lone key goes on with '=', and after
// `key=` the choice's words.
TEST(TrainCli, BashCompletionOffersTheParsersKeysAndWords) {
  if (::access("/bin/bash", X_OK) != 0) GTEST_SKIP() << "no bash";
  const fs::path d = fresh_dir("completion");
  std::ofstream(d / "drive.sh") << "source '" << TETRA_SOURCE_DIR << "/tools/completion/train.bash'\n"
                                << R"(comp() {
  COMP_LINE="$1"; COMP_POINT=${#COMP_LINE}
  read -ra COMP_WORDS <<<"$COMP_LINE"
  [[ $COMP_LINE == *" " ]] && COMP_WORDS+=("")
  COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
  COMP_WORDS[0]=")" << kTrain << R"("
  _tetra_train
  echo "[$1] ${COMPREPLY[*]}"
}
comp "train job.yaml --set model.ty"
comp "train job.yaml --set model.type=g"
comp "train job.yaml --set pipeline.schedule="
comp "train job.yaml --set zero."
comp "train job.yaml --dry"
)";
  const Outcome out = run_program("/bin/bash", {(d / "drive.sh").string()});
  ASSERT_EQ(out.status, 0) << out.out;
  EXPECT_NE(out.out.find("[train job.yaml --set model.ty] model.type=\n"), std::string::npos) << out.out;
  EXPECT_NE(out.out.find("[train job.yaml --set model.type=g] gpt\n"), std::string::npos) << out.out;
  EXPECT_NE(out.out.find("[train job.yaml --set pipeline.schedule=] gpipe 1f1b interleaved_1f1b zbh1 zbv\n"), std::string::npos)
      << out.out;
  EXPECT_NE(out.out.find("[train job.yaml --set zero.] zero.bucket_mb zero.overlap zero.prefetch zero.stage\n"),
            std::string::npos)
      << out.out;
  EXPECT_NE(out.out.find("[train job.yaml --dry] --dry-run\n"), std::string::npos) << out.out;
}
