#include "core/checkpoint.h"

#include <torch/types.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>

#include "collectives/communicator.h"
#include "collectives/error.h"
#include "core/crc32c.h"
#include "core/json_input.h"
#include "core/text.h"

// Note [Checkpoint format 2]
// meta.json holds the user's meta fields at its top level (as format 1 did) and these:
//   "format": 2, "step", "epoch", "step_in_epoch",
//   "world": N, "files": ["rank-00000.safetensors", ...]   (one per world rank)
//   "index": {name: {"dtype": "F32", "shape": [5, 7],
//                    "parts": [{"file": "rank-00000.safetensors", "begin": 0, "end": 12}, ...]}}
// Parts are sorted by begin and cover the flattened tensor [0, numel) exactly once. A
// rank's file is an ordinary safetensors file: a whole tensor under its name and shape; a
// slice under its name as a 1-D tensor of its elements, with its place in the whole in
// the header's __metadata__ "tetra.slices": {"name": {"begin": b, "shape": [...]}}, so
// the files alone describe the checkpoint (rank 0 builds the index from their headers).
//
// Format 1 (before slices) had "format": "tetra-checkpoint-1", no index, and one
// rank-00000.safetensors of whole tensors; the reader indexes that file's header instead.
//
// Saving with a world takes four collectives (each also a barrier): the ranks check that
// they save the same step; rank 0 prepares the temporary folder; every rank writes and
// fsyncs its file; rank 0 indexes, checks, publishes. After each, every rank learns
// whether any rank failed and the first failure's message, so all ranks throw the same
// error together instead of some waiting out a timeout in the next collective.

// Note [Checkpoint checksums]
// Every file of a step folder carries its byte count and CRC-32C (Castagnoli, the
// polynomial storage and network hardware checks), kept in meta.json:
//   "checksums": {"rank-00000.safetensors": {"bytes": 4096, "crc32c": "0x1a2b3c4d"}, ...}
//   "meta_crc32c": "0x..."  the CRC-32C of meta.json's canonical content: the document
//                           without this key, dumped compactly with sorted keys (as
//                           nlohmann::json dumps an object), so a flipped byte anywhere in
//                           the file is caught whether or not it still parses.
// A rank computes its file's CRC from the bytes as it writes them (no second read) and
// the save's agreement after the write carries every rank's size and CRC to rank 0,
// which records them. The reader verifies a file once, the first time it opens it, by
// reading it whole (a resume reads every byte anyway); verify() checks every file. A
// folder without these keys (written before them) loads unverified. A damaged file is a
// tetra::Error "checkpoint <folder> is damaged (<file>: <what differs>)".

namespace tetra::core {

namespace fs = std::filesystem;
using Part = CheckpointReader::Part;

namespace {

constexpr const char* kMeta = "meta.json";
constexpr const char* kFormat1 = "tetra-checkpoint-1";
constexpr int kFormat = 2;
constexpr const char* kSlicesKey = "tetra.slices";
// meta.json keys that are the checkpoint's own, not the user's meta.
const char* const kReserved[] = {"format", "step",  "epoch",     "step_in_epoch", "world",
                                 "files",  "index", "checksums", "meta_crc32c"};
constexpr const char* kChecksums = "checksums";
constexpr const char* kMetaCrc = "meta_crc32c";
// Ranks wait in a save's collectives while the slowest writes its file, which for a large
// model on a slow filesystem takes longer than the communicators' default timeout.
constexpr collectives::Duration kSaveTimeout = std::chrono::minutes(30);

std::string crc_text(uint32_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", crc);
  return buf;
}

uint32_t crc_of(const std::string& bytes) { return crc32c(bytes.data(), bytes.size()); }

// The CRC of meta.json's canonical content (Note [Checkpoint checksums]).
std::string meta_crc(nlohmann::json doc) {
  doc.erase(kMetaCrc);
  return crc_text(crc_of(doc.dump()));
}

// The size and CRC-32C of one file, reading it once; "" when it matches `expected`
// ({"bytes", "crc32c"}), else what differs ("CRC-32C 0x... expected 0x...").
std::string check_file(const std::string& path, const nlohmann::json& expected) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? "missing" : std::string("cannot open: ") + std::strerror(errno);
  Crc32c crc;
  uint64_t size = 0;
  std::vector<char> buf(size_t{1} << 20);
  std::string why;
  for (;;) {
    const ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      why = std::string("cannot read: ") + std::strerror(errno);
      break;
    }
    if (r == 0) break;
    crc.process_bytes(buf.data(), static_cast<size_t>(r));
    size += static_cast<uint64_t>(r);
  }
  ::close(fd);
  if (!why.empty()) return why;
  // The reader checked the entry's form when it read meta.json (checksum_entry_ok).
  uint64_t want = 0;
  json_uint(expected.at("bytes"), &want);
  if (size != want)
    return std::to_string(size) + " bytes, expected " + std::to_string(want) + " (truncated?)";
  const std::string got = crc_text(crc.checksum()), crc_want = expected.at("crc32c").get<std::string>();
  if (got != crc_want) return "CRC-32C " + got + " expected " + crc_want;
  return "";
}

