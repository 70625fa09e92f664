// A run a user cannot lose (issue 33): one run folder that every path follows, checkpoints
// that refuse another job, paths checked before anything trains, exports that carry their
// preprocessing. `train` and `ckpt` run as a user runs them, from a scratch folder.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "collectives/build_config.h"
#include "tests/tools/spawn.h"

namespace fs = std::filesystem;
using tetra::testing_tools::slurp;

namespace {

const std::string kTrain = std::string(TETRA_BIN_DIR) + "/train";
const std::string kCkpt = std::string(TETRA_BIN_DIR) + "/ckpt";

fs::path fresh_dir(const std::string& name) { return tetra::testing_tools::fresh_dir("tetra_runs", name); }

struct Outcome {
  int status = -1;
  std::string out;  // stdout and stderr together
};

// `exe args...` run in `cwd`, as a user in that folder runs it.
Outcome run_in(const fs::path& cwd, const std::string& exe, const std::vector<std::string>& args) {
  std::string command = "cd '" + cwd.string() + "' && exec '" + exe + "'";
  for (const std::string& a : args) command += " '" + a + "'";
  const fs::path log = cwd / "last.log";
  const pid_t pid = tetra::testing_tools::spawn_tool("/bin/sh", {"-c", command}, log);
  Outcome r;
  r.status = tetra::testing_tools::wait_status(pid);
  r.out = slurp(log);
  return r;
}

// A small Fashion-MNIST job with every path left to its default (the run folder).
const char* kJob =
    "name: small\n"
    "model: {type: mlp, hidden: [32]}\n"
    "data: {type: fashion-mnist, batch_size: 64, eval_samples: 500}\n"
    "optimizer: {type: sgd, lr: 0.05}\n"
    "train: {epochs: 1, max_steps: 6, seed: 3, threads: 1}\n"
    "checkpoint: {every_steps: 3, safetensors: model.safetensors}\n"
    "log: {every: 1, progress: plain}\n";

// A tiny byte-level language model on corpus.txt.
const char* kLanguageModel =
    "name: lm\n"
    "model: {type: gpt, layers: 1, d_model: 16, heads: 2}\n"
    "data: {type: text, path: corpus.txt, seq_len: 8, batch_size: 8}\n"
    "train: {max_steps: 2, threads: 1}\n"
    "checkpoint: {safetensors: model.safetensors}\n"
    "log: {progress: plain}\n";

fs::path scratch_with_job(const std::string& name) {
  const fs::path d = fresh_dir(name);
  std::ofstream(d / "job.yaml") << kJob;
  return d;
}

size_t lines_of(const fs::path& p) {
  const std::string text = slurp(p);
  return static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
}

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

// Every file under `dir`, by its path there, with its bytes: a run folder as it stands.
std::map<std::string, std::string> files_of(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out[fs::relative(e.path(), dir).string()] = slurp(e.path());
  return out;
}

}  // namespace

// Item 2: a new name, or a new log.dir, moves the whole run; nothing of the first run is
// touched by the second.
TEST(RunFolder, ANewNameOrLogDirMovesTheWholeRun) {
  const fs::path d = scratch_with_job("moves");
  Outcome first = run_in(d, kTrain, {"job.yaml"});
  ASSERT_EQ(first.status, 0) << first.out;
  const fs::path a = d / "runs/small";
  for (const char* f : {"job.yaml", "summary.json", "metrics.jsonl", "model.safetensors", "config.json",
                        "ckpt/step-00000006/meta.json"})
    EXPECT_TRUE(fs::exists(a / f)) << f << "\n" << first.out;
  const size_t records = lines_of(a / "metrics.jsonl");
  const auto written = fs::last_write_time(a / "model.safetensors");

  Outcome renamed = run_in(d, kTrain, {"job.yaml", "--set", "name=exp2", "--set", "optimizer.lr=0.01"});
  ASSERT_EQ(renamed.status, 0) << renamed.out;
  EXPECT_FALSE(has(renamed.out, "resumed")) << renamed.out;  // its own, new run
  for (const char* f : {"job.yaml", "summary.json", "metrics.jsonl", "model.safetensors", "ckpt/step-00000006/meta.json"})
    EXPECT_TRUE(fs::exists(d / "runs/exp2" / f)) << f;

  Outcome moved = run_in(d, kTrain, {"job.yaml", "--set", "log.dir=elsewhere/run"});
  ASSERT_EQ(moved.status, 0) << moved.out;
  for (const char* f : {"job.yaml", "summary.json", "metrics.jsonl", "model.safetensors", "ckpt/step-00000006/meta.json"})
    EXPECT_TRUE(fs::exists(d / "elsewhere/run" / f)) << f;
  const nlohmann::json summary = nlohmann::json::parse(slurp(d / "elsewhere/run/summary.json"));
  EXPECT_EQ(fs::path(summary["metrics"].get<std::string>()), fs::absolute(d / "elsewhere/run/metrics.jsonl"));

  EXPECT_EQ(lines_of(a / "metrics.jsonl"), records);
  EXPECT_EQ(fs::last_write_time(a / "model.safetensors"), written);

  // The run folder's job.yaml runs the same job again (its paths are the relative ones).
  Outcome again = run_in(d, kTrain, {"runs/small/job.yaml", "--print-config"});
  ASSERT_EQ(again.status, 0) << again.out;
  EXPECT_TRUE(has(again.out, "dir: ckpt")) << again.out;
  EXPECT_FALSE(has(again.out, "\npipeline:")) << again.out;  // no strategy the job did not have
}

