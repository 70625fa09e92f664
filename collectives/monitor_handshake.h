// How the monitor's processes find rank 0 and prove to each other that they belong to the
// job (Note [Monitor], monitor.h): the setup over the world (rank 0's address, the job's
// secret, whether the world shares one network) and the challenge and response on every
// connection.
//
// Note [Monitor handshake]
// Rank 0's port is reachable by anyone on its network, so nothing that arrives there is
// believed before it proves that it holds the job's secret (Note [Job secret]):
//
//   rank 0 -> {"t":"challenge","nonce":Ns}                   on accept, 16 fresh random bytes
//   rank r -> {"t":"hello","rank":r,"where":W,"nonce":Nc,"mac":HMAC(key, "hello" Ns Nc r W)}
//   rank 0 -> {"t":"welcome","mac":HMAC(key, "welcome" Nc Ns r)}   rank 0 proves it too
//
// The connection is then bound to rank r for its life: its later lines are rank r's (a
// forger would have to inject into an established TCP stream), and a second connection
// that proves rank r while the first is open is refused. A connection that does not
// prove the key within kProveWithin, whose first line is anything else, is longer than
// kHandshakeLine before it has, or is one more than the cap of connections waiting to
// prove it, is closed at once: never counted as a rank, never a death, and named in one
// line on rank 0's stderr (at most one line per address per kRefusalQuiet, with the
// count since). A rank refused by mistake (the cap, while a crowd of strangers waits)
// connects again until its deadline. Lines are bounded after the handshake too
// (kLineLimit: a longer one is dropped, named once), and reading is linear in the bytes
// received: each read scans only the bytes it added.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/monitor_transport.h"

namespace tetra::collectives::monitor {

constexpr size_t kHandshakeLine = 4096;
constexpr size_t kLineLimit = size_t{16} << 20;
constexpr int64_t kProveWithin_us = 5'000'000;
constexpr int64_t kRefusalQuiet_us = 10'000'000;
constexpr size_t kWaitingSlack = 16;  // connections waiting to prove the key, beyond the ranks still missing

// ---- setup over the world -----------------------------------------------------------------

// Whether every process of `world` shares this one's kernel and network namespace (then
// rank 0's monitor listens on loopback only): one allreduce of a hash of the namespace.
bool world_shares_one_network(Communicator& world, Duration timeout);

// What every rank learns from rank 0 in the world's first broadcast.
struct Setup {
  std::string address;  // where rank 0 listens (Listener::address)
  std::string key;      // the job's secret (Note [Job secret])
};
// Rank 0's address (`mine`, on rank 0) and the job's secret to every rank, over the world.
// Throws CommError when the ranks disagree on where the secret comes from.
Setup share_setup(Communicator& world, const std::string& mine, Duration timeout);

// ---- the challenge and response -----------------------------------------------------------

// A challenge's or a hello's nonce: 16 fresh random bytes, in hex.
std::string fresh_nonce();

// Rank 0's first line on a connection.
std::string challenge_line(const std::string& server_nonce);

// What a hello claims, once it proved the key.
struct Hello {
  int rank = -1;
  std::string where;
  std::string nonce;  // the client's
};
// Checks the first line of a connection that was sent `server_nonce`: "" and `hello`
// filled when it is a hello with the right proof for a rank of a world of `size`, else
// why it is refused. (Whether that rank is connected already is the server's to say.)
std::string check_hello(const std::string& line, const std::string& server_nonce, const std::string& key, int size,
                        Hello& hello);

// Rank 0's answer to a proven hello: its own proof.
std::string welcome_line(const std::string& key, const std::string& server_nonce, const Hello& hello);

// A connection to rank 0 that proved the job's secret both ways, and the lines that came
// with the welcome.
struct Admitted {
  Connection connection;
  std::vector<std::string> early;
};
// Connects to rank 0 at `address` as `rank` (from `where`) and proves the job's secret,
// both ways. A connection closed before its challenge (rank 0 was refusing a crowd) is
// tried again until `deadline`; an answer without the secret is a CommError at once.
Admitted connect_and_prove(const std::string& address, Deadline deadline, const std::string& key, int rank,
                           const std::string& where);

}  // namespace tetra::collectives::monitor
