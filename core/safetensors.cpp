#include "core/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "collectives/error.h"

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
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
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

TensorMap parse_safetensors(const std::string& bytes, const std::string& path,
                            std::map<std::string, std::string>* metadata) {
  auto bad = [&](const std::string& why) { return Error(path + ": not a valid safetensors file: " + why); };
  if (bytes.size() < 8) throw bad("shorter than its 8-byte header length");
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  if (len > bytes.size() - 8) throw bad("header length " + std::to_string(len) + " exceeds the file");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(len));
  } catch (const std::exception& e) {
    throw bad(std::string("header is not JSON (") + e.what() + ")");
  }
  if (!header.is_object()) throw bad("header is not a JSON object");
  const uint64_t base = 8 + len, data_size = bytes.size() - base;
  TensorMap out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (metadata && it.value().is_object())
        for (auto m = it.value().begin(); m != it.value().end(); ++m)
          if (m.value().is_string()) (*metadata)[m.key()] = m.value().get<std::string>();
      continue;
    }
    const auto& e = it.value();
    torch::ScalarType type;
    if (!e.is_object() || !e.contains("dtype") || !e["dtype"].is_string() ||
        !dtype_from_name(e["dtype"].get<std::string>(), &type))
      throw bad("tensor " + it.key() + " has no known dtype");
    if (!e.contains("shape") || !e["shape"].is_array() || !e.contains("data_offsets") ||
        !e["data_offsets"].is_array() || e["data_offsets"].size() != 2)
      throw bad("tensor " + it.key() + " lacks shape or data_offsets");
    std::vector<int64_t> shape = e["shape"].get<std::vector<int64_t>>();
    uint64_t b = e["data_offsets"][0].get<uint64_t>(), end = e["data_offsets"][1].get<uint64_t>();
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    uint64_t need = static_cast<uint64_t>(numel) * c10::elementSize(type);
    if (b > end || end > data_size || end - b != need)
      throw bad("tensor " + it.key() + " has data_offsets [" + std::to_string(b) + ", " +
                std::to_string(end) + "] that do not fit its shape or the file");
    torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(type));
    if (need) std::memcpy(t.data_ptr(), bytes.data() + base + b, need);
    out.emplace(it.key(), std::move(t));
  }
  return out;
}

}  // namespace tetra::core
