#include "collectives/monitor_handshake.h"

#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "collectives/auth.h"
#include "hardware/env.h"
#include "hardware/host.h"

namespace tetra::collectives::monitor {

// ---- setup over the world -----------------------------------------------------------------

bool world_shares_one_network(Communicator& world, Duration timeout) {
  const Digest d = sha256(hardware::network_namespace_id());
  int64_t v = 0;
  for (int i = 0; i < 7; ++i) v = v << 8 | d[static_cast<size_t>(i)];  // 56 bits: -v cannot overflow
  at::Tensor t = at::tensor({v, -v}, at::kLong);
  AllreduceOptions o;
  o.op = ReduceOp::kMax;
  o.timeout = timeout;
  world.allreduce(t, o)->wait();
  return t[0].item<int64_t>() == -t[1].item<int64_t>();
}

namespace {

// The job's secret from the environment (Note [Job secret]); empty when unset.
std::string secret_from_environment() { return env::text(env::kJobSecret); }

}  // namespace

// Rank 0's address and the job's secret to every rank, over the world: 256 bytes of
// address, a byte that says where the secret comes from (0: these 32 random bytes; 1:
// every rank's TETRA_JOB_SECRET, which does not travel), 32 bytes of secret.
Setup share_setup(Communicator& world, const std::string& mine, Duration timeout) {
  constexpr int64_t kAddress = 256, kKey = 32;
  Setup setup;
  at::Tensor bytes = at::zeros({kAddress + 1 + kKey}, at::kByte);
  auto* b = static_cast<uint8_t*>(bytes.data_ptr());
  const std::string env = secret_from_environment();
  if (world.rank() == 0) {
    std::memcpy(b, mine.data(), std::min<size_t>(mine.size(), kAddress - 1));
    b[kAddress] = env.empty() ? 0 : 1;
    if (env.empty()) {
      setup.key = random_bytes(kKey);
      std::memcpy(b + kAddress + 1, setup.key.data(), kKey);
    }
  }
  BroadcastOptions o;
  o.timeout = timeout;
  world.broadcast(bytes, o)->wait();
  const bool from_env = b[kAddress] == 1;
  if (from_env != !env.empty())
    throw CommError(std::string("monitor: TETRA_JOB_SECRET is set ") + (from_env ? "on rank 0 but not on rank " : "on rank ") +
                    std::to_string(world.rank()) + (from_env ? "" : " but not on rank 0") +
                    ": every process of a job takes the secret from the environment, or none does (the launcher "
                    "passes it: mpirun -x TETRA_JOB_SECRET, or export it before srun or torchrun)");
  if (world.rank() != 0) setup.key = from_env ? env : std::string(reinterpret_cast<const char*>(b + kAddress + 1), kKey);
  else if (from_env) setup.key = env;
  std::memset(b + kAddress + 1, 0, kKey);
  setup.address = std::string(reinterpret_cast<const char*>(b));
  return setup;
}

// ---- the challenge and response -----------------------------------------------------------

std::string fresh_nonce() {
  const std::string r = random_bytes(16);
  return to_hex(reinterpret_cast<const uint8_t*>(r.data()), r.size());
}

namespace {

// The proofs of Note [Monitor handshake] (hex HMACs).
std::string hello_mac(const std::string& key, const std::string& server_nonce, const std::string& client_nonce,
                      int rank, const std::string& where) {
  return to_hex(hmac_sha256(key, "tetra monitor 1\nhello\n" + server_nonce + "\n" + client_nonce + "\n" +
                                     std::to_string(rank) + "\n" + where));
}
std::string welcome_mac(const std::string& key, const std::string& server_nonce, const std::string& client_nonce,
                        int rank) {
  return to_hex(hmac_sha256(key, "tetra monitor 1\nwelcome\n" + client_nonce + "\n" + server_nonce + "\n" +
                                     std::to_string(rank)));
}

}  // namespace

std::string challenge_line(const std::string& server_nonce) {
  return text_of(nlohmann::json({{"t", "challenge"}, {"nonce", server_nonce}}));
}

std::string check_hello(const std::string& line, const std::string& server_nonce, const std::string& key, int size,
                        Hello& hello) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (string_field(j, "t") != "hello") return "its first line is not a hello";
  const auto it = j.find("rank");
  const int64_t rank = it != j.end() && it->is_number_integer() ? it->get<int64_t>() : -1;
  const std::string where = string_field(j, "where"), nonce = string_field(j, "nonce"), mac = string_field(j, "mac");
  if (rank < 1 || rank >= size) return "its hello claims no rank of this world of " + std::to_string(size);
  if (nonce.size() != 32 ||
      !equal_in_constant_time(mac, hello_mac(key, server_nonce, nonce, static_cast<int>(rank), where)))
    return "its hello did not prove that it holds the job's secret (a wrong HMAC: not this job, or "
           "TETRA_JOB_SECRET differs)";
  hello.rank = static_cast<int>(rank);
  hello.where = where;
  hello.nonce = nonce;
  return "";
}

