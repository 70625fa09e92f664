#include "pipeline/partition.h"

#include <algorithm>
#include <limits>

#include "collectives/error.h"

namespace tetra::pipeline {

std::string Partition::str() const {
  std::string s = "[";
  for (int k = 0; k < stages(); ++k) s += (k ? ", " : "") + std::to_string(size(k));
  return s + "]";
}

namespace {

std::string plural(int64_t n, const std::string& one, const std::string& many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

void check_fits(int64_t layers, int stages) {
  if (stages < 1)
    throw ConfigError("the pipeline needs at least 1 stage, got " + std::to_string(stages));
  // The caller knows how P x v made `stages` and may say so; here only the count is known.
  if (layers < stages)
    throw ConfigError("the model has " + plural(layers, "layer", "layers") + ", fewer than the " +
                      plural(stages, "stage", "stages") + " that must each hold one layer");
}

std::string counts_str(const std::vector<int64_t>& counts) {
  std::string s = "[";
  for (size_t i = 0; i < counts.size(); ++i) s += (i ? ", " : "") + std::to_string(counts[i]);
  return s + "]";
}

}  // namespace

Partition partition_uniform(int layers, int stages) {
  check_fits(layers, stages);
  Partition p;
  p.begin.push_back(0);
  const int base = layers / stages, extra = layers % stages;
  for (int k = 0; k < stages; ++k) p.begin.push_back(p.begin.back() + base + (k < extra ? 1 : 0));
  return p;
}

Partition partition_min_max(const std::vector<double>& weights, int stages) {
  const int L = static_cast<int>(weights.size());
  std::vector<double> prefix(L + 1, 0);
  for (int i = 0; i < L; ++i) prefix[i + 1] = prefix[i] + weights[i];
  return partition_min_max(L, stages, [&](int, int a, int b) { return prefix[b] - prefix[a]; });
}

Partition partition_min_max(int L, int stages, const StageCostFn& cost) {
  check_fits(L, stages);
  // Every part's cost is this one call, so the reconstruction below compares exactly the
  // doubles the DP compared.
  auto part = [&](int j, int a, int b) { return cost(stages - j, a, b); };  // j stages left, from a

  // best[j][i]: the smallest possible largest part when layers [i, L) go to the last j stages.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(L + 1, inf));
  best[0][L] = 0;
  for (int j = 1; j <= stages; ++j)
    for (int i = L - j; i >= 0; --i)
      for (int e = i + 1; e <= L - (j - 1); ++e)
        best[j][i] = std::min(best[j][i], std::max(part(j, i, e), best[j - 1][e]));
  const double target = best[stages][0];
  if (target == inf) return {};

  // Among the optimal partitions take, stage by stage, the shortest feasible part: with
  // costs that grow with the part that makes every earlier stage as light as it can be.
  Partition p;
  p.begin.push_back(0);
  for (int k = 0; k < stages; ++k) {
    const int i = p.begin.back(), left = stages - k - 1;
    int e = i + 1;
    while (e < L - left && std::max(part(left + 1, i, e), best[left][e]) > target) ++e;
    p.begin.push_back(e);
  }
  return p;
}

Partition partition_explicit(const std::vector<int64_t>& counts, int layers) {
  if (counts.empty())
    throw ConfigError("balance [] names no stages; give one layer count per stage");
  Partition p;
  p.begin.push_back(0);
  int64_t sum = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    if (counts[k] < 1)
      throw ConfigError("balance " + counts_str(counts) + " gives stage " + std::to_string(k) +
                        " " + plural(counts[k], "layer", "layers") +
                        "; every stage must hold at least one");
    sum += counts[k];
  }
  if (sum != layers)
    throw ConfigError("balance " + counts_str(counts) + " adds up to " +
                      plural(sum, "layer", "layers") + ", the model has " + std::to_string(layers));
  for (int64_t c : counts) p.begin.push_back(p.begin.back() + static_cast<int>(c));
  return p;
}

std::vector<StageCost> stage_costs(const Partition& p, const std::vector<LayerCost>& layers) {
  if (p.begin.empty() || p.begin.back() != static_cast<int>(layers.size()))
    throw Error("stage_costs: the partition covers " +
                std::to_string(p.begin.empty() ? 0 : p.begin.back()) + " layers, the model has " +
                std::to_string(layers.size()));
  std::vector<StageCost> out(p.stages());
  for (int k = 0; k < p.stages(); ++k) {
    StageCost& c = out[k];
    for (int i = p.first(k); i < p.end(k); ++i) {
      c.params += layers[i].params;
      c.forward_s += layers[i].forward_s;
      c.backward_s += layers[i].backward_s;
      c.activation_bytes += layers[i].activation_bytes;
    }
    if (p.size(k) > 0) c.output_bytes = layers[p.end(k) - 1].activation_bytes;
  }
  return out;
}

}  // namespace tetra::pipeline
