#include "tools/planner/cost_model.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "collectives/error.h"

namespace tetra::planner {

double ring_allreduce_s(int n, double bytes, const LinkCost& link) {
  if (n <= 1) return 0;
  return 2.0 * (n - 1) / n * bytes / link.bytes_per_s + 2.0 * (n - 1) * link.alpha_s;
}

double ring_collect_s(int n, double bytes, const LinkCost& link) {
  if (n <= 1) return 0;
  return double(n - 1) / n * bytes / link.bytes_per_s + double(n - 1) * link.alpha_s;
}

double hierarchical_allreduce_s(int hosts, int per_host, double bytes, const LinkCost& intra, const LinkCost& inter) {
  const int k = std::max(1, per_host);
  // The k ranks of a host cross at once, each with B/k, sharing the host's link.
  const LinkCost shared{inter.alpha_s, inter.bytes_per_s / k};
  return 2 * ring_collect_s(k, bytes, intra) + ring_allreduce_s(hosts, bytes / k, shared);
}

double p2p_s(double bytes, const LinkCost& link) { return link.alpha_s + bytes / link.bytes_per_s; }

const LinkCost& Calibration::link(bool across, const std::string& kind, bool chained) const {
  if (chained) {
    const auto& fits = across ? inter_chained : intra_chained;
    if (auto it = fits.find(kind); it != fits.end()) return it->second;
  }
  const auto& kinds = across ? inter_kinds : intra_kinds;
  auto it = kinds.find(kind);
  return it != kinds.end() ? it->second : across ? inter_host : intra_host;
}

double core_share(double cores_per_host, int ranks_per_host, int threads_per_rank) {
  const double want = double(std::max(1, ranks_per_host)) * std::max(1, threads_per_rank);
  return cores_per_host <= 0 ? 1.0 : std::min(1.0, cores_per_host / want);
}

// Note [Fitted collectives]
// An op's time over payloads B is close to a line t = A + S x B on any backend (a fixed
// cost per op, then the bytes). Read through the ring formula of its kind on a group of
// n, A and S give the per-step alpha and beta that the cost model's formulas take:
//   allreduce                   A = 2(n-1) alpha,  S = 2(n-1)/n / beta
//   reduce_scatter, allgather,
//   broadcast                   A = (n-1) alpha,   S = (n-1)/n / beta
//   send                        A = alpha,         S = 1 / beta
// so a group of another size is priced by the same formula with the fitted step. The
// fit: A is the smallest size's time (latency alone), S the least-squares slope of t - A
// over the other sizes (unweighted, so it follows the large payloads a step carries;
// Open MPI switches algorithms with the size, so no one line fits every size).
// Each kind is fitted twice (bench-collectives --calibrate). After compute: the op
// follows a burst of compute on every rank, and its time includes waiting for the ranks
// that end theirs later; where ranks share cores that wait is most of A (4 ranks on this
// 2-core machine: an 8-byte allgather takes 1.5 ms after compute, 0.1 ms chained).
// Chained: the op follows another at once, every rank already there. A step pays the
// first for an op that waits on compute (a bucket at the end of backward, a gather
// without prefetch, a reduce-scatter after a layer's backward, a tensor-parallel
// allreduce) and the second for one issued before the compute it overlaps
// (RankEstimate::chained: ZeRO-3's prefetched gathers), whose late ranks are computing.
// A pipeline's transfers take the chained send: when a message moves is the schedule
// simulation's (pipeline::Costs).
LinkCost fit_collective(const std::string& kind, int n, const std::vector<double>& bytes,
                        const std::vector<double>& seconds) {
  const size_t k = std::min(bytes.size(), seconds.size());
  size_t smallest = 0;
  for (size_t i = 1; i < k; ++i)
    if (bytes[i] < bytes[smallest]) smallest = i;
  double a = k ? seconds[smallest] : 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < k; ++i) {
    if (i == smallest) continue;
    sxx += bytes[i] * bytes[i];
    sxy += bytes[i] * (seconds[i] - a);
  }
  double slope = sxx > 0 ? sxy / sxx : 0;
  slope = std::max(slope, 1e-15);  // at least 1 PB/s: a line never falls
  a = std::max(a, 0.0);
  const int m = std::max(2, n);
  double steps = 1, share = 1;  // A = steps x alpha, S = share / beta
  if (kind == "allreduce") {
    steps = 2.0 * (m - 1);
    share = 2.0 * (m - 1) / m;
  } else if (kind != "send" && kind != "recv") {
    steps = m - 1;
    share = double(m - 1) / m;
  }
  return LinkCost{a / steps, share / slope};
}

