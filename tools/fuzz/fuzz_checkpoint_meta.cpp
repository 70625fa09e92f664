// fuzz-checkpoint-meta — libFuzzer harness for a checkpoint's meta.json, which may come
// from someone else (a checkpoint shared to resume or to export from).
//
// An input is meta.json's text. The harness keeps one step folder under /dev/shm whose
// rank files a two-thread-rank CheckpointStore::save wrote at startup (Note [Checkpoint
// format 2]): model/w F32 [3, 4] in slices [0, 5) and [5, 12) of rank-00000 and
// rank-00001, model/b F32 [4] whole in rank-00000, optim/m BF16 [6] whose rank-00000
// slice is empty, optim/step I64 [1] whole in rank-00001, empty F32 [0, 3]. The input
// becomes that folder's meta.json and goes through CheckpointReader: construction (the
// meta CRC, checksums, the index and its coverage), verify(), then for every tensor
// shape, dtype, numel, parts, expect_shape, read, read_flat of two halves and of ranges
// outside it, and CheckpointStore::load of the folder.
//
// A checksum would stop almost every mutation at the first check, so the harness keeps it
// true where the input asks: when meta.json's "meta_crc32c" is the text "0xfuzzcrc", it is
// replaced by the CRC-32C of the document as the reader computes it, and the mutations
// reach what comes after. The seeds have both forms.
//
// A tetra::Error naming the checkpoint folder is the expected answer to a bad input (a
// ConfigError from expect_shape). A finding is anything else: a crash, an ASan/UBSan
// report, a leak, a hang (-timeout), an allocation past -rss_limit_mb / -malloc_limit_mb
// (an index that claims a huge tensor the files do not hold), an exception other than
// tetra::Error escaping (a nlohmann::json or std::filesystem one), an Error that does not
// name the folder, or a reader that accepts files outside the folder ("../x", "/etc/x":
// files() and every part may only name the folder's own entries). Every finding becomes a
// test in tests/core/test_checkpoint.cpp.
//
// Seeds: TETRA_FUZZ_WRITE_SEEDS=<dir> build-asan/bin/fuzz-checkpoint-meta writes the
// folder's meta.json as the writer made it, the same with "0xfuzzcrc", without its
// checksums, and a format-1 one, to <dir> and exits; tools/fuzz/corpus-checkpoint-meta holds them.
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "collectives/error.h"
#include "collectives/local.h"
#include "core/checkpoint.h"
#include "core/crc32c.h"
#include "core/json_input.h"
#include "core/safetensors.h"
#include "hardware/env.h"

namespace fs = std::filesystem;
using namespace tetra::core;

namespace {

constexpr const char* kCrcPlaceholder = "\"0xfuzzcrc\"";

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz-checkpoint-meta: %s\n", what.c_str());
  std::abort();
}

void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) finding("cannot write " + p.string());
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The folder (see the header comment), written once per process; its meta.json as saved.
struct Folder {
  fs::path step;
  std::string meta;
};

const Folder& folder() {
  static const Folder f = [] {
    fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    const fs::path store = base / ("tetra-fuzz-checkpoint-meta-" + std::to_string(::getpid()));
    fs::remove_all(store);
    tetra::collectives::run_local_ranks(2, [&](int rank, tetra::collectives::Communicator& world) {
      Checkpoint c;
      c.step = 7;
      c.epoch = 1;
      c.step_in_epoch = 2;
      c.meta["job"] = "fuzz";
      const torch::Tensor w = torch::arange(12, torch::kFloat32).reshape({3, 4});
      const torch::Tensor m = torch::arange(6, torch::kFloat32).to(torch::kBFloat16);
      auto slice = [](const torch::Tensor& whole, int64_t begin, int64_t end) {
        Slice s;
        s.shape = whole.sizes().vec();
        s.begin = begin;
        s.data = whole.reshape({-1}).slice(0, begin, end).clone();
        return s;
      };
      c.slices["model/w"] = rank == 0 ? slice(w, 0, 5) : slice(w, 5, 12);
      c.slices["optim/m"] = rank == 0 ? slice(m, 0, 0) : slice(m, 0, 6);
      if (rank == 0) {
        c.tensors["model/b"] = torch::ones({4});
        c.tensors["empty"] = torch::zeros({0, 3});
      } else {
        c.tensors["optim/step"] = torch::tensor({int64_t{7}});
      }
      CheckpointStore(store.string(), 1).save(c, &world);
    });
    Folder out{store / "step-00000007", ""};
    out.meta = read_file(out.step / "meta.json");
    return out;
  }();
  return f;
}

