#include "core/data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <zlib.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "collectives/error.h"
#include "core/random.h"
#include "core/text.h"

namespace tetra::core {

using tetra::detail::concat;

namespace {

// A generator of its own, so that reading data never moves the global torch RNG (which
// initialises the model's parameters).
at::Generator make_cpu_generator(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

const char* split_name(Split split) { return split == Split::kTrain ? "train" : "test"; }

torch::Tensor as_index(const torch::Tensor& indices) {
  TETRA_CHECK(indices.defined() && indices.dim() == 1, "dataset indices must be a 1-D tensor");
  return indices.scalar_type() == torch::kLong ? indices : indices.to(torch::kLong);
}

void check_indices(const torch::Tensor& idx, int64_t size, Split split) {
  if (idx.numel() == 0) return;
  const int64_t lo = idx.min().item<int64_t>();
  const int64_t hi = idx.max().item<int64_t>();
  if (lo < 0 || hi >= size)
    throw Error(concat("dataset index out of range: the ", split_name(split), " split has ",
                       size, " examples, asked for index ", lo < 0 ? lo : hi));
}

// Examples held as whole tensors (images, synthetic): a batch is an index_select.
class TensorDataset : public Dataset {
 public:
  TensorDataset(DataInfo info, torch::Tensor train_x, torch::Tensor train_y,
                torch::Tensor test_x, torch::Tensor test_y)
      : info_(std::move(info)),
        x_{train_x.contiguous(), test_x.contiguous()},
        y_{train_y.contiguous(), test_y.contiguous()} {}

  const DataInfo& info() const override { return info_; }
  int64_t size(Split split) const override { return x_[slot(split)].size(0); }

  Batch get(Split split, const torch::Tensor& indices) const override {
    const int s = slot(split);
    torch::Tensor idx = as_index(indices);
    check_indices(idx, x_[s].size(0), split);
    return Batch{x_[s].index_select(0, idx), y_[s].index_select(0, idx)};
  }

  Batch range(Split split, int64_t begin, int64_t end) const override {
    const int s = slot(split);
    TETRA_CHECK(0 <= begin && begin <= end && end <= x_[s].size(0), "range [", begin, ", ",
                end, ") outside the ", split_name(split), " split of ", x_[s].size(0),
                " examples");
    return Batch{x_[s].slice(0, begin, end), y_[s].slice(0, begin, end)};
  }

 private:
  static int slot(Split split) { return split == Split::kTrain ? 0 : 1; }
  DataInfo info_;
  torch::Tensor x_[2];
  torch::Tensor y_[2];
};

// A byte-level corpus: example i of a split is bytes [i*T, i*T + T + 1) of that split.
class TextDataset : public Dataset {
 public:
  TextDataset(DataInfo info, torch::Tensor train_bytes, torch::Tensor test_bytes)
      : info_(std::move(info)), bytes_{train_bytes, test_bytes} {
    for (int s = 0; s < 2; ++s) examples_[s] = (bytes_[s].size(0) - 1) / info_.seq_len;
  }

  const DataInfo& info() const override { return info_; }
  int64_t size(Split split) const override { return examples_[slot(split)]; }

  Batch get(Split split, const torch::Tensor& indices) const override {
    const int s = slot(split);
    torch::Tensor idx = as_index(indices);
    check_indices(idx, examples_[s], split);
    const int64_t T = info_.seq_len;
    const int64_t n = idx.size(0);
    torch::Tensor offsets = (idx * T).unsqueeze(1) + torch::arange(T + 1, torch::kLong).unsqueeze(0);
    torch::Tensor windows =
        bytes_[s].index_select(0, offsets.reshape({-1})).to(torch::kLong).view({n, T + 1});
    return Batch{windows.slice(1, 0, T).contiguous(), windows.slice(1, 1, T + 1).contiguous()};
  }

 private:
  static int slot(Split split) { return split == Split::kTrain ? 0 : 1; }
  DataInfo info_;
  torch::Tensor bytes_[2];
  int64_t examples_[2] = {0, 0};
};

// Fashion-MNIST's pixel mean and standard deviation over the training split (after / 255),
// with which every image is normalised (exports say so: DataInfo::preprocessing).
constexpr double kFashionMean = 0.2860, kFashionStd = 0.3530;

const char* kFashionHint =
    "install the Debian package dataset-fashion-mnist (tools/setup.sh does) or set data.path";

std::unique_ptr<Dataset> make_fashion_mnist(const DataSpec& spec) {
  namespace fs = std::filesystem;
  const fs::path dir(spec.path);
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw DataError(concat("fashion-mnist folder ", spec.path, " not found: ", kFashionHint));
  auto load = [&](const char* name) {
    const std::string path = (dir / name).string();
    if (!fs::exists(path, ec))
      throw DataError(concat("cannot open ", path, ": No such file or directory; ", kFashionHint));
    return read_idx_gz(path);
  };
  auto images = [&](const char* name) {
    torch::Tensor t = load(name);
    if (t.dim() != 3 || t.size(1) != 28 || t.size(2) != 28) {
      std::vector<int64_t> dims(t.sizes().begin(), t.sizes().end());
      throw DataError(concat((dir / name).string(), ": expected images of [N, 28, 28], got ",
                             shape_str(dims)));
    }
    // [N, 28, 28] uint8 -> [N, 1, 28, 28] float in [0, 1], then Fashion-MNIST's mean/std.
    torch::Tensor x = t.to(torch::kFloat).unsqueeze(1);
    x.mul_(1.0 / (255.0 * kFashionStd)).sub_(kFashionMean / kFashionStd);
    return x;
  };
  auto labels = [&](const char* name, int64_t count) {
    torch::Tensor t = load(name);
    const std::string path = (dir / name).string();
    if (t.dim() != 1)
      throw DataError(concat(path, ": expected a 1-D label file, got ", t.dim(), " dims"));
    if (t.size(0) != count)
      throw DataError(concat(path, ": ", t.size(0), " labels for ", count, " images"));
    if (t.numel() > 0 && t.max().item<int64_t>() > 9)
      throw DataError(concat(path, ": label ", t.max().item<int64_t>(), " outside [0, 9]"));
    return t.to(torch::kLong);
  };
  torch::Tensor train_x = images("train-images-idx3-ubyte.gz");
  torch::Tensor train_y = labels("train-labels-idx1-ubyte.gz", train_x.size(0));
  torch::Tensor test_x = images("t10k-images-idx3-ubyte.gz");
  torch::Tensor test_y = labels("t10k-labels-idx1-ubyte.gz", test_x.size(0));
  DataInfo info;
  info.input_shape = {1, 28, 28};
  info.num_classes = 10;
  info.preprocessing = {
      {"kind", "image"},
      {"raw", "uint8 pixels, 28 x 28, row-major (the IDX files' order); labels 0-9"},
      {"scale", 1.0 / 255.0},
      {"mean", kFashionMean},
      {"std", kFashionStd},
      {"formula", "x = (pixels * scale - mean) / std, float32 of shape [N, 1, 28, 28]"},
      {"classes", {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot"}}};
  info.description = concat("Fashion-MNIST (", train_x.size(0), " train, ", test_x.size(0), " test)");
  return std::make_unique<TensorDataset>(std::move(info), train_x, train_y, test_x, test_y);
}

std::unique_ptr<Dataset> make_text(const DataSpec& spec) {
  if (spec.seq_len < 1) throw ConfigError(concat("data.seq_len must be >= 1, got ", spec.seq_len));
  if (!(spec.test_fraction >= 0.0 && spec.test_fraction < 1.0))
    throw ConfigError(concat("data.test_fraction must be in [0, 1), got ", spec.test_fraction));
  std::ifstream in(spec.path, std::ios::binary | std::ios::ate);
  if (!in) throw DataError(concat("cannot open ", spec.path, ": ", std::strerror(errno)));
  const std::streamoff n = in.tellg();
  if (n < 0) throw DataError(concat("cannot read ", spec.path));
  in.seekg(0);
  torch::Tensor bytes = torch::empty({static_cast<int64_t>(n)}, torch::kUInt8);
  if (n > 0 && !in.read(reinterpret_cast<char*>(bytes.data_ptr<uint8_t>()), n))
    throw DataError(concat("cannot read ", spec.path, ": read failed after ", in.gcount(), " of ",
                           n, " bytes"));
  const int64_t total = n;
  const int64_t train_bytes =
      static_cast<int64_t>(std::floor((1.0 - spec.test_fraction) * static_cast<double>(total)));
  const int64_t test_bytes = total - train_bytes;
  const int64_t T = spec.seq_len;
  auto examples = [T](int64_t b) { return b > 0 ? (b - 1) / T : 0; };
  for (auto [name, b] : {std::pair<const char*, int64_t>{"train", train_bytes},
                         std::pair<const char*, int64_t>{"test", test_bytes}}) {
    if (examples(b) == 0)
      throw DataError(concat(spec.path, " is too small for data.seq_len ", T, ": its ", total,
                             " bytes give a ", name, " split of ", b,
                             " bytes, and a sequence needs seq_len + 1 = ", T + 1));
  }
  DataInfo info;
  info.input_shape = {T};
  info.num_classes = 256;
  info.language_model = true;
  info.seq_len = T;
  info.preprocessing = {
      {"kind", "bytes"},
      {"vocab", 256},
      {"seq_len", T},
      {"formula", "ids = the text's bytes (0-255) as int64, seq_len of them per sequence, shape [N, seq_len]; "
                  "the output at each position scores the next byte"}};
  info.description = concat("text ", spec.path, " (", total, " bytes; ", examples(train_bytes),
                            " train, ", examples(test_bytes), " test sequences of ", T, ")");
  return std::make_unique<TextDataset>(std::move(info), bytes.slice(0, 0, train_bytes).clone(),
                                       bytes.slice(0, train_bytes, total).clone());
}

std::unique_ptr<Dataset> make_synthetic(const DataSpec& spec, int64_t seed) {
  if (spec.shape.empty()) throw ConfigError("data.shape must have at least one dimension");
  for (int64_t d : spec.shape)
    if (d < 1) throw ConfigError(concat("data.shape ", shape_str(spec.shape), " has a dimension < 1"));
  if (spec.classes < 1) throw ConfigError(concat("data.classes must be >= 1, got ", spec.classes));
  if (spec.train_samples < 1 || spec.test_samples < 1)
    throw ConfigError(concat("data.train_samples and data.test_samples must be >= 1, got ",
                             spec.train_samples, " and ", spec.test_samples));
  at::Generator gen = make_cpu_generator(splitmix64(static_cast<uint64_t>(seed) ^ 0x5EEDDA7AULL));
  std::vector<int64_t> centre_shape = {spec.classes};
  centre_shape.insert(centre_shape.end(), spec.shape.begin(), spec.shape.end());
  // Class centres ~ N(0, 1) per element, examples = centre + N(0, 1) noise: separable.
  torch::Tensor centres = torch::randn(centre_shape, gen, torch::kFloat);
  auto draw = [&](int64_t n) {
    torch::Tensor labels = torch::randint(0, spec.classes, {n}, gen, torch::kLong);
    std::vector<int64_t> shape = {n};
    shape.insert(shape.end(), spec.shape.begin(), spec.shape.end());
    torch::Tensor x = centres.index_select(0, labels) + torch::randn(shape, gen, torch::kFloat);
    return std::make_pair(x, labels);
  };
  auto [train_x, train_y] = draw(spec.train_samples);
  auto [test_x, test_y] = draw(spec.test_samples);
  DataInfo info;
  info.input_shape = spec.shape;
  info.num_classes = spec.classes;
  info.preprocessing = {{"kind", "synthetic"},
                        {"formula", "none: float32 inputs of input.shape drawn by tetra from data.seed's stream"}};
  info.description = concat("synthetic (shape ", shape_str(spec.shape), ", ", spec.classes,
                            " classes, ", spec.train_samples, " train, ", spec.test_samples,
                            " test)");
  return std::make_unique<TensorDataset>(std::move(info), train_x, train_y, test_x, test_y);
}

}  // namespace

Batch Dataset::range(Split split, int64_t begin, int64_t end) const {
  TETRA_CHECK(0 <= begin && begin <= end && end <= size(split), "range [", begin, ", ", end,
              ") outside the ", split_name(split), " split of ", size(split), " examples");
  return get(split, torch::arange(begin, end, torch::kLong));
}

std::unique_ptr<Dataset> make_dataset(const DataSpec& spec, int64_t seed) {
  if (spec.type == "fashion-mnist") return make_fashion_mnist(spec);
  if (spec.type == "text") return make_text(spec);
  if (spec.type == "synthetic") return make_synthetic(spec, seed);
  throw ConfigError(concat("unknown data.type '", spec.type,
                           "' (known: fashion-mnist, text, synthetic)"));
}

torch::Tensor read_idx_gz(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) {
    const int err = errno;
    throw DataError(concat("cannot open ", path, ": ",
                           err ? std::strerror(err) : "out of memory in zlib"));
  }
  struct Closer {
    gzFile f;
    ~Closer() { gzclose(f); }
  } closer{f};
  gzbuffer(f, 1 << 20);

  // Reads up to n bytes; returns how many were read (short at end of file).
  auto read = [&](void* dst, int64_t n) -> int64_t {
    int64_t got = 0;
    auto* p = static_cast<unsigned char*>(dst);
    while (got < n) {
      const unsigned chunk =
          static_cast<unsigned>(std::min<int64_t>(n - got, std::numeric_limits<int>::max() / 2));
      const int r = gzread(f, p + got, chunk);
      if (r < 0) {
        int zerr = 0;
        const char* msg = gzerror(f, &zerr);
        throw DataError(concat(path, ": corrupt gzip data (", msg ? msg : "unknown error", ")"));
      }
      if (r == 0) break;
      got += r;
    }
    return got;
  };

  unsigned char magic[4];
  const int64_t got_magic = read(magic, 4);
  if (got_magic < 4)
    throw DataError(concat(path, ": truncated: expected a 4-byte IDX header, got ", got_magic,
                           " bytes"));
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != 0x08) {
    std::ostringstream os;
    os << std::hex;
    for (int i = 0; i < 4; ++i) os << (i ? " " : "") << "0x" << static_cast<int>(magic[i]);
    throw DataError(concat(path, ": bad magic ", os.str(),
                           " (expected 0x0 0x0 0x8 NDIM: an IDX file of uint8)"));
  }
  const int ndim = magic[3];
  if (ndim < 1 || ndim > 8)
    throw DataError(concat(path, ": bad IDX header: ", ndim, " dimensions (expected 1 to 8)"));
  std::vector<int64_t> dims(ndim);
  constexpr int64_t kMaxBytes = int64_t{1} << 34;  // 16 GiB: far beyond any real dataset
  int64_t total = 1;
  for (int i = 0; i < ndim; ++i) {
    unsigned char b[4];
    const int64_t got = read(b, 4);
    if (got < 4)
      throw DataError(concat(path, ": truncated: the IDX header ends inside dimension ", i));
    const uint32_t d = (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
    if (d > static_cast<uint32_t>(std::numeric_limits<int32_t>::max()))
      throw DataError(concat(path, ": bad IDX header: dimension ", i, " is negative"));
    dims[i] = static_cast<int64_t>(d);
    if (dims[i] > 0 && total > kMaxBytes / dims[i])
      throw DataError(concat(path, ": bad IDX header: dims ", shape_str(dims),
                             " are absurdly large (more than 16 GiB of data)"));
    total *= dims[i];
  }
  torch::Tensor out = torch::empty(dims, torch::kUInt8);
  const int64_t got = read(out.data_ptr<uint8_t>(), total);
  if (got < total)
    throw DataError(concat(path, ": truncated: expected ", total, " bytes of data, got ", got));
  return out;
}

BatchPlan::BatchPlan(int64_t examples, int64_t global_batch, int64_t seed, bool shuffle)
    : examples_(examples), global_batch_(global_batch), seed_(seed), steps_per_epoch_(0),
      shuffle_(shuffle) {
  if (global_batch < 1) throw ConfigError(concat("data.batch_size must be >= 1, got ", global_batch));
  if (global_batch > examples)
    throw ConfigError(concat("data.batch_size ", global_batch,
                             " is larger than the training split (", examples, " examples)"));
  steps_per_epoch_ = examples / global_batch;
}

torch::Tensor BatchPlan::global_batch(int64_t epoch, int64_t step) {
  TETRA_CHECK(epoch >= 0, "epoch must be >= 0, got ", epoch);
  TETRA_CHECK(0 <= step && step < steps_per_epoch_, "step ", step, " outside the epoch's ",
              steps_per_epoch_, " steps");
  if (epoch != cached_epoch_ || !order_.defined()) {
    if (shuffle_) {
      const uint64_t h = splitmix64(splitmix64(static_cast<uint64_t>(seed_)) ^
                                    static_cast<uint64_t>(epoch) * 0xD1B54A32D192ED03ULL);
      at::Generator gen = make_cpu_generator(h);
      order_ = torch::randperm(examples_, gen, torch::kLong);
    } else {
      order_ = torch::arange(examples_, torch::kLong);
    }
    cached_epoch_ = epoch;
  }
  return order_.slice(0, step * global_batch_, (step + 1) * global_batch_);
}

torch::Tensor BatchPlan::slice(const torch::Tensor& indices, int64_t part, int64_t parts) {
  TETRA_CHECK(parts >= 1 && 0 <= part && part < parts, "slice part ", part, " of ", parts);
  TETRA_CHECK(indices.dim() == 1, "slice needs 1-D indices");
  const int64_t n = indices.size(0);
  return indices.slice(0, slice_begin(n, part, parts), slice_begin(n, part + 1, parts));
}

int64_t BatchPlan::slice_begin(int64_t n, int64_t part, int64_t parts) { return part * n / parts; }

}  // namespace tetra::core
