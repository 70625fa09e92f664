// Checkpoints: a folder per step that does not depend on the layout that wrote it, written
// so that a kill at any moment leaves the last good one intact.
//
//   <dir>/step-00000500/meta.json               step, epoch, position, job, world, index
//   <dir>/step-00000500/rank-00000.safetensors  what world rank 0 holds
//   <dir>/step-00000500/rank-00001.safetensors  what world rank 1 holds ...
//
// Tensors carry the names a single process uses ("model/3.weight", "optim/3.weight.exp_avg",
// "rng/cpu"). A rank writes whole tensors (replicated state, written once) and slices:
// flattened ranges of tensors, as a ZeRO shard holds them. meta.json's index names, for
// every tensor, its dtype, its whole shape and the parts that make it up (file, element
// range), so any layout (another world size, ZeRO stage, pipeline cut, one process) reads
// back exactly the ranges it needs. Note [Checkpoint format 2] in checkpoint.cpp.
//
// A checkpoint is assembled in a hidden temporary folder (".step-00000500.tmp"), every
// file fsynced, then renamed into place by rank 0 and the parent fsynced: a folder named
// step-* is always complete. The newest `keep` are kept.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "collectives/error.h"
#include "core/safetensors.h"

namespace tetra::collectives {
class Communicator;
}

namespace tetra::core {

// A flattened range of one tensor that this rank holds (a ZeRO shard covers ranges of
// several parameters; at most one Slice per name per rank).
struct Slice {
  std::vector<int64_t> shape;  // the whole tensor's shape
  int64_t begin = 0;           // first element, in the whole tensor's row-major flattened order
  at::Tensor data;          // 1-D contiguous: elements [begin, begin + data.numel())
};

// A save failed (a full disk, a read-only or unwritable folder, a rank that could not
// write): every rank of the save throws the same one, naming the file and the cause, and
// the previous checkpoint is untouched.
class CheckpointSaveError : public Error {
 public:
  using Error::Error;
};

struct Checkpoint {
  int64_t step = 0;           // optimizer steps completed
  int64_t epoch = 0;          // epoch of the next step
  int64_t step_in_epoch = 0;  // index within that epoch of the next step
  TensorMap tensors;          // whole tensors this rank writes (loaded: every tensor, whole)
  std::map<std::string, Slice> slices;             // ranges of tensors this rank writes
  nlohmann::json meta = nlohmann::json::object();  // anything else (metrics, job name)
};

class CheckpointReader;

class CheckpointStore {
 public:
  CheckpointStore(std::string dir, int64_t keep);

  // Writes a checkpoint and returns its folder (on every rank). Collective over `world`
  // when given: every rank calls it with its own part (its whole tensors and slices);
  // step, epoch, step_in_epoch and meta are taken from rank 0 (the ranks must agree on
  // step). Without `world`, a single process (rank 0 of 1). Rank 0 checks that the parts
  // of every tensor cover it exactly once, with one shape and dtype, and records every
  // file's size and CRC-32C: otherwise, or when any rank fails to write (a full disk, a
  // read-only folder), every rank throws the same CheckpointSaveError and no step-*
  // folder appears. Removes the oldest beyond `keep` and stale temporary folders. `world` agrees
  // through small CPU tensors: an mpi, local, gloo or replicate communicator, not nccl.
  std::string save(const Checkpoint& ckpt, collectives::Communicator* world = nullptr);

  // The newest complete checkpoint in the folder, if any.
  std::optional<std::string> latest() const;
  // The newest checkpoint whose every file has its recorded size and CRC-32C (what
  // `resume: auto` takes), as the reader that checked it: its files are open and need no
  // second read. Each newer damaged one is skipped, its error added to `skipped`.
  std::optional<CheckpointReader> latest_intact(std::vector<std::string>* skipped = nullptr) const;
  // Every complete checkpoint, oldest first.
  std::vector<std::string> list() const;

