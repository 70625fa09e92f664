// Data: real datasets held in memory, and the deterministic order each rank reads.
//
// A Dataset hands out examples by index; a BatchPlan decides which indices make each
// global batch (a permutation seeded by (seed, epoch)) and which slice of it a given
// data-parallel rank and micro-batch reads. The global batch is data.batch_size; a rank
// reads batch_size / world of it, in micro-batches of that / accumulation_steps. With
// one rank and one micro-batch this is the plain single-process loop; with more, the
// union of the slices is exactly the same global batch (the numerics contract).
#pragma once

#include <nlohmann/json.hpp>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/job_spec.h"

namespace tetra::core {

enum class Split { kTrain, kTest };

struct DataInfo {
  std::vector<int64_t> input_shape;  // per example, e.g. {1, 28, 28} or {seq_len}
  int64_t num_classes = 0;           // classes, or the vocabulary (256) for text
  bool language_model = false;       // targets are next tokens [seq_len], not a label
  int64_t seq_len = 0;               // text only
  std::string description;           // "Fashion-MNIST (60000 train, 10000 test)"
  // How a raw example becomes the model's input, for a reader of the exported weights
  // (Note [Export config]): the scaling and normalisation of images, the vocabulary and
  // sequence length of text. Null for a program's own dataset.
  nlohmann::json preprocessing;
};

struct Batch {
  at::Tensor inputs;   // float [n, ...] for images/synthetic; int64 [n, seq_len] for text
  at::Tensor targets;  // int64 [n] labels, or int64 [n, seq_len] next tokens
  int64_t size() const { return inputs.defined() ? inputs.size(0) : 0; }
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual const DataInfo& info() const = 0;
  virtual int64_t size(Split split) const = 0;
  // The examples at `indices` (int64, 1-D), in that order.
  virtual Batch get(Split split, const at::Tensor& indices) const = 0;
  // A contiguous range [begin, end) of a split (evaluation reads in order).
  virtual Batch range(Split split, int64_t begin, int64_t end) const;
};

// Builds the dataset a job asks for. A missing or malformed file is a tetra::DataError
// naming the path and what is wrong with it (and, for fashion-mnist, the package).
std::unique_ptr<Dataset> make_dataset(const DataSpec& spec, int64_t seed);

// Reads a gzipped IDX file (magic 0x0000 08 NDIM, big-endian dims, uint8 data) into a
// uint8 tensor of its dims. Truncated or corrupt files are DataErrors naming the path.
at::Tensor read_idx_gz(const std::string& path);

// The deterministic reading order of the training split.
class BatchPlan {
 public:
  // examples: training examples; global_batch: data.batch_size; the last partial batch
  // of an epoch is dropped (every rank then takes the same number of steps).
  BatchPlan(int64_t examples, int64_t global_batch, int64_t seed, bool shuffle);
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  // The indices of global batch `step` (0-based within the epoch) of `epoch`: the same
  // on every rank. Cached per epoch.
  at::Tensor global_batch(int64_t epoch, int64_t step);
  // Slice [part * n / parts, (part + 1) * n / parts) of a batch's indices.
  static at::Tensor slice(const at::Tensor& indices, int64_t part, int64_t parts);
  // Where that slice of n rows begins: its offset in the sliced batch (the dropout key of
  // its first row, Note [Layout-invariant dropout]).
  static int64_t slice_begin(int64_t n, int64_t part, int64_t parts);

 private:
  int64_t examples_, global_batch_, seed_, steps_per_epoch_;
  bool shuffle_;
  int64_t cached_epoch_ = -1;
  at::Tensor order_;
};

}  // namespace tetra::core