Error damaged_file(const std::string& folder, const std::string& file, const std::string& why) {
  return Error("checkpoint " + folder + " is damaged (" + file + ": " + why + ")");
}

// Writes and fsyncs a file of a temporary step folder (the folder's rename is what makes
// it count, so no temporary file of its own). Errors name the file and errno's text.
void write_synced(const fs::path& path, const std::string& bytes) {
  auto fail = [&](int fd) {
    const std::string why = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    ::unlink(path.c_str());
    return Error("checkpoint: cannot write " + path.string() + ": " + why);
  };
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw fail(fd);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw fail(fd);
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0) throw fail(fd);
  if (::close(fd) != 0) throw fail(-1);
}

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string rank_file(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "rank-%05d.safetensors", rank);
  return buf;
}

bool is_step_dir(const fs::directory_entry& e) {
  const std::string n = e.path().filename().string();
  std::error_code ec;
  return e.is_directory(ec) && n.rfind("step-", 0) == 0 && fs::exists(e.path() / kMeta, ec);
}

std::vector<std::string> step_dirs(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (is_step_dir(e)) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());  // zero-padded step numbers sort in step order
  return out;
}


// Elements of a shape of `dtype`; -1 when a dimension is negative, when there are more
// than 64 of them, or when its bytes (the product of its non-zero dimensions, checked at
// every step) would pass 2^60: the limits a safetensors header has (Note [Safetensors
// from elsewhere]), so a damaged meta.json cannot overflow a count or ask for a huge tensor.
int64_t numel_of(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  constexpr uint64_t kMaxBytes = uint64_t{1} << 60;
  if (shape.size() > 64) return -1;
  uint64_t bytes = c10::elementSize(dtype);
  bool empty = false;
  for (int64_t d : shape) {
    if (d < 0) return -1;
    const auto n = static_cast<uint64_t>(d);
    if (n == 0)
      empty = true;
    else if (bytes > kMaxBytes / n)
      return -1;
    else
      bytes *= n;
  }
  return empty ? 0 : static_cast<int64_t>(bytes / c10::elementSize(dtype));
}

// A list of integers from a document read from a file (a shape): false when it is not one.
bool json_int_list(const nlohmann::json& v, std::vector<int64_t>* out) {
  if (!v.is_array() || v.size() > 64) return false;
  out->clear();
  for (const auto& d : v) {
    int64_t n = 0;
    if (!json_int(d, &n)) return false;
    out->push_back(n);
  }
  return true;
}

// A file name that meta.json may give: one entry of the step folder itself, never a path
// elsewhere ("../x", "/etc/x") nor a name a C string would cut short.
bool plain_file_name(const std::string& n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos &&
         n.find('\0') == std::string::npos;
}

// A "checksums" entry as the writer makes it: {"bytes": <non-negative integer>, "crc32c": "0x..."}.
bool checksum_entry_ok(const nlohmann::json& v) {
  uint64_t bytes = 0;
  return v.is_object() && v.contains("bytes") && json_uint(v["bytes"], &bytes) && v.contains("crc32c") &&
         v["crc32c"].is_string();
}

// One tensor of the index while it is built: from rank files' headers (saving, format 1)
// or from meta.json (format 2).
struct IndexEntry {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::string first_file;  // where dtype and shape were first seen, for mismatch errors
  std::vector<Part> parts;
};
using Index = std::map<std::string, IndexEntry>;

void add_part(Index& index, const std::string& name, at::ScalarType dtype,
              const std::vector<int64_t>& shape, Part part, const std::string& where) {
  auto [it, fresh] = index.try_emplace(name);
  IndexEntry& e = it->second;
  if (fresh) {
    e.dtype = dtype;
    e.shape = shape;
    e.first_file = part.file;
  } else if (e.dtype != dtype) {
    throw Error(where + ": tensor " + shown(name) + " is " + safetensors_dtype_name(e.dtype) + " in " +
                e.first_file + " but " + safetensors_dtype_name(dtype) + " in " + part.file);
  } else if (e.shape != shape) {
    throw Error(where + ": tensor " + shown(name) + " has shape " + shape_str(e.shape) + " in " +
                e.first_file + " but " + shape_str(shape) + " in " + part.file);
  }
  e.parts.push_back(std::move(part));
}

