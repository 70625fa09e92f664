#include "core/resume.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <vector>

#include "collectives/error.h"
#include "core/random.h"
#include "core/runtime.h"

namespace tetra::core {

namespace fs = std::filesystem;

torch::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const torch::Tensor& state) {
  std::lock_guard<std::mutex> rank_lock(global_rng_mutex());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

std::optional<CheckpointReader> choose_checkpoint(const CheckpointSpec& ck, collectives::Communicator* ranks) {
  if (ck.resume == "never") return std::nullopt;
  if (ck.resume != "auto" && !CheckpointStore::resolve(ck.resume))
    throw ConfigError("checkpoint.resume: no checkpoint at " + ck.resume);
  // The decision travels as the folder, or as "\n" + the error that every rank then throws.
  std::string from;
  std::optional<CheckpointReader> verified;  // rank 0's: its files read and checked once
  if (!ranks || ranks->rank() == 0) {
    try {
      if (ck.resume != "auto") {
        verified.emplace(ck.resume);
        verified->verify();
      } else if (!ck.dir.empty()) {
        std::vector<std::string> skipped;
        verified = CheckpointStore(ck.dir, ck.keep).latest_intact(&skipped);
        const std::string then = verified ? "resuming from " + fs::path(verified->folder()).filename().string()
                                          : "no intact checkpoint is left: starting afresh";
        for (const auto& why : skipped) std::fprintf(stderr, "warning: %s; %s\n", why.c_str(), then.c_str());
      }
      if (verified) from = verified->folder();
    } catch (const Error& e) {
      // A checkpoint the job names that is damaged is the job's mistake (exit 2, as a
      // missing one is); auto's trouble with its own folder is the run's (exit 1).
      from = std::string(ck.resume != "auto" ? "\n2" : "\n1") + e.what();
    }
  }
  if (ranks && ranks->size() > 1) from = collectives::broadcast_string(*ranks, from);
  if (!from.empty() && from[0] == '\n') {
    if (from[1] == '2') throw ConfigError("checkpoint.resume: " + from.substr(2));
    throw Error(from.substr(2));
  }
  if (!from.empty() && !verified) verified.emplace(from);
  return verified;
}

std::string save_for_stop(collectives::Communicator* ranks, const std::function<std::optional<std::string>()>& save) {
  const std::optional<std::string> saved = save();
  if (!saved) return "";
  std::string folder = *saved;
  if (ranks && ranks->size() > 1) folder = collectives::broadcast_string(*ranks, folder);  // the writer's name for it
  set_stop_exit_status(kExitPreempted);  // a further signal: out at once, and resumable
  return folder;
}

void throw_preempted(int64_t step, int reason, const std::string& folder,
                     const std::function<void(const std::string&)>& say) {
  const std::string what = "preempted at step " + std::to_string(step) + " (" + stop_reason(reason) + ")";
  if (folder.empty())
    throw PreemptedError(what + "; no checkpoint was written (checkpoint.dir is \"\"): a new run starts afresh", "");
  say(what + ": every rank finished the step; checkpoint " + folder);
  throw PreemptedError(what + "; checkpoint " + folder, folder);
}

}  // namespace tetra::core