// Item 1: a checkpoint knows its job and its model. Another job's checkpoint, or another
// model's, is exit 2 naming both, before anything trains; a changed optimizer or schedule
// resumes, listed in one line; a folder with another job's run is refused.
TEST(RunFolder, ACheckpointRefusesAnotherJobAndAnotherModel) {
  const fs::path d = scratch_with_job("identity");
  ASSERT_EQ(run_in(d, kTrain, {"job.yaml"}).status, 0);
  const fs::path ckpt = fs::absolute(d / "runs/small/ckpt");
  const size_t records = lines_of(d / "runs/small/metrics.jsonl");

  // Another job pointed at this job's checkpoints (an explicit dir, an explicit resume).
  Outcome r = run_in(d, kTrain, {"job.yaml", "--set", "name=other", "--set", "checkpoint.dir=" + ckpt.string()});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r.out, "train: error: checkpoint.dir: " + ckpt.string() + " holds checkpoints of job \"small\"")) << r.out;
  EXPECT_TRUE(has(r.out, "this job is \"other\"")) << r.out;
  r = run_in(d, kTrain, {"job.yaml", "--set", "name=other", "--set", "checkpoint.resume=" + (ckpt / "step-00000003").string()});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r.out, "belongs to job \"small\", and this job is \"other\"")) << r.out;
  EXPECT_FALSE(has(r.out, "step 1/")) << r.out;  // nothing trained
  // Another job into this job's run folder.
  r = run_in(d, kTrain, {"job.yaml", "--set", "name=other", "--set", "log.dir=runs/small"});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r.out, "train: error: log.dir: runs/small holds a finished run of job \"small\"")) << r.out;
  EXPECT_TRUE(has(r.out, "--set log.dir=runs/small-2")) << r.out;

  // The same job with another model.
  r = run_in(d, kTrain, {"job.yaml", "--set", "model.hidden=[16]"});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r.out, "holds another model or data (model.hidden [32] there, [16] here")) << r.out;

  EXPECT_EQ(lines_of(d / "runs/small/metrics.jsonl"), records);  // none of them wrote a record

  // The same job, the same model, another learning rate and schedule: resumes, and says so.
  r = run_in(d, kTrain, {"job.yaml", "--set", "optimizer.lr=0.02", "--set", "schedule.warmup_steps=2", "--set",
                         "train.max_steps=8"});
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r.out, "resumed from runs/small/ckpt/step-00000006 at step 6; changed since it was written: "
                         "optimizer.lr 0.05 -> 0.02, schedule.warmup_steps 0 -> 2"))
      << r.out;
}

