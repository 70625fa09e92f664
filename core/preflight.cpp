#include "core/preflight.h"

#include <sys/statvfs.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <tuple>

#include "collectives/error.h"
#include "core/checkpoint.h"
#include "core/device.h"
#include "hardware/topology.h"

namespace tetra::core {

using hardware::ByteDigits;
using hardware::format_bytes;

namespace {

namespace fs = std::filesystem;

std::string in_quotes(const std::string& s) { return "\"" + s + "\""; }

// The path itself when it exists, else its nearest existing parent ("." for a bare name).
fs::path nearest_existing(const fs::path& path) {
  std::error_code ec;
  fs::path p = path;
  while (!p.empty() && !fs::exists(fs::symlink_status(p, ec)) && p != p.root_path()) p = p.parent_path();
  return p.empty() ? fs::path(".") : p;
}

std::string access_error(const fs::path& p, int mode) {
  if (::access(p.c_str(), mode) == 0) return "";
  return std::strerror(errno);
}

// A path the run writes: a folder (`folder`) or a file. "" when it is fine.
std::string write_problem(const std::string& key, const std::string& path, bool folder) {
  if (path.empty()) return "";
  std::error_code ec;
  const fs::path p(path);
  const fs::file_status st = fs::status(p, ec);
  const std::string what = folder ? "a folder" : "a file";
  if (fs::exists(st)) {
    if (folder && !fs::is_directory(st))
      return key + ": " + path + " is a file, and the run needs " + what + " there";
    if (!folder && fs::is_directory(st))
      return key + ": " + path + " is a folder, and the run writes " + what + " there (name the file, e.g. " +
             (p / (key == "log.metrics" ? "metrics.jsonl" : key == "log.trace" ? "trace.json" : "model.safetensors"))
                 .string() +
             ")";
    if (const std::string why = access_error(p, folder ? (W_OK | X_OK) : W_OK); !why.empty())
      return key + ": " + path + " is not writable (" + why + ")";
    return "";
  }
  const fs::path base = nearest_existing(p.parent_path().empty() ? fs::path(".") : p);
  if (!fs::is_directory(base, ec))
    return key + ": cannot create " + path + ": " + base.string() + " is a file in the way";
  if (const std::string why = access_error(base, W_OK | X_OK); !why.empty())
    return key + ": cannot create " + path + " in " + base.string() + " (" + why + ")";
  return "";
}

// A path the job reads: "" when it is there, readable and of the right kind.
std::string read_problem(const std::string& key, const std::string& path, bool folder, const std::string& hint) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) return key + ": " + path + " does not exist" + hint;
  if (folder != fs::is_directory(st))
    return key + ": " + path + " is " + (folder ? "a file" : "a folder") + ", and " + (folder ? "a folder" : "a file") +
           " is read there" + hint;
  if (const std::string why = access_error(path, folder ? (R_OK | X_OK) : R_OK); !why.empty())
    return key + ": " + path + " is not readable (" + why + ")";
  return "";
}

}  // namespace

std::vector<std::string> path_problems(const JobSpec& spec, bool own_data) {
  std::vector<std::string> out;
  auto add = [&](std::string problem) {
    if (!problem.empty()) out.push_back(std::move(problem));
  };
  // Read.
  const DataSpec& d = spec.data;
  if (own_data) {
    // The program's dataset: nothing to read here.
  } else if (d.type == "fashion-mnist") {
    const std::string hint =
        " (data.type fashion-mnist reads a folder of the four gzipped IDX files: install the Debian package "
        "dataset-fashion-mnist, which tools/setup.sh does, or set data.path)";
    std::string folder = read_problem("data.path", d.path, true, hint);
    add(folder);
    if (folder.empty())
      for (const char* name : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                               "t10k-labels-idx1-ubyte.gz"})
        add(read_problem("data.path", (fs::path(d.path) / name).string(), false, hint));
  } else if (d.type == "text") {
    add(read_problem("data.path", d.path, false, " (data.type text reads one text file)"));
  }
  const std::string& resume = spec.checkpoint.resume;
  if (resume != "auto" && resume != "never" && !CheckpointStore::resolve(resume))
    add("checkpoint.resume: no checkpoint at " + resume +
        " (a step folder, ckpt/step-00000500, or a folder of them; auto takes checkpoint.dir's newest)");
  const std::string& init = spec.checkpoint.init_from;
  std::error_code ec;
  if (!init.empty() && !fs::is_regular_file(init, ec) && !CheckpointStore::resolve(init))
    add("checkpoint.init_from: " + init + (fs::exists(init, ec) ? " is neither" : " does not exist: neither") +
        " a checkpoint (a step folder, or a folder of them) nor a safetensors file");
  // Write. When the run folder itself cannot be made, that is the one problem to say
  // about the paths inside it.
  const std::string run_dir = write_problem("log.dir", spec.log.dir, true);
  add(run_dir);
  auto inside_broken_run_dir = [&](const std::string& path) {
    if (run_dir.empty()) return false;
    const std::string rel = fs::path(path).lexically_relative(spec.log.dir).string();
    return !rel.empty() && rel.rfind("..", 0) != 0;
  };
  for (const auto& [key, path, folder] :
       std::vector<std::tuple<std::string, std::string, bool>>{{"checkpoint.dir", spec.checkpoint.dir, true},
                                                               {"log.metrics", spec.log.metrics, false},
                                                               {"log.trace", spec.log.trace, false},
                                                               {"log.tensorboard", spec.log.tensorboard, true},
                                                               {"checkpoint.safetensors", spec.checkpoint.safetensors, false}})
    if (!inside_broken_run_dir(path)) add(write_problem(key, path, folder));
  return out;
}

