#include "core/data.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "collectives/error.h"

namespace fs = std::filesystem;
using tetra::core::Batch;
using tetra::core::BatchPlan;
using tetra::core::DataSpec;
using tetra::core::make_dataset;
using tetra::core::read_idx_gz;
using tetra::core::Split;

namespace {

const std::string kFashion = "/usr/share/datasets/fashion-mnist";

// A scratch folder of this test process, removed at the end.
class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("tetra_test_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

std::string gunzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  EXPECT_NE(f, nullptr);
  std::string out;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  gzclose(f);
  return out;
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  gzclose(f);
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const tetra::DataError& e) {
    return std::string("DataError: ") + e.what();
  } catch (const tetra::ConfigError& e) {
    return std::string("ConfigError: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("other: ") + e.what();
  }
  return "no error";
}

std::vector<int64_t> to_vec(const torch::Tensor& t) {
  torch::Tensor c = t.to(torch::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

DataSpec text_spec(const std::string& path, int64_t seq_len, double test_fraction) {
  DataSpec s;
  s.type = "text";
  s.path = path;
  s.seq_len = seq_len;
  s.test_fraction = test_fraction;
  return s;
}

}  // namespace

// ---- the IDX reader -------------------------------------------------------------------

TEST(IdxReader, ReadsFashionMnistFiles) {
  torch::Tensor images = read_idx_gz(kFashion + "/train-images-idx3-ubyte.gz");
  EXPECT_EQ(images.scalar_type(), torch::kUInt8);
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{60000, 28, 28}));
  torch::Tensor labels = read_idx_gz(kFashion + "/train-labels-idx1-ubyte.gz");
  EXPECT_EQ(labels.sizes(), (std::vector<int64_t>{60000}));
  EXPECT_EQ(labels.min().item<int64_t>(), 0);
  EXPECT_EQ(labels.max().item<int64_t>(), 9);
  // Checked against the file with Python's gzip: the first labels are 9 0 0 3 0 2.
  EXPECT_EQ(to_vec(labels.slice(0, 0, 6)), (std::vector<int64_t>{9, 0, 0, 3, 0, 2}));
  torch::Tensor test_labels = read_idx_gz(kFashion + "/t10k-labels-idx1-ubyte.gz");
  EXPECT_EQ(test_labels.sizes(), (std::vector<int64_t>{10000}));
  EXPECT_EQ(test_labels[0].item<int64_t>(), 9);
  EXPECT_EQ(read_idx_gz(kFashion + "/t10k-images-idx3-ubyte.gz").sizes(),
            (std::vector<int64_t>{10000, 28, 28}));
  // The data bytes are the file's bytes after the 16-byte header.
  const std::string raw = gunzip(kFashion + "/train-images-idx3-ubyte.gz");
  ASSERT_EQ(raw.size(), 16u + 60000u * 28u * 28u);
  EXPECT_EQ(std::memcmp(raw.data() + 16, images.data_ptr<uint8_t>(), raw.size() - 16), 0);
}

TEST(IdxReader, TruncatedFileIsDataError) {
  TempDir dir;
  const std::string raw = gunzip(kFashion + "/train-labels-idx1-ubyte.gz");
  const std::string path = dir.file("short-labels.gz");
  write_gz(path, raw.substr(0, 8 + 100));
  const std::string err = error_of([&] { read_idx_gz(path); });
  EXPECT_NE(err.find("DataError"), std::string::npos) << err;
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;
  EXPECT_NE(err.find("expected 60000 bytes of data, got 100"), std::string::npos) << err;
  EXPECT_NE(err.find(path), std::string::npos) << err;
  // Truncated inside the header.
  write_gz(path, raw.substr(0, 6));
  EXPECT_NE(error_of([&] { read_idx_gz(path); }).find("truncated"), std::string::npos);
}

