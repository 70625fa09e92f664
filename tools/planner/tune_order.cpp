// The tuner's ordering (Note [Tuner]): which candidates memory drops, which to measure
// next by the predictions corrected with what the trials so far measured, and how far
// the predictions were from the measurements.
#include "tools/planner/tune_steps.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <limits>
#include <set>

#include "core/text.h"
#include "hardware/topology.h"

namespace tetra::planner {

using namespace tetra::core;

using hardware::ByteDigits;
using hardware::format_bytes;

namespace tuning {

void say(std::FILE* out, const char* format, ...) {
  if (!out) return;
  va_list args;
  va_start(args, format);
  std::vfprintf(out, format, args);
  va_end(args);
  std::fflush(out);
}

std::string clock_text(double seconds) {
  const int s = static_cast<int>(std::max(0.0, seconds) + 0.5);
  return fmt("%d:%02d", s / 60, s % 60);
}

std::string ms(double seconds) { return seconds < 0 ? "-" : fmt("%.2f", seconds * 1e3); }

// How far a trial's slowest round was from its fastest (0.3: 30% slower); 0 for one round.
double spread_of(const std::vector<double>& rounds) {
  if (rounds.size() < 2) return 0;
  const auto [lo, hi] = std::minmax_element(rounds.begin(), rounds.end());
  return *hi / *lo - 1;
}
bool rounds_agree(const std::vector<double>& rounds) {
  if (rounds.size() < 2) return true;
  const auto [lo, hi] = std::minmax_element(rounds.begin(), rounds.end());
  return *hi <= kRoundsAgree * *lo;
}

double median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// The prediction's terms under the names read_metrics gives the measured ones.
std::map<std::string, double> predicted_phases(const StepPrediction& p) {
  std::map<std::string, double> m = {{"compute", p.compute_s}, {"optimizer", p.optimizer_s},
                                     {"loading", p.loading_s}, {"step", p.total_s}};
  for (const AxisTime& a : p.axes)
    if (a.axis != "pipeline") m["comm " + a.axis] = a.seconds;
  // What a stage idles: the fill and drain, and the activations' transfers it waits for.
  if (p.bubble_s + p.pipeline_s > 0) m["bubble"] = p.bubble_s + p.pipeline_s;
  return m;
}

// measured / predicted per phase, the geometric mean over the trials that measured both.
std::map<std::string, double> phase_ratios(const std::vector<Candidate>& cs) {
  std::map<std::string, std::pair<double, int>> logs;
  for (const Candidate& c : cs) {
    if (c.trial != Candidate::Trial::kOk) continue;
    for (const auto& [name, m] : c.measured_phases) {
      auto p = c.predicted_phases.find(name);
      if (p == c.predicted_phases.end() || !(p->second > 1e-6) || !(m > 1e-6)) continue;
      logs[name].first += std::log(m / p->second);
      logs[name].second += 1;
    }
  }
  std::map<std::string, double> r;
  for (const auto& [name, v] : logs) r[name] = std::exp(v.first / v.second);
  return r;
}

std::string ratios_text(const std::map<std::string, double>& r) {
  std::string s;
  // compute first, step last, the rest by name.
  auto add = [&](const std::string& name, double v) { s += (s.empty() ? "" : ", ") + name + " " + fmt("%.2f", v); };
  if (r.count("compute")) add("compute", r.at("compute"));
  for (const auto& [name, v] : r)
    if (name != "compute" && name != "step") add(name, v);
  if (r.count("step")) add("step", r.at("step"));
  return s;
}

}  // namespace tuning

void prune_by_memory(std::vector<Candidate>& candidates, int64_t limit_bytes) {
  for (Candidate& c : candidates)
    if (c.priced && c.invalid.empty() && limit_bytes > 0 && c.predicted_bytes > limit_bytes)
      c.pruned =
          format_bytes(c.predicted_bytes, ByteDigits::kWhole) + " > " + format_bytes(limit_bytes, ByteDigits::kWhole);
}

double corrected_step(const Candidate& c, const std::map<std::string, double>& ratios) {
  const StepPrediction& p = c.prediction;
  if (ratios.empty() || p.total_s <= 0) return c.predicted_s;
  auto r = [&](const char* phase) {
    auto it = ratios.find(phase);
    return it == ratios.end() ? 1.0 : it->second;
  };
  return p.loading_s * r("loading") + p.compute_s * r("compute") + (p.pipeline_s + p.bubble_s) * r("bubble") +
         p.other_s + p.optimizer_s * r("optimizer");
}

std::vector<int> trial_order(const std::vector<Candidate>& candidates, int count,
                             const std::map<std::string, double>& ratios) {
  std::vector<int> order;
  std::set<std::string> taken;  // structures measured already
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    if (c.trial != Candidate::Trial::kNotRun) {
      taken.insert(c.structure);
      continue;
    }
    if (!c.as_given && c.priced && c.invalid.empty() && c.pruned.empty() && c.predicted_s > 0)
      order.push_back(static_cast<int>(i));
  }
  // By predicted step (corrected by the trials so far), within the model's resolution
  // (0.5%: steps closer than that are a tie) the one that holds less memory first (ZeRO-1
  // before a plain allreduce that sends the same bytes).
  std::vector<double> step(candidates.size(), 0);
  for (int i : order) step[static_cast<size_t>(i)] = corrected_step(candidates[static_cast<size_t>(i)], ratios);
  auto key = [&](int i) {
    return std::make_pair(std::floor(std::log(step[static_cast<size_t>(i)]) / std::log(1.005)),
                          candidates[static_cast<size_t>(i)].predicted_bytes);
  };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key(a) < key(b); });
  // The best of each structure first (a bucket size rarely moves a step by more than a
  // trial's noise; another layout or stage may), then the rest in the same order.
  std::vector<int> first, then;
  for (int i : order) (taken.insert(candidates[static_cast<size_t>(i)].structure).second ? first : then).push_back(i);
  first.insert(first.end(), then.begin(), then.end());
  if (static_cast<int>(first.size()) > count) first.resize(static_cast<size_t>(std::max(0, count)));
  return first;
}

double rank_correlation(const std::vector<double>& a, const std::vector<double>& b) {
  const size_t n = std::min(a.size(), b.size());
  if (n < 3) return std::numeric_limits<double>::quiet_NaN();
  auto ranks = [n](const std::vector<double>& v) {
    std::vector<size_t> idx(n);
    for (size_t i = 0; i < n; ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](size_t x, size_t y) { return v[x] < v[y]; });
    std::vector<double> r(n);
    for (size_t i = 0; i < n;) {
      size_t j = i;
      while (j + 1 < n && v[idx[j + 1]] == v[idx[i]]) ++j;
      for (size_t k = i; k <= j; ++k) r[idx[k]] = (double(i) + double(j)) / 2 + 1;
      i = j + 1;
    }
    return r;
  };
  const std::vector<double> ra = ranks(a), rb = ranks(b);
  double ma = 0, mb = 0;
  for (size_t i = 0; i < n; ++i) ma += ra[i], mb += rb[i];
  ma /= double(n), mb /= double(n);
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < n; ++i) {
    sab += (ra[i] - ma) * (rb[i] - mb);
    saa += (ra[i] - ma) * (ra[i] - ma);
    sbb += (rb[i] - mb) * (rb[i] - mb);
  }
  return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : std::numeric_limits<double>::quiet_NaN();
}

}  // namespace tetra::planner
