#include "collectives/flight_recorder.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "hardware/env.h"
#include "hardware/host.h"

namespace tetra::collectives {

namespace fs = std::filesystem;

const char* to_string(OpState s) {
  switch (s) {
    case OpState::kQueued: return "queued";
    case OpState::kStarted: return "started";
    case OpState::kFinished: return "finished";
    case OpState::kFailed: return "failed";
  }
  return "?";
}

std::string process_description() {
  // Leaked: the monitor and watchdog threads may read it while the process exits.
  static const std::string* d = new std::string("host " + hardware::hostname() + ", pid " + std::to_string(::getpid()));
  return *d;
}

int64_t wall_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

namespace {

std::string shape_text(const std::string& dtype, const std::vector<int64_t>& shape) {
  if (dtype.empty()) return "";
  std::string s = " " + dtype + "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The process's recorders and the dump folder.
struct Registry {
  std::mutex mu;
  std::vector<std::weak_ptr<FlightRecorder>> recorders;
  std::string dir = env::text(env::kFlightRecorderDir);
};

Registry& registry() {
  static Registry* r = new Registry;  // leaked: used from signal handlers and at exit
  return *r;
}

}  // namespace

std::string OpRecord::describe() const {
  std::string s = op + " #" + std::to_string(seq);
  if (group) s += " on " + group->name;
  return s + shape_text(dtype, shape);
}

std::string OpRecord::describe_at(int64_t now_us) const {
  if (state == OpState::kStarted) return describe() + " (running for " + seconds_text(now_us - started_us) + ")";
  return describe() + " (" + to_string(state) + ")";
}

std::string seconds_text(int64_t us) {
  std::ostringstream os;
  os.precision(us >= 10'000'000 ? 0 : 1);
  os << std::fixed << static_cast<double>(us) / 1e6 << " s";
  return os.str();
}

size_t FlightRecorder::default_capacity() {
  return static_cast<size_t>(env::integer(env::kFlightRecorderEntries, /*min=*/1));
}

FlightRecorder::FlightRecorder(std::string owner, size_t capacity)
    : owner_(std::move(owner)), capacity_(std::max<size_t>(capacity, 1)) {
  ring_.reserve(std::min<size_t>(capacity_, 256));
}

FlightRecorder::~FlightRecorder() = default;

std::string FlightRecorder::owner() const {
  std::lock_guard<std::mutex> lock(mu_);
  return owner_;
}

void FlightRecorder::set_owner(std::string owner) {
  std::lock_guard<std::mutex> lock(mu_);
  owner_ = std::move(owner);
}

uint64_t FlightRecorder::record(OpRecord r) {
  std::lock_guard<std::mutex> lock(mu_);
  r.id = next_++;
  if (r.id == 1) {
    // First use: join the process's list (a shared_ptr owns every recorder).
    Registry& reg = registry();
    std::lock_guard<std::mutex> rl(reg.mu);
    reg.recorders.erase(std::remove_if(reg.recorders.begin(), reg.recorders.end(),
                                       [](const auto& w) { return w.expired(); }),
                        reg.recorders.end());
    reg.recorders.push_back(weak_from_this());
  }
  if (ring_.size() < capacity_) ring_.push_back(std::move(r));
  else ring_[(r.id - 1) % capacity_] = std::move(r);
  return next_ - 1;
}

OpRecord* FlightRecorder::find_locked(uint64_t id) {
  if (id == 0 || id >= next_ || next_ - id > capacity_) return nullptr;
  OpRecord& r = ring_[(id - 1) % capacity_];
  return r.id == id ? &r : nullptr;
}

bool FlightRecorder::started(uint64_t id, OpRecord* out) {
  std::lock_guard<std::mutex> lock(mu_);
  OpRecord* r = find_locked(id);
  if (!r) return false;
  r->state = OpState::kStarted;
  r->started_us = wall_us();
  if (out) *out = *r;
  return true;
}

void FlightRecorder::ended(uint64_t id, const std::string& error) {
  std::lock_guard<std::mutex> lock(mu_);
  OpRecord* r = find_locked(id);
  if (!r) return;
  r->state = error.empty() ? OpState::kFinished : OpState::kFailed;
  r->ended_us = wall_us();
  if (!r->started_us) r->started_us = r->ended_us;
  r->error = error;
}

bool FlightRecorder::snapshot_of(uint64_t id, OpRecord& out) const {
  std::lock_guard<std::mutex> lock(mu_);
  OpRecord* r = const_cast<FlightRecorder*>(this)->find_locked(id);
  if (!r) return false;
  out = *r;
  return true;
}

std::vector<OpRecord> FlightRecorder::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<OpRecord> out;
  out.reserve(ring_.size());
  const uint64_t first = next_ > capacity_ ? next_ - capacity_ : 1;
  for (uint64_t id = first; id < next_; ++id) out.push_back(ring_[(id - 1) % capacity_]);
  return out;
}

bool FlightRecorder::try_snapshot(std::vector<OpRecord>& out) const {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  const uint64_t first = next_ > capacity_ ? next_ - capacity_ : 1;
  for (uint64_t id = first; id < next_; ++id) out.push_back(ring_[(id - 1) % capacity_]);
  return true;
}

std::vector<std::shared_ptr<FlightRecorder>> FlightRecorder::all() {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::vector<std::shared_ptr<FlightRecorder>> out;
  for (const auto& w : reg.recorders)
    if (auto r = w.lock()) out.push_back(std::move(r));
  return out;
}

void FlightRecorder::set_dump_dir(const std::string& dir) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.dir = dir;
}