// Indexes one rank file by its header: whole tensors, and slices as its "tetra.slices"
// metadata places them.
void index_file(Index& index, const std::string& file_name, const SafetensorsFile& file,
                const std::string& where) {
  nlohmann::json slices = nlohmann::json::object();
  auto md = file.metadata().find(kSlicesKey);
  if (md != file.metadata().end()) {
    try {
      slices = parse_json_input(md->second);
    } catch (const std::exception& e) {
      throw Error(file.path() + ": its " + kSlicesKey + " metadata is not JSON (" + shown(e.what()) + ")");
    }
    if (!slices.is_object())
      throw Error(file.path() + ": its " + kSlicesKey + " metadata is not a JSON object");
  }
  for (const auto& [name, entry] : file.entries()) {
    if (!slices.contains(name)) {
      add_part(index, name, entry.dtype, entry.shape, Part{file_name, 0, entry.numel()}, where);
      continue;
    }
    const auto& s = slices[name];
    std::vector<int64_t> shape;
    int64_t begin = -1;
    if (!s.is_object() || !s.contains("shape") || !json_int_list(s["shape"], &shape) ||
        !s.contains("begin") || !json_int(s["begin"], &begin))
      throw Error(file.path() + ": the slice of tensor " + shown(name) + " lacks begin or shape in its " +
                  kSlicesKey + " metadata (" + shown(s) + ")");
    const int64_t numel = numel_of(shape, entry.dtype);
    if (entry.shape.size() != 1 || numel < 0 || begin < 0 || begin > numel ||
        entry.numel() > numel - begin)
      throw Error(file.path() + ": the slice of tensor " + shown(name) + " (" + shape_str(entry.shape) +
                  " elements from " + std::to_string(begin) + ") does not fit its shape " +
                  shape_str(shape));
    add_part(index, name, entry.dtype, shape, Part{file_name, begin, begin + entry.numel()}, where);
  }
  for (auto it = slices.begin(); it != slices.end(); ++it)
    if (!file.contains(it.key()))
      throw Error(file.path() + ": its " + kSlicesKey + " metadata names tensor " + shown(it.key()) +
                  ", which it lacks");
}

// Sorts each tensor's parts and checks that they cover it exactly once.
void check_index(Index& index, const std::string& where) {
  for (auto& [name, e] : index) {
    const int64_t numel = numel_of(e.shape, e.dtype);
    if (numel < 0) throw Error(where + ": tensor " + shown(name) + " has shape " + shape_str(e.shape));
    auto& parts = e.parts;
    std::stable_sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    // An empty range holds nothing (a ZeRO rank can own no element of a tensor); keep
    // one part only for an empty tensor, so that every tensor names a file.
    if (numel > 0)
      parts.erase(std::remove_if(parts.begin(), parts.end(),
                                 [](const Part& p) { return p.begin == p.end; }),
                  parts.end());
    else if (parts.size() > 1)
      parts.resize(1);
    int64_t at = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& p = parts[i];
      if (p.begin < 0 || p.end < p.begin || p.end > numel)
        throw Error(where + ": tensor " + shown(name) + " (" + std::to_string(numel) +
                    " elements) has a part " + range_str(p.begin, p.end) + " in " + p.file +
                    " outside it");
      if (p.begin > at)
        throw Error(where + ": tensor " + shown(name) + ": elements " + range_str(at, p.begin) +
                    " of its " + std::to_string(numel) +
                    " are in no file (a gap between the slices of the ranks)");
      if (p.begin < at)
        throw Error(where + ": tensor " + shown(name) + ": elements " +
                    range_str(p.begin, std::min(at, p.end)) + " are in both " + parts[i - 1].file +
                    " and " + p.file + " (overlapping slices)");
      at = p.end;
    }
    if (at < numel)
      throw Error(where + ": tensor " + shown(name) + ": elements " + range_str(at, numel) + " of its " +
                  std::to_string(numel) + " are in no file (a gap after the last slice)");
  }
}

nlohmann::json index_json(const Index& index) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, e] : index) {
    nlohmann::json parts = nlohmann::json::array();
    for (const auto& p : e.parts)
      parts.push_back({{"file", p.file}, {"begin", p.begin}, {"end", p.end}});
    out[name] = {{"dtype", safetensors_dtype_name(e.dtype)},
                 {"shape", e.shape},
                 {"parts", std::move(parts)}};
  }
  return out;
}

// Runs `fn`; returns its error's message, or "" when it succeeded.
std::string attempt(const std::function<void()>& fn) {
  try {
    fn();
    return "";
  } catch (const std::exception& e) {
    return e.what()[0] ? e.what() : "unknown error";
  } catch (...) {
    return "unknown error";
  }
}