// Item 3: --check, and every run at its start, check each path the job reads and writes,
// naming the key; exit 2 before anything trains.
TEST(RunFolder, CheckFindsWhatWouldFailAfterTraining) {
  const fs::path d = scratch_with_job("check");
  Outcome ok = run_in(d, kTrain, {"job.yaml", "--check"});
  EXPECT_EQ(ok.status, 0) << ok.out;
  EXPECT_TRUE(has(ok.out, "job.yaml: ok (Fashion-MNIST")) << ok.out;

  Outcome r = run_in(d, kTrain, {"job.yaml", "--check", "--set", "data.path=/nonexistent/fashion"});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r.out, "train: error: data.path: /nonexistent/fashion does not exist")) << r.out;
  std::ofstream(d / "lm.yaml") << kLanguageModel;
  for (const std::vector<std::string>& how : {std::vector<std::string>{"--check"}, std::vector<std::string>{}}) {
    std::vector<std::string> args = {"lm.yaml", "--set", "data.path=/nonexistent/corpus.txt"};
    args.insert(args.end(), how.begin(), how.end());
    r = run_in(d, kTrain, args);
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_TRUE(has(r.out, "train: error: data.path: /nonexistent/corpus.txt does not exist")) << r.out;
  }

  // A file where a folder goes: --check and the run both stop before training.
  std::ofstream(d / "afile") << "x";
  const std::string in_the_way = (d / "afile/ckpt").string();
  for (bool check : {true, false}) {
    std::vector<std::string> args = {"job.yaml", "--set", "checkpoint.dir=" + in_the_way};
    if (check) args.push_back("--check");
    r = run_in(d, kTrain, args);
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_TRUE(has(r.out, "train: error: checkpoint.dir: cannot create " + in_the_way + ": " + (d / "afile").string() +
                               " is a file in the way"))
        << r.out;
    EXPECT_FALSE(has(r.out, "step 1/")) << r.out;
  }
  r = run_in(d, kTrain, {"job.yaml", "--check", "--set", "checkpoint.safetensors=" + d.string()});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r.out, "checkpoint.safetensors: " + d.string() + " is a folder")) << r.out;

  // A read-only file system, and one too small for a checkpoint (tmpfs, as root).
  const fs::path mnt = d / "mnt";
  fs::create_directories(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", MS_RDONLY, "size=1m") != 0) GTEST_SKIP() << "cannot mount a tmpfs here";
  r = run_in(d, kTrain, {"job.yaml", "--check", "--set", "log.dir=" + (mnt / "run").string()});
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r.out, "train: error: log.dir: cannot create " + (mnt / "run").string())) << r.out;
  EXPECT_TRUE(has(r.out, "Read-only file system")) << r.out;
  ASSERT_EQ(::umount(mnt.c_str()), 0);
  ASSERT_EQ(::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=64k"), 0);
  for (bool check : {true, false}) {
    std::vector<std::string> args = {"job.yaml", "--set", "checkpoint.dir=" + (mnt / "ckpt").string(), "--set",
                                     "model.hidden=[256]"};
    if (check) args.push_back("--check");
    r = run_in(d, kTrain, args);
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_TRUE(has(r.out, "train: error: checkpoint.dir: one checkpoint needs about")) << r.out;
    EXPECT_TRUE(has(r.out, mnt.string() + " has")) << r.out;
    EXPECT_FALSE(has(r.out, "step 1/")) << r.out;
  }
  ::umount(mnt.c_str());
}

