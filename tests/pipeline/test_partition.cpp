// Cutting layers into stages: uniform, exact min-max (checked against brute force) and
// explicit counts with their errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "collectives/error.h"
#include "pipeline/partition.h"

using namespace tetra::pipeline;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const tetra::ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

// Every partition of `weights` into `stages` non-empty parts; the min-max one, ties to
// lighter earlier stages (then shorter earlier stages, for zero weights).
Partition brute_force(const std::vector<double>& w, int stages) {
  const int L = static_cast<int>(w.size());
  Partition best;
  double best_max = 0;
  std::vector<double> best_sums;
  std::vector<int> begin(stages + 1);
  // Recursive enumeration of the cut points.
  std::function<void(int, int)> go = [&](int k, int from) {
    if (k == stages) {
      std::vector<double> sums;
      for (int j = 0; j < stages; ++j) {
        double s = 0;
        for (int i = begin[j]; i < begin[j + 1]; ++i) s += w[i];
        sums.push_back(s);
      }
      const double mx = *std::max_element(sums.begin(), sums.end());
      if (best.begin.empty() || mx < best_max ||
          (mx == best_max && (sums < best_sums || (sums == best_sums && begin < best.begin)))) {
        best.begin = begin;
        best_max = mx;
        best_sums = sums;
      }
      return;
    }
    const int last = (k == stages - 1) ? L : L - (stages - k - 1);
    for (int e = (k == stages - 1) ? L : from + 1; e <= last; ++e) {
      begin[k + 1] = e;
      go(k + 1, e);
    }
  };
  begin[0] = 0;
  go(0, 0);
  return best;
}

}  // namespace

TEST(Partition, UniformGivesTheExtrasToTheFirstStages) {
  EXPECT_EQ(partition_uniform(8, 3).str(), "[3, 3, 2]");
  EXPECT_EQ(partition_uniform(8, 3).begin, (std::vector<int>{0, 3, 6, 8}));
  EXPECT_EQ(partition_uniform(4, 4).str(), "[1, 1, 1, 1]");
  EXPECT_EQ(partition_uniform(5, 1).str(), "[5]");
  EXPECT_EQ(error_of([] { partition_uniform(3, 4); }),
            "the model has 3 layers, fewer than the 4 stages that must each hold one layer");
  EXPECT_EQ(error_of([] { partition_uniform(1, 2); }),
            "the model has 1 layer, fewer than the 2 stages that must each hold one layer");
}

TEST(Partition, MinMaxMatchesBruteForce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const int L = 1 + static_cast<int>(rng() % 9);
    const int K = 1 + static_cast<int>(rng() % L);
    std::vector<double> w(L);
    // Small integers (zeros included) so sums are exact and ties are common.
    for (auto& x : w) x = static_cast<double>(rng() % 5);
    Partition p = partition_min_max(w, K);
    Partition q = brute_force(w, K);
    std::string ws;
    for (double x : w) ws += std::to_string(static_cast<int>(x)) + " ";
    EXPECT_EQ(p.begin, q.begin) << "weights " << ws << "stages " << K << ": " << p.str() << " vs "
                                << q.str();
  }
}

TEST(Partition, MinMaxExamples) {
  EXPECT_EQ(partition_min_max({1, 1, 1, 1}, 2).str(), "[2, 2]");
  EXPECT_EQ(partition_min_max({10, 1, 1, 1, 1}, 2).str(), "[1, 4]");
  EXPECT_EQ(partition_min_max({1, 1, 1}, 2).str(),
            "[1, 2]");  // the tie goes to a lighter first stage
  EXPECT_EQ(error_of([] {
              partition_min_max({1, 2, 3}, 4);
            }),
            "the model has 3 layers, fewer than the 4 stages that must each hold one layer");
}

TEST(Partition, ExplicitCountsAndTheirErrors) {
  EXPECT_EQ(partition_explicit({4, 3, 5}, 12).begin, (std::vector<int>{0, 4, 7, 12}));
  EXPECT_EQ(error_of([] {
              partition_explicit({4, 4}, 9);
            }),
            "balance [4, 4] adds up to 8 layers, the model has 9");
  EXPECT_EQ(error_of([] {
              partition_explicit({4, 0, 5}, 9);
            }),
            "balance [4, 0, 5] gives stage 1 0 layers; every stage must hold at least one");
  EXPECT_NE(error_of([] { partition_explicit({}, 9); }), "(no ConfigError)");
}

TEST(Partition, StageCostsSumTheLayers) {
  std::vector<LayerCost> layers = {
      {"0", 10, 1.0, 2.0, 100}, {"1", 20, 0.5, 1.0, 50}, {"2", 5, 0.25, 0.5, 8}};
  auto costs = stage_costs(partition_explicit({2, 1}, 3), layers);
  ASSERT_EQ(costs.size(), 2u);
  EXPECT_EQ(costs[0].params, 30);
  EXPECT_DOUBLE_EQ(costs[0].forward_s, 1.5);
  EXPECT_DOUBLE_EQ(costs[0].backward_s, 3.0);
  EXPECT_EQ(costs[0].activation_bytes, 150);
  EXPECT_EQ(costs[0].output_bytes, 50);
  EXPECT_EQ(costs[1].params, 5);
  EXPECT_EQ(costs[1].output_bytes, 8);
}