// Collective: every rank learns whether any rank failed, and the message of the lowest
// rank that did ("" when none did). Also a barrier.
std::string agree(collectives::Communicator* world, const std::string& error) {
  if (!world) return error;
  const int64_t mine = error.empty() ? world->size() : world->rank();
  at::Tensor first = at::full({1}, mine, at::kLong);
  world->allreduce(first, {collectives::ReduceOp::kMin, kSaveTimeout})->wait();
  const int64_t root = first.item<int64_t>();
  if (root == world->size()) return "";
  return collectives::broadcast_string(*world, error, {static_cast<int>(root), kSaveTimeout});
}

// This rank's whole tensors and slices as one safetensors file; returns its byte count and
// CRC-32C, computed from the bytes written.
std::pair<int64_t, uint32_t> write_part(const fs::path& file, const Checkpoint& ckpt, int rank) {
  const std::string who = "checkpoint: rank " + std::to_string(rank);
  TensorMap tensors;
  for (const auto& [name, t] : ckpt.tensors) {
    if (!t.defined()) throw Error(who + ": tensor " + name + " is undefined");
    tensors.emplace(name, t);
  }
  nlohmann::json slices = nlohmann::json::object();
  for (const auto& [name, s] : ckpt.slices) {
    if (tensors.count(name))
      throw Error(who + " holds tensor " + name + " both whole and as a slice");
    if (!s.data.defined() || s.data.dim() != 1)
      throw Error(who + ": the slice of tensor " + name + " must be 1-D, not of shape " +
                  (s.data.defined() ? shape_str(s.data.sizes().vec()) : "(undefined)"));
    const int64_t numel = numel_of(s.shape, s.data.scalar_type());
    if (numel < 0 || s.begin < 0 || s.begin > numel || s.data.numel() > numel - s.begin)
      throw Error(who + ": the slice of tensor " + name + " holds elements " +
                  range_str(s.begin, s.begin + s.data.numel()) + ", outside its shape " +
                  shape_str(s.shape));
    tensors.emplace(name, s.data);
    slices[name] = {{"begin", s.begin}, {"shape", s.shape}};
  }
  std::map<std::string, std::string> metadata;
  if (!slices.empty()) metadata[kSlicesKey] = slices.dump();
  std::string bytes;
  try {
    bytes = safetensors_bytes(tensors, metadata);
  } catch (const std::exception& e) {
    throw Error(who + " could not write " + file.string() + ": " + e.what());
  }
  write_synced(file, bytes);  // its errors name the file and the cause
  return {static_cast<int64_t>(bytes.size()), crc_of(bytes)};
}

}  // namespace

CheckpointStore::CheckpointStore(std::string dir, int64_t keep)
    : dir_(std::move(dir)), keep_(keep) {}

std::vector<std::string> CheckpointStore::list() const { return step_dirs(dir_); }

std::optional<std::string> CheckpointStore::latest() const {
  auto all = list();
  if (all.empty()) return std::nullopt;
  return all.back();
}

std::optional<CheckpointReader> CheckpointStore::latest_intact(
    std::vector<std::string>* skipped) const {
  auto all = list();
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      CheckpointReader reader(*it);
      reader.verify();
      return reader;
    } catch (const Error& e) {
      if (skipped) skipped->push_back(e.what());
    }
  }
  return std::nullopt;
}