std::string FlightRecorder::dump_dir() {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  return reg.dir;
}

nlohmann::json to_json(const OpRecord& r) {
  nlohmann::json j = {{"id", r.id},          {"op", r.op},         {"seq", r.seq},
                      {"state", to_string(r.state)}, {"queued_us", r.queued_us}, {"started_us", r.started_us},
                      {"ended_us", r.ended_us}};
  if (r.group) j["group"] = to_json(*r.group);
  if (r.p2p) j["p2p"] = true, j["tag"] = r.tag;
  if (r.peer >= 0) j["peer"] = r.peer;
  if (!r.dtype.empty()) {
    j["dtype"] = r.dtype;
    j["shape"] = r.shape;
    j["bytes"] = r.bytes;
  }
  if (!r.error.empty()) j["error"] = r.error;
  return j;
}

nlohmann::json to_json(const GroupInfo& g) {
  return {{"name", g.name}, {"identity", g.identity}, {"agreed", g.agreed},
          {"backend", g.backend}, {"rank", g.rank}, {"size", g.size}};
}

std::shared_ptr<const GroupInfo> group_from_json(const nlohmann::json& gj) {
  auto g = std::make_shared<GroupInfo>();
  g->name = gj.value("name", "");
  g->identity = gj.value("identity", "");
  g->agreed = gj.value("agreed", true);
  g->backend = gj.value("backend", "");
  g->rank = gj.value("rank", 0);
  g->size = gj.value("size", 1);
  return g;
}

namespace {

OpState state_from(const std::string& s) {
  if (s == "started") return OpState::kStarted;
  if (s == "finished") return OpState::kFinished;
  if (s == "failed") return OpState::kFailed;
  return OpState::kQueued;
}

}  // namespace

OpRecord op_record_from_json(const nlohmann::json& j) {
  OpRecord r;
  r.id = j.value("id", uint64_t{0});
  r.op = j.value("op", "");
  r.seq = j.value("seq", int64_t{0});
  r.p2p = j.value("p2p", false);
  r.peer = j.value("peer", -1);
  r.tag = j.value("tag", 0);
  r.dtype = j.value("dtype", "");
  if (j.contains("shape")) r.shape = j["shape"].get<std::vector<int64_t>>();
  r.bytes = j.value("bytes", int64_t{0});
  r.state = state_from(j.value("state", "queued"));
  r.queued_us = j.value("queued_us", int64_t{0});
  r.started_us = j.value("started_us", int64_t{0});
  r.ended_us = j.value("ended_us", int64_t{0});
  r.error = j.value("error", "");
  if (j.contains("group")) r.group = group_from_json(j["group"]);
  return r;
}

