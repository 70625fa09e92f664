// Jobs across hosts: two test hosts on this machine (tools/test-hosts.sh: a network and a
// UTS namespace each, a bridge between them), `mpirun` starting two ranks on each through
// the script's agent, so ranks on one host talk through shared memory and ranks on
// different hosts through TCP, as on a cluster. Every strategy follows the single-process
// run within relative 1e-5 (fp32), losses at every step and every parameter at the end;
// the plan and topo see two hosts; a host that dies ends the job on the other, named.
//
// The same hosts as the nodes of a real Slurm cluster (tools/test-slurm.sh: munged,
// slurmctld, a slurmd on each host): srun starts the ranks, with PMIx for Open MPI and
// without it for gloo.
//
// The hosts need root (namespaces, a bridge); without it, or without iproute2 (or Slurm's
// packages, for the Slurm cases), every case skips and says why.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "collectives/build_config.h"
#include "core/safetensors.h"
#include "tests/tools/spawn.h"

namespace fs = std::filesystem;
using namespace tetra::testing_tools;

namespace {

const std::string kTrain = std::string(TETRA_BIN_DIR) + "/train";
const std::string kTopo = std::string(TETRA_BIN_DIR) + "/topo";

struct Result {
  int status = -1;
  std::string out;  // stdout and stderr together
};

const std::string kHosts = std::string(TETRA_SOURCE_DIR) + "/tools/test-hosts.sh";
const std::string kSlurm = std::string(TETRA_SOURCE_DIR) + "/tools/test-slurm.sh";

int wait_on_hosts(pid_t pid, std::chrono::seconds limit) { return wait_on_test_hosts(pid, limit, kHosts); }

// Runs `exe args...` to its end, at most 5 minutes (a hang is a failure, not ctest's timeout).
Result run(const std::string& exe, const std::vector<std::string>& args, const fs::path& log) {
  const pid_t pid = spawn_tool(exe, args, log);
  Result r;
  r.status = wait_on_hosts(pid, std::chrono::minutes(5));
  r.out = slurp(log);
  if (r.status == -1) ADD_FAILURE() << exe << " was still running after 5 minutes:\n" << r.out;
  return r;
}

// The two hosts, up for the whole suite (the script is idempotent) and down after it.
class MultiHost : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (::geteuid() != 0) {
      skip_ = "test hosts need root (network namespaces, a bridge)";
      return;
    }
    const fs::path log = fs::path(testing::TempDir()) / ("test_hosts_up_" + std::to_string(::getpid()) + ".log");
    const Result up = run(kHosts, {"up", "2"}, log);
    if (up.status != 0) skip_ = "tools/test-hosts.sh up 2 failed: " + up.out;
  }
  static void TearDownTestSuite() {
    if (!skip_.empty()) return;
    run(kHosts, {"down"}, fs::path(testing::TempDir()) / ("test_hosts_down_" + std::to_string(::getpid()) + ".log"));
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
  }

  static inline std::string skip_;
};

// `train args...` as 4 ranks, 2 on each host.
Result across(const fs::path& dir, const std::vector<std::string>& args) {
  std::vector<std::string> all = {"run", "-np", "4", kTrain};
  all.insert(all.end(), args.begin(), args.end());
  return run(kHosts, all, dir / "across.log");
}

fs::path fresh(const std::string& name) { return fresh_dir("multihost", name); }

// step -> loss of the train records.
std::map<int64_t, double> losses(const fs::path& metrics) {
  std::map<int64_t, double> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto rec = nlohmann::json::parse(line);
    if (!rec.value("eval", false)) out[rec["step"].get<int64_t>()] = rec["loss"].get<double>();
  }
  return out;
}

// A small Fashion-MNIST MLP, 20 steps, the final weights exported. The silence after
// which a host counts as lost is 60 s, not 20: on this 2-core VM, 4 oversubscribed ranks
// spinning in MPI_Comm_split (Open MPI's threaded communicator-id agreement, at start-up)
// have been seen to leave the sleeping threads of one host's processes unscheduled for
// ~20 s while the other host's ran (a detector process outside the job froze with them).
// These cases test the numerics; the silence rule has its own (test_faults.cpp).
fs::path write_job(const fs::path& d, const std::string& optimizer) {
  const fs::path p = d / "job.yaml";
  std::ofstream(p) << "name: multihost\n"
                      "model: {type: mlp, hidden: [128, 64]}\n"
                      "data: {type: fashion-mnist, batch_size: 128, eval_samples: 0}\n"
                   << "optimizer: " << optimizer << "\n"
                   << "train: {max_steps: 20, seed: 5, threads: 1}\n"
                      "data_parallel: {bucket_mb: 0.05}\n"
                      "collectives: {peer_silence_s: 60}\n"
                      "checkpoint: {dir: \"\"}\n"
                      "log: {every: 1, progress: plain}\n";
  return p;
}

