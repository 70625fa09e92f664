#include "collectives/monitor_client.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace tetra::collectives::monitor {

Client::Client(const MonitorOptions& options, int rank, int size, std::string key)
    : Session(options, rank, size, std::move(key)) {}

Client::~Client() { close_connections(); }

void Client::connect(const std::string& address, Deadline deadline) {
  Admitted admitted = connect_and_prove(address, deadline, key_, rank_, process_description());
  up_ = Peer{};
  static_cast<Connection&>(up_) = std::move(admitted.connection);
  up_.heard_us = mono_us();
  early_ = std::move(admitted.early);
}

void Client::close_connections() {
  if (up_.fd >= 0) ::close(up_.fd);
  up_.fd = -1;
}

std::vector<MemberProgress> Client::remote_members(const std::string& identity) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!running_) return {};
  const int64_t id = next_query_++;
  lock.unlock();
  send_line(up_.fd, text_of(nlohmann::json({{"t", "query"}, {"id", id}, {"identity", identity}})));
  lock.lock();
  answered_.wait_for(lock, std::chrono::seconds(3), [&] { return answers_.count(id) != 0; });
  auto it = answers_.find(id);
  if (it == answers_.end()) return {};
  std::vector<MemberProgress> out = std::move(it->second);
  answers_.erase(it);
  // The answer holds this process's own members too (rank 0 cannot tell them apart).
  const std::string here = process_description();
  out.erase(std::remove_if(out.begin(), out.end(), [&](const MemberProgress& m) { return m.where == here; }), out.end());
  return out;
}

void Client::line_unguarded(const std::string& line) {
  nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return;
  const std::string t = j.value("t", "");
  if (t == "lost") {
    lost(j.value("text", "a rank died"));
  } else if (t == "failed") {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.empty()) note_failure_locked(j.value("text", "a rank failed"));
  } else if (t == "bye") {
    up_.goodbye = true;
  } else if (t == "report") {
    std::lock_guard<std::mutex> lock(mu_);
    where_[0] = j.value("where", "");
    reports_[0] = parse_report(j.value("comms", nlohmann::json::array()));
  } else if (t == "state") {
    std::lock_guard<std::mutex> lock(mu_);
    answers_[j.value("id", int64_t{0})] = parse_report(j.value("members", nlohmann::json::array()));
    answered_.notify_all();
  }
}

// A line the monitor cannot use is dropped; it never stops the monitor.
void Client::line(const std::string& line) {
  try {
    line_unguarded(line);
  } catch (const std::exception&) {
  }
}

Client::Turn Client::read_up() {
  up_.heard_us = mono_us();
  std::vector<std::string> lines;
  const Read read = read_lines(up_, lines, kLineLimit);
  for (const auto& l : lines) line(l);
  if (read == Read::kTooLong)
    std::fprintf(stderr, "tetra: rank %d: the monitor dropped a line of more than %s from rank 0\n", rank_,
                 line_limit_text(kLineLimit).c_str());
  if (read != Read::kClosed) return Turn::kGoOn;
  if (up_.goodbye || stop_.load()) return Turn::kDone;  // rank 0 ended cleanly
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty()) {
      // Rank 0 failed and said so: its end is no death; the grace period runs on.
      ::close(up_.fd);
      up_.fd = -1;
      return Turn::kNext;
    }
    failure = who(0, where_[0]) +
              " died: its monitor connection closed without a goodbye (killed, out of memory, or crashed); " +
              last_seen(reports_[0]);
  }
  lost(failure);
  return Turn::kDone;
}

void Client::loop() {
  std::string last_report;
  int64_t last_sent = 0, last_turn = mono_us();
  for (const std::string& l : early_) line(l);
  early_.clear();
  while (!stop_.load()) {
    pollfd fds[2] = {{wake_.read_fd(), POLLIN, 0}, {up_.fd, POLLIN, 0}};
    ::poll(fds, 2, 250);
    if (stalled(last_turn, mono_us())) up_.heard_us = mono_us();
    if (fds[0].revents) wake_.drain();
    if (fds[1].revents) {
      const Turn turn = read_up();
      if (turn == Turn::kDone) return;
      if (turn == Turn::kNext) continue;
    }
    const int64_t now = mono_us();
    // Note [Silence]: rank 0 not heard from for silent_us_ is lost.
    if (up_.fd >= 0 && !up_.goodbye && now - up_.heard_us > silent_us_) {
      std::string text;
      {
        std::lock_guard<std::mutex> lock(mu_);
        text = who(0, where_[0]) + " died: no word from it for " + seconds_text(silent_us_) +
               " (its host stopped, or the network to it); " + last_seen(reports_[0]);
      }
      lost(text);
    }
    if (now - last_sent >= report_every_us()) {
      std::string r = report_json();
      if (up_.fd >= 0 && (r != last_report || now - last_sent >= heartbeat_us_)) {
        send_line(up_.fd, r);
        last_report = std::move(r);
        last_sent = now;
      }
    }
    end_when_failure_due(now);
  }
}

}  // namespace tetra::collectives::monitor
