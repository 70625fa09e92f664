#include "core/safetensors.h"

#include <torch/types.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "collectives/error.h"
#include "core/json_input.h"

namespace tetra::core {

namespace fs = std::filesystem;

namespace {

struct DtypeName {
  torch::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {torch::kFloat64, "F64"}, {torch::kFloat32, "F32"}, {torch::kFloat16, "F16"},
    {torch::kBFloat16, "BF16"}, {torch::kInt64, "I64"}, {torch::kInt32, "I32"},
    {torch::kInt16, "I16"}, {torch::kInt8, "I8"}, {torch::kUInt8, "U8"}, {torch::kBool, "BOOL"},
};

const char* dtype_name(torch::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  throw Error(std::string("safetensors: unsupported dtype ") + c10::toString(t));
}

bool dtype_from_name(const std::string& n, torch::ScalarType* out) {
  for (const auto& d : kDtypes)
    if (n == d.name) {
      *out = d.type;
      return true;
    }
  return false;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

std::string safetensors_bytes(const TensorMap& tensors,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> data;
  data.reserve(tensors.size());
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
    uint64_t n = static_cast<uint64_t>(c.numel()) * c.element_size();
    header[name] = {{"dtype", dtype_name(c.scalar_type())},
                    {"shape", c.sizes().vec()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
    data.push_back(std::move(c));
  }
  std::string json = header.dump();
  // Pad the header with spaces so the data starts 8-byte aligned (as the reference does).
  while ((json.size() + 8) % 8 != 0) json.push_back(' ');
  std::string out;
  out.reserve(8 + json.size() + offset);
  uint64_t len = json.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  out += json;
  for (const auto& c : data)
    out.append(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  return out;
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  fs::path p(path);
  fs::path dir = p.parent_path();
  if (!dir.empty()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw Error("cannot create folder " + dir.string() + ": " + ec.message());
  }
  // Unique per call: two threads of one process (trainers of two jobs in one program)
  // may write the same path; each renames its own whole file.
  static std::atomic<uint64_t> calls{0};
  std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(calls++);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error("cannot write " + tmp + ": " + errno_text());
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      std::string why = errno_text();
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Error("cannot write " + tmp + ": " + why);
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw Error("cannot write " + tmp + ": " + why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw Error("cannot rename " + tmp + " to " + path + ": " + why);
  }
  fsync_dir(dir.string());
}

void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata) {
  write_file_atomic(path, safetensors_bytes(tensors, metadata));
}

TensorMap load_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open " + path + ": " + errno_text());
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_safetensors(bytes, path, metadata);
}

namespace {

uint64_t header_length(const unsigned char* b) {
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(b[i]) << (8 * i);
  return len;
}

// Note [Safetensors from elsewhere]
// A safetensors file may come from anyone (an exported model, a checkpoint's rank file),
// so the header is checked before any of it is trusted, as the reference implementation
// (huggingface/safetensors) checks it: a header of at most kMaxHeaderBytes, JSON nested
// no deeper than kMaxJsonDepth (core/json_input.h), every entry an object with a known
// dtype, a shape of at most kMaxDims non-negative integers whose byte count (checked at
// every multiplication, zero dimensions or not) is at most kMaxTensorBytes, and
// data_offsets [begin, end] with end - begin that byte count; then the entries' ranges,
// in order of begin, must tile the data section exactly: no overlap, no gap, nothing
// after the last. So every byte a reader reads is inside the file and belongs to one
// tensor, no allocation is larger than the file, and a malformed file is one
// tetra::Error "<path>: not a valid safetensors file: <why>" (names and values in it
// through shown()).
constexpr uint64_t kMaxHeaderBytes = 100000000;      // the reference's MAX_HEADER_SIZE
constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 60;
constexpr size_t kMaxDims = 64;

// The one header parser, for whole files in memory and for SafetensorsFile: checks every
// entry against its shape and the `data_size` bytes that follow the header.
std::map<std::string, SafetensorsFile::Entry> parse_header(const char* json, uint64_t len, uint64_t data_size,
                                                           const std::string& path,
                                                           std::map<std::string, std::string>* metadata) {
  auto bad = [&](const std::string& why) { return Error(path + ": not a valid safetensors file: " + why); };
  nlohmann::json header;
  try {
    header = parse_json_input(json, json + len);
  } catch (const std::exception& e) {
    throw bad("header is not JSON (" + shown(e.what()) + ")");
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  std::map<std::string, SafetensorsFile::Entry> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (metadata && it.value().is_object())
        for (auto m = it.value().begin(); m != it.value().end(); ++m)
          if (m.value().is_string()) (*metadata)[m.key()] = m.value().get<std::string>();
      continue;
    }
    const std::string tensor = "tensor " + shown(it.key());
    const auto& e = it.value();
    SafetensorsFile::Entry entry;
    if (!e.is_object()) throw bad(tensor + " is " + shown(e) + ", not an object");
    const auto dtype = e.find("dtype"), shape = e.find("shape"), off = e.find("data_offsets");
    if (dtype == e.end() || !dtype->is_string() ||
        !safetensors_dtype_from_name(dtype->get<std::string>(), &entry.dtype))
      throw bad(tensor + " has no known dtype" + (dtype == e.end() ? "" : " (" + shown(*dtype) + ")"));
    if (shape == e.end() || !shape->is_array() || off == e.end() || !off->is_array() || off->size() != 2)
      throw bad(tensor + " lacks shape or data_offsets");
    if (shape->size() > kMaxDims)
      throw bad(tensor + " has " + std::to_string(shape->size()) + " dimensions (at most " +
                std::to_string(kMaxDims) + ")");
    // Its byte count: the product of the non-zero dimensions must stay within
    // kMaxTensorBytes even when another dimension is 0 (torch sizes such a tensor too).
    uint64_t bytes = c10::elementSize(entry.dtype);
    bool empty = false;
    entry.shape.reserve(shape->size());
    for (const auto& d : *shape) {
      uint64_t n = 0;
      if (!json_uint(d, &n)) throw bad(tensor + " has shape " + shown(*shape));
      if (n == 0)
        empty = true;
      else if (bytes > kMaxTensorBytes / n)
        throw bad(tensor + " has shape " + shown(*shape) + ", over 2^60 bytes");
      else
        bytes *= n;
      entry.shape.push_back(static_cast<int64_t>(n));
    }
    const uint64_t need = empty ? 0 : bytes;
    if (!json_uint((*off)[0], &entry.begin) || !json_uint((*off)[1], &entry.end))
      throw bad(tensor + " has data_offsets " + shown(*off));
    if (entry.begin > entry.end || entry.end > data_size || entry.end - entry.begin != need)
      throw bad(tensor + " has data_offsets [" + std::to_string(entry.begin) + ", " +
                std::to_string(entry.end) + "] that do not fit its shape or the file");
    out.emplace(it.key(), std::move(entry));
  }
  // The ranges tile the data section (Note [Safetensors from elsewhere]).
  std::vector<std::pair<const std::string*, const SafetensorsFile::Entry*>> order;
  order.reserve(out.size());
  for (const auto& [name, e] : out) order.emplace_back(&name, &e);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.second->begin != b.second->begin ? a.second->begin < b.second->begin
                                              : a.second->end < b.second->end;
  });
  uint64_t at = 0;
  const std::string* last = nullptr;
  for (const auto& [name, e] : order) {
    if (e->begin < at)
      throw bad("tensors " + shown(*last) + " and " + shown(*name) + " overlap (data bytes [" +
                std::to_string(e->begin) + ", " + std::to_string(std::min(at, e->end)) + "))");
    if (e->begin > at)
      throw bad("data bytes [" + std::to_string(at) + ", " + std::to_string(e->begin) +
                ") belong to no tensor");
    at = e->end;
    last = name;
  }
  if (at != data_size)
    throw bad("data bytes [" + std::to_string(at) + ", " + std::to_string(data_size) +
              ") after the last tensor belong to no tensor");
  return out;
}

}  // namespace