nlohmann::json FlightRecorder::dump_json(const std::string& reason) {
  nlohmann::json recs = nlohmann::json::array();
  for (const auto& rec : all()) {
    nlohmann::json entries = nlohmann::json::array();
    for (const OpRecord& r : rec->snapshot()) entries.push_back(to_json(r));
    recs.push_back({{"owner", rec->owner()}, {"entries", std::move(entries)}});
  }
  return {{"format", "tetra flight recorder 1"}, {"reason", reason},   {"host", hardware::hostname()},
          {"pid", static_cast<int64_t>(::getpid())},  {"time_us", wall_us()}, {"recorders", std::move(recs)}};
}

std::string FlightRecorder::dump(const std::string& reason) {
  const std::string dir = dump_dir();
  if (dir.empty()) return "";
  try {
    fs::create_directories(dir);
    const fs::path path = fs::path(dir) / ("flight-" + hardware::hostname() + "-" + std::to_string(::getpid()) + ".json");
    const fs::path tmp = path.string() + ".tmp";
    {
      std::ofstream out(tmp);
      out << dump_json(reason).dump(1) << "\n";
      if (!out) return "";
    }
    fs::rename(tmp, path);  // a reader never sees half a dump
    return path.string();
  } catch (const std::exception&) {
    return "";
  }
}

// ---- analysis ---------------------------------------------------------------------------

namespace {

struct Member {
  std::string who;  // "rank 3 (host h, pid p)"
  std::vector<OpRecord> ops;  // on this group, oldest first
};

struct Rank {
  std::string who;
  std::vector<OpRecord> ops;  // every op of the recorder, oldest first
  int64_t dumped_us = 0;      // when its dump was taken
};

std::string list(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? (i + 1 == v.size() ? " and " : ", ") : "") + v[i];
  return s;
}

// "its last op was send to 1 tag 0 #77 on pipeline Float[1024] (running for 63 s)"
std::string last_op(const Rank& r) {
  const OpRecord* last = nullptr;
  for (const OpRecord& o : r.ops)
    if (o.state != OpState::kQueued && (!last || o.started_us >= last->started_us)) last = &o;
  if (!last) return "it recorded no op";
  return "its last op was " + last->describe_at(r.dumped_us);
}

}  // namespace

