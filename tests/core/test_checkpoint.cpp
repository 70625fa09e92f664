// Safetensors round trip, the atomic, keep-K checkpoint store, and sharded checkpoints:
// thread-ranks writing slices, any range read back by a reader of any layout. Checksums:
// each kind of damage detected and named, the fallback to the newest intact checkpoint, and
// saves onto a full or read-only filesystem (a tmpfs the test mounts) failing cleanly.
#include <gtest/gtest.h>
#include <sys/mount.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "collectives/error.h"
#include "collectives/local.h"
#include "core/checkpoint.h"
#include "core/crc32c.h"
#include "core/job_spec.h"
#include "core/runtime.h"
#include "core/safetensors.h"
#include "core/trainer.h"
#include "tests/common/job.h"

using namespace tetra::core;
namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::path(testing::TempDir()) / ("tetra_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST(Safetensors, RoundTripsEveryDtype) {
  TensorMap in;
  in["f32"] = torch::randn({3, 4});
  in["f64"] = torch::randn({2}, torch::kFloat64);
  in["bf16"] = torch::randn({5}).to(torch::kBFloat16);
  in["f16"] = torch::randn({2, 2}).to(torch::kFloat16);
  in["i64"] = torch::arange(7, torch::kInt64);
  in["i32"] = torch::arange(3, torch::kInt32);
  in["u8"] = torch::arange(9, torch::kUInt8).reshape({3, 3});
  in["bool"] = torch::tensor({true, false});
  in["scalar"] = torch::tensor(2.5f);
  in["empty"] = torch::zeros({0, 3});
  in["strided"] = torch::randn({4, 4}).t();  // non-contiguous input is written contiguous
  fs::path f = fresh_dir("st") / "w.safetensors";
  std::map<std::string, std::string> meta_in = {{"format", "pt"}}, meta_out;
  save_safetensors(f.string(), in, meta_in);
  TensorMap out = load_safetensors(f.string(), &meta_out);
  ASSERT_EQ(out.size(), in.size());
  for (const auto& [k, v] : in) {
    ASSERT_TRUE(out.count(k)) << k;
    EXPECT_EQ(out[k].scalar_type(), v.scalar_type()) << k;
    EXPECT_EQ(out[k].sizes(), v.sizes()) << k;
    EXPECT_TRUE(torch::equal(out[k], v)) << k;
  }
  EXPECT_EQ(meta_out, meta_in);
}

TEST(Safetensors, LayoutIsTheHuggingFaceFormat) {
  TensorMap in;
  in["w"] = torch::tensor({1.0f, 2.0f});
  std::string bytes = safetensors_bytes(in);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
  ASSERT_EQ((8 + n) % 8, 0u);  // data 8-byte aligned
  std::string header = bytes.substr(8, n);
  EXPECT_NE(header.find("\"w\":{\"data_offsets\":[0,8],\"dtype\":\"F32\",\"shape\":[2]}"), std::string::npos)
      << header;
  ASSERT_EQ(bytes.size(), 8 + n + 8);
  float v[2];
  std::memcpy(v, bytes.data() + 8 + n, 8);  // raw little-endian floats
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], 2.0f);
}

TEST(Safetensors, DamagedFilesAreClearErrors) {
  fs::path d = fresh_dir("st_bad");
  auto expect_error = [&](const std::string& bytes, const std::string& needle) {
    fs::path f = d / "bad.safetensors";
    std::ofstream(f, std::ios::binary) << bytes;
    try {
      load_safetensors(f.string());
      FAIL() << "no error for " << needle;
    } catch (const tetra::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(f.string()), std::string::npos) << e.what();
    }
  };
  expect_error("abc", "shorter than");
  expect_error(std::string("\xff\x00\x00\x00\x00\x00\x00\x00", 8) + "{}", "exceeds the file");
  expect_error(std::string("\x02\x00\x00\x00\x00\x00\x00\x00", 8) + "{x", "not JSON");
  TensorMap t;
  t["w"] = torch::ones({4});
  std::string good = safetensors_bytes(t);
  expect_error(good.substr(0, good.size() - 4), "do not fit");
  EXPECT_THROW(load_safetensors((d / "missing").string()), tetra::Error);
}

TEST(CheckpointStore, SavesAtomicallyKeepsNewestK) {
  fs::path d = fresh_dir("ckpt");
  CheckpointStore store(d.string(), 2);
  for (int64_t step : {10, 20, 30}) {
    Checkpoint c;
    c.step = step;
    c.epoch = 1;
    c.step_in_epoch = step % 7;
    c.tensors["model/w"] = torch::full({3}, static_cast<float>(step));
    c.meta["job"] = "t";
    store.save(c);
  }
  auto all = store.list();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(fs::path(all[0]).filename(), "step-00000020");
  EXPECT_EQ(fs::path(all[1]).filename(), "step-00000030");
  Checkpoint back = CheckpointStore::load(d.string());  // the folder resolves to the newest
  EXPECT_EQ(back.step, 30);
  EXPECT_EQ(back.step_in_epoch, 2);
  EXPECT_EQ(back.meta["job"], "t");
  EXPECT_TRUE(torch::equal(back.tensors["model/w"], torch::full({3}, 30.0f)));
}

TEST(CheckpointStore, AHalfWrittenCheckpointNeverCounts) {
  fs::path d = fresh_dir("ckpt_half");
  CheckpointStore store(d.string(), 3);
  Checkpoint c;
  c.step = 5;
  c.tensors["model/w"] = torch::ones({2});
  store.save(c);
  // What a kill mid-save leaves: a temporary folder, and a step folder without meta.json.
  fs::create_directories(d / ".step-00000006.tmp");
  std::ofstream(d / ".step-00000006.tmp" / "rank-00000.safetensors") << "partial";
  fs::create_directories(d / "step-00000007");
  ASSERT_EQ(store.latest().value(), (d / "step-00000005").string());
  EXPECT_EQ(CheckpointStore::load(d.string()).step, 5);
  c.step = 8;
  store.save(c);  // cleans the stale temporary
  EXPECT_FALSE(fs::exists(d / ".step-00000006.tmp"));
  EXPECT_EQ(store.latest().value(), (d / "step-00000008").string());
}

TEST(CheckpointStore, MissingOrDamagedIsAClearError) {
  fs::path d = fresh_dir("ckpt_bad");
  try {
    CheckpointStore::load((d / "nothing").string());
    FAIL();
  } catch (const tetra::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no checkpoint at"), std::string::npos) << e.what();
  }
  fs::create_directories(d / "step-00000001");
  std::ofstream(d / "step-00000001" / "meta.json") << "{ not json";
  EXPECT_THROW(CheckpointStore::load(d.string()), tetra::Error);
}

TEST(AtomicWrite, ReplacesWholeFileOnly) {
  fs::path f = fresh_dir("atomic") / "sub" / "x.txt";
  write_file_atomic(f.string(), "first");
  write_file_atomic(f.string(), "second");
  EXPECT_EQ(read_all(f), "second");
  int files = 0;
  for (auto& e : fs::directory_iterator(f.parent_path())) (void)e, ++files;
  EXPECT_EQ(files, 1);  // no temporaries left behind
}

// ---- SafetensorsFile ------------------------------------------------------------------