double bubble_fraction(int stages, int micro_batches, int virtual_stages) {
  if (stages <= 1) return 0;
  return double(stages - 1) / (double(std::max(1, virtual_stages)) * std::max(1, micro_batches) + stages - 1);
}

AxisTime axis_time(const collectives::Traffic& t, const AxisLinks& l, const Calibration& c,
                   const collectives::Traffic* chained) {
  using K = collectives::Traffic;
  const bool across = l.hosts > 1;
  // Across hosts, the groups that cross from one host at once share its link.
  const double sharing = across ? std::max(1, l.groups_per_host) : 1;
  const LinkCost inter_shared{c.inter_host.alpha_s, c.inter_host.bytes_per_s / sharing};
  AxisTime out;
  out.axis = l.axis;
  out.ops = t.ops;
  const int n = l.size;
  const bool hier = l.hierarchical && across && l.per_host > 1;
  // Each kind's ops are priced one by one at the mean payload (the byte term is linear,
  // the latency term counts ops); chained ops with the chained fits.
  auto price = [&](const K& ops, bool is_chained) {
    auto link = [&](K::Kind k) {
      LinkCost x = c.link(across, K::name(k), is_chained);
      x.bytes_per_s /= sharing;
      return x;
    };
    auto each = [&](K::Kind k, auto&& one) {
      if (ops.count[k] <= 0) return 0.0;
      return double(ops.count[k]) * one(double(ops.payload[k]) / double(ops.count[k]));
    };
    double s = each(K::kAllreduce, [&](double b) {
      return hier ? hierarchical_allreduce_s(l.hosts, l.per_host, b, c.intra_host, inter_shared)
                  : ring_allreduce_s(n, b, link(K::kAllreduce));
    });
    for (K::Kind k : {K::kReduceScatter, K::kAllgather, K::kBroadcast})
      s += each(k, [&](double b) { return ring_collect_s(n, b, link(k)); });
    return s + each(K::kSend, [&](double b) { return p2p_s(b, link(K::kSend)); });
  };
  out.seconds = chained ? price(t - *chained, false) + price(*chained, true) : price(t, false);
  std::ostringstream how;
  if (t.count[K::kSend] && !t.count[K::kAllreduce] && !t.count[K::kReduceScatter] && !t.count[K::kAllgather])
    how << "point-to-point ";
  else if (hier && t.count[K::kAllreduce])
    how << "hierarchical (" << l.hosts << " hosts x " << l.per_host << ") ";
  else
    how << "ring of " << n << " ";
  how << (across ? "across hosts" : "inside a host");
  out.how = how.str();
  return out;
}