TEST(IdxReader, BadMagicAndAbsurdDimsAreDataErrors) {
  TempDir dir;
  const std::string path = dir.file("bad.gz");
  write_gz(path, std::string("\x00\x00\x0d\x01\x00\x00\x00\x01x", 9));
  std::string err = error_of([&] { read_idx_gz(path); });
  EXPECT_NE(err.find("DataError"), std::string::npos) << err;
  EXPECT_NE(err.find("bad magic"), std::string::npos) << err;
  EXPECT_NE(err.find(path), std::string::npos) << err;
  // 3 dims of 0x7fffffff: far more data than any file.
  write_gz(path, std::string("\x00\x00\x08\x03\x7f\xff\xff\xff\x7f\xff\xff\xff\x7f\xff\xff\xff", 16));
  err = error_of([&] { read_idx_gz(path); });
  EXPECT_NE(err.find("DataError"), std::string::npos) << err;
  EXPECT_NE(err.find("absurd"), std::string::npos) << err;
  // A small, well-formed file.
  write_gz(path, std::string("\x00\x00\x08\x02\x00\x00\x00\x02\x00\x00\x00\x03\x01\x02\x03\x04\x05\x06", 18));
  torch::Tensor t = read_idx_gz(path);
  EXPECT_EQ(t.sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(to_vec(t.flatten()), (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
}

TEST(IdxReader, MissingFileNamesThePath) {
  const std::string err = error_of([] { read_idx_gz("/nonexistent/x/y.gz"); });
  EXPECT_NE(err.find("DataError: cannot open /nonexistent/x/y.gz: No such file or directory"),
            std::string::npos)
      << err;
}

// ---- fashion-mnist --------------------------------------------------------------------

TEST(FashionMnist, ShapesAndNormalisation) {
  DataSpec spec;  // defaults: fashion-mnist from the Debian package's folder
  // (How long loading and a batch take is bench-overhead's to print, not a test's.)
  auto data = make_dataset(spec, 1);
  const auto& info = data->info();
  EXPECT_EQ(info.input_shape, (std::vector<int64_t>{1, 28, 28}));
  EXPECT_EQ(info.num_classes, 10);
  EXPECT_FALSE(info.language_model);
  EXPECT_NE(info.description.find("Fashion-MNIST"), std::string::npos);
  EXPECT_EQ(data->size(Split::kTrain), 60000);
  EXPECT_EQ(data->size(Split::kTest), 10000);

  Batch all = data->range(Split::kTrain, 0, 60000);
  EXPECT_EQ(all.inputs.scalar_type(), torch::kFloat);
  EXPECT_EQ(all.inputs.sizes(), (std::vector<int64_t>{60000, 1, 28, 28}));
  EXPECT_EQ(all.targets.scalar_type(), torch::kLong);
  EXPECT_NEAR(all.inputs.mean().item<double>(), 0.0, 0.02);
  EXPECT_NEAR(all.inputs.std().item<double>(), 1.0, 0.02);
  EXPECT_EQ(all.targets[0].item<int64_t>(), 9);

  // get() is index_select: examples in the order asked for, contiguous.
  torch::Tensor idx = torch::tensor({5, 0, 59999, 5}, torch::kLong);
  Batch b = data->get(Split::kTrain, idx);
  EXPECT_EQ(b.size(), 4);
  EXPECT_TRUE(b.inputs.is_contiguous());
  EXPECT_TRUE(torch::equal(b.inputs[0], all.inputs[5]));
  EXPECT_TRUE(torch::equal(b.inputs[2], all.inputs[59999]));
  EXPECT_TRUE(torch::equal(b.inputs[3], b.inputs[0]));
  EXPECT_EQ(to_vec(b.targets), (std::vector<int64_t>{all.targets[5].item<int64_t>(),
                                                     all.targets[0].item<int64_t>(),
                                                     all.targets[59999].item<int64_t>(),
                                                     all.targets[5].item<int64_t>()}));
  Batch test = data->range(Split::kTest, 10, 20);
  EXPECT_EQ(test.size(), 10);
  EXPECT_THROW(data->get(Split::kTest, torch::tensor({10000}, torch::kLong)), tetra::Error);
}

TEST(FashionMnist, MissingFolderOrFileNamesThePackage) {
  DataSpec spec;
  spec.path = "/nonexistent/fashion";
  std::string err = error_of([&] { make_dataset(spec, 1); });
  EXPECT_NE(err.find("DataError"), std::string::npos) << err;
  EXPECT_NE(err.find("/nonexistent/fashion"), std::string::npos) << err;
  EXPECT_NE(err.find("dataset-fashion-mnist"), std::string::npos) << err;
  EXPECT_NE(err.find("data.path"), std::string::npos) << err;

  TempDir dir;  // a folder holding only one of the four files
  fs::copy_file(kFashion + "/train-images-idx3-ubyte.gz", dir.file("train-images-idx3-ubyte.gz"));
  spec.path = dir.path().string();
  err = error_of([&] { make_dataset(spec, 1); });
  EXPECT_NE(err.find("DataError"), std::string::npos) << err;
  EXPECT_NE(err.find(dir.file("train-labels-idx1-ubyte.gz")), std::string::npos) << err;
  EXPECT_NE(err.find("dataset-fashion-mnist"), std::string::npos) << err;
}

TEST(FashionMnist, LabelCountMismatchIsDataError) {
  TempDir dir;
  for (const char* f : {"train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                        "t10k-labels-idx1-ubyte.gz"})
    fs::copy_file(kFashion + "/" + f, dir.file(f));
  // 3 labels for 60000 images.
  write_gz(dir.file("train-labels-idx1-ubyte.gz"),
           std::string("\x00\x00\x08\x01\x00\x00\x00\x03\x01\x02\x03", 11));
  DataSpec spec;
  spec.path = dir.path().string();
  const std::string err = error_of([&] { make_dataset(spec, 1); });
  EXPECT_NE(err.find("DataError"), std::string::npos) << err;
  EXPECT_NE(err.find("3 labels for 60000 images"), std::string::npos) << err;
}

// ---- text -----------------------------------------------------------------------------

TEST(TextData, WindowsShiftByOne) {
  TempDir dir;
  std::string content;
  for (int i = 0; i < 1000; ++i) content.push_back(static_cast<char>(i % 251));
  const std::string path = dir.file("corpus.txt");
  write_file(path, content);
  auto data = make_dataset(text_spec(path, 16, 0.1), 1);
  const auto& info = data->info();
  EXPECT_TRUE(info.language_model);
  EXPECT_EQ(info.seq_len, 16);
  EXPECT_EQ(info.num_classes, 256);
  EXPECT_EQ(info.input_shape, (std::vector<int64_t>{16}));
  // Train = the first 900 bytes, test = the last 100; examples = (bytes - 1) / seq_len.
  EXPECT_EQ(data->size(Split::kTrain), (900 - 1) / 16);
  EXPECT_EQ(data->size(Split::kTest), (100 - 1) / 16);

  Batch b = data->get(Split::kTrain, torch::tensor({0, 3, 55}, torch::kLong));
  EXPECT_EQ(b.inputs.scalar_type(), torch::kLong);
  EXPECT_EQ(b.targets.scalar_type(), torch::kLong);
  EXPECT_EQ(b.inputs.sizes(), (std::vector<int64_t>{3, 16}));
  EXPECT_EQ(b.targets.sizes(), (std::vector<int64_t>{3, 16}));
  const std::vector<int64_t> starts = {0, 3 * 16, 55 * 16};
  auto in = to_vec(b.inputs), tg = to_vec(b.targets);
  for (int r = 0; r < 3; ++r)
    for (int t = 0; t < 16; ++t) {
      EXPECT_EQ(in[r * 16 + t], static_cast<unsigned char>(content[starts[r] + t]));
      EXPECT_EQ(tg[r * 16 + t], static_cast<unsigned char>(content[starts[r] + t + 1]));
    }
  // The last train example ends inside the train split (byte 55*16 + 16 = 896 < 900).
  EXPECT_THROW(data->get(Split::kTrain, torch::tensor({56}, torch::kLong)), tetra::Error);

  Batch t = data->range(Split::kTest, 0, data->size(Split::kTest));
  auto tin = to_vec(t.inputs), ttg = to_vec(t.targets);
  for (int64_t r = 0; r < t.size(); ++r)
    for (int k = 0; k < 16; ++k) {
      EXPECT_EQ(tin[r * 16 + k], static_cast<unsigned char>(content[900 + r * 16 + k]));
      EXPECT_EQ(ttg[r * 16 + k], static_cast<unsigned char>(content[900 + r * 16 + k + 1]));
    }
  for (int64_t r = 0; r + 1 < t.size(); ++r)  // consecutive windows share a boundary byte
    EXPECT_EQ(ttg[r * 16 + 15], tin[(r + 1) * 16]);
}

TEST(TextData, TooSmallAndMissingFilesAreDataErrors) {
  TempDir dir;
  const std::string path = dir.file("tiny.txt");
  write_file(path, std::string(100, 'a'));
  // 90 train bytes hold 89 / 16 = 5 examples; 10 test bytes hold none.
  std::string err = error_of([&] { make_dataset(text_spec(path, 16, 0.1), 1); });
  EXPECT_NE(err.find("DataError"), std::string::npos) << err;
  EXPECT_NE(err.find("too small"), std::string::npos) << err;
  EXPECT_NE(err.find("100 bytes"), std::string::npos) << err;
  EXPECT_NE(err.find("seq_len 16"), std::string::npos) << err;
  EXPECT_NE(err.find(path), std::string::npos) << err;
  // 9 test bytes hold exactly one example of 8 (+1).
  auto data = make_dataset(text_spec(path, 8, 0.1), 1);
  EXPECT_EQ(data->size(Split::kTest), 1);
  EXPECT_EQ(data->size(Split::kTrain), (90 - 1) / 8);

  err = error_of([&] { make_dataset(text_spec(dir.file("missing.txt"), 16, 0.1), 1); });
  EXPECT_NE(err.find("DataError"), std::string::npos) << err;
  EXPECT_NE(err.find(dir.file("missing.txt")), std::string::npos) << err;
}

// ---- synthetic ------------------------------------------------------------------------

TEST(SyntheticData, DeterministicInSeedAndLearnable) {
  DataSpec spec;
  spec.type = "synthetic";
  spec.shape = {3, 4};
  spec.classes = 5;
  spec.train_samples = 300;
  spec.test_samples = 50;
  torch::manual_seed(123);
  const torch::Tensor before = torch::rand({4});
  torch::manual_seed(123);
  auto a = make_dataset(spec, 7);
  // Making data does not move the global RNG.
  EXPECT_TRUE(torch::equal(torch::rand({4}), before));
  auto b = make_dataset(spec, 7);
  auto c = make_dataset(spec, 8);
  EXPECT_EQ(a->info().input_shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(a->info().num_classes, 5);
  EXPECT_EQ(a->size(Split::kTrain), 300);
  EXPECT_EQ(a->size(Split::kTest), 50);
  Batch ta = a->range(Split::kTrain, 0, 300), tb = b->range(Split::kTrain, 0, 300),
        tc = c->range(Split::kTrain, 0, 300);
  EXPECT_EQ(ta.inputs.sizes(), (std::vector<int64_t>{300, 3, 4}));
  EXPECT_EQ(ta.inputs.scalar_type(), torch::kFloat);
  EXPECT_EQ(ta.targets.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(ta.inputs, tb.inputs));
  EXPECT_TRUE(torch::equal(ta.targets, tb.targets));
  EXPECT_FALSE(torch::equal(ta.inputs, tc.inputs));
  EXPECT_TRUE(torch::equal(a->range(Split::kTest, 0, 50).inputs, b->range(Split::kTest, 0, 50).inputs));
  EXPECT_GE(ta.targets.min().item<int64_t>(), 0);
  EXPECT_LT(ta.targets.max().item<int64_t>(), 5);

  // Learnable: nearest class mean (estimated on train) classifies test well above chance.
  torch::Tensor x = ta.inputs.reshape({300, -1});
  torch::Tensor means = torch::zeros({5, 12});
  for (int k = 0; k < 5; ++k) means[k] = x.index({ta.targets == k}).mean(0);
  Batch te = a->range(Split::kTest, 0, 50);
  torch::Tensor d = torch::cdist(te.inputs.reshape({50, -1}), means);
  const double acc = d.argmin(1).eq(te.targets).to(torch::kFloat).mean().item<double>();
  EXPECT_GT(acc, 0.6);
}

// ---- the batch plan -------------------------------------------------------------------

TEST(BatchPlanTest, EpochIsAPermutation) {
  BatchPlan plan(1000, 100, 42, true);
  EXPECT_EQ(plan.steps_per_epoch(), 10);
  std::set<int64_t> seen;
  for (int64_t s = 0; s < plan.steps_per_epoch(); ++s) {
    torch::Tensor b = plan.global_batch(0, s);
    EXPECT_EQ(b.scalar_type(), torch::kLong);
    EXPECT_EQ(b.size(0), 100);
    for (int64_t i : to_vec(b)) seen.insert(i);
  }
  EXPECT_EQ(seen.size(), 1000u);
  EXPECT_EQ(*seen.begin(), 0);
  EXPECT_EQ(*seen.rbegin(), 999);
}

TEST(BatchPlanTest, DeterministicPerSeedAndEpoch) {
  BatchPlan a(1000, 64, 42, true), b(1000, 64, 42, true), c(1000, 64, 43, true);
  EXPECT_EQ(a.steps_per_epoch(), 15);  // the last partial batch is dropped
  torch::manual_seed(5);
  const torch::Tensor before = torch::rand({3});
  torch::manual_seed(5);
  const auto e0s3 = to_vec(a.global_batch(0, 3));
  const auto e1s3 = to_vec(a.global_batch(1, 3));
  EXPECT_TRUE(torch::equal(torch::rand({3}), before));  // the global RNG is untouched
  EXPECT_EQ(to_vec(a.global_batch(0, 3)), e0s3);         // back to epoch 0: same order
  EXPECT_EQ(to_vec(b.global_batch(1, 3)), e1s3);
  EXPECT_EQ(to_vec(b.global_batch(0, 3)), e0s3);
  EXPECT_NE(e0s3, e1s3);
  EXPECT_NE(to_vec(c.global_batch(0, 3)), e0s3);
  EXPECT_THROW(a.global_batch(0, 15), tetra::Error);
}

TEST(BatchPlanTest, NoShuffleIsIdentityOrder) {
  BatchPlan plan(10, 3, 42, false);
  EXPECT_EQ(plan.steps_per_epoch(), 3);
  EXPECT_EQ(to_vec(plan.global_batch(0, 0)), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(to_vec(plan.global_batch(0, 2)), (std::vector<int64_t>{6, 7, 8}));
  EXPECT_EQ(to_vec(plan.global_batch(5, 1)), (std::vector<int64_t>{3, 4, 5}));
}

TEST(BatchPlanTest, SlicesPartitionTheBatch) {
  for (int64_t batch : {12, 13, 7, 1}) {
    BatchPlan plan(100, batch, 9, true);
    torch::Tensor b = plan.global_batch(2, 1);
    for (int64_t parts : {1, 2, 3, 4, 5}) {
      std::vector<torch::Tensor> pieces;
      int64_t total = 0;
      for (int64_t p = 0; p < parts; ++p) {
        torch::Tensor s = BatchPlan::slice(b, p, parts);
        const int64_t expect = (p + 1) * batch / parts - p * batch / parts;
        EXPECT_EQ(s.size(0), expect);
        total += s.size(0);
        pieces.push_back(s);
      }
      EXPECT_EQ(total, batch);
      EXPECT_TRUE(torch::equal(torch::cat(pieces), b)) << batch << " in " << parts;
      // Nested slicing (ranks, then micro-batches) also partitions.
      std::vector<torch::Tensor> nested;
      for (int64_t r = 0; r < parts; ++r)
        for (int64_t m = 0; m < 2; ++m)
          nested.push_back(BatchPlan::slice(BatchPlan::slice(b, r, parts), m, 2));
      EXPECT_TRUE(torch::equal(torch::cat(nested), b));
    }
  }
}

TEST(BatchPlanTest, BatchLargerThanDataIsConfigError) {
  const std::string err = error_of([] { BatchPlan(100, 256, 1, true); });
  EXPECT_NE(err.find("ConfigError: data.batch_size 256 is larger than the training split (100 examples)"),
            std::string::npos)
      << err;
  BatchPlan exact(256, 256, 1, true);
  EXPECT_EQ(exact.steps_per_epoch(), 1);
}
