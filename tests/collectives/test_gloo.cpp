// The gloo backend (LibTorch's c10d ProcessGroupGloo over TCP on loopback) held to the
// same conformance suite as the others, with ranks as threads of this process, each
// rendezvousing through rank 0's TCPStore as torchrun's ranks would.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "collectives/build_config.h"
#include "collectives/error.h"
#include "conformance.h"

#if TETRA_HAVE_GLOO
#include "collectives/gloo.h"
#endif

using namespace tetra::collectives;

namespace {

#if TETRA_HAVE_GLOO
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

void run_gloo_ranks(int n, const std::function<void(Communicator&)>& fn) {
  const int port = free_port();
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(n);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        WorldOptions o;
        o.timeout = std::chrono::seconds(60);
        CommunicatorPtr c = gloo_world(r, n, "127.0.0.1", port, o);
        fn(*c);
        c->barrier()->wait();
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}
#endif

}  // namespace

class Gloo : public testing::TestWithParam<int> {};

TEST_P(Gloo, Conformance) {
#if TETRA_HAVE_GLOO
  conformance::Config cfg;
  cfg.large_numel = 1 << 16;
  run_gloo_ranks(GetParam(), [&](Communicator& c) {
    EXPECT_EQ(c.backend(), "gloo");
    conformance::run_all(c, cfg);
  });
#else
  GTEST_SKIP() << "built without the gloo backend (libgloo-dev headers not found)";
#endif
}

INSTANTIATE_TEST_SUITE_P(Ranks, Gloo, testing::Values(1, 2, 3));

// Two processes given the same rank (torchrun on two nodes without --node_rank) are named
// at once, on every rank, as a user error: not a wait for the rank that is "missing" until
// the timeout. Ranks 0, 1, 1 of 3, with a 60 s timeout that nobody should reach.
TEST(GlooRendezvous, ARankGivenToTwoProcessesIsNamedAtOnce) {
#if TETRA_HAVE_GLOO
  const int port = free_port();
  const std::vector<int> ranks = {0, 1, 1};
  std::vector<std::string> said(ranks.size());
  std::vector<std::thread> threads;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < ranks.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        WorldOptions o;
        o.timeout = std::chrono::seconds(60);
        gloo_world(ranks[i], 3, "127.0.0.1", port, o);
        said[i] = "joined";
      } catch (const tetra::ConfigError& e) {
        said[i] = e.what();
      } catch (const std::exception& e) {
        said[i] = std::string("not a ConfigError: ") + e.what();
      }
    });
  for (auto& t : threads) t.join();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t i = 0; i < said.size(); ++i) {
    EXPECT_NE(said[i].find("rank 1 was given to two processes"), std::string::npos) << "rank " << ranks[i] << ": " << said[i];
    EXPECT_NE(said[i].find("--node_rank"), std::string::npos) << said[i];
  }
  EXPECT_LT(took, 40.0) << "the ranks waited for the timeout instead of naming the duplicate";
#else
  GTEST_SKIP() << "built without the gloo backend (libgloo-dev headers not found)";
#endif
}