TEST(SafetensorsFile, ReadsAnyByteRangeOfATensor) {
  TensorMap in;
  in["a"] = torch::arange(10, torch::kFloat32);
  in["b"] = torch::arange(6, torch::kInt64).reshape({2, 3});
  fs::path f = fresh_dir("stfile") / "x.safetensors";
  save_safetensors(f.string(), in, {{"k", "v"}});
  SafetensorsFile file(f.string());
  EXPECT_EQ(file.entries().size(), 2u);
  EXPECT_EQ(file.metadata().at("k"), "v");
  EXPECT_EQ(file.entry("b").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(file.entry("b").dtype, torch::kInt64);
  float got[3];
  file.read("a", 4 * sizeof(float), sizeof(got), got);
  EXPECT_EQ(got[0], 4.0f);
  EXPECT_EQ(got[2], 6.0f);
  EXPECT_TRUE(torch::equal(file.tensor("b"), in["b"]));
  EXPECT_THROW(file.read("a", 8 * sizeof(float), 3 * sizeof(float), got), tetra::Error);  // past its end
  try {
    file.entry("c");
    FAIL();
  } catch (const tetra::Error& e) {
    EXPECT_NE(std::string(e.what()).find(f.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("no tensor c"), std::string::npos) << e.what();
  }
  EXPECT_THROW(SafetensorsFile((f.parent_path() / "missing").string()), tetra::Error);
}

// ---- sharded checkpoints --------------------------------------------------------------

namespace {

// The tensors of one "model": a [5, 7] weight, a bf16 vector, an int64 counter, a scalar.
TensorMap reference_tensors(float offset) {
  TensorMap t;
  t["model/w"] = torch::arange(35, torch::kFloat32).reshape({5, 7}) + offset;
  t["optim/w.exp_avg"] = (torch::arange(10, torch::kFloat32) * 0.5 + offset).to(torch::kBFloat16);
  t["optim/step"] = torch::tensor({static_cast<int64_t>(offset) + 3});
  t["model/scale"] = torch::tensor(2.5f + offset);
  return t;
}

Slice slice_of(const torch::Tensor& whole, int64_t begin, int64_t count) {
  Slice s;
  s.shape = whole.sizes().vec();
  s.begin = begin;
  s.data = whole.reshape({-1}).slice(0, begin, begin + count).clone();
  return s;
}

// What rank `rank` of 3 holds: model/w split 12/12/11, optim/w.exp_avg split 0/4/6 (rank
// 0 owns none of it), optim/step and model/scale whole on rank 0.
Checkpoint rank_part(int rank, int64_t step, const TensorMap& ref) {
  Checkpoint c;
  c.step = step;
  c.epoch = 2;
  c.step_in_epoch = 4;
  c.meta["job"] = "sharded";
  const int64_t w_begin[] = {0, 12, 24}, w_count[] = {12, 12, 11};
  const int64_t m_begin[] = {0, 0, 4}, m_count[] = {0, 4, 6};
  c.slices["model/w"] = slice_of(ref.at("model/w"), w_begin[rank], w_count[rank]);
  if (m_count[rank] > 0)
    c.slices["optim/w.exp_avg"] = slice_of(ref.at("optim/w.exp_avg"), m_begin[rank], m_count[rank]);
  if (rank == 0) {
    c.tensors["optim/step"] = ref.at("optim/step");
    c.tensors["model/scale"] = ref.at("model/scale");
  }
  return c;
}

void save_sharded(const fs::path& dir, int64_t step, const TensorMap& ref, int64_t keep = 3) {
  tetra::collectives::run_local_ranks(3, [&](int rank, tetra::collectives::Communicator& world) {
    CheckpointStore store(dir.string(), keep);
    std::string folder = store.save(rank_part(rank, step, ref), &world);
    // Every rank returns the folder, and only once it exists.
    EXPECT_EQ(folder, (dir / ("step-0000000" + std::to_string(step))).string());
    EXPECT_TRUE(fs::exists(fs::path(folder) / "meta.json"));
  });
}

// Saves on three thread-ranks, rank r writing part_of(r); returns each rank's error ("" for
// a rank whose save returned).
std::vector<std::string> save_on_three(const fs::path& dir, const std::function<Checkpoint(int)>& part_of) {
  std::vector<std::string> errors(3);
  try {
    tetra::collectives::run_local_ranks(3, [&](int rank, tetra::collectives::Communicator& world) {
      try {
        CheckpointStore(dir.string(), 3).save(part_of(rank), &world);
      } catch (const tetra::Error& e) {
        errors[rank] = e.what();
        throw;
      }
    });
  } catch (const tetra::Error&) {
  }
  return errors;
}

// Every rank threw the same error, carrying `needle`.
void expect_same_error(const std::vector<std::string>& errors, const std::string& needle) {
  for (const auto& e : errors) {
    EXPECT_NE(e.find(needle), std::string::npos) << "error: \"" << e << "\"";
    EXPECT_EQ(e, errors[0]);
  }
}

std::vector<std::string> entries_of(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(ShardedCheckpoint, ThreeRanksWriteSlicesAReaderAssemblesAnyRange) {
  fs::path d = fresh_dir("sharded");
  const TensorMap ref = reference_tensors(0);
  save_sharded(d, 7, ref);

  const fs::path step = d / "step-00000007";
  EXPECT_EQ(entries_of(step), (std::vector<std::string>{"meta.json", "rank-00000.safetensors",
                                                        "rank-00001.safetensors", "rank-00002.safetensors"}));
  EXPECT_EQ(entries_of(d), (std::vector<std::string>{"step-00000007"}));  // no temporary left

  // The index, as meta.json spells it.
  nlohmann::json meta = nlohmann::json::parse(read_all(step / "meta.json"));
  EXPECT_EQ(meta["format"], 2);
  EXPECT_EQ(meta["world"], 3);
  EXPECT_EQ(meta["step"], 7);
  EXPECT_EQ(meta["job"], "sharded");
  EXPECT_EQ(meta["index"]["model/w"]["dtype"], "F32");
  EXPECT_EQ(meta["index"]["model/w"]["shape"], nlohmann::json({5, 7}));
  EXPECT_EQ(meta["index"]["model/w"]["parts"],
            nlohmann::json::parse(R"([{"file":"rank-00000.safetensors","begin":0,"end":12},
                                      {"file":"rank-00001.safetensors","begin":12,"end":24},
                                      {"file":"rank-00002.safetensors","begin":24,"end":35}])"));
  EXPECT_EQ(meta["index"]["optim/w.exp_avg"]["dtype"], "BF16");
  EXPECT_EQ(meta["index"]["optim/w.exp_avg"]["parts"].size(), 2u);
  EXPECT_EQ(meta["index"]["optim/step"]["parts"],
            nlohmann::json::parse(R"([{"file":"rank-00000.safetensors","begin":0,"end":1}])"));

  // Each rank file is a plain safetensors file: the slice as 1-D data, its place in metadata.
  std::map<std::string, std::string> md;
  TensorMap r1 = load_safetensors((step / "rank-00001.safetensors").string(), &md);
  EXPECT_EQ(r1.at("model/w").sizes(), (std::vector<int64_t>{12}));
  auto slices = nlohmann::json::parse(md.at("tetra.slices"));
  EXPECT_EQ(slices["model/w"]["begin"], 12);
  EXPECT_EQ(slices["model/w"]["shape"], nlohmann::json({5, 7}));

  CheckpointReader r(d.string());  // the store's folder resolves to its newest
  EXPECT_EQ(r.folder(), step.string());
  EXPECT_EQ(r.step(), 7);
  EXPECT_EQ(r.epoch(), 2);
  EXPECT_EQ(r.step_in_epoch(), 4);
  EXPECT_EQ(r.world(), 3);
  EXPECT_EQ(r.meta(), nlohmann::json({{"job", "sharded"}}));
  EXPECT_EQ(r.names(), (std::vector<std::string>{"model/scale", "model/w", "optim/step", "optim/w.exp_avg"}));
  EXPECT_TRUE(r.contains("model/w"));
  EXPECT_FALSE(r.contains("model/v"));
  EXPECT_EQ(r.shape("model/w"), (std::vector<int64_t>{5, 7}));
  EXPECT_EQ(r.dtype("optim/w.exp_avg"), torch::kBFloat16);
  ASSERT_EQ(r.parts("model/w").size(), 3u);
  EXPECT_EQ(r.parts("model/w")[2].file, "rank-00002.safetensors");
  EXPECT_EQ(r.parts("model/w")[2].begin, 24);
  EXPECT_EQ(r.parts("model/w")[2].end, 35);

  for (const auto& [name, t] : ref) {
    torch::Tensor back = r.read(name);
    EXPECT_EQ(back.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(back.sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(back, t)) << name;
  }
  // Ranges inside one file, across two, across all three, at the ends, empty.
  const torch::Tensor flat = ref.at("model/w").reshape({-1});
  for (auto [b, n] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 35}, {0, 12}, {10, 5}, {11, 14}, {12, 12}, {23, 2}, {34, 1}, {3, 0}, {35, 0}, {5, 27}}) {
    torch::Tensor got = r.read_flat("model/w", b, n);
    EXPECT_EQ(got.dim(), 1);
    EXPECT_TRUE(torch::equal(got, flat.slice(0, b, b + n))) << "[" << b << ", " << b + n << ")";
  }
  const torch::Tensor m = ref.at("optim/w.exp_avg");
  EXPECT_TRUE(torch::equal(r.read_flat("optim/w.exp_avg", 2, 5), m.slice(0, 2, 7)));

  // Clear errors: a name it lacks, a range past the end.
  try {
    r.read("model/v");
    FAIL();
  } catch (const tetra::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model/v"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(step.string()), std::string::npos) << e.what();
  }
  EXPECT_THROW(r.read_flat("model/w", 30, 6), tetra::Error);
  EXPECT_THROW(r.read_flat("model/w", -1, 2), tetra::Error);
  CheckpointReader moved = std::move(r);  // keeps the files it opened
  EXPECT_TRUE(torch::equal(moved.read("model/w"), ref.at("model/w")));

  // load() gives every tensor whole, as before.
  Checkpoint all = CheckpointStore::load(step.string());
  EXPECT_EQ(all.step, 7);
  EXPECT_EQ(all.meta["job"], "sharded");
  ASSERT_EQ(all.tensors.size(), ref.size());
  for (const auto& [name, t] : ref) EXPECT_TRUE(torch::equal(all.tensors.at(name), t)) << name;

  // Another layout reads its own shards back: 2 thread-ranks, each its own reader, each
  // half of model/w's elements.
  tetra::collectives::run_local_ranks(2, [&](int rank, tetra::collectives::Communicator&) {
    CheckpointReader mine(step.string());
    const int64_t b = rank == 0 ? 0 : 18, n = rank == 0 ? 18 : 17;
    for (int i = 0; i < 20; ++i)
      EXPECT_TRUE(torch::equal(mine.read_flat("model/w", b, n), flat.slice(0, b, b + n))) << rank;
  });
}

TEST(ShardedCheckpoint, ASingleProcessWritesTheSameFormat) {
  fs::path d = fresh_dir("sharded_single");
  const TensorMap ref = reference_tensors(1);
  Checkpoint c;
  c.step = 3;
  c.tensors["model/scale"] = ref.at("model/scale");
  c.slices["model/w"] = slice_of(ref.at("model/w"), 0, 35);  // one slice covering it all
  CheckpointStore(d.string(), 2).save(c);
  CheckpointReader r(d.string());
  EXPECT_EQ(r.world(), 1);
  EXPECT_EQ(r.files(), (std::vector<std::string>{"rank-00000.safetensors"}));
  EXPECT_TRUE(torch::equal(r.read("model/w"), ref.at("model/w")));
  EXPECT_TRUE(torch::equal(r.read("model/scale"), ref.at("model/scale")));
}

TEST(ShardedCheckpoint, AGapOrOverlapIsAnErrorAndPublishesNothing) {
  fs::path d = fresh_dir("sharded_bad");
  const TensorMap ref = reference_tensors(0);
  save_sharded(d, 5, ref);
  const torch::Tensor w = ref.at("model/w");

  // Each case: what ranks 0, 1, 2 hold of model/w ({begin, count}), and a word the error must carry.
  struct Case {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{{0, 12}, {13, 12}, {25, 10}}, "[12, 13) of its 35 are in no file"},  // a gap
      {{{0, 12}, {12, 12}, {24, 10}}, "[34, 35) of its 35 are in no file"},  // short at the end
      {{{0, 13}, {12, 12}, {24, 11}}, "[12, 13) are in both rank-00000.safetensors and rank-00001.safetensors"},
  };
  for (const auto& c : cases) {
    auto errors = save_on_three(d, [&](int rank) {
      Checkpoint part = rank_part(rank, 6, ref);
      part.slices["model/w"] = slice_of(w, c.ranges[rank].first, c.ranges[rank].second);
      return part;
    });
    expect_same_error(errors, "tensor model/w: elements " + c.needle);
    EXPECT_EQ(entries_of(d), (std::vector<std::string>{"step-00000005"})) << c.needle;
  }

  // Shapes that disagree between ranks, and a slice outside its tensor.
  auto errors = save_on_three(d, [&](int rank) {
    Checkpoint part = rank_part(rank, 6, ref);
    if (rank == 2) part.slices["model/w"].shape = {35};
    return part;
  });
  expect_same_error(errors, "tensor model/w has shape [5, 7] in rank-00000.safetensors but [35] in rank-00002");
  try {
    Checkpoint c;
    c.slices["model/w"] = slice_of(w, 30, 5);
    c.slices["model/w"].begin = 31;
    CheckpointStore(d.string(), 3).save(c);
    FAIL();
  } catch (const tetra::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model/w"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[31, 36)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(entries_of(d), (std::vector<std::string>{"step-00000005"}));
  EXPECT_TRUE(torch::equal(CheckpointReader(d.string()).read("model/w"), w));
}

TEST(ShardedCheckpoint, FormatOneCheckpointsStillLoad) {
  // A checkpoint as the single-file format wrote it: whole tensors in rank-00000, no index.
  fs::path d = fresh_dir("format1");
  const fs::path step = d / "step-00000012";
  fs::create_directories(step);
  const TensorMap ref = reference_tensors(2);
  save_safetensors((step / "rank-00000.safetensors").string(), ref);
  nlohmann::json meta = {{"format", "tetra-checkpoint-1"}, {"step", 12}, {"epoch", 1}, {"step_in_epoch", 5},
                         {"files", {"rank-00000.safetensors"}}, {"job", "old"}, {"batch_size", 64}};
  std::ofstream(step / "meta.json") << meta.dump(2);

  CheckpointReader r(d.string());
  EXPECT_EQ(r.format(), 1);
  EXPECT_EQ(r.world(), 1);
  EXPECT_EQ(r.step(), 12);
  EXPECT_EQ(r.epoch(), 1);
  EXPECT_EQ(r.step_in_epoch(), 5);
  EXPECT_EQ(r.meta(), nlohmann::json({{"job", "old"}, {"batch_size", 64}}));
  EXPECT_EQ(r.names().size(), ref.size());
  for (const auto& [name, t] : ref) {
    EXPECT_TRUE(torch::equal(r.read(name), t)) << name;
    ASSERT_EQ(r.parts(name).size(), 1u);
    EXPECT_EQ(r.parts(name)[0].end, t.numel());
  }
  EXPECT_TRUE(torch::equal(r.read_flat("model/w", 6, 9), ref.at("model/w").reshape({-1}).slice(0, 6, 15)));
  Checkpoint c = CheckpointStore::load(d.string());
  EXPECT_EQ(c.step, 12);
  EXPECT_EQ(c.meta["batch_size"], 64);
  for (const auto& [name, t] : ref) EXPECT_TRUE(torch::equal(c.tensors.at(name), t)) << name;
}

TEST(ShardedCheckpoint, AnInterruptedSaveLeavesTheLastGoodCheckpointNewestAndWhole) {
  fs::path d = fresh_dir("sharded_interrupted");
  const TensorMap good = reference_tensors(0), next = reference_tensors(10);
  save_sharded(d, 4, good);

  // Rank 2 fails while writing its file (a dtype safetensors cannot hold), after ranks 0
  // and 1 wrote theirs: every rank throws, nothing is published, the temporary is gone.
  auto errors = save_on_three(d, [&](int rank) {
    Checkpoint part = rank_part(rank, 8, next);
    if (rank == 2) part.tensors["optim/odd"] = torch::zeros({2}, torch::kComplexFloat);
    return part;
  });
  expect_same_error(errors, "rank 2 could not write");
  expect_same_error(errors, "rank-00002.safetensors");
  EXPECT_EQ(entries_of(d), (std::vector<std::string>{"step-00000004"}));

  // What a kill leaves: a temporary with some rank files, and one complete but for the
  // rename (meta.json written). Neither counts; the reader resumes the last good one.
  fs::create_directories(d / ".step-00000008.tmp");
  fs::copy_file(d / "step-00000004" / "rank-00000.safetensors", d / ".step-00000008.tmp" / "rank-00000.safetensors");
  fs::copy(d / "step-00000004", d / ".step-00000009.tmp");
  CheckpointStore store(d.string(), 3);
  EXPECT_EQ(store.latest().value(), (d / "step-00000004").string());
  EXPECT_EQ(store.list().size(), 1u);
  CheckpointReader r(d.string());
  EXPECT_EQ(r.step(), 4);
  for (const auto& [name, t] : good) EXPECT_TRUE(torch::equal(r.read(name), t)) << name;

  // The next save (of the interrupted step, say) cleans the temporaries up.
  save_sharded(d, 8, next);
  EXPECT_EQ(entries_of(d), (std::vector<std::string>{"step-00000004", "step-00000008"}));
  CheckpointReader r8(d.string());
  EXPECT_EQ(r8.step(), 8);
  for (const auto& [name, t] : next) EXPECT_TRUE(torch::equal(r8.read(name), t)) << name;
  // The older one is untouched by the newer save.
  for (const auto& [name, t] : good) EXPECT_TRUE(torch::equal(r.read(name), t)) << name;
}

TEST(ShardedCheckpoint, RanksSavingDifferentStepsIsAnError) {
  fs::path d = fresh_dir("sharded_steps");
  const TensorMap ref = reference_tensors(0);
  auto errors = save_on_three(d, [&](int rank) { return rank_part(rank, rank == 1 ? 9 : 8, ref); });
  expect_same_error(errors, "save different steps (from 8 to 9)");
  EXPECT_TRUE(entries_of(d).empty());
}

TEST(ShardedCheckpoint, ADamagedIndexOrRankFileIsAClearError) {
  fs::path d = fresh_dir("sharded_damaged");
  const TensorMap ref = reference_tensors(0);
  save_sharded(d, 4, ref);
  const fs::path step = d / "step-00000004";
  auto expect_error = [&](const std::function<void()>& fn, const std::string& needle) {
    try {
      fn();
      FAIL() << "no error for " << needle;
    } catch (const tetra::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // A rank file cut short: the reader opens it when a range in it is read, and names it.
  const fs::path f1 = step / "rank-00001.safetensors";
  std::string bytes = read_all(f1);
  std::ofstream(f1, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 8);
  CheckpointReader r(step.string());
  EXPECT_TRUE(torch::equal(r.read_flat("model/w", 0, 12), ref.at("model/w").reshape({-1}).slice(0, 0, 12)));
  expect_error([&] { r.read("model/w"); }, "checkpoint " + step.string() + " is damaged (rank-00001.safetensors: ");
  // An index whose parts leave a gap (without its checksum, which would catch any edit
  // first: this is the index's own check, as a checkpoint from before checksums has).
  nlohmann::json meta = nlohmann::json::parse(read_all(step / "meta.json"));
  meta.erase("meta_crc32c");
  meta.erase("checksums");
  meta["index"]["model/w"]["parts"][1]["begin"] = 13;
  std::ofstream(step / "meta.json", std::ios::trunc) << meta.dump();
  expect_error([&] { CheckpointReader bad(step.string()); }, "model/w");
  // An index that points outside the folder.
  meta["index"]["model/w"]["parts"][1]["begin"] = 12;
  meta["index"]["model/w"]["parts"][1]["file"] = "../../etc/passwd";
  std::ofstream(step / "meta.json", std::ios::trunc) << meta.dump();
  expect_error([&] { CheckpointReader bad(step.string()); }, "is damaged");
}

// ---- checksums, damage, fallback, failed saves ------------------------------------------

namespace {

using tetra::core::Crc32c;

void write_all(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// The message of the tetra::Error `fn` throws ("" when it throws none).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const tetra::Error& e) {
    return e.what();
  }
  return "";
}

// A small tmpfs mounted at a fresh folder for the test's life; skips when mounting is not
// permitted (not root, or a container without CAP_SYS_ADMIN).
class Tmpfs {
 public:
  Tmpfs(const std::string& name, const std::string& size) : dir_(fresh_dir(name)), size_(size) {
    if (::mount("tmpfs", dir_.c_str(), "tmpfs", 0, ("size=" + size_).c_str()) != 0)
      reason_ = "cannot mount a tmpfs at " + dir_.string() + ": " + std::strerror(errno) +
                " (these tests need root)";
  }
  ~Tmpfs() {
    if (reason_.empty()) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  const std::string& skip_reason() const { return reason_; }
  const fs::path& dir() const { return dir_; }
  void read_only() {
    ASSERT_EQ(::mount(nullptr, dir_.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, ("size=" + size_).c_str()), 0)
        << std::strerror(errno);
  }

 private:
  fs::path dir_;
  std::string size_, reason_;
};

// Flips one bit of byte `at` of a file (from its end when `at` is negative).
void flip_byte(const fs::path& p, int64_t at) {
  std::string bytes = read_all(p);
  const size_t i = at < 0 ? bytes.size() + at : static_cast<size_t>(at);
  bytes[i] = static_cast<char>(bytes[i] ^ 0x10);
  write_all(p, bytes);
}

// Each kind of damage, to step folder `step`: what it did, and the file the error must name.
struct Damage {
  const char* what;
  const char* file;
  const char* needle;  // what the error says differs
  std::function<void(const fs::path&)> apply;
};

std::vector<Damage> damages() {
  return {
      {"truncated rank file", "rank-00001.safetensors", "expected",
       [](const fs::path& s) {
         const std::string b = read_all(s / "rank-00001.safetensors");
         write_all(s / "rank-00001.safetensors", b.substr(0, b.size() - 8));
       }},
      {"flipped byte in a rank file", "rank-00002.safetensors", "CRC-32C",
       [](const fs::path& s) { flip_byte(s / "rank-00002.safetensors", -3); }},
      {"flipped byte in meta.json", "meta.json", "CRC-32C",
       [](const fs::path& s) {
         // A digit of "step_in_epoch": 4 -> 5 keeps the JSON valid, so only the checksum can tell.
         std::string m = read_all(s / "meta.json");
         const size_t at = m.find("\"step_in_epoch\": 4");
         ASSERT_NE(at, std::string::npos) << m;
         m[at + 17] = '5';
         write_all(s / "meta.json", m);
       }},
      {"missing shard", "rank-00002.safetensors", "missing",
       [](const fs::path& s) { fs::remove(s / "rank-00002.safetensors"); }},
  };
}

}  // namespace

TEST(CheckpointChecksums, EveryFileCarriesItsSizeAndCrc32c) {
  fs::path d = fresh_dir("checksums");
  save_sharded(d, 4, reference_tensors(0));
  const fs::path step = d / "step-00000004";
  const auto meta = nlohmann::json::parse(read_all(step / "meta.json"));
  ASSERT_TRUE(meta.contains("meta_crc32c")) << meta.dump();
  ASSERT_EQ(meta["checksums"].size(), 3u) << meta.dump();
  for (const auto& f : {"rank-00000.safetensors", "rank-00001.safetensors", "rank-00002.safetensors"}) {
    const std::string bytes = read_all(step / f);
    Crc32c crc;
    crc.process_bytes(bytes.data(), bytes.size());
    char want[16];
    std::snprintf(want, sizeof(want), "0x%08x", crc.checksum());
    EXPECT_EQ(meta["checksums"][f]["bytes"].get<size_t>(), bytes.size()) << f;
    EXPECT_EQ(meta["checksums"][f]["crc32c"].get<std::string>(), want) << f;
  }
  CheckpointReader r(step.string());
  EXPECT_NO_THROW(r.verify());
  EXPECT_EQ(r.meta().count("checksums"), 0u);  // the user's meta only
  EXPECT_EQ(r.meta().count("meta_crc32c"), 0u);
}

TEST(CheckpointChecksums, EachDamageIsNamedAndLatestIntactSkipsIt) {
  const TensorMap ref = reference_tensors(0);
  for (const auto& damage : damages()) {
    SCOPED_TRACE(damage.what);
    fs::path d = fresh_dir("damage");
    save_sharded(d, 3, ref);
    save_sharded(d, 4, ref);
    const fs::path step = d / "step-00000004";
    damage.apply(step);
    // verify() (what resume and `ckpt verify` run) and a plain load both refuse it, naming
    // the folder, the file and what differs.
    const std::string verify = error_of([&] { CheckpointReader(step.string()).verify(); });
    const std::string load = error_of([&] { CheckpointStore::load(step.string()); });
    for (const std::string& e : {verify, load}) {
      EXPECT_NE(e.find("checkpoint " + step.string() + " is damaged (" + damage.file + ": "), std::string::npos) << e;
      EXPECT_NE(e.find(damage.needle), std::string::npos) << e;
    }
    // What resume: auto takes: the newest intact one, newest first, each skipped one said.
    CheckpointStore store(d.string(), 3);
    EXPECT_EQ(*store.latest(), step.string());  // complete, though damaged
    std::vector<std::string> skipped;
    auto good = store.latest_intact(&skipped);
    ASSERT_TRUE(good);
    EXPECT_EQ(good->folder(), (d / "step-00000003").string());
    EXPECT_EQ(skipped, std::vector<std::string>{verify});
    damage.apply(d / "step-00000003");
    skipped.clear();
    EXPECT_FALSE(store.latest_intact(&skipped));
    EXPECT_EQ(skipped.size(), 2u);
  }
}

TEST(CheckpointChecksums, ARangeReadVerifiesOnlyTheFilesItOpens) {
  fs::path d = fresh_dir("lazy_verify");
  const TensorMap ref = reference_tensors(0);
  save_sharded(d, 4, ref);
  const fs::path step = d / "step-00000004";
  flip_byte(step / "rank-00002.safetensors", -1);
  CheckpointReader r(step.string());
  // Elements 0..23 of model/w live in ranks 0 and 1: intact, read.
  EXPECT_TRUE(torch::equal(r.read_flat("model/w", 0, 24), ref.at("model/w").reshape({-1}).slice(0, 0, 24)));
  EXPECT_NE(error_of([&] { r.read("model/w"); }).find("rank-00002.safetensors: CRC-32C"), std::string::npos);
}

TEST(CheckpointChecksums, CheckpointsWithoutChecksumsStillLoad) {
  fs::path d = fresh_dir("no_checksums");
  const TensorMap ref = reference_tensors(0);
  save_sharded(d, 4, ref);
  const fs::path step = d / "step-00000004";
  auto meta = nlohmann::json::parse(read_all(step / "meta.json"));
  meta.erase("checksums");
  meta.erase("meta_crc32c");
  write_all(step / "meta.json", meta.dump(1));
  Checkpoint c = CheckpointStore::load(step.string());
  for (const auto& [name, t] : ref) EXPECT_TRUE(torch::equal(c.tensors.at(name), t)) << name;
  EXPECT_NO_THROW(CheckpointReader(step.string()).verify());
  // A file the index names is still required.
  fs::remove(step / "rank-00001.safetensors");
  EXPECT_NE(error_of([&] { CheckpointReader(step.string()).verify(); }).find("rank-00001.safetensors: missing"),
            std::string::npos);
}

TEST(CheckpointSaveErrors, AFullDiskIsTheSameErrorOnEveryRankAndKeepsThePreviousCheckpoint) {
  Tmpfs disk("full_disk", "64k");
  if (!disk.skip_reason().empty()) GTEST_SKIP() << disk.skip_reason();
  const fs::path d = disk.dir() / "ckpt";
  const TensorMap ref = reference_tensors(0);
  save_sharded(d, 1, ref);
  // Rank 1's part of step 2 (400 KB) does not fit in 64 KiB.
  const std::vector<std::string> errors = save_on_three(d, [&](int rank) {
    Checkpoint c = rank_part(rank, 2, ref);
    if (rank == 1) c.tensors["optim/big"] = torch::ones({100000});
    return c;
  });
  expect_same_error(errors, "checkpoint: cannot write " + (d / ".step-00000002.tmp" / "rank-00001.safetensors").string() +
                                ": No space left on device");
  EXPECT_EQ(entries_of(d), std::vector<std::string>{"step-00000001"});  // the temporary folder is gone
  CheckpointReader r((d / "step-00000001").string());
  EXPECT_NO_THROW(r.verify());
  EXPECT_TRUE(torch::equal(r.read("model/w"), ref.at("model/w")));
}

TEST(CheckpointSaveErrors, AReadOnlyFolderIsAClearErrorAndKeepsThePreviousCheckpoint) {
  Tmpfs disk("read_only", "1m");
  if (!disk.skip_reason().empty()) GTEST_SKIP() << disk.skip_reason();
  const TensorMap ref = reference_tensors(0);
  save_sharded(disk.dir(), 1, ref);
  disk.read_only();
  const std::vector<std::string> errors =
      save_on_three(disk.dir(), [&](int rank) { return rank_part(rank, 2, ref); });
  expect_same_error(errors, "checkpoint: cannot create " + (disk.dir() / ".step-00000002.tmp").string() +
                                ": Read-only file system");
  try {
    CheckpointStore(disk.dir().string(), 3).save(rank_part(0, 2, ref));  // one process, too
    FAIL() << "saved on a read-only folder";
  } catch (const CheckpointSaveError& e) {
    EXPECT_NE(std::string(e.what()).find("Read-only file system"), std::string::npos) << e.what();
  }
  auto good = CheckpointStore(disk.dir().string(), 3).latest_intact();
  ASSERT_TRUE(good);
  EXPECT_EQ(good->folder(), (disk.dir() / "step-00000001").string());
}

// ---- the trainer: resume fallback and checkpoint.on_error -----------------------------

namespace {

const char* kJob = R"(
model: {type: mlp, hidden: [32], dropout: 0.2}
data: {type: synthetic, shape: [24], classes: 4, train_samples: 512, test_samples: 64, batch_size: 16}
optimizer: {type: adamw, lr: 0.01}
train: {max_steps: 30, seed: 3, threads: 1, eval_every: 0}
log: {metrics: "", progress: off}
)";

JobSpec job(std::vector<std::string> sets) {
  return tetra::numerics::job_without_run_folder(kJob, "test", std::move(sets), SectionRegistry{});
}

struct Interrupt {};

}  // namespace

TEST(CheckpointResume, AutoSkipsADamagedCheckpointAndTheRunMatchesAnUninterruptedOne) {
  set_threads(1);
  const fs::path d = fresh_dir("resume_fallback");
  auto with = [&](const std::string& dir) {
    return job({"checkpoint.dir=" + (d / dir).string(), "checkpoint.every_steps=10"});
  };
  Trainer whole_run(with("a"));
  TrainResult whole = whole_run.run();
  ASSERT_EQ(whole.losses.size(), 30u);

  TrainerOptions stop_at_25;
  stop_at_25.on_step = [](int64_t step, double) {
    if (step == 25) throw Interrupt{};
  };
  EXPECT_THROW(Trainer(with("b"), stop_at_25).run(), Interrupt);
  const fs::path bad = d / "b" / "step-00000020";
  flip_byte(bad / "rank-00000.safetensors", -5);

  testing::internal::CaptureStderr();
  Trainer resumed_run(with("b"));
  TrainResult rest = resumed_run.run();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("warning: checkpoint " + bad.string() + " is damaged (rank-00000.safetensors: CRC-32C 0x"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("); resuming from step-00000010"), std::string::npos) << err;
  EXPECT_EQ(rest.resumed_from, (d / "b" / "step-00000010").string());
  ASSERT_EQ(rest.losses.size(), 20u);
  for (size_t i = 0; i < 20; ++i) EXPECT_EQ(rest.losses[i], whole.losses[10 + i]) << "step " << 11 + i;
  const TensorMap a = whole_run.weights(), b = resumed_run.weights();
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
}

TEST(CheckpointResume, AnExplicitDamagedCheckpointIsAnErrorNotAFallback) {
  set_threads(1);
  const fs::path d = fresh_dir("resume_explicit");
  Trainer(job({"checkpoint.dir=" + d.string(), "checkpoint.every_steps=10", "train.max_steps=20"})).run();
  fs::remove(d / "step-00000020" / "rank-00000.safetensors");
  const std::string e = error_of([&] {
    Trainer(job({"checkpoint.dir=" + (d / "next").string(), "checkpoint.resume=" + (d / "step-00000020").string()}))
        .run();
  });
  EXPECT_NE(e.find("checkpoint " + (d / "step-00000020").string() + " is damaged (rank-00000.safetensors: missing)"),
            std::string::npos)
      << e;
}

TEST(CheckpointOnError, WarnTrainsOnPastAReadOnlyFolderStopEndsTheRun) {
  Tmpfs disk("on_error", "1m");
  if (!disk.skip_reason().empty()) GTEST_SKIP() << disk.skip_reason();
  set_threads(1);
  const fs::path d = fresh_dir("on_error_logs");
  std::vector<std::string> sets = {"checkpoint.dir=" + disk.dir().string(), "checkpoint.every_steps=10",
                                   "train.max_steps=10", "checkpoint.on_error=warn"};
  Trainer(job(sets)).run();  // step-00000010 on the tmpfs
  disk.read_only();

  sets[2] = "train.max_steps=30";
  sets.push_back("log.metrics=" + (d / "metrics.jsonl").string());
  testing::internal::CaptureStderr();
  TrainResult r = Trainer(job(sets)).run();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(r.final_step, 30);  // trained on past both failed saves (step 20, the end)
  EXPECT_EQ(r.resumed_from, (disk.dir() / "step-00000010").string());
  EXPECT_NE(err.find("warning: checkpoint: cannot create " + (disk.dir() / ".step-00000020.tmp").string() +
                     ": Read-only file system"),
            std::string::npos)
      << err;
  int64_t failures = 0;
  std::ifstream metrics(d / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    auto rec = nlohmann::json::parse(line);
    if (rec.contains("checkpoint_failures")) failures = rec["checkpoint_failures"].get<int64_t>();
  }
  EXPECT_EQ(failures, 2);
  auto good = CheckpointStore(disk.dir().string(), 3).latest_intact();
  ASSERT_TRUE(good);
  EXPECT_EQ(good->folder(), (disk.dir() / "step-00000010").string());

  sets[3] = "checkpoint.on_error=stop";
  EXPECT_THROW(Trainer(job(sets)).run(), CheckpointSaveError);
}

// ---- files from elsewhere (Note [Safetensors from elsewhere]; tools/fuzz) ------------------
// A safetensors file or a meta.json may come from another person: each crafted input below
// is a tetra::Error naming the file, never a crash, undefined behaviour, a huge allocation,
// another exception type or a read outside the file. The cases are what tools/fuzz's
// fuzz-safetensors and fuzz-checkpoint-meta probe (and what review of the readers found).

namespace {

// A safetensors file of `header` (JSON text, as given) and `data` bytes after it.
std::string crafted_safetensors(const std::string& header, const std::string& data = "") {
  std::string out;
  const uint64_t len = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  return out + header + data;
}

// True when `s` is well-formed UTF-8 (nlohmann's dump() refuses anything else).
bool is_utf8(const std::string& s) {
  try {
    (void)nlohmann::json(s).dump();
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

// Both safetensors readers refuse `bytes` with an Error naming the file and carrying `needle`.
void expect_refused(const fs::path& f, const std::string& bytes, const std::string& needle) {
  SCOPED_TRACE(needle);
  write_all(f, bytes);
  const std::string load = error_of([&] { load_safetensors(f.string()); });
  const std::string open = error_of([&] { SafetensorsFile file(f.string()); });
  for (const std::string& e : {load, open}) {
    EXPECT_NE(e.find(f.string() + ": not a valid safetensors file: "), std::string::npos) << e;
    EXPECT_NE(e.find(needle), std::string::npos) << e;
    EXPECT_TRUE(is_utf8(e)) << e;
  }
}

}  // namespace

TEST(SafetensorsFromElsewhere, CraftedHeadersAreClearErrorsNamingTheFile) {
  const fs::path f = fresh_dir("st_crafted") / "crafted.safetensors";
  const std::string eight(8, '\0');
  // Header lengths: 2^63 and 2^64 - 1 in a small file.
  expect_refused(f, std::string("\0\0\0\0\0\0\0\x80", 8) + "{}", "header length 9223372036854775808 exceeds the file");
  expect_refused(f, std::string(8, '\xff') + "{}", "exceeds the file");
  // Shapes whose byte count overflows: with every dimension non-zero, and with a zero one
  // (0 elements, but torch sizes the others: an overflow there was a c10::Error).
  expect_refused(f, crafted_safetensors(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,0]}})"),
                 "tensor w has shape [4294967296,4294967296,4294967296], over 2^60 bytes");
  expect_refused(f, crafted_safetensors(R"({"w":{"dtype":"F32","shape":[0,4611686018427387904,4611686018427387904],"data_offsets":[0,0]}})"),
                 "over 2^60 bytes");
  expect_refused(f, crafted_safetensors(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", "abcd"),
                 "tensor w has shape [1.5]");
  expect_refused(f, crafted_safetensors(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "abcd"),
                 "tensor w has shape [-1]");
  expect_refused(f, crafted_safetensors(R"({"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]}})", "abcd"),
                 "over 2^60 bytes");
  std::string dims = "[1";
  for (int i = 0; i < 64; ++i) dims += ",1";
  expect_refused(f, crafted_safetensors(R"({"w":{"dtype":"U8","shape":)" + dims + R"(],"data_offsets":[0,1]}})", "a"),
                 "has 65 dimensions");
  // Offsets: reversed, past the file, huge, not integers.
  expect_refused(f, crafted_safetensors(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})", eight),
                 "data_offsets [8, 0] that do not fit");
  expect_refused(f, crafted_safetensors(R"({"w":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}})", eight),
                 "data_offsets [0, 16] that do not fit");
  expect_refused(f, crafted_safetensors(R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[18446744073709551608,0]}})", eight),
                 "do not fit");
  expect_refused(f, crafted_safetensors(R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8e0]}})", eight),
                 "tensor w has data_offsets [0,8.0]");
  // Ranges that overlap, leave a gap, or leave bytes after the last tensor (the reference
  // implementation's rule: the tensors tile the data section).
  expect_refused(f, crafted_safetensors(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                                        R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})", eight + "abcd"),
                 "tensors a and b overlap (data bytes [4, 8))");
  expect_refused(f, crafted_safetensors(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                                        R"("b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})", eight + "abcd"),
                 "data bytes [4, 8) belong to no tensor");
  expect_refused(f, crafted_safetensors(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", eight),
                 "data bytes [4, 8) after the last tensor belong to no tensor");
  // Names: bytes that are not UTF-8 (the message escapes them and stays UTF-8), control
  // characters, an unknown dtype, an entry that is not an object, JSON nested too deep.
  expect_refused(f, crafted_safetensors("{\"w\xff\xfe\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}"),
                 "header is not JSON");
  expect_refused(f, crafted_safetensors(R"({"w\u0001":{"dtype":"F8_E4M3","shape":[0],"data_offsets":[0,0]}})"),
                 "tensor w\\x01 has no known dtype (\"F8_E4M3\")");
  expect_refused(f, crafted_safetensors(R"({"w":[1,2]})"), "tensor w is [1,2], not an object");
  expect_refused(f, crafted_safetensors(R"({"__metadata__":{"k":)" + std::string(100000, '[') +
                                        std::string(100000, ']') + "}}"),
                 "nested deeper than 64 levels");
  // Nested in the shape, whose text the error quoted: dump() recursed 200,000 levels and
  // overflowed the stack.
  expect_refused(f, crafted_safetensors(R"({"w":{"dtype":"F32","shape":)" + std::string(200000, '[') +
                                        std::string(200000, ']') + R"(,"data_offsets":[0,0]}})"),
                 "nested deeper than 64 levels");
}

