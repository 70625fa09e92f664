// Running a tool as a user runs it, for the tests of tools/: a fresh folder per case, and
// one spawn of the binary with its stdout and stderr captured in files of that folder.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace tetra::testing_tools {

// An empty folder under the test's temporary directory: <prefix>_<name>_<pid>.
inline std::filesystem::path fresh_dir(const std::string& prefix, const std::string& name) {
  std::filesystem::path d =
      std::filesystem::path(testing::TempDir()) / (prefix + "_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct Outcome {
  int status = -1;  // the exit status, or 128 + the signal that ended it
  std::string out, err;
};

// Starts `exe args...` with stdout going to `out` and stderr to `err` (to `out` as well
// when `err` is empty), in this process's environment with `env` ("NAME=value") set on
// top; returns its pid.
inline pid_t spawn_tool(const std::string& exe, const std::vector<std::string>& args, const std::filesystem::path& out,
                        const std::filesystem::path& err = {}, const std::vector<std::string>& env = {}) {
  std::vector<std::string> vars;
  for (char** e = environ; *e; ++e) {
    const std::string v = *e;
    bool replaced = false;
    for (const auto& x : env) replaced = replaced || v.compare(0, x.find('=') + 1, x, 0, x.find('=') + 1) == 0;
    if (!replaced) vars.push_back(v);
  }
  vars.insert(vars.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (auto& v : vars) envp.push_back(const_cast<char*>(v.c_str()));
  envp.push_back(nullptr);
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(exe.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (err.empty())
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
  else
    posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = -1;
  EXPECT_EQ(posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv.data(), envp.data()), 0);
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

// The exit status of a spawned process, or 128 + the signal that ended it.
inline int wait_status(pid_t pid) {
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// Waits for `pid` up to `limit`: its exit status (or 128 + signal), and in `took` how long
// it ran from the call; -1 when it is still running then (it is killed).
inline int wait_within(pid_t pid, std::chrono::seconds limit, double* took = nullptr) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  int st = 0;
  while (Clock::now() - start < limit) {
    if (waitpid(pid, &st, WNOHANG) == pid) {
      if (took) *took = std::chrono::duration<double>(Clock::now() - start).count();
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &st, 0);
  return -1;
}

// wait_within, and when `pid` is still running at the limit, every process left on the
// test hosts (tools/test-hosts.sh `hosts_script`) killed too: ranks orphaned by a killed
// mpirun.
inline int wait_on_test_hosts(pid_t pid, std::chrono::seconds limit, const std::string& hosts_script) {
  const int status = wait_within(pid, limit);
  if (status == -1)
    for (const char* host : {"tetra-host1", "tetra-host2"}) wait_status(spawn_tool(hosts_script, {"kill", host}, "/dev/null"));
  return status;
}

// mpirun's arguments for `exe args...` on np local ranks (--oversubscribe: CI has 2 cores;
// the run-as-root variables set, as CI runs as root and they are ignored otherwise).
inline std::vector<std::string> mpirun_args(int np, const std::string& exe, const std::vector<std::string>& args) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  std::vector<std::string> all = {"--oversubscribe", "--bind-to", "none", "-np", std::to_string(np), exe};
  all.insert(all.end(), args.begin(), args.end());
  return all;
}

// The major version of the Open MPI whose launcher `mpiexec` is ("mpirun (Open MPI)
// 5.0.7": 5; 4 on Debian 12, 5 on Debian 13, whose mpirun is PRRTE's); 0 when it names none.
inline int open_mpi_major(const std::string& mpiexec) {
  int major = 0;
  if (FILE* p = ::popen(("'" + mpiexec + "' --version 2>&1").c_str(), "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, p))
      if (const char* at = std::strstr(line, "(Open MPI) "); at && major == 0) major = std::atoi(at + 11);
    ::pclose(p);
  }
  return major;
}

// mpirun's arguments (from -np on) for `cmd...` on values.size() ranks where rank r has
// `var` set to values[r], or unset where values[r] is empty: each rank is a shell that
// sets it from its rank (OMPI_COMM_WORLD_RANK, or PMIx's or PMI's) and execs cmd, so the
// rank is cmd itself. This rather than mpirun's MPMD form (`-x V=a A : -x V=b B`), on
// which Debian 13's Open MPI 5.0.7 segfaults before any rank starts (open-mpi/ompi#13303;
// Ubuntu 25.04 and 26.04 too): with more than one app, PMIx's pmdl/ompi (5.0.2 to 5.0.9,
// fixed after) reads the entries it took from PMIx's parameter file as another type, and
// Debian's file has one (mca_base_component_path).
inline std::vector<std::string> mpirun_per_rank_env(const std::string& var, const std::vector<std::string>& values,
                                                    const std::vector<std::string>& cmd) {
  std::vector<std::string> args = {"-np", std::to_string(values.size())};
  std::string unset = "unset";
  for (size_t r = 0; r < values.size(); ++r) {
    const std::string name = "TETRA_TEST_RANK_ENV_" + std::to_string(r);
    if (!values[r].empty()) args.insert(args.end(), {"-x", name + "=" + values[r]});
    unset += " " + name;
  }
  args.insert(args.end(), {"/bin/sh", "-c",
                           "r=${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-$PMI_RANK}}; "
                           "eval \"is_=\\${TETRA_TEST_RANK_ENV_$r+set} v_=\\${TETRA_TEST_RANK_ENV_$r-}\"; " +
                               unset + "; unset " + var + "; if [ -n \"$is_\" ]; then export " + var +
                               "=\"$v_\"; fi; unset is_ v_ r; exec \"$@\"",
                           "sh"});
  args.insert(args.end(), cmd.begin(), cmd.end());
  return args;
}

// Runs `exe args...` to its end; its output lands in dir/stdout.txt and dir/stderr.txt.
inline Outcome run_tool(const std::string& exe, const std::filesystem::path& dir, const std::vector<std::string>& args) {
  const std::filesystem::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  Outcome r;
  const pid_t pid = spawn_tool(exe, args, out, err);
  if (pid <= 0) return r;
  r.status = wait_status(pid);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

// A TCP port free on loopback now (for a rendezvous the test starts next).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// A job that trains for ever (data parallel on `ranks`, unless `strategy` says more: a
// mesh line and its sections), written as d/job.yaml; its metrics go to d/m.jsonl and its
// flight-recorder dumps under d. The fault tests kill or stop it long before it ends.
inline std::string long_job(const std::filesystem::path& d, const std::string& backend, int ranks,
                            const std::string& strategy = "", int timeout_s = 600) {
  const std::filesystem::path p = d / "job.yaml";
  std::ofstream(p) << "name: faults\n"
                      "model: {type: mlp, hidden: [64, 64]}\n"
                      "data: {type: synthetic, batch_size: 48}\n"
                      "optimizer: {type: sgd, lr: 0.01}\n"
                      "train: {max_steps: 1000000, seed: 3, threads: 1}\n"
                   << (strategy.empty() ? "mesh: {data: " + std::to_string(ranks) + "}\n" : strategy + "\n")
                   << "collectives: {backend: " << backend << ", timeout_s: " << timeout_s
                   << "}\n"
                      "checkpoint: {dir: \"\"}\n"
                      "log: {every: 1, progress: off, metrics: "
                   << (d / "m.jsonl").string() << ", dir: " << d.string() << "}\n";
  return p.string();
}

}  // namespace tetra::testing_tools