  // Loads a checkpoint folder (or, given the store's folder or a parent of step-*
  // folders, its newest): every tensor whole in `tensors`, whatever layout wrote it. A
  // missing or damaged checkpoint is a tetra::Error naming it.
  static Checkpoint load(const std::string& path);
  // Resolves what `checkpoint.resume` points at: a step folder, or a folder of them.
  static std::optional<std::string> resolve(const std::string& path);

  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  int64_t keep_;
};

// Reads a checkpoint of any format and layout, loading no more than is asked: meta.json
// at construction (its checksum checked), a file when a tensor in it is first read (read
// whole once to check its size and CRC-32C, then its header), then only the bytes of the
// ranges read. A damaged file is a tetra::Error "checkpoint <folder> is damaged (<file>:
// <why>)". Each object opens its own files (no shared state), so thread-ranks
// may each read the same folder with their own reader; one reader may also be shared.
class CheckpointReader {
 public:
  // A step folder, or a folder of them (its newest). Missing/damaged: tetra::Error naming it.
  explicit CheckpointReader(const std::string& path);
  // Note [Weights from elsewhere]: the model's weights alone, as "model/<name>": of a
  // checkpoint (a step folder or a folder of them, any job, any layout; its other tensors
  // hidden), or of a safetensors file (an export: its tensors are the model's, by their
  // single-process names). step() is the checkpoint's, or the export's "step" metadata.
  static CheckpointReader weights_of(const std::string& path);
  ~CheckpointReader();
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;

  const std::string& folder() const { return folder_; }
  int64_t step() const { return step_; }
  int64_t epoch() const { return epoch_; }
  int64_t step_in_epoch() const { return step_in_epoch_; }
  const nlohmann::json& meta() const { return meta_; }  // the user meta (job, batch_size, ...)
  int world() const { return world_; }                  // ranks that wrote it
  int format() const { return format_; }                // 1 (one whole-tensor file) or 2
  const std::vector<std::string>& files() const { return files_; }  // file names in folder()

  // Checks every file (meta.json is checked at construction): a tetra::Error naming the
  // first damaged or missing one. Checkpoints written before checksums: their files exist.
  void verify() const;

  std::vector<std::string> names() const;  // every tensor, sorted
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  std::vector<int64_t> shape(const std::string& name) const;
  at::ScalarType dtype(const std::string& name) const;
  // Before a resume changes anything: a tetra::ConfigError naming this checkpoint, the
  // tensor and both shapes when `name` is missing or its shape is not `shape`. `what`
  // says what the tensor is for ("model parameter 3.weight").
  void expect_shape(const std::string& name, at::IntArrayRef shape, const std::string& what) const;
  int64_t numel(const std::string& name) const;

  at::Tensor read(const std::string& name) const;  // the whole tensor, assembled from its parts
  // Elements [begin, begin + count) of the flattened tensor, assembled from whatever files
  // hold them (1-D).
  at::Tensor read_flat(const std::string& name, int64_t begin, int64_t count) const;

  struct Part {
    std::string file;    // in folder()
    int64_t begin, end;  // elements [begin, end) of the flattened tensor
  };
  const std::vector<Part>& parts(const std::string& name) const;

 private:
  CheckpointReader();
  struct Entry {
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> shape;
    int64_t numel = 0;
    std::vector<Part> parts;  // sorted by begin, covering [0, numel) once
  };
  const Entry& find(const std::string& name) const;
  // Elements [begin, begin + count) of tensor `name` as a tensor of `shape`.
  at::Tensor read_range(const std::string& name, const Entry& e, int64_t begin, int64_t count,
                           at::IntArrayRef shape) const;
  const SafetensorsFile& file(const std::string& name) const;

  std::string folder_;
  int64_t step_ = 0, epoch_ = 0, step_in_epoch_ = 0;
  nlohmann::json meta_ = nlohmann::json::object();
  int world_ = 1, format_ = 2;
  std::vector<std::string> files_;
  // What an index name has that the file's tensor name lacks ("model/" for an export read
  // by weights_of, whose file names the model's tensors bare); "" for a checkpoint.
  std::string stored_prefix_;
  std::map<std::string, Entry> index_;
  nlohmann::json checksums_ = nlohmann::json::object();  // file -> {bytes, crc32c}; may be empty
  struct Files;  // the rank files opened so far, behind a mutex (the reader stays movable)
  std::unique_ptr<Files> open_;
};

}  // namespace tetra::core