StepPrediction predict_step(const std::vector<StageWork>& stages, const std::vector<AxisLinks>& links,
                            int micro_batches, int virtual_stages, int64_t global_batch, double total_flops,
                            int ranks, const Calibration& c, double schedule_bubble, double share,
                            const SimulatedPipeline& simulated) {
  StepPrediction p;
  p.ranks = ranks;
  p.core_share = share = std::clamp(share, 1e-6, 1.0);
  // A stage's forward and backward: timed here (alone, so shared out), else FLOPs over
  // the calibrated rate (measured per rank with the host's ranks running).
  auto compute_of = [&](const StageWork& w) { return w.timed_s >= 0 ? w.timed_s / share : w.flops / c.flops_per_s; };
  const int pp = static_cast<int>(stages.size());
  const double bubble =
      pp > 1 && schedule_bubble >= 0 ? schedule_bubble : bubble_fraction(pp, micro_batches, virtual_stages);
  double busiest = -1;
  size_t slowest = 0;
  std::vector<std::vector<AxisTime>> per_stage(stages.size());
  std::vector<double> busy(stages.size()), other(stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    double pipe = 0, rest = 0;
    for (const AxisLinks& l : links) {
      auto it = stages[s].traffic.find(l.axis);
      if (it == stages[s].traffic.end() || it->second.ops == 0) continue;
      collectives::Traffic t = it->second;
      if (l.axis == "pipeline") {
        // A stage waits for what it receives as much as for what it sends: both
        // directions of its links are on the step's critical path.
        t.payload[collectives::Traffic::kSend] += t.payload[collectives::Traffic::kRecv];
        t.count[collectives::Traffic::kSend] += t.count[collectives::Traffic::kRecv];
      }
      auto ch = stages[s].chained.find(l.axis);
      AxisTime a = axis_time(t, l, c, ch == stages[s].chained.end() ? nullptr : &ch->second);
      (l.axis == "pipeline" ? pipe : rest) += a.seconds;
      per_stage[s].push_back(std::move(a));
    }
    busy[s] = compute_of(stages[s]) + pipe;
    other[s] = rest;
    if (busy[s] > busiest) {
      busiest = busy[s];
      slowest = s;
    }
  }
  if (stages.empty()) return p;
  p.timed = stages[slowest].timed_s >= 0;
  p.compute_s = compute_of(stages[slowest]);
  p.pipeline_s = busy[slowest] - p.compute_s;
  p.bubble_s = busy[slowest] / (1 - bubble) - busy[slowest];
  if (simulated.makespan_s > 0 && simulated.without_transfers_s > 0) {
    p.bubble_s = std::max(0.0, simulated.without_transfers_s - p.compute_s);
    p.pipeline_s = std::max(0.0, simulated.makespan_s - simulated.without_transfers_s);
    busy[slowest] = p.compute_s + p.pipeline_s;
  }
  p.other_s = *std::max_element(other.begin(), other.end());
  for (const StageWork& w : stages) p.optimizer_s = std::max(p.optimizer_s, w.optimizer_s / share);
  p.loading_s = stages[slowest].loading_s / share;
  p.axes = per_stage[slowest];
  p.total_s = p.loading_s + busy[slowest] + p.bubble_s + p.other_s + p.optimizer_s;
  p.samples_per_s = p.total_s > 0 ? double(global_batch) / p.total_s : 0;
  // One rank with the whole batch: the slowest stage's rate (timed: its seconds per FLOP
  // with a core to itself) for every FLOP of the step.
  const StageWork& sw = stages[slowest];
  const double rate = p.timed && sw.timed_s > 0 && sw.flops > 0 ? sw.flops / sw.timed_s : c.flops_per_s;
  p.single_rank_s = total_flops / rate;
  p.efficiency = p.total_s > 0 ? p.single_rank_s / (double(ranks) * p.total_s) : 0;
  return p;
}

