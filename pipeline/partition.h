// Cutting a sequence of layers into contiguous pipeline stages.
//
// balance: uniform      equal layer counts (the first stages take one more when it
//                       does not divide)
//          by_params    minimise the largest stage's parameter count
//          by_time      minimise the largest stage's measured forward+backward time
//          [4, 3, 5]    explicit layer counts, one per stage, summing to the layers
// by_params and by_time solve the contiguous min-max partition exactly (dynamic
// programming over prefix sums, O(K * L^2) for L layers and K stages — L is hundreds
// at most). Every stage must hold at least one layer. Nothing here touches torch: the
// costs are numbers the pipeline plugin measured or counted.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tetra::pipeline {

// What one layer costs.
struct LayerCost {
  std::string name;         // "3: Linear(512 -> 512)"
  int64_t params = 0;       // parameter count
  double forward_s = 0;     // measured on one micro-batch (by_time, or --dry-run)
  double backward_s = 0;
  int64_t activation_bytes = 0;  // the layer's output for one micro-batch
  // What its forward keeps for backward for one micro-batch, output included (-1: not
  // measured, kept() is the output), and what its recomputation under train.recompute holds
  // beyond that (Note [Kept bytes]).
  int64_t kept_bytes = -1, recompute_bytes = 0;
  int64_t kept() const { return kept_bytes >= 0 ? kept_bytes : activation_bytes; }
  // The times were taken on one short sample and scaled by FLOPs (Note [Layer costs]).
  bool scaled = false;
};

// A partition: stage k holds layers [begin[k], begin[k+1]); begin.size() == K + 1,
// begin.front() == 0, begin.back() == L.
struct Partition {
  std::vector<int> begin;
  int stages() const { return static_cast<int>(begin.size()) - 1; }
  int first(int k) const { return begin[k]; }
  int end(int k) const { return begin[k + 1]; }
  int size(int k) const { return begin[k + 1] - begin[k]; }
  // Layer counts per stage: "[3, 3, 2]".
  std::string str() const;
};

// Throws tetra::ConfigError when layers < stages: "the model has 3 layers, fewer than
// the 4 stages (pipeline 2 x virtual_stages 2) that must each hold one".
Partition partition_uniform(int layers, int stages);
// The contiguous partition into `stages` non-empty parts minimising the largest part's
// sum of weights; ties go to the partition whose earlier stages are lighter.
Partition partition_min_max(const std::vector<double>& weights, int stages);
// The same over any cost of a part: cost(stage, first, end) for layers [first, end) as
// stage `stage`, growing with the part; infinity where the part may not be (balance by
// time under pipeline.memory_gb: a stage that does not fit). Returns an empty partition
// (no begin) when every cut has an infinite part.
using StageCostFn = std::function<double(int stage, int first, int end)>;
Partition partition_min_max(int layers, int stages, const StageCostFn& cost);
// Explicit counts; every count >= 1 and the sum == layers, else a ConfigError naming
// what is wrong ("balance [4, 4] adds up to 8 layers, the model has 9").
Partition partition_explicit(const std::vector<int64_t>& counts, int layers);

// Per-stage totals of a partition.
struct StageCost {
  int64_t params = 0;
  double forward_s = 0, backward_s = 0;
  int64_t activation_bytes = 0;  // one micro-batch's layer outputs (what backward keeps)
  int64_t output_bytes = 0;      // the stage's last output (what it sends)
};
std::vector<StageCost> stage_costs(const Partition& p, const std::vector<LayerCost>& layers);

}  // namespace tetra::pipeline