// Item 4: both exports (train's and `ckpt export`'s) carry a config a reader can use:
// Debian's torch, given only the weights and the config, evaluates the test split to
// tetra's own evaluation within 1e-4.
TEST(RunFolder, AnExportEvaluatesInPyTorchAsInTetra) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "Debian's python3-torch is not installed (tools/setup.sh installs it)";
  const fs::path d = scratch_with_job("export");
  Outcome trained = run_in(d, kTrain, {"job.yaml", "--set", "train.max_steps=60", "--set", "checkpoint.every_steps=0"});
  ASSERT_EQ(trained.status, 0) << trained.out;
  const fs::path run = d / "runs/small";

  const nlohmann::json config = nlohmann::json::parse(slurp(run / "config.json"));
  const nlohmann::json& pre = config["input"]["preprocessing"];
  EXPECT_EQ(pre["kind"], "image");
  EXPECT_DOUBLE_EQ(pre["mean"].get<double>(), 0.2860);
  EXPECT_DOUBLE_EQ(pre["std"].get<double>(), 0.3530);
  EXPECT_DOUBLE_EQ(pre["scale"].get<double>(), 1.0 / 255);
  ASSERT_EQ(config["layers"].size(), 4u);  // Flatten, Linear, ReLU, Linear
  EXPECT_EQ(config["layers"][1]["layer"], "Linear(in_features=784, out_features=32, bias=true)");

  // `ckpt export` of the final checkpoint writes the same config beside its weights.
  const fs::path exported = d / "exported";
  fs::create_directories(exported);
  Outcome ck = run_in(d, kCkpt, {"export", (run / "ckpt").string(), "-o", (exported / "model.safetensors").string()});
  ASSERT_EQ(ck.status, 0) << ck.out;
  ASSERT_TRUE(fs::exists(exported / "config.json")) << ck.out;
  nlohmann::json again = nlohmann::json::parse(slurp(exported / "config.json"));
  EXPECT_EQ(again["layers"], config["layers"]);
  EXPECT_EQ(again["input"], config["input"]);

  // A pipeline's export: rank 0 holds only its stage's layers, and the config still
  // lists the whole model's (two processes under mpirun).
  const std::string mpirun = std::string(TETRA_MPIEXEC) + (::geteuid() == 0 ? " --allow-run-as-root" : "") +
                             " --oversubscribe --bind-to none -np 2 " + kTrain;
  Outcome piped = run_in(d, "/bin/sh", {"-c", mpirun + " job.yaml --set name=piped --set mesh.pipeline=2 --set "
                                              "pipeline.micro_batches=2 --set train.max_steps=60 --set "
                                              "checkpoint.every_steps=0"});
  ASSERT_EQ(piped.status, 0) << piped.out;
  const fs::path pipe_run = d / "runs/piped";
  EXPECT_EQ(nlohmann::json::parse(slurp(pipe_run / "config.json"))["layers"], config["layers"]);

  for (const fs::path& dir : {run, exported, pipe_run}) {
    const nlohmann::json tetra_eval =
        nlohmann::json::parse(slurp((dir == exported ? run : dir) / "summary.json"))["final_eval"];
    const double tetra_loss = tetra_eval["test_loss"].get<double>();
    const double tetra_accuracy = tetra_eval["test_accuracy"].get<double>();
    const fs::path out = d / "reader.json";
    const std::string command = "/usr/bin/python3 " + std::string(TETRA_SOURCE_DIR) + "/tests/tools/export_reader.py " +
                                (dir / "model.safetensors").string() + " " + (dir / "config.json").string() +
                                " /usr/share/datasets/fashion-mnist 500 > " + out.string() + " 2>&1";
    ASSERT_EQ(std::system(command.c_str()), 0) << slurp(out);
    const nlohmann::json torch_eval = nlohmann::json::parse(slurp(out));
    EXPECT_EQ(torch_eval["samples"], 500);
    EXPECT_NEAR(torch_eval["test_loss"].get<double>(), tetra_loss, 1e-4) << dir;
    EXPECT_NEAR(torch_eval["accuracy"].get<double>(), tetra_accuracy, 1e-4) << dir;
    std::printf("%s: PyTorch test loss %.6f accuracy %.4f; tetra %.6f, %.4f\n", dir.filename().c_str(),
                torch_eval["test_loss"].get<double>(), torch_eval["accuracy"].get<double>(), tetra_loss, tetra_accuracy);
  }

  // A language model's export names its byte vocabulary and sequence length.
  std::ofstream(d / "corpus.txt") << std::string(4000, 'a') + "the quick brown fox jumps over the lazy dog\n";
  std::ofstream(d / "lm.yaml") << kLanguageModel;
  Outcome lm = run_in(d, kTrain, {"lm.yaml", "--set", "data.seq_len=16"});
  ASSERT_EQ(lm.status, 0) << lm.out;
  const nlohmann::json lm_config = nlohmann::json::parse(slurp(d / "runs/lm/config.json"));
  EXPECT_EQ(lm_config["input"]["preprocessing"]["kind"], "bytes");
  EXPECT_EQ(lm_config["input"]["preprocessing"]["vocab"], 256);
  EXPECT_EQ(lm_config["input"]["preprocessing"]["seq_len"], 16);
}