TEST(SafetensorsFromElsewhere, AHeaderLengthPastTheLimitIsRefusedBeforeItIsRead) {
  // A sparse 200 MB file whose header length says 150 MB: refused without reading or
  // allocating the header (the reference's limit is 100 MB).
  const fs::path f = fresh_dir("st_sparse") / "sparse.safetensors";
  {
    std::ofstream out(f, std::ios::binary);
    const uint64_t len = 150000000;
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((len >> (8 * i)) & 0xff));
  }
  fs::resize_file(f, 200000000);
  const std::string e = error_of([&] { SafetensorsFile file(f.string()); });
  EXPECT_NE(e.find(f.string() + ": not a valid safetensors file: header length 150000000 is over the 100 MB"),
            std::string::npos)
      << e;
}

TEST(SafetensorsFromElsewhere, ReadsPastATensorAreRefused) {
  TensorMap in;
  in["a"] = torch::arange(4, torch::kInt32);
  const fs::path f = fresh_dir("st_past") / "x.safetensors";
  save_safetensors(f.string(), in);
  SafetensorsFile file(f.string());
  char buf[32];
  for (const auto& range : {std::pair<uint64_t, uint64_t>{16, 1}, {0, 17}, {~uint64_t{0}, 2}, {1, ~uint64_t{0}}}) {
    const std::string e = error_of([&] { file.read("a", range.first, range.second, buf); });
    EXPECT_NE(e.find(f.string() + ": bytes ["), std::string::npos) << range.first << " " << range.second << ": " << e;
  }
}