std::string CheckpointStore::save(const Checkpoint& ckpt, collectives::Communicator* world) {
  const int rank = world ? world->rank() : 0, size = world ? world->size() : 1;
  const std::string name = step_name(ckpt.step);
  const fs::path final_dir = fs::path(dir_) / name;
  const fs::path tmp_dir = fs::path(dir_) / ("." + name + ".tmp");
  const std::string where = "checkpoint " + name + " in " + dir_;

  // Each rank names the temporary folder after its own step: ranks that disagree would
  // write into different folders and rank 0 would find files missing.
  if (world) {
    at::Tensor steps = at::tensor({ckpt.step, -ckpt.step}, at::kLong);
    world->allreduce(steps, {collectives::ReduceOp::kMax, kSaveTimeout})->wait();
    const int64_t hi = steps[0].item<int64_t>(), lo = -steps[1].item<int64_t>();
    if (hi != lo)
      throw Error("checkpoint: the ranks of \"" + world->name() + "\" save different steps (from " +
                  std::to_string(lo) + " to " + std::to_string(hi) + ")");
  }

  std::string error;
  auto fail = [&](const std::string& why) {  // every rank, with the agreed message
    if (rank == 0) {
      std::error_code ec;
      fs::remove_all(tmp_dir, ec);  // where possible: a read-only folder keeps nothing anyway
    }
    throw CheckpointSaveError(why);
  };
  if (rank == 0)
    error = attempt([&] {
      std::error_code ec;
      fs::create_directories(dir_, ec);
      if (ec) throw Error("checkpoint: cannot create " + dir_ + ": " + ec.message());
      fs::remove_all(tmp_dir, ec);  // what a killed save of this step left
      fs::create_directories(tmp_dir, ec);
      if (ec) throw Error("checkpoint: cannot create " + tmp_dir.string() + ": " + ec.message());
    });
  error = agree(world, error);
  if (!error.empty()) fail(error);

  // Every rank writes its file, even an empty one: the folder then says which ranks wrote.
  std::pair<int64_t, uint32_t> sum{-1, 0};
  error = agree(world, attempt([&] { sum = write_part(tmp_dir / rank_file(rank), ckpt, rank); }));
  if (!error.empty()) fail(error);
  // Every rank's size and CRC to rank 0 (Note [Checkpoint checksums]): slot r is rank r's.
  at::Tensor sums = at::zeros({2 * size}, at::kLong);
  sums.data_ptr<int64_t>()[2 * rank] = sum.first;
  sums.data_ptr<int64_t>()[2 * rank + 1] = static_cast<int64_t>(sum.second);
  if (world) world->allreduce(sums, {collectives::ReduceOp::kSum, kSaveTimeout})->wait();

  if (rank == 0) {
    error = attempt([&] {
      Index index;
      std::vector<std::string> files;
      nlohmann::json checksums = nlohmann::json::object();
      for (int r = 0; r < size; ++r) {
        files.push_back(rank_file(r));
        SafetensorsFile file((tmp_dir / files.back()).string());  // the header only
        index_file(index, files.back(), file, where);
        const int64_t* got = sums.data_ptr<int64_t>() + 2 * r;
        checksums[files.back()] = {{"bytes", got[0]},
                                   {"crc32c", crc_text(static_cast<uint32_t>(got[1]))}};
      }
      check_index(index, where);
      nlohmann::json meta = ckpt.meta.is_object() ? ckpt.meta : nlohmann::json::object();
      meta["format"] = kFormat;
      meta["step"] = ckpt.step;
      meta["epoch"] = ckpt.epoch;
      meta["step_in_epoch"] = ckpt.step_in_epoch;
      meta["world"] = size;
      meta["files"] = files;
      meta["index"] = index_json(index);
      meta[kChecksums] = checksums;
      meta[kMetaCrc] = meta_crc(meta);
      write_synced(tmp_dir / kMeta, meta.dump(1) + "\n");
      fsync_dir(tmp_dir.string());

      // Replace an older checkpoint of the same step (a rerun) only once the new one is whole.
      std::error_code ec;
      if (fs::exists(final_dir)) fs::remove_all(final_dir, ec);
      fs::rename(tmp_dir, final_dir, ec);
      if (ec) throw Error("checkpoint: cannot rename " + tmp_dir.string() + " to " + final_dir.string() + ": " + ec.message());
      fsync_dir(dir_);

      // Keep the newest K; drop temporaries a killed run left behind.
      auto all = list();
      for (size_t i = 0; i + static_cast<size_t>(std::max<int64_t>(keep_, 1)) < all.size(); ++i)
        fs::remove_all(all[i], ec);
      for (const auto& e : fs::directory_iterator(dir_, ec)) {
        const std::string n = e.path().filename().string();
        if (n.size() > 4 && n[0] == '.' && n.rfind(".tmp") == n.size() - 4)
          fs::remove_all(e.path(), ec);
      }
    });
  }
  // No rank returns before the checkpoint exists (or all know that it does not).
  error = agree(world, error);
  if (!error.empty()) fail(error);
  return final_dir.string();
}

std::optional<std::string> CheckpointStore::resolve(const std::string& path) {
  std::error_code ec;
  if (fs::exists(fs::path(path) / kMeta, ec)) return path;
  auto all = step_dirs(path);
  if (all.empty()) return std::nullopt;
  return all.back();
}

Checkpoint CheckpointStore::load(const std::string& path) {
  CheckpointReader reader(path);
  Checkpoint ckpt;
  ckpt.step = reader.step();
  ckpt.epoch = reader.epoch();
  ckpt.step_in_epoch = reader.step_in_epoch();
  ckpt.meta = reader.meta();
  for (const auto& name : reader.names()) ckpt.tensors.emplace(name, reader.read(name));
  return ckpt;
}

// ---- CheckpointReader -----------------------------------------------------------------

struct CheckpointReader::Files {
  std::mutex mu;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open;  // by file name
};

