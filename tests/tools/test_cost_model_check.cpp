// The cost model against what runs (Note [Cost model]): short layouts of the MLP that
// tools/bench_hosts.sh measures, run for real under mpirun on this machine and across two
// test hosts (tools/test-hosts.sh, a 1 Gbit/s link), each beside its `train --dry-run`
// prediction on a calibration that `bench-collectives --calibrate` measures on the same
// ranks first (the collectives fitted by kind for the mpi backend, Note [Fitted
// collectives]; the hosts' share of this machine's cores, Note [Ranks sharing cores])
// with the layers and the optimizer timed here (--time-layers). Each measured/predicted
// samples/s must stay inside 0.7-1.4: the benchmark's goal is 0.8-1.25, a test's band is
// wider because the machine is shared.
// Measured is the steady state: the median of the metrics' 10-step rates after the first
// ten (the first step allocates, faults in and plans; the model prices a later one).
// The test runs alone (RUN_SERIAL): a neighbour on these two cores would halve what it
// measures. The test hosts need root; without it that case skips and says why.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unistd.h>
#include <string>
#include <vector>

#include "collectives/build_config.h"
#include "hardware/host.h"
#include "tests/tools/spawn.h"

namespace fs = std::filesystem;
using namespace tetra::testing_tools;

namespace {

const std::string kBin = std::string(TETRA_BIN_DIR);
const std::string kHosts = std::string(TETRA_SOURCE_DIR) + "/tools/test-hosts.sh";

struct Layout {
  std::string name;
  int np;
  std::vector<std::string> sets;
  int hosts = 1;  // 2: across the two test hosts, np / 2 on each
};

class CostModelCheck : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fresh_dir("cost_check", "run");
    job_ = (dir_ / "job.yaml").string();
    std::ofstream(job_) << "name: cost-check\n"
                           "model: {type: mlp, hidden: [1024, 1024]}\n"
                           "data: {type: fashion-mnist, batch_size: 256, eval_samples: 0}\n"
                           "optimizer: {type: sgd, lr: 0.05}\n"
                           "train: {max_steps: 60, seed: 1, threads: 1}\n"
                           "checkpoint: {dir: \"\"}\n"
                           "log: {every: 10, progress: off}\n";
  }
  void TearDown() override {
    if (hosts_up_) run_tool(kHosts, dir_, {"down"});
    if (!HasFailure()) fs::remove_all(dir_);
  }

  // The two test hosts, joined by a 1 Gbit/s link; "" when they are up, else why not.
  std::string hosts_up() {
    if (::geteuid() != 0) return "test hosts need root (network namespaces, a bridge)";
    const Outcome up = run_tool(kHosts, dir_, {"up", "2", "--rate", "1gbit"});
    if (up.status != 0) return "tools/test-hosts.sh up 2 failed: " + up.out + up.err;
    hosts_up_ = true;
    return "";
  }

  // `exe args` as np ranks, on this host or across the test hosts; a run still going
  // after 3 minutes is a failure (and, across hosts, its ranks are killed).
  Outcome launch(int np, int hosts, const std::string& exe, const std::vector<std::string>& args) {
    if (hosts == 1) return run_tool(TETRA_MPIEXEC, dir_, mpirun_args(np, exe, args));
    std::vector<std::string> all = {"run", "-np", std::to_string(np), exe};
    all.insert(all.end(), args.begin(), args.end());
    const pid_t pid = spawn_tool(kHosts, all, dir_ / "stdout.txt", dir_ / "stderr.txt");
    Outcome r;
    r.status = wait_on_test_hosts(pid, std::chrono::minutes(3), kHosts);
    if (r.status == -1) ADD_FAILURE() << exe << " across the test hosts was still running after 3 minutes";
    r.out = slurp(dir_ / "stdout.txt");
    r.err = slurp(dir_ / "stderr.txt");
    return r;
  }

  // The calibration of np ranks on `hosts` hosts.
  std::string calibrate(int np, int hosts) {
    const std::string cal = (dir_ / ("calibration" + std::to_string(np) + "x" + std::to_string(hosts) + ".json")).string();
    Outcome r = launch(np, hosts, kBin + "/bench-collectives", {"--calibrate", cal});
    EXPECT_EQ(r.status, 0) << r.out << r.err;
    return cal;
  }

  // The steady samples/s of one run of the layout.
  double measure(const Layout& l) {
    const std::string metrics = (dir_ / "metrics.jsonl").string();
    fs::remove(metrics);
    // A run folder of its own each time: a finished run is never trained again over
    // (Note [A finished run stays]).
    const fs::path run = dir_ / "runs";
    fs::remove_all(run);
    std::vector<std::string> args = {job_, "--set", "log.metrics=" + metrics, "--set", "log.dir=" + run.string()};
    for (const std::string& s : l.sets) args.insert(args.end(), {"--set", s});
    Outcome r = l.np == 1 ? run_tool(kBin + "/train", dir_, args) : launch(l.np, l.hosts, kBin + "/train", args);
    EXPECT_EQ(r.status, 0) << l.name << ": " << r.out << r.err;
    std::vector<double> rates;
    std::istringstream lines(slurp(metrics));
    for (std::string line; std::getline(lines, line);) {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("samples_per_s") && !j.value("eval", false)) rates.push_back(j["samples_per_s"]);
    }
    if (rates.size() < 2) return 0;
    rates.erase(rates.begin());  // the first ten steps
    std::nth_element(rates.begin(), rates.begin() + rates.size() / 2, rates.end());
    return rates[rates.size() / 2];
  }

  // The dry run's prediction for the layout on `cal`.
  nlohmann::json predict(const Layout& l, const std::string& cal) {
    std::vector<std::string> args = {job_, "--dry-run", "--json", "--np", std::to_string(l.np), "--ranks-per-host",
                                     std::to_string(l.np / l.hosts), "--calibration", cal, "--time-layers"};
    for (const std::string& s : l.sets) args.insert(args.end(), {"--set", s});
    Outcome r = run_tool(kBin + "/train", dir_, args);
    EXPECT_EQ(r.status, 0) << r.out << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
    return j.is_object() && j.contains("cost") ? j["cost"] : nlohmann::json::object();
  }

  // Each layout measured (the best of three runs: a shared machine's noise only ever
  // slows one down) against its prediction on `cal`.
  void check(const std::vector<Layout>& layouts, const std::string& cal) {
    for (const Layout& l : layouts) {
      const nlohmann::json cost = predict(l, cal);
      const double predicted = cost.value("samples_per_s", 0.0);
      ASSERT_GT(predicted, 0) << l.name << ": " << cost.dump();
      EXPECT_TRUE(cost.value("compute_timed", false)) << l.name;
      const double measured = std::max({measure(l), measure(l), measure(l)});
      const double ratio = measured / predicted;
      RecordProperty(l.name, std::to_string(ratio));
      std::printf("%-44s measured %8.0f predicted %8.0f samples/s  ratio %.2f\n", l.name.c_str(), measured, predicted, ratio);
      EXPECT_GE(ratio, 0.7) << l.name << ": measured " << measured << " predicted " << predicted << "\n" << cost.dump(1);
      EXPECT_LE(ratio, 1.4) << l.name << ": measured " << measured << " predicted " << predicted << "\n" << cost.dump(1);
    }
  }

  fs::path dir_;
  std::string job_;
  bool hosts_up_ = false;
};

}  // namespace

