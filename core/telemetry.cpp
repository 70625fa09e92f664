#include "core/telemetry.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "collectives/error.h"
#include "collectives/launch.h"
#include "core/safetensors.h"
#include "hardware/topology.h"

namespace tetra::core {

using hardware::ByteDigits;
using hardware::format_bytes;

namespace fs = std::filesystem;

void MetricsWriter::open(const std::string& path, bool append) {
  path_ = path;
  fs::path p(path);
  std::error_code ec;
  if (!p.parent_path().empty()) fs::create_directories(p.parent_path(), ec);
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  // A path this run may not write is the job's to change (exit 2), not a failed run.
  if (!out_)
    throw ConfigError("log.metrics: cannot write " + path + ": " + std::strerror(errno) +
                      " (set log.dir, or log.metrics, to a place this run may write)");
}

void MetricsWriter::open_tensorboard(const std::string& dir, int64_t resumed_at) { events_.open(dir, resumed_at); }

void MetricsWriter::write(const nlohmann::json& record) {
  events_.record(record);
  if (!out_.is_open()) return;
  out_ << record.dump() << '\n';
  out_.flush();
}

Progress::Progress(const std::string& mode, int64_t every, std::FILE* out) : every_(every), out_(out) {
  const bool tty = out && ::isatty(::fileno(out)) != 0;
  const bool launched = collectives::detect_launch().launcher != "single";
  off_ = mode == "off" || !out;  // no stream: nothing to print on
  live_ = !off_ && (mode == "line" || (mode == "auto" && tty && !launched));
}

std::string Progress::format(const Status& s) const {
  char buf[256];
  double eta = s.samples_per_s > 0 && s.step > 0 ? s.elapsed_s / s.step * (s.total - s.step) : 0;
  int w = static_cast<int>(std::to_string(s.total).size());
  std::snprintf(buf, sizeof(buf),
                "step %*lld/%lld  epoch %lld/%lld  loss %.4f  lr %.3g  %.0f samples/s  ETA %s  mem %s",
                w, static_cast<long long>(s.step), static_cast<long long>(s.total),
                static_cast<long long>(s.epoch), static_cast<long long>(s.epochs), s.loss, s.lr,
                s.samples_per_s, human_duration(eta).c_str(), format_bytes(s.peak_rss, ByteDigits::kWhole).c_str());
  return buf;
}

void Progress::update(const Status& s) {
  if (off_) return;
  if (live_) {
    auto now = std::chrono::steady_clock::now();
    // Redraw at most 10 times a second, and always at the last step.
    if (shown_ && s.step != s.total && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    std::fprintf(out_, "\r\033[K%s", format(s).c_str());
    std::fflush(out_);
    shown_ = true;
    return;
  }
  if (s.step % every_ == 0 || s.step == s.total) {
    std::fprintf(out_, "%s\n", format(s).c_str());
    std::fflush(out_);
  }
}

void Progress::clear_live() {
  if (live_ && shown_) {
    std::fprintf(out_, "\r\033[K");
    shown_ = false;
  }
}

void Progress::message(const std::string& text) {
  if (off_) return;
  clear_live();
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
}

void Progress::finish() {
  if (live_ && shown_) {
    std::fprintf(out_, "\n");
    std::fflush(out_);
    shown_ = false;
  }
}

void Trace::enable(int pid, const std::string& process_name) {
  enabled_ = true;
  pid_ = pid;
  process_name_ = process_name;
  start_ = std::chrono::steady_clock::now();
  epoch_us_ = std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double Trace::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start_).count();
}

double Trace::us_at(std::chrono::steady_clock::time_point t) const {
  return std::chrono::duration<double, std::micro>(t - start_).count();
}

int Trace::track_id(const std::string& track) {
  for (size_t i = 0; i < tracks_.size(); ++i)
    if (tracks_[i] == track) return static_cast<int>(i);
  tracks_.push_back(track);
  return static_cast<int>(tracks_.size() - 1);
}

void Trace::span(const std::string& track, const std::string& name, double begin_us, double end_us,
                 nlohmann::json args) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json e = {{"ph", "X"}, {"name", name}, {"pid", pid_}, {"tid", track_id(track)},
                      {"ts", begin_us}, {"dur", end_us - begin_us}};
  if (!args.is_null()) e["args"] = std::move(args);
  events_.push_back(std::move(e));
}

void Trace::write(const std::string& path) const {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", pid_}, {"args", {{"name", process_name_}}}});
  // Wall-clock time of ts = 0, so trace-merge can line up the ranks exactly.
  events.push_back({{"ph", "M"}, {"name", "clock_sync"}, {"pid", pid_}, {"args", {{"epoch_us", epoch_us_}}}});
  for (size_t i = 0; i < tracks_.size(); ++i)
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid_}, {"tid", i},
                      {"args", {{"name", tracks_[i]}}}});
  for (const auto& e : events_) events.push_back(e);
  nlohmann::json doc = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  write_file_atomic(path, doc.dump() + "\n");
}

std::string human_duration(double seconds) {
  char buf[32];
  if (!std::isfinite(seconds) || seconds < 0) seconds = 0;
  long s = std::lround(seconds);
  if (s >= 3600) std::snprintf(buf, sizeof(buf), "%ldh%02ldm", s / 3600, (s % 3600) / 60);
  else if (s >= 60) std::snprintf(buf, sizeof(buf), "%ldm%02lds", s / 60, s % 60);
  else std::snprintf(buf, sizeof(buf), "%lds", s);
  return buf;
}

}  // namespace tetra::core
