#include "collectives/monitor_session.h"

#include <cstdio>
#include <cstdlib>

namespace tetra::collectives::monitor {

std::string report_json() {
  nlohmann::json comms = nlohmann::json::array();
  for (const MemberProgress& m : local_progress())
    if (m.group && m.group->agreed) comms.push_back(to_json(m));
  return text_of(nlohmann::json({{"t", "report"}, {"where", process_description()}, {"comms", std::move(comms)}}));
}

std::vector<MemberProgress> parse_report(const nlohmann::json& comms) {
  std::vector<MemberProgress> out;
  for (const auto& c : comms) out.push_back(member_progress_from_json(c));
  return out;
}

std::string who(int rank, const std::string& where) {
  return "rank " + std::to_string(rank) + (where.empty() ? "" : " (" + where + ")");
}

std::string last_seen(const std::vector<MemberProgress>& report) {
  const MemberProgress* best = nullptr;
  for (const MemberProgress& m : report) {
    if (m.running && (!best || !best->running || m.current.started_us > best->current.started_us)) best = &m;
    else if (!m.running && m.has_last && (!best || (!best->running && m.last.started_us > best->last.started_us))) best = &m;
  }
  if (!best) return "it had reported no op";
  return "it was last in " + (best->running ? best->current : best->last).describe_at(wall_us());
}

namespace {

[[noreturn]] void end_process(const std::string& text) {
  const std::string path = FlightRecorder::dump("peer lost: " + text);
  std::fflush(stdout);
  std::fprintf(stderr, "\ntetra: %s; ending this rank (exit status %d: a peer was lost)%s%s\n", text.c_str(),
               kExitPeerLost, path.empty() ? "" : "; flight recorder: ", path.c_str());
  std::fflush(stderr);
  std::_Exit(kExitPeerLost);
}

int64_t us(Duration d) { return std::chrono::duration_cast<std::chrono::microseconds>(d).count(); }

}  // namespace

Session::Session(const MonitorOptions& options, int rank, int size, std::string key)
    : options_(options), rank_(rank), size_(size), key_(std::move(key)) {
  silent_us_ = us(options.silence);
  heartbeat_us_ = std::min<int64_t>(2'000'000, silent_us_ / 4);
  stalled_us_ = std::max<int64_t>(1'000'000, std::min<int64_t>(5'000'000, silent_us_ / 4));
  wake_.open();
}

Session::~Session() { wake_.close(); }

void Session::start() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    where_[rank_] = process_description();
    running_ = true;
  }
  thread_ = std::thread([this] { run_guarded(); });
}

// The monitor must never take the process down: whatever escapes ends the monitoring
// with a line on stderr, and the job goes on without it.
void Session::run_guarded() {
  try {
    loop();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tetra: the monitor's %s stopped: %s (dead ranks will no longer be named)\n", role(), e.what());
  }
}

void Session::halt(const std::string& last) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!running_) return;
    running_ = false;
  }
  ending_ = true;
  if (!last.empty()) say(last);
  stop_ = true;
  wake_.wake();
  if (thread_.joinable()) thread_.join();
  close_connections();
  wake_.close();
}

bool Session::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

bool Session::send_line(int fd, const std::string& line) {
  std::lock_guard<std::mutex> lock(send_mu_);
  return send_all(fd, line);
}

// Note [Silence]: whether this process itself did not run (its loop came round `gap` late:
// a paused machine, SIGSTOP, a debugger, a starved CPU). Then every silence it measured
// is its own, and the caller restarts its peers' clocks instead of blaming them.
bool Session::stalled(int64_t& last_turn_us, int64_t now) const {
  const int64_t gap = now - last_turn_us;
  last_turn_us = now;
  if (gap <= stalled_us_) return false;
  std::fprintf(stderr,
               "tetra: rank %d (%s): the monitor did not run for %s (this machine or process was stopped or starved); "
               "the other ranks' silence over that time is not held against them\n",
               rank_, process_description().c_str(), seconds_text(gap).c_str());
  return true;
}

void Session::lost(const std::string& text) const {
  if (ending_.load()) return;
  end_process(text);
}

void Session::note_failure_locked(const std::string& text) {
  if (!failure_.empty()) return;
  failure_ = text;
  failure_deadline_us_ = mono_us() + us(options_.failure_grace);
}

void Session::end_when_failure_due(int64_t now) {
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty() && now >= failure_deadline_us_) failure = failure_;
  }
  if (!failure.empty()) lost(failure);
}

}  // namespace tetra::collectives::monitor
