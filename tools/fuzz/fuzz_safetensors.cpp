// fuzz-safetensors — libFuzzer harness for the safetensors readers, whose file may come
// from someone else (an exported model, a rank file of a shared checkpoint).
//
// An input is a whole file. It goes through every reader tetra has for one:
//   - parse_safetensors, the bytes in memory (load_safetensors, the pipeline's stage state);
//   - SafetensorsFile on the same bytes written under /dev/shm (header parsed once, then
//     pread of ranges): every entry read whole with tensor(), by a range in its middle, and
//     by ranges past its end, which must be refused;
//   - CheckpointReader on a format-1 checkpoint folder whose rank-00000.safetensors it is
//     (meta.json {"format": "tetra-checkpoint-1"}): the index built from the header and its
//     "tetra.slices" metadata, every tensor read whole and read_flat in two halves.
// The two safetensors readers must agree: both refuse the input, or both accept it with the
// same entries and the same bytes.
//
// A tetra::Error naming the file (the checkpoint folder for CheckpointReader) is the expected
// answer to a bad input (Note [Safetensors from elsewhere] in core/safetensors.cpp). A
// finding is anything else: a crash, an ASan/UBSan report, a leak, a hang (-timeout), an
// allocation past -rss_limit_mb / -malloc_limit_mb (a header that sizes a tensor past the
// file), an exception other than tetra::Error escaping, an Error that does not name the
// file, or the readers disagreeing. Every finding becomes a test in
// tests/core/test_checkpoint.cpp (the Safetensors* suites).
//
// Seeds: TETRA_FUZZ_WRITE_SEEDS=<dir> build-asan/bin/fuzz-safetensors writes files made by
// safetensors_bytes (every dtype, metadata, empty and scalar tensors) and the rank files of
// a two-rank checkpoint that CheckpointStore::save wrote (slices and their metadata) to
// <dir> and exits; tools/fuzz/corpus-safetensors holds what it wrote.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "collectives/error.h"
#include "collectives/local.h"
#include "core/checkpoint.h"
#include "core/safetensors.h"
#include "hardware/env.h"

namespace fs = std::filesystem;
using namespace tetra::core;

namespace {

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz-safetensors: %s\n", what.c_str());
  std::abort();
}

// A folder on tmpfs (or $TMPDIR) for this process: step-00000001/ holds the input as
// rank-00000.safetensors beside a format-1 meta.json.
const fs::path& work_dir() {
  static const fs::path dir = [] {
    fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    fs::path d = base / ("tetra-fuzz-safetensors-" + std::to_string(::getpid()));
    fs::remove_all(d);
    fs::create_directories(d / "step-00000001");
    std::ofstream(d / "step-00000001" / "meta.json") << R"({"format": "tetra-checkpoint-1", "step": 1})";
    return d;
  }();
  return dir;
}

void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) finding("cannot write " + p.string());
}

// Runs fn; returns "" when it succeeded, else the Error's message, which must name `who`.
template <typename Fn>
std::string attempt(const std::string& who, Fn&& fn) {
  try {
    fn();
    return "";
  } catch (const tetra::Error& e) {
    const std::string what = e.what();
    if (what.find(who) == std::string::npos) finding("an error that does not name " + who + ": " + what);
    return what.empty() ? "?" : what;
  } catch (const std::exception& e) {
    finding(std::string("an exception other than tetra::Error escaped: ") + e.what());
  } catch (...) {
    finding("an exception other than tetra::Error escaped");
  }
}