// The job on one process, then across the hosts with `sets`: losses within relative
// 1e-5 at every step, every parameter within 1e-5 (relative to the tensor's scale).
// Returns what the run across the hosts printed. `launch` starts the run across the hosts
// (mpirun by default).
using Launch = std::function<Result(const fs::path& dir, const std::vector<std::string>& args)>;
std::string expect_follows_one_process(const std::string& name, const std::string& optimizer,
                                       const std::vector<std::string>& sets, const Launch& launch = across) {
  const fs::path d = fresh(name);
  const std::string job = write_job(d, optimizer).string();
  auto args = [&](const std::string& tag) {
    return std::vector<std::string>{job, "--set", "log.metrics=" + (d / (tag + ".jsonl")).string(), "--set",
                                    "checkpoint.safetensors=" + (d / (tag + ".safetensors")).string(), "--set",
                                    "log.dir=" + (d / tag).string()};
  };
  const Result one = run(kTrain, args("one"), d / "one.log");
  EXPECT_EQ(one.status, 0) << one.out;
  std::vector<std::string> many_args = args("many");
  for (const auto& s : sets) {
    many_args.push_back("--set");
    many_args.push_back(s);
  }
  const Result many = launch(d, many_args);
  EXPECT_EQ(many.status, 0) << many.out;
  if (one.status != 0 || many.status != 0) return many.out;
  const auto a = losses(d / "one.jsonl"), b = losses(d / "many.jsonl");
  EXPECT_EQ(a.size(), 20u);
  EXPECT_EQ(b.size(), 20u) << many.out;
  for (const auto& [step, loss] : a) EXPECT_NEAR(b.at(step), loss, 1e-5 * std::abs(loss)) << name << ", step " << step;
  const auto wa = tetra::core::load_safetensors((d / "one.safetensors").string());
  const auto wb = tetra::core::load_safetensors((d / "many.safetensors").string());
  EXPECT_EQ(wa.size(), wb.size());
  for (const auto& [key, t] : wa) {
    if (!wb.count(key)) {
      ADD_FAILURE() << name << ": the run across the hosts has no parameter " << key;
      continue;
    }
    const double scale = std::max(1.0, t.abs().max().item<double>());
    const double diff = (wb.at(key) - t).abs().max().item<double>();
    EXPECT_LE(diff, 1e-5 * scale) << name << ": parameter " << key;
  }
  return many.out;
}

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

}  // namespace

// Data parallel over 4 ranks on 2 hosts, plain SGD without clipping (a sum instead of an
// average would be 4x the step): hierarchical allreduce turns itself on (the data group
// spans the hosts, two ranks on each), and matches the flat allreduce.
TEST_F(MultiHost, DataParallelAcrossTwoHostsFollowsOneProcessHierarchicalAndFlat) {
  const std::string sgd = "{type: sgd, lr: 0.05}";
  const std::string out = expect_follows_one_process("dp", sgd, {"mesh.data=4"});
  EXPECT_TRUE(has(out, "2 hosts")) << out;
  EXPECT_TRUE(has(out, "hierarchical")) << out;
  expect_follows_one_process("dp_flat", sgd, {"mesh.data=4", "data_parallel.hierarchical=off"});
}

// pipeline 2 x data 2: the data groups (consecutive ranks) stay inside a host, the
// pipeline's sends cross between the hosts.
TEST_F(MultiHost, PipelineTimesDataAcrossTwoHostsFollowsOneProcess) {
  expect_follows_one_process("pp_dp", "{type: adamw, lr: 2.0e-3}",
                             {"mesh.pipeline=2", "mesh.data=2", "pipeline.schedule=1f1b", "pipeline.micro_batches=4"});
}

TEST_F(MultiHost, ZeroThreeAcrossTwoHostsFollowsOneProcessWithPlainSgd) {
  expect_follows_one_process("zero3", "{type: sgd, lr: 0.05}", {"mesh.data=4", "zero.stage=3"});
}