// The reader's CRC of a meta.json document (Note [Checkpoint checksums]).
std::string meta_crc(nlohmann::json doc) {
  doc.erase("meta_crc32c");
  const std::string canonical = doc.dump();
  tetra::core::Crc32c crc;
  crc.process_bytes(canonical.data(), canonical.size());
  char buf[16];
  std::snprintf(buf, sizeof buf, "\"0x%08x\"", crc.checksum());
  return buf;
}

// Runs fn; returns whether it succeeded. An Error must name the folder.
template <typename Fn>
bool attempt(const std::string& who, Fn&& fn) {
  try {
    fn();
    return true;
  } catch (const tetra::Error& e) {
    if (std::string(e.what()).find(who) == std::string::npos)
      finding("an error that does not name " + who + ": " + e.what());
    return false;
  } catch (const std::exception& e) {
    finding(std::string("an exception other than tetra::Error escaped: ") + e.what());
  } catch (...) {
    finding("an exception other than tetra::Error escaped");
  }
}

void write_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  const Folder& f = folder();
  write_file(dir / "saved.json", f.meta);
  fs::remove_all(f.step.parent_path());
  nlohmann::json doc = nlohmann::json::parse(f.meta);
  doc["meta_crc32c"] = "0xfuzzcrc";
  write_file(dir / "crc-placeholder.json", doc.dump(1) + "\n");
  doc.erase("meta_crc32c");
  doc.erase("checksums");
  write_file(dir / "no-checksums.json", doc.dump(1) + "\n");
  write_file(dir / "format1.json", R"({"format": "tetra-checkpoint-1", "step": 7, "job": "old"})"
                                   "\n");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  if (const std::optional<std::string> seeds = tetra::env::get(tetra::env::kFuzzWriteSeeds)) {
    write_seeds(*seeds);
    std::exit(0);
  }
  (void)folder();
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(folder().step.parent_path(), ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string meta(reinterpret_cast<const char*>(data), size);
  const size_t at = meta.find(kCrcPlaceholder);
  if (at != std::string::npos) {
    try {
      const nlohmann::json doc = parse_json_input(meta);
      if (doc.is_object() && doc.value("meta_crc32c", nlohmann::json()) == "0xfuzzcrc")
        meta.replace(at, std::string(kCrcPlaceholder).size(), meta_crc(doc));
    } catch (const std::exception&) {
    }
  }
  const Folder& f = folder();
  const std::string where = f.step.string();
  write_file(f.step / "meta.json", meta);

  attempt(where, [&] {
    CheckpointReader reader(where);
    for (const auto& file : reader.files())
      if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos ||
          file.find('\0') != std::string::npos)
        finding("the reader accepted a file outside its folder: " + file);
    attempt(where, [&] { reader.verify(); });
    for (const auto& name : reader.names()) {
      const std::vector<int64_t> shape = reader.shape(name);
      (void)reader.dtype(name);
      (void)reader.parts(name);
      const int64_t n = reader.numel(name);
      try {
        reader.expect_shape(name, {4}, "a fuzzed tensor");
      } catch (const tetra::ConfigError& e) {
        if (std::string(e.what()).find(where) == std::string::npos) finding(std::string("expect_shape: ") + e.what());
      }
      if (attempt(where, [&] { (void)reader.read(name); }) && n > 0) {
        const torch::Tensor half = reader.read_flat(name, n / 2, n - n / 2);
        if (half.numel() != n - n / 2) finding("read_flat of tensor " + name + " returned the wrong count");
      }
      for (const auto& range : {std::pair<int64_t, int64_t>{-1, 1}, {n, 1}, {0, n + 1},
                                {INT64_MAX, INT64_MAX}, {1, INT64_MAX}})
        if (attempt(where, [&] { (void)reader.read_flat(name, range.first, range.second); }))
          finding("read_flat of elements outside tensor " + name + " succeeded");
    }
  });
  attempt(where, [&] { (void)CheckpointStore::load(where); });
  return 0;
}