std::string bytes_of(const torch::Tensor& t) {
  return std::string(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
}

// The seeds (see the header comment).
void write_seeds(const fs::path& dir) {
  fs::create_directories(dir);
  TensorMap every;
  every["f64"] = torch::arange(3, torch::kFloat64);
  every["f32"] = torch::arange(6, torch::kFloat32).reshape({2, 3});
  every["f16"] = torch::ones({2}, torch::kFloat16);
  every["bf16"] = torch::ones({2, 1}, torch::kBFloat16);
  every["i64"] = torch::arange(2, torch::kInt64);
  every["i32"] = torch::arange(2, torch::kInt32);
  every["i16"] = torch::arange(2, torch::kInt16);
  every["i8"] = torch::arange(3, torch::kInt8);
  every["u8"] = torch::arange(4, torch::kUInt8);
  every["bool"] = torch::tensor({true, false});
  write_file(dir / "every-dtype.safetensors", safetensors_bytes(every, {{"format", "pt"}}));
  TensorMap odd;
  odd["scalar"] = torch::tensor(1.5f);
  odd["empty"] = torch::zeros({0, 3});
  odd["w"] = torch::ones({2, 2});
  write_file(dir / "scalar-empty.safetensors", safetensors_bytes(odd));
  write_file(dir / "no-tensors.safetensors", safetensors_bytes({}, {{"k", "v"}}));

  // A two-rank checkpoint as CheckpointStore writes it: its rank files carry slices.
  const fs::path store = dir / "store.tmp";
  fs::remove_all(store);
  tetra::collectives::run_local_ranks(2, [&](int rank, tetra::collectives::Communicator& world) {
    Checkpoint c;
    c.step = 3;
    const torch::Tensor w = torch::arange(12, torch::kFloat32).reshape({3, 4});
    Slice s;
    s.shape = {3, 4};
    s.begin = rank == 0 ? 0 : 5;
    s.data = w.reshape({-1}).slice(0, s.begin, rank == 0 ? 5 : 12).clone();
    c.slices["model/w"] = s;
    if (rank == 0) c.tensors["model/b"] = torch::ones({4});
    if (rank == 1) c.tensors["optim/step"] = torch::tensor({int64_t{3}});
    CheckpointStore(store.string(), 1).save(c, &world);
  });
  for (int r = 0; r < 2; ++r) {
    const std::string name = "rank-0000" + std::to_string(r) + ".safetensors";
    fs::copy_file(store / "step-00000003" / name, dir / ("checkpoint-" + name),
                  fs::copy_options::overwrite_existing);
  }
  fs::remove_all(store);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  if (const std::optional<std::string> seeds = tetra::env::get(tetra::env::kFuzzWriteSeeds)) {
    write_seeds(*seeds);
    std::exit(0);
  }
  (void)work_dir();
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(work_dir(), ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const fs::path folder = work_dir() / "step-00000001";
  const std::string path = (folder / "rank-00000.safetensors").string();
  write_file(path, input);

  // In memory.
  TensorMap parsed;
  std::map<std::string, std::string> parsed_meta;
  const std::string parse_error =
      attempt(path, [&] { parsed = parse_safetensors(input, path, &parsed_meta); });

  // From the file, by ranges.
  std::string file_error = attempt(path, [&] {
    SafetensorsFile file(path);
    if (!parse_error.empty()) finding("SafetensorsFile accepts what parse_safetensors refuses: " + parse_error);
    if (file.entries().size() != parsed.size() || file.metadata() != parsed_meta)
      finding("SafetensorsFile and parse_safetensors read different entries or metadata");
    for (const auto& [entry_name, e] : file.entries()) {
      const std::string& name = entry_name;  // a lambda cannot capture a structured binding
      auto in_memory = parsed.find(name);
      if (in_memory == parsed.end()) finding("parse_safetensors lacks tensor " + name);
      const torch::Tensor whole = file.tensor(name);
      if (whole.sizes() != in_memory->second.sizes() || whole.scalar_type() != in_memory->second.scalar_type() ||
          bytes_of(whole) != bytes_of(in_memory->second))
        finding("the two readers disagree on tensor " + name);
      const uint64_t n = e.end - e.begin;
      if (n >= 2) {
        std::string middle(n - 1, '\0');
        file.read(name, 1, n - 1, middle.data());
        if (middle != bytes_of(whole).substr(1)) finding("a range read of " + name + " differs");
      }
      char byte = 0;
      for (const auto& range : {std::pair<uint64_t, uint64_t>{n, 1}, {0, n + 1}, {~uint64_t{0}, 2},
                                {1, ~uint64_t{0}}})
        if (attempt(path, [&] { file.read(name, range.first, range.second, &byte); }).empty())
          finding("a read past tensor " + name + "'s " + std::to_string(n) + " bytes succeeded");
    }
  });
  if (file_error.empty() != parse_error.empty())
    finding("parse_safetensors and SafetensorsFile disagree: \"" + parse_error + "\" vs \"" + file_error + "\"");

  // As a format-1 checkpoint's only file: the index from its header and slice metadata.
  attempt(folder.string(), [&] {
    CheckpointReader reader(folder.string());
    for (const auto& name : reader.names()) {
      const int64_t n = reader.numel(name);
      attempt(folder.string(), [&] { (void)reader.read(name); });
      attempt(folder.string(), [&] {
        (void)reader.read_flat(name, 0, n / 2);
        (void)reader.read_flat(name, n / 2, n - n / 2);
      });
    }
  });
  return 0;
}