// 4 processes x 2 replica threads: 8 data-parallel ranks, 4 on each host.
TEST_F(MultiHost, ReplicasAcrossTwoHostsFollowOneProcess) {
  expect_follows_one_process("replicas", "{type: sgd, lr: 0.05}", {"mesh.data=4", "replicate.replicas=2"});
}

// Two hosts on one machine by name (hardware::hostname: TETRA_HOSTNAME, as Horovod's
// HOROVOD_HOSTNAME), each pair of ranks its own (mpirun_per_rank_env: a shell that sets it
// by rank, where mpirun's MPMD form, A : B, crashes Debian 13's Open MPI). Data parallelism
// with `hierarchical: on` and small buckets (every bucket through reduce-scatter inside a
// host, allreduce across, allgather inside) follows one process with plain SGD, parameters
// too; the plan names both hosts. No namespaces: this runs wherever mpirun does.
TEST(NamedHosts, HierarchicalDataParallelOverTwoNamedHostsFollowsOneProcess) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  const Launch named = [](const fs::path& dir, const std::vector<std::string>& args) {
    std::vector<std::string> all = {"--oversubscribe", "--bind-to", "none"};
    std::vector<std::string> cmd = {kTrain};
    cmd.insert(cmd.end(), args.begin(), args.end());
    for (const std::string& a : mpirun_per_rank_env("TETRA_HOSTNAME", {"named-a", "named-a", "named-b", "named-b"}, cmd))
      all.push_back(a);
    return run(TETRA_MPIEXEC, all, dir / "named.log");
  };
  const std::string out = expect_follows_one_process(
      "named_hosts", "{type: sgd, lr: 0.05}", {"mesh.data=4", "data_parallel.hierarchical=on"}, named);
  EXPECT_TRUE(has(out, "4 data ranks on 2 hosts")) << out;
  EXPECT_TRUE(has(out, "hierarchical allreduce")) << out;
}

// Note [Monitor handshake], on the test hosts: a job of 2 ranks on tetra-host1 while a
// hostile peer (tests/tools/hostile_peer.py) on tetra-host2, and then one on tetra-host1
// itself, connects to rank 0's monitor and tries a hello claiming rank 1 then a close
// (which ended every job before the handshake), a forged failure report, 100 MB without
// a newline, 500 connections at once, random bytes and a replayed challenge. The job runs
// every step to the end with exit 0 and the losses of an undisturbed run, bit for bit;
// its log names the refused addresses. TETRA_MONITOR_ADDR=10.213.0.1 makes rank 0 listen
// on host 1's interface; the undisturbed run, without it, shows where a job on one host
// listens: loopback only (Note [Monitor listens]).
namespace {

// The local address of the socket listening on `port` inside `host`'s network namespace
// ("0100007F" for 127.0.0.1, as /proc/net/tcp writes it); empty when none listens yet.
std::string listening_on(const std::string& host, int port, const fs::path& dir) {
  char hex[8];
  std::snprintf(hex, sizeof(hex), ":%04X", port);
  const Result r = run(kHosts, {"exec", host, "cat", "/proc/net/tcp"}, dir / "tcp.txt");
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    std::istringstream f(line);
    std::string slot, local, remote, state;
    f >> slot >> local >> remote >> state;
    if (state == "0A" && local.size() > 5 && local.substr(local.size() - 5) == hex) return local.substr(0, local.size() - 5);
  }
  return "";
}

std::string wait_listening(const std::string& host, int port, const fs::path& dir) {
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60); std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(std::chrono::milliseconds(100)))
    if (std::string a = listening_on(host, port, dir); !a.empty()) return a;
  return "";
}

}  // namespace