namespace {

// The CRC-32C meta.json carries for `doc` (Note [Checkpoint checksums]).
std::string meta_crc_of(nlohmann::json doc) {
  doc.erase("meta_crc32c");
  const std::string canonical = doc.dump();
  Crc32c crc;
  crc.process_bytes(canonical.data(), canonical.size());
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", crc.checksum());
  return buf;
}

}  // namespace

TEST(CheckpointFromElsewhere, ACraftedMetaJsonIsAClearErrorNamingIt) {
  const fs::path d = fresh_dir("crafted_meta");
  save_sharded(d, 4, reference_tensors(0));
  const fs::path step = d / "step-00000004", meta_path = step / "meta.json";
  const nlohmann::json saved = nlohmann::json::parse(read_all(meta_path));
  // Each case edits the saved meta.json; its CRC is recomputed (`crc`) or dropped with the
  // checksums (an older checkpoint's form) so that the value itself is what is checked.
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> edit;
    bool crc;
    const char* needle;
    bool on_read;  // refused when read (verify, read), not when opened; else it names meta.json
  };
  const std::vector<Case> cases = {
      // A double where an integer goes: get<int>() of 1e300 was undefined behaviour.
      {"world 1e300", [](auto& m) { m["world"] = 1e300; }, true, "\"world\" is 1e+300, not a count", false},
      {"step 1e300", [](auto& m) { m["step"] = 1e300; }, true, "\"step\" is 1e+300, not a count", false},
      {"epoch -1", [](auto& m) { m["epoch"] = -1; }, true, "\"epoch\" is -1, not a count", false},
      // Found by fuzz-checkpoint-meta on the old reader (after ~30,000 runs): a dimension past
      // uint64 parses as a double, and get<std::vector<int64_t>>() converted it out of range.
      {"a dimension past uint64",
       [](auto& m) { m["index"]["model/w"]["shape"] = nlohmann::json::parse("[49223372036854775807]"); }, true,
       "tensor model/w has shape [4.92", false},
      {"a begin of 0.5", [](auto& m) { m["index"]["model/w"]["parts"][0]["begin"] = 0.5; }, true,
       "tensor model/w has a part {\"begin\":0.5", false},
      // A format past int: get<int>() wrapped 2^32 + 2 to 2 and read it as format 2.
      {"format 2^32 + 2", [](auto& m) { m["format"] = 4294967298LL; }, true, "has format 4294967298, newer than", false},
      // Shapes whose element count overflowed int64 (undefined behaviour in numel_of).
      {"shape [2^40, 2^40]", [](auto& m) { m["index"]["model/w"]["shape"] = {1LL << 40, 1LL << 40}; }, true,
       "tensor model/w has shape [1099511627776,1099511627776]", false},
      {"shape [-5, 7]", [](auto& m) { m["index"]["model/w"]["shape"] = {-5, 7}; }, true, "has shape [-5,7]", false},
      // Files outside the folder: verify() read whatever "files" named.
      {"files ../", [](auto& m) { m["files"][2] = "../../../../etc/passwd"; }, true,
       "\"files\" names \"../../../../etc/passwd\", not a file of the folder", false},
      {"files absolute", [](auto& m) { m["files"][2] = "/etc/passwd"; }, true, "not a file of the folder", false},
      {"files with NUL", [](auto& m) { m["files"][2] = std::string("rank-00002.safetensors\0x", 24); }, true,
       "\"files\" names \"rank-00002.safetensors\\u0000x\"", false},
      {"files twice", [](auto& m) { m["files"][2] = "rank-00001.safetensors"; }, true, "names a file twice", false},
      {"world 2 of 3 files", [](auto& m) { m["world"] = 2; }, true, "names 3 files for a world of 2 ranks", false},
      // A checksum entry of the wrong form: its nlohmann::json::type_error escaped verify().
      {"checksums entry 5", [](auto& m) { m["checksums"]["rank-00001.safetensors"] = 5; }, true,
       "\"checksums\" of rank-00001.safetensors is 5, not {\"bytes\"", false},
      {"checksums bytes 1e300", [](auto& m) { m["checksums"]["rank-00001.safetensors"]["bytes"] = 1e300; }, true,
       "\"checksums\" of rank-00001.safetensors is {\"bytes\":1e+300", false},
      // A file name too long for the filesystem: std::filesystem::exists threw its own error.
      {"a 300-byte file name",
       [](auto& m) {
         const std::string name(300, 'a');
         m["files"][2] = name;
         for (auto& entry : m["index"])
           for (auto& part : entry["parts"])
             if (part["file"] == "rank-00002.safetensors") part["file"] = name;
       },
       false, "is damaged (aaaa", true},
      // An index claiming a tensor of 2^56 floats that rank-00000 holds 12 of: refused from
      // the file's header before the 2^58 bytes are allocated (a c10::Error before).
      {"a huge tensor",
       [](auto& m) {
         m["index"]["model/w"]["shape"] = {1LL << 56};
         m["index"]["model/w"]["parts"] = {{{"file", "rank-00000.safetensors"}, {"begin", 0}, {"end", 1LL << 56}}};
       },
       true, "rank-00000.safetensors holds tensor model/w as F32 [12], the index as F32 elements [0, 72057594037927936)",
       true},
      // Nesting past what dump() (the meta CRC) can recurse through.
      {"deep nesting", [](auto& m) { m["job"] = nlohmann::json::parse(std::string(100, '[') + std::string(100, ']')); }, false,
       "nested deeper than 64 levels", false},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    nlohmann::json m = saved;
    if (!c.crc) {
      m.erase("meta_crc32c");
      m.erase("checksums");
    }
    c.edit(m);
    if (c.crc) m["meta_crc32c"] = meta_crc_of(m);
    write_all(meta_path, m.dump(1));
    const std::string e = error_of([&] {
      CheckpointReader r(step.string());
      if (c.on_read) {
        r.verify();
        for (const auto& name : r.names()) (void)r.read(name);
      }
    });
    EXPECT_NE(e.find(step.string()), std::string::npos) << e;
    EXPECT_NE(e.find(c.needle), std::string::npos) << e;
    EXPECT_TRUE(is_utf8(e)) << e;
    if (!c.on_read && std::string(c.what) != "format 2^32 + 2") {  // a version, not damage: names the folder
      EXPECT_NE(e.find(meta_path.string()), std::string::npos) << e;
    }
  }
  // Still a good checkpoint once meta.json is back.
  write_all(meta_path, saved.dump(1));
  EXPECT_NO_THROW(CheckpointReader(step.string()).verify());
}

