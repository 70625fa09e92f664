// The safetensors format (Hugging Face): an 8-byte little-endian header length N, N
// bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {string: string}}, then the raw little-endian tensor bytes. tetra
// exports weights in it and keeps checkpoint tensors in it: one format a user can open
// with any safetensors reader.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tetra::core {

using TensorMap = std::map<std::string, at::Tensor>;

// Serialises tensors (any of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL) to bytes.
std::string safetensors_bytes(const TensorMap& tensors,
                              const std::map<std::string, std::string>& metadata = {});
// Writes atomically: a temporary file beside `path`, fsync, rename, fsync of the folder.
void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata = {});
// Reads a file; a malformed one is a tetra::Error naming the path and the problem.
TensorMap load_safetensors(const std::string& path,
                           std::map<std::string, std::string>* metadata = nullptr);

// Parses safetensors_bytes' output (a message from another rank, say); `where` names
// its origin in errors.
TensorMap parse_safetensors(const std::string& bytes, const std::string& where,
                            std::map<std::string, std::string>* metadata = nullptr);
// Writes `bytes` to `path` atomically (temporary file, fsync, rename, fsync folder).
void write_file_atomic(const std::string& path, const std::string& bytes);
// fsync of a directory (after a rename inside it).
void fsync_dir(const std::string& dir);

// The safetensors names of dtypes ("F32", "BF16", ...); an unsupported dtype is a tetra::Error.
const char* safetensors_dtype_name(at::ScalarType type);
// The dtype of a safetensors name; false when it is not one tetra reads.
bool safetensors_dtype_from_name(const std::string& name, at::ScalarType* type);

// One safetensors file opened for reading pieces of it: the header is parsed once (and
// checked as load_safetensors checks it), then any byte range of a tensor is read with
// pread(), so a reader of a slice of a large file touches only that slice's bytes.
// Reads do not move a file position: one object may serve several threads at once.
class SafetensorsFile {
 public:
  struct Entry {
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // its bytes, relative to the start of the data section
    int64_t numel() const;
  };

  // Opens `path` and reads its header; a missing or malformed file is a tetra::Error naming it.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return file_size_; }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  // The entry of `name`; a tetra::Error naming the file and the tensor when it has none.
  const Entry& entry(const std::string& name) const;

  // Reads bytes [offset, offset + length) of tensor `name`'s data into `dst`.
  void read(const std::string& name, uint64_t offset, uint64_t length, void* dst) const;
  // The whole tensor `name`.
  at::Tensor tensor(const std::string& name) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t file_size_ = 0, data_start_ = 0;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace tetra::core