// Issue 48, item 1 (Note [A finished run stays], core/trainer.cpp): running a finished
// job again, by its own file or by the run folder's job.yaml, trains nothing, says so,
// exits 0 and leaves every file of the run as it was (before: 0 steps, "final loss
// 0.0000", a summary of zeros written over the run's). Another model under the same name
// is exit 2 naming what differs, with checkpoints and without; raising the steps continues
// the run and appends.
TEST(RunFolder, AFinishedRunIsNeverWrittenOver) {
  const fs::path d = scratch_with_job("finished");
  ASSERT_EQ(run_in(d, kTrain, {"job.yaml"}).status, 0);
  const fs::path run = d / "runs/small";
  const auto before = files_of(run);
  ASSERT_TRUE(before.count("summary.json")) << "no summary";

  for (const std::string& job : {std::string("job.yaml"), std::string("runs/small/job.yaml")}) {
    const Outcome again = run_in(d, kTrain, {job});
    EXPECT_EQ(again.status, 0) << job << "\n" << again.out;
    EXPECT_TRUE(has(again.out, "runs/small: finished at step 6: nothing to train; raise train.max_steps or "
                               "train.epochs to continue it, or --set name=NEW for a new run"))
        << again.out;
    EXPECT_FALSE(has(again.out, "final loss")) << again.out;
    EXPECT_TRUE(files_of(run) == before) << job << ": the finished run's files changed";
  }
  // A checkpoint past this job's end (a shorter run asked of it): nothing to train either.
  Outcome shorter = run_in(d, kTrain, {"job.yaml", "--set", "train.max_steps=4"});
  EXPECT_EQ(shorter.status, 0) << shorter.out;
  EXPECT_TRUE(has(shorter.out, "finished at step 6 (this job stops at step 4): nothing to train")) << shorter.out;
  EXPECT_TRUE(files_of(run) == before);

  // Another model under the same name: refused, nothing written.
  Outcome other = run_in(d, kTrain, {"job.yaml", "--set", "model.hidden=[16]"});
  EXPECT_EQ(other.status, 2) << other.out;
  EXPECT_TRUE(files_of(run) == before);

  // Raising the steps continues it: the records grow, the summary is the longer run's.
  Outcome longer = run_in(d, kTrain, {"job.yaml", "--set", "train.max_steps=8"});
  ASSERT_EQ(longer.status, 0) << longer.out;
  EXPECT_TRUE(has(longer.out, "resumed from runs/small/ckpt/step-00000006 at step 6")) << longer.out;
  const nlohmann::json summary = nlohmann::json::parse(slurp(run / "summary.json"));
  EXPECT_EQ(summary["final_step"], 8);
  EXPECT_EQ(summary["steps"], 2);
  EXPECT_GT(lines_of(run / "metrics.jsonl"), std::count(before.at("metrics.jsonl").begin(),
                                                         before.at("metrics.jsonl").end(), '\n'));
}

// The same with checkpoints off (checkpoint.dir ""), where no checkpoint refuses another
// model and none continues the run: the summary's identity decides (before: the run was
// trained again from step 0 over the finished one's files, whatever its model).
TEST(RunFolder, AFinishedRunWithoutCheckpointsIsNeverWrittenOver) {
  const fs::path d = scratch_with_job("finished_nockpt");
  const std::vector<std::string> off = {"--set", "checkpoint.dir=", "--set", "checkpoint.safetensors="};
  auto with = [&](std::vector<std::string> args) {
    args.insert(args.end(), off.begin(), off.end());
    return run_in(d, kTrain, args);
  };
  ASSERT_EQ(with({"job.yaml"}).status, 0);
  const fs::path run = d / "runs/small";
  const auto before = files_of(run);

  Outcome again = with({"job.yaml"});
  EXPECT_EQ(again.status, 0) << again.out;
  EXPECT_TRUE(has(again.out, "runs/small: finished at step 6: nothing to train; it kept no checkpoint to continue "
                             "from, so --set name=NEW for a new run"))
      << again.out;
  Outcome other = with({"job.yaml", "--set", "model.hidden=[16]"});
  EXPECT_EQ(other.status, 2) << other.out;
  EXPECT_TRUE(has(other.out, "train: error: log.dir: runs/small holds a finished run of job \"small\" with another "
                             "model or data (model.hidden [32] there, [16] here"))
      << other.out;
  Outcome longer = with({"job.yaml", "--set", "train.max_steps=9"});
  EXPECT_EQ(longer.status, 2) << longer.out;
  EXPECT_TRUE(has(longer.out, "that stopped at step 6, and this job trains to step 9, but it kept no checkpoints "
                              "(checkpoint.dir \"\") to continue from"))
      << longer.out;
  EXPECT_FALSE(has(longer.out, "step 1/")) << longer.out;  // nothing trained
  EXPECT_TRUE(files_of(run) == before) << "the finished run's files changed";
}