std::string welcome_line(const std::string& key, const std::string& server_nonce, const Hello& hello) {
  return text_of(nlohmann::json({{"t", "welcome"}, {"mac", welcome_mac(key, server_nonce, hello.nonce, hello.rank)}}));
}

Admitted connect_and_prove(const std::string& address, Deadline deadline, const std::string& key, int rank,
                           const std::string& where) {
  std::string problem = "no attempt";
  while (Clock::now() < deadline) {
    Connection c;
    c.fd = connect_to(address, deadline);
    std::vector<std::string> queue;
    std::string line;
    const Deadline handshake = std::min<Deadline>(deadline, Clock::now() + std::chrono::seconds(10));
    if (!next_line(c, queue, handshake, kHandshakeLine, line)) {
      ::close(c.fd);
      problem = "rank 0 closed the connection, or sent nothing, before its challenge";
      std::this_thread::sleep_for(std::chrono::milliseconds(100 + 100 * (rank % 4)));
      continue;
    }
    const nlohmann::json challenge = nlohmann::json::parse(line, nullptr, false);
    const std::string server_nonce = string_field(challenge, "nonce");
    if (string_field(challenge, "t") != "challenge" || server_nonce.size() != 32) {
      ::close(c.fd);
      throw CommError("monitor: what answers at " + address +
                      " is not rank 0's monitor (its first line is no challenge): another program on that port? "
                      "TETRA_MONITOR_PORT picks another");
    }
    const std::string client_nonce = fresh_nonce();
    send_all(c.fd, text_of(nlohmann::json({{"t", "hello"},
                                           {"rank", rank},
                                           {"where", where},
                                           {"nonce", client_nonce},
                                           {"mac", hello_mac(key, server_nonce, client_nonce, rank, where)}})));
    if (!next_line(c, queue, handshake, kHandshakeLine, line)) {
      ::close(c.fd);
      throw CommError("monitor: rank 0 (" + address +
                      ") refused this rank's proof of the job's secret (rank 0's output says why): do all ranks of "
                      "the job have the same TETRA_JOB_SECRET, or none?");
    }
    const nlohmann::json welcome = nlohmann::json::parse(line, nullptr, false);
    if (string_field(welcome, "t") != "welcome" ||
        !equal_in_constant_time(string_field(welcome, "mac"), welcome_mac(key, server_nonce, client_nonce, rank))) {
      ::close(c.fd);
      throw CommError("monitor: the process at " + address +
                      " answered without the job's secret: it is not this job's rank 0");
    }
    return Admitted{std::move(c), std::move(queue)};
  }
  throw CommError("monitor: rank 0 at " + address + " did not admit this rank in time: " + problem);
}

}  // namespace tetra::collectives::monitor