CheckpointReader::CheckpointReader(const std::string& path) : open_(std::make_unique<Files>()) {
  auto dir = CheckpointStore::resolve(path);
  if (!dir)
    throw Error("checkpoint: no checkpoint at " + path + " (expected a step-* folder with " +
                kMeta + ")");
  folder_ = *dir;
  const std::string meta_path = (fs::path(folder_) / kMeta).string();
  auto damaged = [&](const std::string& why) {
    return Error("checkpoint: " + meta_path + " is damaged: " + why);
  };
  // meta.json may come from elsewhere (a checkpoint someone shared): every value is
  // checked for its type and range before use, and a bad one is damage named in the file
  // (Note [Safetensors from elsewhere] for the limits on shapes).
  nlohmann::json doc;
  {
    std::ifstream in(meta_path, std::ios::binary);
    if (!in) throw Error("checkpoint: cannot read " + meta_path);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) throw Error("checkpoint: cannot read " + meta_path);
    try {
      doc = parse_json_input(text);
    } catch (const std::exception& e) {
      throw damaged(shown(e.what()));
    }
  }
  if (!doc.is_object()) throw damaged("not a JSON object");
  if (doc.contains(kMetaCrc)) {
    const std::string want = doc[kMetaCrc].is_string() ? doc[kMetaCrc].get<std::string>() : "",
                      got = meta_crc(doc);
    if (got != want) throw damaged_file(folder_, kMeta, "CRC-32C " + got + " expected " + shown(want));
    const auto& sums = doc.value(kChecksums, nlohmann::json::object());
    if (!sums.is_object()) throw damaged("\"checksums\" is not an object");
    for (auto it = sums.begin(); it != sums.end(); ++it)
      if (!checksum_entry_ok(it.value()))
        throw damaged("\"checksums\" of " + shown(it.key()) + " is " + shown(it.value()) +
                      ", not {\"bytes\": <count>, \"crc32c\": <text>}");
    checksums_ = sums;
  }
  // An integer member of meta.json (0 when absent).
  // A count in meta.json (0 when absent): an integer, not negative.
  auto integer = [&](const char* key) {
    int64_t v = 0;
    if (doc.contains(key) && (!json_int(doc[key], &v) || v < 0))
      throw damaged("\"" + std::string(key) + "\" is " + shown(doc[key]) + ", not a count");
    return v;
  };

  // Format 1's errors are about its rank file's header; format 2's about meta.json's index.
  std::string where = "checkpoint " + folder_;
  Index index;
  try {
    const nlohmann::json format = doc.value("format", nlohmann::json());
    step_ = integer("step");
    epoch_ = integer("epoch");
    step_in_epoch_ = integer("step_in_epoch");
    int64_t format_number = 0;
    if (format.is_number_integer() && !json_int(format, &format_number))
      format_number = std::numeric_limits<int64_t>::max();  // past int64: newer than any
    if (format == kFormat1) {
      // Format 1: one process wrote every tensor whole into one file; its header is the index.
      format_ = 1;
      world_ = 1;
      files_ = {rank_file(0)};
      auto file = std::make_unique<SafetensorsFile>((fs::path(folder_) / files_[0]).string());
      index_file(index, files_[0], *file, where);
      open_->open.emplace(files_[0], std::move(file));
    } else if (format.is_number_integer() && format_number == kFormat) {
      format_ = kFormat;
      where = "checkpoint " + meta_path;
      const int64_t world = integer("world");
      if (world < 1 || world > std::numeric_limits<int>::max())
        throw damaged("\"world\" is " + shown(doc.value("world", nlohmann::json())) +
                      ", not a count of ranks");
      world_ = static_cast<int>(world);
      const auto& files = doc.at("files");
      if (!files.is_array()) throw damaged("\"files\" is not a list");
      for (const auto& f : files) {
        if (!f.is_string() || !plain_file_name(f.get<std::string>()))
          throw damaged("\"files\" names " + shown(f) + ", not a file of the folder");
        files_.push_back(f.get<std::string>());
      }
      const std::set<std::string> known(files_.begin(), files_.end());
      if (known.size() != files_.size()) throw damaged("\"files\" names a file twice");
      if (files_.size() != static_cast<size_t>(world_))
        throw damaged("\"files\" names " + std::to_string(files_.size()) + " files for a world of " +
                      std::to_string(world_) + " ranks");
      const auto& idx = doc.at("index");
      if (!idx.is_object()) throw damaged("\"index\" is not an object");
      for (auto it = idx.begin(); it != idx.end(); ++it) {
        const std::string tensor = "tensor " + shown(it.key());
        const auto& e = it.value();
        if (!e.is_object()) throw damaged(tensor + " is " + shown(e) + ", not an object");
        at::ScalarType dtype;
        if (!e.contains("dtype") || !e["dtype"].is_string() ||
            !safetensors_dtype_from_name(e["dtype"].get<std::string>(), &dtype))
          throw damaged(tensor + " has dtype " + shown(e.value("dtype", nlohmann::json())));
        std::vector<int64_t> shape;
        if (!e.contains("shape") || !json_int_list(e["shape"], &shape) || numel_of(shape, dtype) < 0)
          throw damaged(tensor + " has shape " + shown(e.value("shape", nlohmann::json())));
        const auto& parts = e.at("parts");
        if (!parts.is_array()) throw damaged(tensor + " has parts " + shown(parts) + ", not a list");
        for (const auto& p : parts) {
          Part part{"", 0, 0};
          if (!p.is_object() || !p.contains("file") || !p["file"].is_string() || !p.contains("begin") ||
              !json_int(p["begin"], &part.begin) || !p.contains("end") || !json_int(p["end"], &part.end))
            throw damaged(tensor + " has a part " + shown(p) + ", not {\"file\", \"begin\", \"end\"}");
          part.file = p["file"].get<std::string>();
          // Only files of this folder: a damaged index must not send the reader elsewhere.
          if (!known.count(part.file))
            throw damaged(tensor + " has a part in " + shown(part.file) + ", which is not one of its files");
          add_part(index, it.key(), dtype, shape, std::move(part), where);
        }
        if (!index.count(it.key())) throw damaged(tensor + " has no parts");
      }
    } else if (format.is_number_integer() && format_number > kFormat) {
      throw Error("checkpoint: " + folder_ + " has format " + shown(format) +
                  ", newer than this tetra reads (" + std::to_string(kFormat) + ")");
    } else {
      throw Error("checkpoint: " + folder_ + " is not a tetra checkpoint (format " + shown(format) +
                  ")");
    }
  } catch (const nlohmann::json::exception& e) {
    throw damaged(shown(e.what()));
  }
  check_index(index, where);
  for (auto& [name, e] : index)
    index_.emplace(name, Entry{e.dtype, e.shape, numel_of(e.shape, e.dtype), std::move(e.parts)});

  meta_ = doc;
  for (const char* key : kReserved) meta_.erase(key);
}