namespace {

// One-way seconds for `bytes` between ranks a and b (others only take part in the
// barriers): half the best round trip of `iters`.
double one_way_s(collectives::Communicator& comm, int a, int b, int64_t bytes, int iters) {
  // Where the group carries tensors (Note [Two planes]): a GPU's link is timed on its memory.
  const at::TensorOptions where = at::TensorOptions().device(comm.device());
  at::Tensor buf = at::zeros({std::max<int64_t>(1, bytes)}, where.dtype(at::kByte));
  const int me = comm.rank();
  double best = 1e300;
  for (int i = 0; i < iters + 2; ++i) {
    comm.barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    if (me == a) {
      comm.send(buf, b)->wait();
      comm.recv(buf, b)->wait();
    } else if (me == b) {
      comm.recv(buf, a)->wait();
      comm.send(buf, a)->wait();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 2;
    if (i >= 2) best = std::min(best, s);  // two warm-up rounds
  }
  // Rank a's measurement, to everyone.
  at::Tensor t = at::full({1}, me == a ? best : 0.0, where.dtype(at::kDouble));
  comm.allreduce(t)->wait();
  return t.item<double>();
}

}  // namespace

LinkCost measure_link(collectives::Communicator& comm, int a, int b) {
  const double small = one_way_s(comm, a, b, 8, 50);
  const int64_t big1 = int64_t{4} << 20, big2 = int64_t{16} << 20;
  const double t1 = one_way_s(comm, a, b, big1, 5), t2 = one_way_s(comm, a, b, big2, 5);
  LinkCost l;
  l.alpha_s = small;
  l.bytes_per_s = t2 > t1 ? double(big2 - big1) / (t2 - t1) : double(big2) / std::max(t2, 1e-9);
  return l;
}

namespace {

// Seconds as ms, or us below a millisecond (a small model's step on a fast cluster).
std::string ms(double s) {
  char b[32];
  std::snprintf(b, sizeof(b), s >= 0.1 ? "%.0f ms" : s >= 0.001 ? "%.1f ms" : "%.1f us", s >= 0.001 ? s * 1e3 : s * 1e6);
  return b;
}

// A share as a percentage with the digits it needs: 41%, 0.52%, 0.0031%.
std::string percent(double f) {
  char b[32];
  std::snprintf(b, sizeof(b), f >= 0.01 || f <= 0 ? "%.0f%%" : "%.2g%%", f * 100);
  return b;
}

std::string rate(const LinkCost& l) {
  char b[64];
  std::snprintf(b, sizeof(b), "alpha %.1f us, beta %.2f GB/s", l.alpha_s * 1e6, l.bytes_per_s / 1e9);
  return b;
}

}  // namespace

std::string prediction_text(const StepPrediction& p, const Calibration& c) {
  std::ostringstream os;
  char b[256];
  os << "cost model (Note [Cost model]; " << c.source << "):\n";
  os << "  inside a host " << rate(c.intra_host) << "; across hosts " << rate(c.inter_host) << "; compute ";
  if (p.timed)
    os << "the layers as timed\n";
  else {
    std::snprintf(b, sizeof(b), "%.1f GFLOP/s per rank\n", c.flops_per_s / 1e9);
    os << b;
  }
  if (p.core_share < 1) {
    std::snprintf(b, sizeof(b), "  each rank gets %s of a core (its host's ranks x threads outnumber its %g cores)\n",
                  percent(p.core_share).c_str(), c.cores_per_host);
    os << b;
  }
  // Each term with its share of the step, so that what makes a plan slow is in sight.
  std::vector<std::pair<std::string, double>> terms;
  auto line = [&](const std::string& name, double s, const std::string& what) {
    if (name != "compute" && s <= 0) return;
    terms.emplace_back(name, s);
    std::snprintf(b, sizeof(b), "  %-12s %-9s %4s  %s\n", name.c_str(), ms(s).c_str(),
                  percent(p.total_s > 0 ? s / p.total_s : 0).c_str(), what.c_str());
    os << b;
  };
  line("compute", p.compute_s, "the slowest stage's forward and backward");
  line("pipeline", p.pipeline_s, "its sends and receives");
  line("bubble", p.bubble_s, "idle while the pipeline fills and drains");
  for (const AxisTime& a : p.axes) {
    if (a.axis == "pipeline") continue;
    line(a.axis, a.seconds, std::to_string(a.ops) + " ops, " + a.how);
  }
  line("optimizer", p.optimizer_s, "the update of what the rank owns");
  line("loading", p.loading_s, "its batch read from the dataset");
  if (p.ranks == 1)
    std::snprintf(b, sizeof(b), "  step         %s predicted: %.0f samples/s on 1 rank\n", ms(p.total_s).c_str(),
                  p.samples_per_s);
  else
    std::snprintf(b, sizeof(b), "  step         %s predicted: %.0f samples/s on %d ranks, efficiency %s of %d x one rank (%s)\n",
                  ms(p.total_s).c_str(), p.samples_per_s, p.ranks, percent(p.efficiency).c_str(), p.ranks,
                  ms(p.single_rank_s).c_str());
  os << b;
  std::sort(terms.begin(), terms.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  if (terms.size() > 1 && p.total_s > 0) {
    os << "  dominated by " << terms[0].first << " (" << percent(terms[0].second / p.total_s) << ")";
    if (terms[1].second > 0) os << ", then " << terms[1].first << " (" << percent(terms[1].second / p.total_s) << ")";
    os << "\n";
  }
  return os.str();
}

nlohmann::json prediction_json(const StepPrediction& p, const Calibration& c) {
  nlohmann::json axes = nlohmann::json::array();
  for (const AxisTime& a : p.axes) axes.push_back({{"axis", a.axis}, {"how", a.how}, {"seconds", a.seconds}, {"ops", a.ops}});
  nlohmann::json cal = calibration_json(c);
  cal["source"] = c.source;  // which figures, measured or assumed (Note [This machine's figures])
  return {{"calibration", cal}, {"ranks", p.ranks},       {"compute_s", p.compute_s},
          {"compute_timed", p.timed},           {"core_share", p.core_share}, {"optimizer_s", p.optimizer_s}, {"loading_s", p.loading_s},
          {"pipeline_s", p.pipeline_s},         {"bubble_s", p.bubble_s}, {"other_s", p.other_s},
          {"step_s", p.total_s},                {"samples_per_s", p.samples_per_s},
          {"single_rank_s", p.single_rank_s},   {"efficiency", p.efficiency}, {"axes", axes}};
}

nlohmann::json calibration_json(const Calibration& c, const std::string& measured) {
  nlohmann::json j = {{"format", "tetra calibration 1"},
                      {"intra_host", {{"alpha_us", c.intra_host.alpha_s * 1e6}, {"beta_gbytes_per_s", c.intra_host.bytes_per_s / 1e9}}},
                      {"inter_host", {{"alpha_us", c.inter_host.alpha_s * 1e6}, {"beta_gbytes_per_s", c.inter_host.bytes_per_s / 1e9}}},
                      {"compute", {{"gflops_per_s", c.flops_per_s / 1e9}}}};
  auto kinds = [](const std::map<std::string, LinkCost>& m) {
    nlohmann::json k = nlohmann::json::object();
    for (const auto& [name, l] : m) k[name] = {{"alpha_us", l.alpha_s * 1e6}, {"beta_gbytes_per_s", l.bytes_per_s / 1e9}};
    return k;
  };
  if (!c.intra_kinds.empty()) j["intra_host"]["kinds"] = kinds(c.intra_kinds);
  if (!c.inter_kinds.empty()) j["inter_host"]["kinds"] = kinds(c.inter_kinds);
  if (!c.intra_chained.empty()) j["intra_host"]["chained"] = kinds(c.intra_chained);
  if (!c.inter_chained.empty()) j["inter_host"]["chained"] = kinds(c.inter_chained);
  if (c.cores_per_host > 0) j["host"] = {{"cores", c.cores_per_host}};
  if (!measured.empty()) j["measured"] = measured;
  return j;
}

Calibration load_calibration(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError("calibration " + path + ": cannot read it (bench-collectives --calibrate writes one)");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object()) throw ConfigError("calibration " + path + ": not a JSON object");
  if (j.value("format", "") != "tetra calibration 1")
    throw ConfigError("calibration " + path + ": \"format\" is not \"tetra calibration 1\"");
  Calibration c;
  auto number = [&](const nlohmann::json& obj, const std::string& where, const char* key, double scale, double& out) {
    if (!obj.contains(key)) return;
    const auto& v = obj.at(key);
    if (!v.is_number() || !(v.get<double>() > 0))
      throw ConfigError("calibration " + path + ": " + where + "." + key + " must be a number > 0");
    out = v.get<double>() * scale;
  };
  for (auto [name, link] : {std::pair<const char*, LinkCost*>{"intra_host", &c.intra_host}, {"inter_host", &c.inter_host}}) {
    if (!j.contains(name)) continue;
    if (!j[name].is_object()) throw ConfigError("calibration " + path + ": " + name + " must be an object");
    number(j[name], name, "alpha_us", 1e-6, link->alpha_s);
    number(j[name], name, "beta_gbytes_per_s", 1e9, link->bytes_per_s);
    const bool intra = link == &c.intra_host;
    for (auto [key, into] : {std::pair<const char*, std::map<std::string, LinkCost>*>{"kinds", intra ? &c.intra_kinds : &c.inter_kinds},
                             {"chained", intra ? &c.intra_chained : &c.inter_chained}}) {
      if (!j[name].contains(key)) continue;
      const auto& kinds = j[name][key];
      const std::string where = std::string(name) + "." + key;
      if (!kinds.is_object()) throw ConfigError("calibration " + path + ": " + where + " must be an object");
      for (const auto& [kind, v] : kinds.items()) {
        bool known = false;
        for (int k = 0; k < collectives::Traffic::kKinds; ++k)
          known = known || kind == collectives::Traffic::name(static_cast<collectives::Traffic::Kind>(k));
        if (!known)
          throw ConfigError("calibration " + path + ": " + where + "." + kind +
                            ": not a collective (allreduce, reduce_scatter, allgather, broadcast, send)");
        if (!v.is_object()) throw ConfigError("calibration " + path + ": " + where + "." + kind + " must be an object");
        LinkCost l = *link;
        number(v, where + "." + kind, "alpha_us", 1e-6, l.alpha_s);
        number(v, where + "." + kind, "beta_gbytes_per_s", 1e9, l.bytes_per_s);
        (*into)[kind] = l;
      }
    }
  }
  if (j.contains("compute")) number(j["compute"], "compute", "gflops_per_s", 1e9, c.flops_per_s);
  if (j.contains("host")) number(j["host"], "host", "cores", 1, c.cores_per_host);
  c.source = "calibration " + path + (j.contains("measured") ? " (" + j.value("measured", "") + ")" : "");
  return c;
}

}  // namespace tetra::planner
