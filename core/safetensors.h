// The safetensors format (Hugging Face): an 8-byte little-endian header length N, N
// bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {string: string}}, then the raw little-endian tensor bytes. tetra
// exports weights in it and keeps checkpoint tensors in it: one format a user can open
// with any safetensors reader.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>

namespace tetra::core {

using TensorMap = std::map<std::string, torch::Tensor>;

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

}  // namespace tetra::core