TEST_F(MultiHost, AHostilePeerNeitherEndsNorDisturbsTheJob) {
  const fs::path d = fresh("hostile");
  const int port = 29517;
  const fs::path job = d / "job.yaml";
  std::ofstream(job) << "name: hostile\n"
                        "model: {type: mlp, hidden: [256, 256]}\n"
                        "data: {type: synthetic, batch_size: 64}\n"
                        "optimizer: {type: sgd, lr: 0.01}\n"
                        "train: {max_steps: 2500, seed: 3, threads: 1}\n"
                        "mesh: {data: 2}\n"
                        "checkpoint: {dir: \"\"}\n"
                        "log: {every: 1, progress: off, dir: "
                     << (d / "run").string() << "}\n";  // not d: the run folder gets a job.yaml of its own
  const auto job_on_host1 = [&](const std::string& tag, const std::vector<std::string>& env) {
    std::vector<std::string> args = {"exec", "tetra-host1", TETRA_MPIEXEC, "--allow-run-as-root", "--oversubscribe",
                                     "--bind-to", "none", "-np", "2", "-x", "TETRA_MONITOR_PORT=" + std::to_string(port)};
    for (const std::string& e : env) args.insert(args.end(), {"-x", e});
    args.insert(args.end(), {kTrain, job.string(), "--set", "log.metrics=" + (d / (tag + ".jsonl")).string(), "--set",
                             "log.dir=" + (d / ("run-" + tag)).string()});
    return spawn_tool(kHosts, args, d / (tag + ".log"));
  };

  // Undisturbed, and on one host: rank 0 listens on loopback only.
  const pid_t quiet = job_on_host1("quiet", {});
  EXPECT_EQ(wait_listening("tetra-host1", port, d), "0100007F");
  ASSERT_EQ(wait_on_hosts(quiet, std::chrono::minutes(3)), 0) << slurp(d / "quiet.log");

  // Attacked, listening on host 1's interface (10.213.0.1 is 0100D50A in /proc/net/tcp).
  const pid_t attacked = job_on_host1("attacked", {"TETRA_MONITOR_ADDR=10.213.0.1"});
  EXPECT_EQ(wait_listening("tetra-host1", port, d), "0100D50A");
  const std::string peer = std::string(TETRA_SOURCE_DIR) + "/tests/tools/hostile_peer.py";
  std::map<std::string, std::string> said;
  for (const std::string from : {"tetra-host2", "tetra-host1"}) {
    const Result r = run(kHosts, {"exec", from, "/usr/bin/python3", peer, "10.213.0.1", std::to_string(port)},
                         d / ("peer_" + from + ".log"));
    EXPECT_EQ(r.status, 0) << from << ":\n" << r.out << "\nthe job:\n" << slurp(d / "attacked.log");
    said[from] = r.out;
    EXPECT_TRUE(has(r.out, "the monitor still answers")) << from << ": the job ended before the attacks did:\n" << r.out;
    EXPECT_TRUE(has(r.out, "hello without proof: closed by the monitor")) << r.out;
    EXPECT_TRUE(has(r.out, "forged failure report: closed by the monitor")) << r.out;
    EXPECT_TRUE(has(r.out, "random bytes on 20 connections: 20 closed by the monitor")) << r.out;
    EXPECT_TRUE(has(r.out, "another connection's challenge: closed by the monitor")) << r.out;
  }
  const int status = wait_on_hosts(attacked, std::chrono::minutes(3));
  const std::string out = slurp(d / "attacked.log");
  ASSERT_EQ(status, 0) << out;
  EXPECT_FALSE(has(out, "died")) << out;
  EXPECT_TRUE(has(out, "the monitor refused a connection (the first) from 10.213.0.2:")) << out;
  EXPECT_TRUE(has(out, "from 10.213.0.1")) << out;
  EXPECT_TRUE(has(out, "too many connections at once that have not proved the job's secret")) << out;
  EXPECT_TRUE(has(out, "its hello did not prove that it holds the job's secret")) << out;
  const auto a = losses(d / "quiet.jsonl"), b = losses(d / "attacked.jsonl");
  EXPECT_EQ(a.size(), 2500u);
  EXPECT_EQ(b, a) << "the attacked run's losses differ from the undisturbed run's";
  for (const auto& [from, text] : said) std::printf("from %s:\n%s", from.c_str(), text.c_str());
}

// topo run across the hosts sees two hosts and which ranks live where.
TEST_F(MultiHost, TopoShowsBothHostsAndTheirRanks) {
  const fs::path d = fresh("topo");
  const Result r = run(kHosts, {"run", "-np", "4", kTopo}, d / "topo.log");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r.out, "tetra-host1")) << r.out;
  EXPECT_TRUE(has(r.out, "tetra-host2")) << r.out;
}