TEST_F(CostModelCheck, ShortLayoutsOnThisMachineArePredictedWithin0_7To1_4) {
  check({{"one process", 1, {}},
         {"data parallel, 2 ranks", 2, {"mesh.data=2"}},
         {"pipeline, 2 stages x 4 micro-batches", 2, {"mesh.pipeline=2", "pipeline.micro_batches=4"}}},
        calibrate(2, 1));
}

// Two ranks on each host: the cross-host link, and the hosts' share of this machine's
// two cores, both in the prediction.
TEST_F(CostModelCheck, LayoutsAcrossTwoTestHostsArePredictedWithin0_7To1_4) {
  if (const std::string why = hosts_up(); !why.empty()) GTEST_SKIP() << why;
  const std::string cal = calibrate(4, 2);
  // The two hosts are namespaces of this machine (one boot id): each has half its cores.
  const nlohmann::json j = nlohmann::json::parse(slurp(cal), nullptr, false);
  ASSERT_TRUE(j.is_object()) << slurp(cal);
  EXPECT_DOUBLE_EQ(j["host"].value("cores", 0.0), tetra::hardware::usable_cores() / 2.0) << j.dump(1);
  EXPECT_NE(j.value("measured", "").find("2 hosts share one machine"), std::string::npos) << j.dump(1);
  check({{"data parallel, 4 ranks on 2 hosts", 4, {"mesh.data=4"}, 2},
         {"pipeline x data, stages on 2 hosts", 4, {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4"}, 2}},
        cal);
}