// Issue 48, item 2: the job files tetra writes (the run folder's job.yaml, the tuner's
// tuned job) keep log.dir unset, so that each runs again under a new name into a folder
// of its own (before: job.yaml pinned log.dir: runs/small, and `--set name=copy` was
// refused as another job in that folder; the tuned job kept the job's name and continued
// its run). Nothing of the first run changes.
TEST(RunFolder, JobFilesTetraWritesRunAgainUnderANewName) {
  const fs::path d = scratch_with_job("rerun");
  ASSERT_EQ(run_in(d, kTrain, {"job.yaml"}).status, 0);
  const fs::path run = d / "runs/small";
  const auto before = files_of(run);
  EXPECT_TRUE(has(before.at("job.yaml"), "  dir: ~\n")) << before.at("job.yaml");

  fs::copy_file(run / "job.yaml", d / "copy.yaml");
  Outcome copy = run_in(d, kTrain, {"copy.yaml", "--set", "name=small-copy"});
  ASSERT_EQ(copy.status, 0) << copy.out;
  EXPECT_TRUE(fs::exists(d / "runs/small-copy/summary.json")) << copy.out;
  EXPECT_FALSE(has(copy.out, "resumed")) << copy.out;

  // The tuner's job, on paper: named small-tuned, its own folder.
  Outcome tune = run_in(d, kTrain, {"job.yaml", "--tune", "--np", "1", "--dry-run"});
  ASSERT_EQ(tune.status, 0) << tune.out;
  const std::string tuned = slurp(d / "job-tuned.yaml");
  EXPECT_TRUE(has(tuned, "\nname: small-tuned\n")) << tuned;
  EXPECT_TRUE(has(tuned, "#   named small-tuned: its run folder is runs/small-tuned")) << tuned;
  EXPECT_TRUE(has(tuned, "  dir: ~\n")) << tuned;
  Outcome tuned_run = run_in(d, kTrain, {"job-tuned.yaml"});
  ASSERT_EQ(tuned_run.status, 0) << tuned_run.out;
  EXPECT_FALSE(has(tuned_run.out, "resumed")) << tuned_run.out;
  EXPECT_TRUE(fs::exists(d / "runs/small-tuned/summary.json")) << tuned_run.out;

  EXPECT_TRUE(files_of(run) == before) << "the first run's files changed";
}

// Issue 48, item 7: a damaged checkpoint that checkpoint.resume names is the job's
// mistake, exit 2 (the exit table's), and `train --check` finds it (before: exit 1, and
// --check passed it).
TEST(RunFolder, ADamagedCheckpointNamedByResumeIsExit2AndCheckFindsIt) {
  const fs::path d = scratch_with_job("damaged");
  ASSERT_EQ(run_in(d, kTrain, {"job.yaml"}).status, 0);
  const fs::path step = d / "runs/small/ckpt/step-00000003";
  std::string bytes = slurp(step / "rank-00000.safetensors");
  bytes[bytes.size() - 2] ^= 0x01;
  std::ofstream(step / "rank-00000.safetensors", std::ios::binary | std::ios::trunc) << bytes;
  const std::string resume = "checkpoint.resume=" + step.string();
  for (const char* how : {"--check", ""}) {
    std::vector<std::string> args = {"job.yaml", "--set", "name=again", "--set", resume};
    if (*how) args.push_back(how);
    const Outcome r = run_in(d, kTrain, args);
    EXPECT_EQ(r.status, 2) << how << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "train: error: checkpoint.resume: checkpoint " + step.string() + " is damaged")) << r.out;
  }
}