TEST(CheckpointFromElsewhere, ReadFlatOutsideATensorIsAnErrorEvenWhenTheRangeOverflows) {
  const fs::path d = fresh_dir("read_flat_outside");
  save_sharded(d, 4, reference_tensors(0));
  CheckpointReader r((d / "step-00000004").string());
  for (const auto& range : {std::pair<int64_t, int64_t>{-1, 1}, {35, 1}, {0, 36},
                            {INT64_MAX, INT64_MAX}, {1, INT64_MAX}}) {
    const std::string e = error_of([&] { (void)r.read_flat("model/w", range.first, range.second); });
    EXPECT_NE(e.find("of tensor model/w are outside its 35 elements"), std::string::npos) << e;
  }
}

TEST(CheckpointFromElsewhere, AResumedMetaValueOfAnotherTypeIsAnErrorNamingTheCheckpoint) {
  // The trainer reads best_accuracy from the user meta: a string there was a
  // nlohmann::json::type_error escaping the resume.
  set_threads(1);
  const fs::path d = fresh_dir("resume_meta_type");
  Trainer(job({"checkpoint.dir=" + d.string(), "checkpoint.every_steps=10", "train.max_steps=10"})).run();
  const fs::path step = d / "step-00000010", meta_path = step / "meta.json";
  nlohmann::json m = nlohmann::json::parse(read_all(meta_path));
  m["best_accuracy"] = "high";
  m["meta_crc32c"] = meta_crc_of(m);
  write_all(meta_path, m.dump(1));
  const std::string e = error_of([&] {
    Trainer(job({"checkpoint.dir=" + (d / "next").string(), "checkpoint.resume=" + step.string()})).run();
  });
  EXPECT_NE(e.find("checkpoint " + step.string() + ": its meta.json has best_accuracy \"high\", not a number"),
            std::string::npos)
      << e;
}