// Ranks that fail while starting (here: told to reach rank 0's monitor by a name their
// hosts cannot resolve) exit, with the reason; they do not wait in MPI_Finalize for rank
// 0, which waits for them, and mpirun ends the job.
TEST_F(MultiHost, RanksThatFailWhileStartingEndTheJobInsteadOfHanging) {
  const fs::path d = fresh("early_failure");
  const std::string job = write_job(d, "{type: sgd, lr: 0.05}").string();
  const pid_t pid = spawn_tool(kHosts,
                               {"run", "-np", "4", "-x", "TETRA_MONITOR_ADDR=tetra-nowhere.invalid", kTrain, job, "--set",
                                "mesh.data=4", "--set", "log.metrics="},
                               d / "run.log");
  const auto t0 = std::chrono::steady_clock::now();
  const int status = wait_on_hosts(pid, std::chrono::seconds(60));
  const std::string out = slurp(d / "run.log");
  ASSERT_NE(status, -1) << "still running 60 s after the ranks failed:\n" << out;
  EXPECT_NE(status, 0) << out;
  EXPECT_TRUE(has(out, "monitor: cannot connect to rank 0 on port")) << out;
  EXPECT_TRUE(has(out, "tetra-nowhere.invalid: ")) << out;  // the name tried, and why it failed
  std::printf("the job ended %.2f s after it started (status %d)\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), status);
}

// A host that dies (every process on it killed at once, its daemon too) ends the job on
// the other host within 30 s, naming both ranks that were lost (Note [Monitor]: the
// ranks lost within 300 ms of the first are named with it).
TEST_F(MultiHost, AHostThatDiesEndsTheJobOnTheOtherNamingItsRanks) {
  const fs::path d = fresh("host_dies");
  const std::string job = long_job(d, "mpi", 4);
  const pid_t mpirun = spawn_tool(kHosts, {"run", "-np", "4", kTrain, job}, d / "run.log");
  // Wait until the job is training.
  const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(2);
  auto steps = [&] {
    std::ifstream in(d / "m.jsonl");
    int n = 0;
    for (std::string l; std::getline(in, l);) n += l.find("\"loss\"") != std::string::npos;
    return n;
  };
  while (steps() < 3 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_GE(steps(), 3) << slurp(d / "run.log");
  const Result killed = run(kHosts, {"kill", "tetra-host2"}, d / "kill.log");
  ASSERT_EQ(killed.status, 0) << killed.out;
  const auto t0 = std::chrono::steady_clock::now();
  const int status = wait_on_hosts(mpirun, std::chrono::seconds(30));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string out = slurp(d / "run.log");
  ASSERT_NE(status, -1) << "the job did not end within 30 s of its host dying:\n" << out;
  // Open MPI 5.0's mpirun (PRRTE 3.0) exits at once, with status 0, when it loses a host's
  // daemon, and the other host's ranks are killed without a word of theirs relayed (its
  // node-died path sets no exit status: tools/test-hosts.sh run -np 4 sleep 60 and a kill
  // ends the same way, 0 in 16 ms; Open MPI 4.1: 205 after 2 s). Nothing of tetra's to
  // test under it; under any launcher that waits for the survivors, everything below.
  if (status == 0 && has(out, "PRTE has lost communication with a remote daemon"))
    GTEST_SKIP() << "mpirun (PRRTE) ended with status 0 " << took << " s after losing tetra-host2's daemon, "
                 << "without waiting for the other host's ranks:\n" << out;
  EXPECT_NE(status, 0) << out;
  EXPECT_TRUE(has(out, "tetra-host2")) << out;
  // Both of its ranks, named together by the other host's ranks.
  EXPECT_TRUE(has(out, "rank 2 (host tetra-host2")) << out;
  EXPECT_TRUE(has(out, "rank 3 (host tetra-host2")) << out;
  std::printf("the job ended %.2f s after tetra-host2 died (status %d)\n", took, status);
}

// The test hosts as the nodes of a Slurm cluster, for the whole suite.
class Slurm : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (::geteuid() != 0) {
      skip_ = "a Slurm cluster on the test hosts needs root";
      return;
    }
    const fs::path log = fs::path(testing::TempDir()) / ("test_slurm_up_" + std::to_string(::getpid()) + ".log");
    Result up = run(kHosts, {"up", "2"}, log);
    if (up.status == 0) up = run(kSlurm, {"up", "--hosts"}, log);
    if (up.status != 0) skip_ = up.out;
  }
  static void TearDownTestSuite() {
    if (!skip_.empty()) return;
    const fs::path log = fs::path(testing::TempDir()) / ("test_slurm_down_" + std::to_string(::getpid()) + ".log");
    run(kSlurm, {"down"}, log);
    run(kHosts, {"down"}, log);
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
  }

  static inline std::string skip_;
};