std::string analyze(const std::vector<nlohmann::json>& dumps) {
  std::vector<Rank> ranks;
  std::map<std::string, std::shared_ptr<const GroupInfo>> groups;       // identity -> info
  std::map<std::string, std::map<int, std::pair<size_t, std::vector<OpRecord>>>> members;  // identity -> rank -> (ranks index, ops)
  for (const auto& d : dumps) {
    const int64_t dumped = d.value("time_us", int64_t{0});
    const std::string where = "host " + d.value("host", std::string("?")) + ", pid " + std::to_string(d.value("pid", 0));
    for (const auto& rj : d.value("recorders", nlohmann::json::array())) {
      Rank r;
      r.who = rj.value("owner", std::string("?")) + " (" + where + ")";
      r.dumped_us = dumped;
      for (const auto& e : rj.value("entries", nlohmann::json::array())) r.ops.push_back(op_record_from_json(e));
      ranks.push_back(std::move(r));
      const size_t index = ranks.size() - 1;
      for (const OpRecord& o : ranks[index].ops) {
        if (!o.group) continue;
        // In-process identities are only comparable inside one dump.
        const std::string id = o.group->agreed ? o.group->identity : where + ":" + o.group->identity;
        groups.emplace(id, o.group);
        auto& m = members[id][o.group->rank];
        m.first = index;
        m.second.push_back(o);
      }
    }
  }
  std::vector<std::string> findings;
  for (const auto& [id, info] : groups) {
    const auto& ms = members[id];
    const std::string gname = info->name;
    // Collectives: how far each member got.
    int64_t front = 0;
    const OpRecord* front_op = nullptr;
    std::map<int, int64_t> entered;
    for (const auto& [rank, m] : ms) {
      int64_t e = 0;
      for (const OpRecord& o : m.second)
        if (!o.p2p && o.state != OpState::kQueued) e = std::max(e, o.seq);
      entered[rank] = e;
      for (const OpRecord& o : m.second)
        if (!o.p2p && o.seq == e && o.state != OpState::kQueued && (!front_op || e > front)) front = e, front_op = &o;
    }
    // Disagreements at one sequence number.
    std::map<int64_t, std::map<std::string, std::vector<std::string>>> by_seq;
    for (const auto& [rank, m] : ms)
      for (const OpRecord& o : m.second)
        if (!o.p2p) by_seq[o.seq][o.op + shape_text(o.dtype, o.shape)].push_back(ranks[m.first].who);
    for (const auto& [seq, calls] : by_seq) {
      if (calls.size() < 2) continue;
      std::string f = "ranks of " + gname + " called different ops as #" + std::to_string(seq) + ":";
      bool first = true;
      for (const auto& [what, who] : calls) f += std::string(first ? " " : "; ") + list(who) + " called " + what, first = false;
      findings.push_back(f);
      break;  // the first disagreement explains the rest
    }
    if (front_op) {
      std::vector<std::string> waiting, absent;
      int64_t longest = 0, first_wait = 0;
      std::vector<const Rank*> behind;
      for (const auto& [rank, m] : ms) {
        if (entered[rank] >= front) {
          for (const OpRecord& o : m.second)
            if (!o.p2p && o.seq == front && o.state == OpState::kStarted) {
              waiting.push_back(ranks[m.first].who);
              longest = std::max(longest, ranks[m.first].dumped_us - o.started_us);
              first_wait = first_wait ? std::min(first_wait, o.started_us) : o.started_us;
            }
        } else {
          behind.push_back(&ranks[m.first]);
        }
      }
      // Dumps are taken one process at a time: a rank is behind only if its dump was
      // taken after the others had been waiting a while (else it may just have been
      // dumped first).
      behind.erase(std::remove_if(behind.begin(), behind.end(),
                                  [&](const Rank* b) { return b->dumped_us < first_wait + 1'000'000; }),
                   behind.end());
      for (int k = 0; k < info->size; ++k)
        if (!ms.count(k)) absent.push_back("rank " + std::to_string(k) + " of the group");
      if (!waiting.empty() && (!behind.empty() || !absent.empty())) {
        std::string f;
        for (const Rank* b : behind)
          f += (f.empty() ? "" : "; ") + b->who + " never entered " + front_op->op + " #" + std::to_string(front) + " on " +
               gname + " (" + list(waiting) + " waiting " + seconds_text(longest) + "); " + last_op(*b);
        if (!absent.empty())
          f += (f.empty() ? "" : "; ") + list(absent) + " of " + gname + " left no dump (dead, or its dump is not here): " +
               list(waiting) + " wait in " + front_op->op + " #" + std::to_string(front) + " for " + seconds_text(longest);
        findings.insert(findings.begin(), f);
      }
    }
    // Point to point: a receive waiting for a send that never came.
    for (const auto& [rank, m] : ms)
      for (const OpRecord& o : m.second) {
        if (!o.p2p || o.state != OpState::kStarted || o.op.rfind("recv", 0) != 0) continue;
        auto peer = ms.find(o.peer);
        int64_t sent = 0;
        if (peer != ms.end())
          for (const OpRecord& s : peer->second.second)
            if (s.p2p && s.op.rfind("send", 0) == 0 && s.peer == rank && s.tag == o.tag && s.state != OpState::kQueued)
              sent = std::max(sent, s.seq);
        if (sent >= o.seq) continue;
        std::string f = ranks[m.first].who + " waits " + seconds_text(ranks[m.first].dumped_us - o.started_us) + " in " + o.describe() + "; ";
        if (peer == ms.end())
          f += "that rank left no record on " + gname;
        else
          f += ranks[peer->second.first].who + " sent only " + std::to_string(sent) + " with that tag to it; " + last_op(ranks[peer->second.first]);
        findings.push_back(f);
      }
    // Failures.
    for (const auto& [rank, m] : ms)
      for (const OpRecord& o : m.second)
        if (o.state == OpState::kFailed) {
          findings.push_back(ranks[m.first].who + ": " + o.describe() + " failed: " + o.error.substr(0, o.error.find('\n')));
          break;
        }
  }
  std::string out;
  std::set<std::string> seen;
  for (const auto& f : findings)
    if (seen.insert(f).second) out += f + "\n";
  if (out.empty())
    out = "no stuck or mismatched op in " + std::to_string(ranks.size()) + " recorder" + (ranks.size() == 1 ? "" : "s") +
          " from " + std::to_string(dumps.size()) + " dump" + (dumps.size() == 1 ? "" : "s") + "\n";
  return out;
}

}  // namespace tetra::collectives