CheckpointReader::CheckpointReader() : open_(std::make_unique<Files>()) {}

CheckpointReader CheckpointReader::weights_of(const std::string& path) {
  const std::string prefix = "model/";
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    CheckpointReader r(path);
    for (auto it = r.index_.begin(); it != r.index_.end();)
      it = it->first.rfind(prefix, 0) == 0 ? std::next(it) : r.index_.erase(it);
    if (r.index_.empty()) throw Error("checkpoint " + r.folder() + " holds no model weights (no tensor named model/...)");
    return r;
  }
  // An export: one file of whole tensors (or a checkpoint's rank file of slices, read the
  // same way), its tensors the model's.
  CheckpointReader r;
  const fs::path file = fs::absolute(path, ec);
  r.folder_ = file.parent_path().string();
  r.format_ = 1;
  r.files_ = {file.filename().string()};
  auto st = std::make_unique<SafetensorsFile>(file.string());
  Index index;
  index_file(index, r.files_[0], *st, path);
  check_index(index, path);
  for (auto& [name, e] : index)
    r.index_.emplace(prefix + name, Entry{e.dtype, e.shape, numel_of(e.shape, e.dtype), std::move(e.parts)});
  r.stored_prefix_ = prefix;
  if (r.index_.empty()) throw Error(path + " holds no tensors");
  if (auto step = st->metadata().find("step"); step != st->metadata().end()) {
    try {
      r.step_ = std::stoll(step->second);
    } catch (const std::exception&) {
      r.step_ = 0;  // an export from elsewhere: its step is only said
    }
  }
  r.meta_ = {{"weights", path}};
  r.open_->open.emplace(r.files_[0], std::move(st));
  return r;
}

CheckpointReader::~CheckpointReader() = default;
CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;

std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, e] : index_) out.push_back(name);
  return out;
}

const CheckpointReader::Entry& CheckpointReader::find(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) throw Error("checkpoint " + folder_ + " has no tensor " + name);
  return it->second;
}

std::vector<int64_t> CheckpointReader::shape(const std::string& name) const {
  return find(name).shape;
}
at::ScalarType CheckpointReader::dtype(const std::string& name) const { return find(name).dtype; }
int64_t CheckpointReader::numel(const std::string& name) const { return find(name).numel; }

