#include "tools/trials/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "collectives/build_config.h"
#include "hardware/env.h"

namespace tetra::trials {

namespace {

using Clock = std::chrono::steady_clock;

// Splits a launcher's words on spaces ("mpirun -np 4 --hostfile h").
std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> w;
  std::istringstream in(s);
  for (std::string x; in >> x;) w.push_back(x);
  return w;
}

std::vector<std::string> launcher_words(int np, std::string l) {
  if (!l.empty()) {
    for (size_t at; (at = l.find("{np}")) != std::string::npos;) l.replace(at, 4, std::to_string(np));
    return words(l);
  }
  if (np == 1) return {};
  if (!env::text(env::kSlurmJobId).empty())
    return {"srun", "--mpi=pmix", "-n", std::to_string(np)};
  std::vector<std::string> w = {*TETRA_MPIEXEC ? TETRA_MPIEXEC : "mpirun", "-np", std::to_string(np), "--oversubscribe", "--bind-to", "none"};
  if (::geteuid() == 0) w.push_back("--allow-run-as-root");
  return w;
}

// Runs argv with stdout and stderr to `log`, in a process group of its own that is ended
// (SIGTERM, then SIGKILL after 5 s) at `deadline`.
planner::Launched run_command(const std::vector<std::string>& argv, const std::string& log, Clock::time_point deadline) {
  planner::Launched e;
  const pid_t pid = ::fork();
  if (pid < 0) return e;
  if (pid == 0) {
    ::setpgid(0, 0);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "tune: cannot start %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  int status = 0;
  bool termed = false;
  Clock::time_point kill_at{};
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) return e;
    const auto now = Clock::now();
    if (!termed && now >= deadline) {
      ::kill(-pid, SIGTERM);
      termed = true;
      e.timed_out = true;
      kill_at = now + std::chrono::seconds(5);
    } else if (termed && now >= kill_at) {
      ::kill(-pid, SIGKILL);
      kill_at = now + std::chrono::hours(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(-pid, SIGKILL);  // what the launcher left behind
  e.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return e;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string self_exe() {
  std::error_code ec;
  const auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("train") : p.string();
}

}  // namespace

ProcessLauncher::ProcessLauncher(int np, std::string launcher, std::string train_exe)
    : words_(launcher_words(np, std::move(launcher))),
      train_exe_(train_exe.empty() ? self_exe() : std::move(train_exe)),
      bench_((std::filesystem::path(train_exe_).parent_path() / "bench-collectives").string()) {}

std::string ProcessLauncher::command() const {
  std::string s;
  for (const auto& w : words_) s += (s.empty() ? "" : " ") + w;
  return s;
}

planner::Launched ProcessLauncher::run(std::vector<std::string> argv, const std::string& log, double seconds) const {
  argv.insert(argv.begin(), words_.begin(), words_.end());
  planner::Launched e =
      run_command(argv, log, Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  e.log = read_text(log);
  return e;
}

planner::Launched ProcessLauncher::train(const std::string& job_file, const std::string& log, double seconds) {
  return run({train_exe_, job_file}, log, seconds);
}

bool ProcessLauncher::can_calibrate() const { return std::filesystem::exists(bench_); }

planner::Launched ProcessLauncher::calibrate(const std::string& file, const std::string& log, double seconds) {
  return run({bench_, "--calibrate", file}, log, seconds);
}

}  // namespace tetra::trials
