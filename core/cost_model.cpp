#include "core/cost_model.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "collectives/error.h"

namespace tetra::core {

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

double bubble_fraction(int stages, int micro_batches, int virtual_stages) {
  if (stages <= 1) return 0;
  return double(stages - 1) / (double(std::max(1, virtual_stages)) * std::max(1, micro_batches) + stages - 1);
}

AxisTime axis_time(const collectives::Traffic& t, const AxisLinks& l, const Calibration& c) {
  using K = collectives::Traffic;
  const bool across = l.hosts > 1;
  const LinkCost& link = across ? c.inter_host : c.intra_host;
  AxisTime out;
  out.axis = l.axis;
  out.ops = t.ops;
  const int n = l.size;
  // Each kind's ops are priced one by one at the mean payload (the byte term is linear,
  // the latency term counts ops).
  auto each = [&](K::Kind k, auto&& one) {
    if (t.count[k] == 0) return 0.0;
    return double(t.count[k]) * one(double(t.payload[k]) / double(t.count[k]));
  };
  const bool hier = l.hierarchical && across && l.per_host > 1;
  out.seconds += each(K::kAllreduce, [&](double b) {
    return hier ? hierarchical_allreduce_s(l.hosts, l.per_host, b, c.intra_host, c.inter_host)
                : ring_allreduce_s(n, b, link);
  });
  for (K::Kind k : {K::kReduceScatter, K::kAllgather, K::kBroadcast})
    out.seconds += each(k, [&](double b) { return ring_collect_s(n, b, link); });
  out.seconds += each(K::kSend, [&](double b) { return p2p_s(b, link); });
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
                            int ranks, const Calibration& c, double schedule_bubble) {
  StepPrediction p;
  p.ranks = ranks;
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
      AxisTime a = axis_time(t, l, c);
      (l.axis == "pipeline" ? pipe : rest) += a.seconds;
      per_stage[s].push_back(std::move(a));
    }
    busy[s] = stages[s].flops / c.flops_per_s + pipe;
    other[s] = rest;
    if (busy[s] > busiest) {
      busiest = busy[s];
      slowest = s;
    }
  }
  if (stages.empty()) return p;
  p.compute_s = stages[slowest].flops / c.flops_per_s;
  p.pipeline_s = busy[slowest] - p.compute_s;
  p.bubble_s = busy[slowest] / (1 - bubble) - busy[slowest];
  p.other_s = *std::max_element(other.begin(), other.end());
  p.axes = per_stage[slowest];
  p.total_s = busy[slowest] + p.bubble_s + p.other_s;
  p.samples_per_s = p.total_s > 0 ? double(global_batch) / p.total_s : 0;
  p.single_rank_s = total_flops / c.flops_per_s;
  p.efficiency = p.total_s > 0 ? p.single_rank_s / (double(ranks) * p.total_s) : 0;
  return p;
}

namespace {

// One-way seconds for `bytes` between ranks a and b (others only take part in the
// barriers): half the best round trip of `iters`.
double one_way_s(collectives::Communicator& comm, int a, int b, int64_t bytes, int iters) {
  at::Tensor buf = at::zeros({std::max<int64_t>(1, bytes)}, at::kByte);
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
  at::Tensor t = at::full({1}, me == a ? best : 0.0, at::kDouble);
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
  std::snprintf(b, sizeof(b), "%.1f GFLOP/s per rank\n", c.flops_per_s / 1e9);
  os << b;
  os << "  compute      " << ms(p.compute_s) << " (the slowest stage)\n";
  if (p.pipeline_s > 0 || p.bubble_s > 0)
    os << "  pipeline     " << ms(p.pipeline_s) << " sends, " << ms(p.bubble_s) << " bubble\n";
  for (const AxisTime& a : p.axes) {
    if (a.axis == "pipeline") continue;
    std::snprintf(b, sizeof(b), "  %-12s %s, %lld ops, %s\n", a.axis.c_str(), ms(a.seconds).c_str(),
                  static_cast<long long>(a.ops), a.how.c_str());
    os << b;
  }
  if (p.ranks == 1)
    std::snprintf(b, sizeof(b), "  step         %s predicted: %.0f samples/s on 1 rank\n", ms(p.total_s).c_str(),
                  p.samples_per_s);
  else
    std::snprintf(b, sizeof(b), "  step         %s predicted: %.0f samples/s on %d ranks, efficiency %s of %d x one rank (%s)\n",
                  ms(p.total_s).c_str(), p.samples_per_s, p.ranks, percent(p.efficiency).c_str(), p.ranks,
                  ms(p.single_rank_s).c_str());
  os << b;
  return os.str();
}

nlohmann::json prediction_json(const StepPrediction& p, const Calibration& c) {
  nlohmann::json axes = nlohmann::json::array();
  for (const AxisTime& a : p.axes) axes.push_back({{"axis", a.axis}, {"how", a.how}, {"seconds", a.seconds}, {"ops", a.ops}});
  nlohmann::json cal = calibration_json(c);
  cal["source"] = c.source;  // which figures, measured or assumed (Note [This machine's figures])
  return {{"calibration", cal}, {"ranks", p.ranks},       {"compute_s", p.compute_s},
          {"pipeline_s", p.pipeline_s},         {"bubble_s", p.bubble_s}, {"other_s", p.other_s},
          {"step_s", p.total_s},                {"samples_per_s", p.samples_per_s},
          {"single_rank_s", p.single_rank_s},   {"efficiency", p.efficiency}, {"axes", axes}};
}

nlohmann::json calibration_json(const Calibration& c, const std::string& measured) {
  nlohmann::json j = {{"format", "tetra calibration 1"},
                      {"intra_host", {{"alpha_us", c.intra_host.alpha_s * 1e6}, {"beta_gbytes_per_s", c.intra_host.bytes_per_s / 1e9}}},
                      {"inter_host", {{"alpha_us", c.inter_host.alpha_s * 1e6}, {"beta_gbytes_per_s", c.inter_host.bytes_per_s / 1e9}}},
                      {"compute", {{"gflops_per_s", c.flops_per_s / 1e9}}}};
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
  }
  if (j.contains("compute")) number(j["compute"], "compute", "gflops_per_s", 1e9, c.flops_per_s);
  c.source = "calibration " + path + (j.contains("measured") ? " (" + j.value("measured", "") + ")" : "");
  return c;
}

}  // namespace tetra::core