void CheckpointReader::expect_shape(const std::string& name, at::IntArrayRef shape, const std::string& what) const {
  if (!contains(name))
    throw ConfigError("checkpoint " + folder_ + " has no tensor " + name + " for " + what +
                      " (is it from another model or optimizer?)");
  const std::vector<int64_t> there = this->shape(name);
  if (!shape.equals(there))
    throw ConfigError("checkpoint " + folder_ + ": tensor " + name + " has shape " + shape_str(there) + " there and " +
                      shape_str(shape.vec()) + " in this model (a checkpoint of another model: --set "
                      "checkpoint.resume=never starts afresh, or give this job a checkpoint.dir of its own)");
}
const std::vector<Part>& CheckpointReader::parts(const std::string& name) const {
  return find(name).parts;
}

const SafetensorsFile& CheckpointReader::file(const std::string& name) const {
  std::lock_guard<std::mutex> lock(open_->mu);
  auto it = open_->open.find(name);
  if (it == open_->open.end()) {
    const std::string path = (fs::path(folder_) / name).string();
    // Verified once, on first open (Note [Checkpoint checksums]); a file the index names
    // that is absent is damage whether or not the folder has checksums.
    auto sum = checksums_.find(name);
    if (sum != checksums_.end()) {
      const std::string why = check_file(path, *sum);
      if (!why.empty()) throw damaged_file(folder_, name, why);
    } else if (std::error_code ec; !fs::exists(path, ec)) {
      throw damaged_file(folder_, name, ec ? ec.message() : "missing");
    }
    it = open_->open.emplace(name, std::make_unique<SafetensorsFile>(path)).first;
  }
  return *it->second;
}

void CheckpointReader::verify() const {
  for (const auto& f : files_) file(f);
}

torch::Tensor CheckpointReader::read_range(const std::string& name, const Entry& e, int64_t begin,
                                          int64_t count, at::IntArrayRef shape) const {
  const int64_t end = begin + count;  // the callers checked [begin, end) is within [0, numel)
  const size_t size = c10::elementSize(e.dtype);
  const std::string in_file = !stored_prefix_.empty() && name.rfind(stored_prefix_, 0) == 0
                                  ? name.substr(stored_prefix_.size()) : name;
  // First every part the range touches, checked against its file's header: a damaged index
  // can claim a tensor of 2^58 elements, but the tensor is allocated only once files
  // hold all of its bytes.
  struct Piece {
    const SafetensorsFile* file;
    int64_t lo, hi, part_begin;  // elements [lo, hi) of the tensor, in a part from part_begin
  };
  std::vector<Piece> pieces;
  // The first part that ends past `begin`; parts are sorted and disjoint.
  auto it = std::upper_bound(e.parts.begin(), e.parts.end(), begin,
                             [](int64_t b, const Part& p) { return b < p.end; });
  for (; it != e.parts.end() && it->begin < end; ++it) {
    const int64_t lo = std::max(begin, it->begin), hi = std::min(end, it->end);
    if (lo >= hi) continue;
    const SafetensorsFile& f = file(it->file);
    if (!f.contains(in_file))
      throw Error("checkpoint " + folder_ + ": " + it->file + " has no tensor " + shown(name) +
                  ", though the index puts its elements " + range_str(it->begin, it->end) +
                  " there");
    const auto& stored = f.entry(in_file);
    if (stored.dtype != e.dtype || stored.numel() != it->end - it->begin)
      throw Error("checkpoint " + folder_ + ": " + it->file + " holds tensor " + shown(name) + " as " +
                  safetensors_dtype_name(stored.dtype) + " " + shape_str(stored.shape) +
                  ", the index as " + safetensors_dtype_name(e.dtype) + " elements " +
                  range_str(it->begin, it->end));
    pieces.push_back({&f, lo, hi, it->begin});
  }
  torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(e.dtype));
  char* out = static_cast<char*>(t.data_ptr());
  for (const Piece& p : pieces)
    p.file->read(in_file, static_cast<uint64_t>(p.lo - p.part_begin) * size,
                 static_cast<uint64_t>(p.hi - p.lo) * size, out + static_cast<size_t>(p.lo - begin) * size);
  return t;
}

torch::Tensor CheckpointReader::read(const std::string& name) const {
  const Entry& e = find(name);
  return read_range(name, e, 0, e.numel, e.shape);
}

torch::Tensor CheckpointReader::read_flat(const std::string& name, int64_t begin,
                                          int64_t count) const {
  const Entry& e = find(name);
  if (begin < 0 || count < 0 || begin > e.numel || count > e.numel - begin) {
    int64_t end = 0;
    const std::string range = __builtin_add_overflow(begin, count, &end)
                                  ? std::to_string(count) + " from " + std::to_string(begin)
                                  : range_str(begin, end);
    throw Error("checkpoint " + folder_ + ": elements " + range + " of tensor " + shown(name) +
                " are outside its " + std::to_string(e.numel) + " elements");
  }
  return read_range(name, e, begin, count, {count});
}

}  // namespace tetra::core