int64_t checkpoint_bytes(const JobSpec& spec, int64_t parameters) {
  const OptimizerSpec& o = spec.optimizer;
  const int64_t slots = o.type == "sgd" ? (o.momentum > 0 ? 1 : 0) : 2;  // momentum; adam's two moments
  return parameters * 4 * (1 + slots) + (1 << 16);  // fp32 weights and state, + meta and RNG
}

std::string space_problem(const JobSpec& spec, int64_t parameters) {
  if (spec.checkpoint.dir.empty()) return "";
  const fs::path base = nearest_existing(spec.checkpoint.dir);
  struct statvfs vfs {};
  if (::statvfs(base.c_str(), &vfs) != 0) return "";  // write_problem says what is wrong with it
  const int64_t free_bytes = static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
  const int64_t need = checkpoint_bytes(spec, parameters);
  if (free_bytes >= need) return "";
  return "checkpoint.dir: one checkpoint needs about " + format_bytes(need, ByteDigits::kWhole) + " (" +
         std::to_string(parameters) + " parameters: fp32 weights and " + spec.optimizer.type + "'s state) and " +
         base.string() + " has " + format_bytes(free_bytes, ByteDigits::kWhole) +
         " free: the run would fail at its first save (free space there, or set " +
         "checkpoint.dir to a larger disk, or \"\" for none)";
}

std::string run_folder_problem(const JobSpec& spec) {
  std::error_code ec;
  if (!spec.log.dir.empty()) {
    // The run folder, or the nearest folder above it that exists, must take a new entry
    // (tried: permission bits say nothing for root, nor of a read-only or virtual file
    // system); else the run would fail at its first record.
    fs::path at = fs::absolute(spec.log.dir, ec);
    while (!at.empty() && !fs::exists(at, ec) && at != at.parent_path()) at = at.parent_path();
    if (fs::is_directory(at, ec)) {
      const fs::path probe = at / (".tetra-write-check-" + std::to_string(::getpid()));
      if (!fs::create_directory(probe, ec) || ec)
        return "log.dir: " + spec.log.dir + " cannot be written: nothing can be created in " + at.string() + " (" +
               (ec ? ec.message() : std::string("it exists")) + "); set log.dir to a folder this run may write, or \"\" for none";
      fs::remove(probe, ec);
    }
    const fs::path job_yaml = fs::path(spec.log.dir) / "job.yaml";
    if (fs::is_regular_file(job_yaml, ec)) {
      std::string other;
      try {
        const YAML::Node n = YAML::LoadFile(job_yaml.string());
        if (n.IsMap() && n["name"] && n["name"].IsScalar()) other = n["name"].Scalar();
      } catch (const std::exception&) {
        // Not a job.yaml tetra wrote: nothing to compare.
      }
      if (!other.empty() && other != spec.name) {
        const bool finished = fs::exists(fs::path(spec.log.dir) / "summary.json", ec);
        return "log.dir: " + spec.log.dir + " holds " + (finished ? "a finished" : "an unfinished") + " run of job " +
               in_quotes(other) + " (its job.yaml), and this job is " + in_quotes(spec.name) +
               ": a run folder holds one job's files, and nothing of that run is written over. Give this run a "
               "folder of its own, --set log.dir=" + spec.log.dir + "-2 (left unset, it is runs/<name> and "
               "follows the name), or --set name=" + other + " to go on with that job";
      }
    }
  }
  // A checkpoint folder elsewhere (an absolute checkpoint.dir) may hold another job's
  // checkpoints: this run's saves would prune them (keep).
  if (!spec.checkpoint.dir.empty() && fs::is_directory(spec.checkpoint.dir, ec)) {
    try {
      if (const auto newest = CheckpointStore(spec.checkpoint.dir, spec.checkpoint.keep).latest()) {
        const CheckpointReader r(*newest);
        const nlohmann::json& meta = r.meta();
        if (meta.contains("job") && meta["job"].is_string() && meta["job"].get<std::string>() != spec.name)
          return "checkpoint.dir: " + spec.checkpoint.dir + " holds checkpoints of job " +
                 in_quotes(meta["job"].get<std::string>()) + " (" + fs::path(*newest).filename().string() +
                 "), and this job is " + in_quotes(spec.name) +
                 ": resuming would go on with that job, and saving would prune its checkpoints. Give this run its "
                 "own checkpoint.dir (the default, ckpt in the run folder, follows the name), or --set name=" +
                 meta["job"].get<std::string>() + " to go on with that job";
      }
    } catch (const std::exception&) {
      // A damaged newest checkpoint: the resume decision says so, with the one before it.
    }
  }
  return "";
}

void check_paths(const JobSpec& spec, bool own_data) {
  std::vector<std::string> problems = path_problems(spec, own_data);
  if (const std::string p = run_folder_problem(spec); !p.empty()) problems.push_back(p);
  if (const std::string p = device_problem(spec); !p.empty()) problems.push_back(p);
  if (problems.empty()) return;
  std::string msg;
  for (const std::string& p : problems) msg += (msg.empty() ? "" : "\n") + p;  // a line each
  throw ConfigError(msg);
}

}  // namespace tetra::core