TensorMap parse_safetensors(const std::string& bytes, const std::string& path,
                            std::map<std::string, std::string>* metadata) {
  auto bad = [&](const std::string& why) { return Error(path + ": not a valid safetensors file: " + why); };
  if (bytes.size() < 8) throw bad("shorter than its 8-byte header length");
  const uint64_t len = header_length(reinterpret_cast<const unsigned char*>(bytes.data()));
  if (len > bytes.size() - 8) throw bad("header length " + std::to_string(len) + " exceeds the file");
  if (len > kMaxHeaderBytes) throw bad("header length " + std::to_string(len) + " is over the 100 MB a header may have");
  const uint64_t base = 8 + len;
  auto entries = parse_header(bytes.data() + 8, len, bytes.size() - base, path, metadata);
  TensorMap out;
  for (const auto& [name, e] : entries) {
    torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
    if (e.end > e.begin) std::memcpy(t.data_ptr(), bytes.data() + base + e.begin, e.end - e.begin);
    out.emplace(name, std::move(t));
  }
  return out;
}

const char* safetensors_dtype_name(torch::ScalarType type) { return dtype_name(type); }

bool safetensors_dtype_from_name(const std::string& name, torch::ScalarType* type) {
  return dtype_from_name(name, type);
}

int64_t SafetensorsFile::Entry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// Reads exactly `length` bytes at `offset`, or says why not.
void pread_all(int fd, const std::string& path, uint64_t offset, uint64_t length, void* dst) {
  char* p = static_cast<char*>(dst);
  while (length > 0) {
    ssize_t r = ::pread(fd, p, length, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw Error("cannot read " + path + ": " + errno_text());
    }
    if (r == 0) throw Error(path + ": not a valid safetensors file: it ends early (truncated?)");
    p += r;
    offset += static_cast<uint64_t>(r);
    length -= static_cast<uint64_t>(r);
  }
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw Error("cannot open " + path + ": " + errno_text());
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throw Error("cannot stat " + path + ": " + errno_text());
    file_size_ = static_cast<uint64_t>(st.st_size);
    auto bad = [&](const std::string& why) { return Error(path + ": not a valid safetensors file: " + why); };
    if (file_size_ < 8) throw bad("shorter than its 8-byte header length");
    unsigned char head[8];
    pread_all(fd_, path, 0, 8, head);
    const uint64_t len = header_length(head);
    if (len > file_size_ - 8) throw bad("header length " + std::to_string(len) + " exceeds the file");
    if (len > kMaxHeaderBytes) throw bad("header length " + std::to_string(len) + " is over the 100 MB a header may have");
    std::string json(len, '\0');
    pread_all(fd_, path, 8, len, json.data());
    data_start_ = 8 + len;
    entries_ = parse_header(json.data(), len, file_size_ - data_start_, path, &metadata_);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) throw Error(path_ + " has no tensor " + name);
  return it->second;
}

void SafetensorsFile::read(const std::string& name, uint64_t offset, uint64_t length, void* dst) const {
  const Entry& e = entry(name);
  if (offset > e.end - e.begin || length > e.end - e.begin - offset)
    throw Error(path_ + ": bytes [" + std::to_string(offset) + ", " + std::to_string(offset + length) +
                ") of tensor " + name + " are past its " + std::to_string(e.end - e.begin) + " bytes");
  pread_all(fd_, path_, data_start_ + e.begin + offset, length, dst);
}

torch::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const Entry& e = entry(name);
  // At most the file's size, which a sparse file may still make more than the memory.
  torch::Tensor t;
  try {
    t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
  } catch (const std::exception& ex) {
    throw Error(path_ + ": cannot allocate the " + std::to_string(e.end - e.begin) + " bytes of tensor " +
                shown(name) + " (" + shown(ex.what()) + ")");
  }
  if (e.end > e.begin) read(name, 0, e.end - e.begin, t.data_ptr());
  return t;
}

}  // namespace tetra::core
