// What a run reports as it runs (its telemetry): metrics as JSON lines, a progress display,
// a Chrome trace. (Not the `report` tool, tools/report.cpp, which reads a run folder after.)
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "core/tensorboard.h"

namespace tetra::core {

// One JSON object per line, flushed as written, so `tail -f` and a killed run both see
// every record up to the last step.
class MetricsWriter {
 public:
  MetricsWriter() = default;
  // append=false truncates (a new run); true continues a resumed run's file.
  void open(const std::string& path, bool append);
  bool is_open() const { return out_.is_open(); }
  // Every record also goes to TensorBoard event files in `dir` (Note [Event files]);
  // `resumed_at` >= 0: the run resumed from that step. Works with or without the JSONL.
  void open_tensorboard(const std::string& dir, int64_t resumed_at);
  void write(const nlohmann::json& record);
  const std::string& path() const { return path_; }
  const EventWriter& events() const { return events_; }

 private:
  std::ofstream out_;
  std::string path_;
  EventWriter events_;
};

// The progress display. `line`: one live line rewritten in place; `plain`: a line every
// log.every steps; `off`: nothing. `auto` is the live line only on a terminal of a process
// no launcher started: Open MPI gives each rank a pseudo-terminal even when mpirun's own
// output goes to a file, so under a launcher (mpirun, srun, torchrun) isatty() cannot
// tell a person from a file, and auto prints plain lines there.
class Progress {
 public:
  struct Status {
    int64_t step = 0, total = 0, epoch = 0, epochs = 0;
    double loss = 0, lr = 0, samples_per_s = 0, elapsed_s = 0;
    int64_t peak_rss = 0;
  };
  Progress(const std::string& mode, int64_t every, std::FILE* out = stdout);
  void update(const Status& s);
  // A line of its own (eval results, checkpoints), not overwritten by the live line.
  void message(const std::string& text);
  void finish();
  bool live() const { return live_; }

 private:
  void clear_live();
  std::string format(const Status& s) const;
  bool live_ = false, off_ = false, shown_ = false;
  int64_t every_;
  std::FILE* out_;
  std::chrono::steady_clock::time_point last_draw_{};
};

// A Chrome trace-event recorder (chrome://tracing, Perfetto): complete events ("X")
// on named tracks. Cheap when disabled; thread-safe when enabled.
class Trace {
 public:
  void enable(int pid, const std::string& process_name);
  bool enabled() const { return enabled_; }
  // Microseconds since the recorder was enabled.
  double now_us() const;
  // The same clock for a steady_clock time (a Work's start or end, say).
  double us_at(std::chrono::steady_clock::time_point t) const;
  void span(const std::string& track, const std::string& name, double begin_us, double end_us,
            nlohmann::json args = nullptr);
  void write(const std::string& path) const;

  // RAII span.
  class Scope {
   public:
    Scope(Trace& t, const char* track, const char* name)
        : t_(t), track_(track), name_(name), begin_(t.enabled() ? t.now_us() : 0) {}
    ~Scope() {
      if (t_.enabled()) t_.span(track_, name_, begin_, t_.now_us());
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Trace& t_;
    const char* track_;
    const char* name_;
    double begin_;
  };

 private:
  int track_id(const std::string& track);
  bool enabled_ = false;
  int pid_ = 0;
  std::string process_name_;
  std::chrono::steady_clock::time_point start_{};
  double epoch_us_ = 0;  // system clock at start_, in microseconds since the epoch
  mutable std::mutex mu_;
  std::vector<std::string> tracks_;
  std::vector<nlohmann::json> events_;
};

// "1h02m", "3m05s", "42s"
std::string human_duration(double seconds);

}  // namespace tetra::core