// `train args...` as one srun step of 4 tasks, 2 on each node, started from tetra-host1.
Launch srun(const std::vector<std::string>& options) {
  return [options](const fs::path& dir, const std::vector<std::string>& args) {
    std::vector<std::string> all = {"srun", "-N", "2", "-n", "4", "--ntasks-per-node", "2", "--kill-on-bad-exit=1"};
    all.insert(all.end(), options.begin(), options.end());
    all.push_back(kTrain);
    all.insert(all.end(), args.begin(), args.end());
    return run(kSlurm, all, dir / "srun.log");
  };
}

// srun --mpi=pmix: Open MPI's ranks find each other through Slurm's PMIx server, no
// mpirun; tetra takes the world from Slurm's variables. Plain SGD without clipping.
TEST_F(Slurm, SrunWithPmixAcrossTwoNodesFollowsOneProcessWithPlainSgd) {
  const std::string out =
      expect_follows_one_process("slurm_mpi", "{type: sgd, lr: 0.05}", {"mesh.data=4"}, srun({"--mpi=pmix"}));
  EXPECT_TRUE(has(out, "slurm, world 4, local ranks 2 (srun: SLURM_PROCID, SLURM_STEP_NUM_TASKS; PMIx), 2 hosts"))
      << out;
  EXPECT_TRUE(has(out, "backend mpi")) << out;
}

// gloo needs no PMI: the ranks meet at the step's first node (SLURM_STEP_NODELIST
// "tetra-host[1-2]", expanded) on a port derived from the job and step ids, with no
// MASTER_ADDR or MASTER_PORT exported. ZeRO-3 with plain SGD, so the gathers and
// reduce-scatters cross the nodes too.
TEST_F(Slurm, GlooUnderSrunMeetsAtTheStepsFirstNode) {
  const std::string out = expect_follows_one_process("slurm_gloo", "{type: sgd, lr: 0.05}",
                                                     {"mesh.data=4", "zero.stage=3", "collectives.backend=gloo"}, srun({}));
  EXPECT_TRUE(has(out, "slurm, world 4, local ranks 2 (srun: SLURM_PROCID, SLURM_STEP_NUM_TASKS), 2 hosts")) << out;
  EXPECT_TRUE(has(out, "backend gloo")) << out;
}

// The two mistakes Slurm users make first, each answered with what to do, exit status 2,
// and no hang: `train` in a batch script without srun (one process inside an allocation
// of 4 tasks, not rank 0 of 4), and the mpi backend under srun without PMIx (Open MPI
// would print a page about rebuilding it and abort).
TEST_F(Slurm, BatchScriptWithoutSrunAndSrunWithoutPmixSayWhatToDo) {
  const fs::path d = fresh("slurm_mistakes");
  const std::string job = write_job(d, "{type: sgd, lr: 0.05}").string();
  const Result batch = run(kSlurm,
                           {"exec", "sbatch", "--wait", "-n", "4", "-o", (d / "batch.out").string(), "--wrap",
                            kTrain + " " + job + " --set mesh.data=4"},
                           d / "sbatch.log");
  EXPECT_EQ(batch.status, 2) << batch.out;  // sbatch --wait exits with the job's status
  const std::string said = slurp(d / "batch.out");
  EXPECT_TRUE(has(said, "mesh data=4 = 4 ranks, but the world has 1 (a single process (a Slurm batch step: "
                        "SLURM_NTASKS=4, no SLURM_STEP_ID; srun starts the ranks))"))
      << said;
  const Result no_pmix = srun({"--mpi=none"})(d, {job, "--set", "mesh.data=4", "--set", "log.metrics="});
  EXPECT_NE(no_pmix.status, 0) << no_pmix.out;
  EXPECT_TRUE(has(no_pmix.out, "the mpi backend under srun needs the PMIx plugin")) << no_pmix.out;
  EXPECT_TRUE(has(no_pmix.out, "srun --mpi=pmix")) << no_pmix.out;
  EXPECT_FALSE(has(no_pmix.out, "OPAL ERROR")) << no_pmix.out;
}