// Issue 48, item 4 (Note [Weights from elsewhere]): checkpoint.init_from gives a run
// another run's weights and nothing else, from a checkpoint or a safetensors export alike;
// names and shapes are checked before anything trains, every mismatch listed; the run is
// its own, and resuming it resumes it.
TEST(RunFolder, InitFromStartsFromAnotherRunsWeightsAndNothingElse) {
  const fs::path d = scratch_with_job("init_from");
  ASSERT_EQ(run_in(d, kTrain, {"job.yaml"}).status, 0);
  auto first_loss = [&](const std::string& run) {
    std::ifstream in(d / "runs" / run / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.value("step", 0) == 1 && j.contains("loss")) return j["loss"].get<double>();
    }
    return -1.0;
  };
  const std::vector<std::string> one_step = {"--set", "train.max_steps=1"};
  auto run = [&](const std::string& name, const std::string& from, std::vector<std::string> more = {}) {
    std::vector<std::string> args = {"job.yaml", "--set", "name=" + name, "--set", "checkpoint.init_from=" + from};
    args.insert(args.end(), one_step.begin(), one_step.end());
    args.insert(args.end(), more.begin(), more.end());
    return run_in(d, kTrain, args);
  };
  Outcome ckpt = run("ft", "runs/small/ckpt/step-00000006");
  ASSERT_EQ(ckpt.status, 0) << ckpt.out;
  EXPECT_TRUE(has(ckpt.out, "weights from runs/small/ckpt/step-00000006 (job \"small\", step 6): 4 of the model's 4 "
                            "parameters (no optimizer state, no step: a run of its own)"))
      << ckpt.out;
  Outcome exported = run("ft2", "runs/small/model.safetensors");
  ASSERT_EQ(exported.status, 0) << exported.out;
  EXPECT_TRUE(has(exported.out, "weights from runs/small/model.safetensors (step 6)")) << exported.out;
  ASSERT_EQ(run_in(d, kTrain, {"job.yaml", "--set", "name=fresh", "--set", "train.max_steps=1"}).status, 0);
  // The same weights on the same first batch: the same loss, bit for bit; not the drawn ones'.
  EXPECT_EQ(first_loss("ft"), first_loss("ft2"));
  EXPECT_NE(first_loss("ft"), first_loss("fresh"));
  EXPECT_GT(first_loss("ft"), 0);
  // Its checkpoints are its own, from step 1; resuming it takes them, not the source.
  const nlohmann::json meta = nlohmann::json::parse(slurp(d / "runs/ft/ckpt/step-00000001/meta.json"));
  EXPECT_EQ(meta["job"], "ft");
  Outcome resumed = run("ft", "runs/small/ckpt/step-00000006", {"--set", "train.max_steps=2"});
  ASSERT_EQ(resumed.status, 0) << resumed.out;
  EXPECT_TRUE(has(resumed.out, "resumed from runs/ft/ckpt/step-00000001 at step 1")) << resumed.out;
  EXPECT_FALSE(has(resumed.out, "weights from")) << resumed.out;

  // Another shape: every one listed, exit 2, nothing trained.
  Outcome wider = run("wide", "runs/small/ckpt", {"--set", "model.hidden=[16]"});
  EXPECT_EQ(wider.status, 2) << wider.out;
  EXPECT_TRUE(has(wider.out, "train: error: checkpoint.init_from: runs/small/ckpt (job \"small\", step 6) does not fit "
                             "this model; 3 of another shape: 1.bias [32] there, [16] here, 1.weight [32, 784] there, "
                             "[16, 784] here, 3.weight [10, 32] there, [10, 16] here"))
      << wider.out;
  EXPECT_FALSE(fs::exists(d / "runs/wide/metrics.jsonl")) << wider.out;
  // Other names (a checkpoint's every tensor, exported with --all): strict lists both
  // sides; init_strict: false starts from what matches (nothing here) and says so.
  ASSERT_EQ(run_in(d, kCkpt, {"export", "runs/small/ckpt", "-o", "all.safetensors", "--all"}).status, 0);
  Outcome strict = run("all", "all.safetensors");
  EXPECT_EQ(strict.status, 2) << strict.out;
  EXPECT_TRUE(has(strict.out, "4 of this model not in it: 1.bias, 1.weight, 3.bias, 3.weight; ")) << strict.out;
  EXPECT_TRUE(has(strict.out, "6 in it that this model does not have: model/1.bias, model/1.weight, model/3.bias, "
                              "model/3.weight, optim/__step__, rng/cpu")) << strict.out;
  EXPECT_TRUE(has(strict.out, "checkpoint.init_strict: false starts from the tensors that match")) << strict.out;
  Outcome loose = run("all", "all.safetensors", {"--set", "checkpoint.init_strict=false"});
  EXPECT_EQ(loose.status, 0) << loose.out;
  EXPECT_TRUE(has(loose.out, "0 of the model's 4 parameters; not in it, initialised as usual: 1.bias, 1.weight, "
                             "3.bias, 3.weight; in it, not in this model, left: model/1.bias"))
      << loose.out;
  Outcome missing = run("none", "no/such/ckpt");
  EXPECT_EQ(missing.status, 2) << missing.out;
  EXPECT_TRUE(has(missing.out, "train: error: checkpoint.init_from: no/such/ckpt does not exist")) << missing.out;
}
