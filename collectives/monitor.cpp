#include "collectives/monitor.h"

#include <unistd.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "collectives/monitor_client.h"
#include "collectives/monitor_handshake.h"
#include "collectives/monitor_server.h"
#include "collectives/watchdog.h"

namespace tetra::collectives {

namespace {

// Rank 0's listening socket until its Server takes it (closed when the setup throws).
struct ListenGuard {
  int fd = -1;
  ~ListenGuard() {
    if (fd >= 0) ::close(fd);
  }
  int release() { return std::exchange(fd, -1); }
};

}  // namespace

Monitor::Monitor(Communicator& world, const MonitorOptions& options) {
  if (world.size() == 1 || has_remote_progress()) return;
  if (options.silence < std::chrono::seconds(1))
    throw CommError("monitor: the silence after which a peer is lost must be at least 1 s, got " +
                    std::to_string(options.silence.count()) + " ms");
  const bool server = world.rank() == 0;
  // Note [Monitor listens] (monitor_transport.cpp).
  const bool one_network = monitor::world_shares_one_network(world, options.timeout);
  ListenGuard listening;
  std::string address;
  if (server) {
    monitor::Listener l = monitor::listen_for_ranks(one_network);
    listening.fd = l.fd;
    address = l.address;
  }
  monitor::Setup setup = monitor::share_setup(world, address, options.timeout);
  if (server) {
    session_ = std::make_shared<monitor::Server>(options, world.size(), std::move(setup.key), listening.release());
  } else {
    auto client = std::make_shared<monitor::Client>(options, world.rank(), world.size(), std::move(setup.key));
    // Rank 0 listened before it shared its addresses: a rank that reaches none of them
    // within 20 s will not (a name that does not resolve here, a network between).
    client->connect(setup.address, Clock::now() + std::min<Duration>(options.timeout, std::chrono::seconds(20)));
    session_ = std::move(client);
  }
  session_->start();
  set_remote_progress(session_);
}

Monitor::~Monitor() {
  if (!session_) return;
  detach();
  session_->halt("");
}

void Monitor::detach() { clear_remote_progress(session_.get()); }

void Monitor::stop() {
  if (!session_) return;
  detach();
  session_->halt(R"({"t":"bye"})");
}

void Monitor::report_failure(const std::string& message) {
  if (!session_) return;
  session_->set_ending();
  detach();
  const std::string first = message.substr(0, std::min<size_t>(message.size(), 2000));
  session_->halt(session_->server()
                     ? monitor::text_of(nlohmann::json(
                           {{"t", "failed"}, {"text", monitor::who(0, process_description()) + " failed: " + first}}))
                     : monitor::text_of(nlohmann::json({{"t", "fail"}, {"message", first}})));
}

void Monitor::ending() {
  if (session_) session_->set_ending();
}

void Monitor::settle(Duration wait) const {
  if (!running() || session_->ending()) return;
  const Deadline end = Clock::now() + wait;
  while (Clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

bool Monitor::running() const { return session_ && session_->running(); }

std::vector<MemberProgress> Monitor::remote_members(const std::string& identity) const {
  return session_ ? session_->remote_members(identity) : std::vector<MemberProgress>{};
}

}  // namespace tetra::collectives
