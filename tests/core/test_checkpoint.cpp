// Safetensors round trip and the atomic, keep-K checkpoint store.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "core/checkpoint.h"
#include "collectives/error.h"
#include "core/safetensors.h"

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
