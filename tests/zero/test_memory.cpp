// What a rank creates of its model, counted in bytes by the allocator itself: LibTorch's
// CPU allocator is wrapped for the test, and every allocation a rank's thread makes is
// charged to that rank (its live bytes and their high-water mark), wherever it is freed.
//
// - Initial weights are the same bytes on every layout (Note [Layout-invariant
//   initialisation]): one process, ZeRO-3 on 3 and 4 ranks, a pipeline of 2 stages,
//   pipeline x ZeRO-3, and data parallelism export the same tensors bit for bit, for an
//   MLP (uniform draws) and a GPT (normal draws, norms).
// - No rank's allocations ever exceed its plan's share of the model state (the dry run's
//   per-rank estimate) plus one unit being gathered: not while the trainer builds and
//   shards the model (the whole model, 4 bytes per parameter, never exists on a ZeRO-3
//   rank), and not while it trains, beyond the activations the step keeps.
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>

#include "collectives/local.h"
#include "core/init.h"
#include "core/layers.h"
#include "core/runtime.h"
#include "core/torch_compat.h"
#include "core/model_plan.h"
#include "core/trainer.h"
#include "tests/common/numerics.h"

using namespace tetra;
using namespace tetra::core;

namespace {

// ---- an allocator that charges each allocation to the rank whose thread made it -------

struct Account {
  std::atomic<int64_t> live{0}, peak{0};
  void reset_peak() { peak = live.load(); }
};
thread_local Account* t_account = nullptr;  // the rank this thread allocates for

// Each block carries a 64-byte header (keeping c10's 64-byte alignment) naming its size
// and its account, so a block freed on another thread (a progress thread, autograd)
// still goes back to the right rank.
struct Header {
  size_t bytes;
  Account* account;
};
constexpr size_t kHeader = 64;

void counted_free(void* p) {
  if (!p) return;
  char* base = static_cast<char*>(p) - kHeader;
  const Header* h = reinterpret_cast<const Header*>(base);
  if (h->account) h->account->live -= static_cast<int64_t>(h->bytes);
  std::free(base);
}

class CountingAllocator final : public core::compat::CpuAllocator {
 public:
  c10::DataPtr make(size_t n) const override {
    void* base = nullptr;
    if (posix_memalign(&base, 64, n + kHeader) != 0) throw std::bad_alloc();
    Account* a = t_account;
    *static_cast<Header*>(base) = {n, a};
    if (a) {
      const int64_t now = a->live += static_cast<int64_t>(n);
      int64_t seen = a->peak.load();
      while (now > seen && !a->peak.compare_exchange_weak(seen, now)) {
      }
    }
    void* p = static_cast<char*>(base) + kHeader;
    return {p, p, &counted_free, at::Device(at::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_free; }
};

// Installs the counting allocator for the test's lifetime (and puts the previous back).
class CountAllocations {
 public:
  CountAllocations() : previous_(c10::GetCPUAllocator()) {
    c10::SetCPUAllocator(&counting(), /*priority=*/1);
  }
  ~CountAllocations() { c10::SetCPUAllocator(previous_, /*priority=*/1); }

 private:
  static CountingAllocator& counting() {
    static CountingAllocator* a = new CountingAllocator;  // blocks may outlive the test
    return *a;
  }
  c10::Allocator* previous_;
};

// ---- jobs -------------------------------------------------------------------------------

const char* kMlp = R"(
model: {type: mlp, hidden: [128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128]}
data: {type: synthetic, shape: [64], classes: 10, train_samples: 480, test_samples: 48, batch_size: 48, eval_samples: 48}
optimizer: {type: adam, lr: 1.0e-3}
train: {max_steps: 3, seed: 9, threads: 1, eval_every: 0}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

const char* kGpt = R"(
model: {type: gpt, layers: 2, d_model: 32, heads: 2}
data: {type: text, seq_len: 16, batch_size: 24, eval_samples: 24}
optimizer: {type: adamw, lr: 1.0e-3}
train: {max_steps: 2, seed: 9, threads: 1}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

std::string text_file() {
  const std::string path = testing::TempDir() + "/tetra_memory_text.txt";
  std::ofstream f(path);
  for (int i = 0; i < 200; ++i) f << "a text to read, line " << i << ". ";
  return path;
}

// The whole model's initial weights, gathered on the writer, as one layout creates them
// (`base`: a program's own model, TrainerOptions::model).
TensorMap initial_weights(const std::string& yaml, std::vector<std::string> sets, int processes,
                          const TrainerOptions& base = {}) {
  const JobSpec spec = numerics::job(yaml, sets, "memory");
  set_threads(1);
  if (processes == 1) return Trainer(spec, base).weights();
  TensorMap out;
  collectives::run_local_ranks(processes, [&](int p, collectives::Communicator& world) {
    TrainerOptions o = base;
    o.world = world.shared_from_this();
    Trainer t(spec, o);
    TensorMap w = t.weights();
    if (p == 0) out = std::move(w);
  });
  return out;
}

}  // namespace

TEST(ZeroMemory, InitialWeightsDoNotDependOnTheLayout) {
  const std::string text = "data.path=" + text_file();
  for (const auto& [yaml, sets] :
       std::vector<std::pair<const char*, std::vector<std::string>>>{{kMlp, {}}, {kGpt, {text}}}) {
    const TensorMap one = initial_weights(yaml, sets, 1);
    ASSERT_FALSE(one.empty());
    struct Layout {
      int processes;
      std::vector<std::string> sets;
    };
    for (const Layout& l : std::vector<Layout>{
             {3, {"mesh.data=3", "zero.stage=3"}},
             {4, {"mesh.data=4", "zero.stage=3"}},
             {2, {"mesh.data=2", "zero.stage=1"}},
             {2, {"mesh.data=2"}},
             {2, {"mesh.pipeline=2", "pipeline.micro_batches=2"}},
             {4, {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=2", "zero.stage=3"}}}) {
      auto s = sets;
      s.insert(s.end(), l.sets.begin(), l.sets.end());
      std::string what;
      for (const auto& x : l.sets) what += x + " ";
      const TensorMap got = initial_weights(yaml, s, l.processes);
      ASSERT_EQ(got.size(), one.size()) << what;
      for (const auto& [name, w] : one) {
        ASSERT_TRUE(got.count(name)) << what << name;
        EXPECT_TRUE(at::equal(got.at(name), w)) << what << ": " << name << " differs";
      }
    }
  }
}

// A program's own model built of tetra's layers, and of a module of its own that says how
// its parameter is drawn, is shapes like the zoo's: ZeRO-3's ranks draw their chunks, and
// they are the bytes one process draws.
namespace {
struct ScaleImpl : torch::nn::Cloneable<ScaleImpl>, Initialized {
  explicit ScaleImpl(int64_t n) : n_(n) { reset(); }
  void reset() override { gain = register_parameter("gain", shape_parameter({n_}, gain)); }
  at::Tensor forward(const at::Tensor& x) { return x * gain; }
  Init init_of(const std::string&) const override { return Init::normal(1.0, 0.1); }
  at::Tensor gain;
  int64_t n_;
};
TORCH_MODULE(Scale);
}  // namespace

TEST(ZeroMemory, AProgramsModelOfTetrasLayersDrawsTheSameWeightsOnEveryLayout) {
  TrainerOptions own;
  own.model = [](const DataInfo& d) {
    torch::nn::Sequential m;
    m->push_back(Linear(d.input_shape[0], 96));
    m->push_back(Scale(96));
    m->push_back(torch::nn::ReLU());
    m->push_back(Linear(96, d.num_classes));
    return m;
  };
  const TensorMap one = initial_weights(kMlp, {}, 1, own);
  ASSERT_EQ(one.size(), 5u);
  const TensorMap got = initial_weights(kMlp, {"mesh.data=2", "zero.stage=3"}, 2, own);
  for (const auto& [name, w] : one) EXPECT_TRUE(at::equal(got.at(name), w)) << name << " differs";
  EXPECT_NEAR(one.at("1.gain").mean().item<double>(), 1.0, 0.05);
}

// ZeRO-3 on 2 and 4 thread-ranks over a deep MLP: what each rank's thread allocates while
// the trainer is made, and at any moment of three training steps.
TEST(ZeroMemory, NoRankAllocatesMoreThanItsShareAndOneUnit) {
  const std::vector<std::string> base = {"zero.stage=3"};
  const JobSpec probe = numerics::job(kMlp, {"mesh.data=2", "zero.stage=3"}, "memory");
  // The data, made once and shared, is not the model's.
  std::shared_ptr<const Dataset> data(make_dataset(probe.data, probe.train.seed));
  CountAllocations counting;
  for (int n : {2, 4}) {
    auto sets = base;
    sets.push_back("mesh.data=" + std::to_string(n));
    const JobSpec spec = numerics::job(kMlp, sets, "memory");
    const std::vector<RankEstimate> plan = ModelPlan(spec, {}, data).estimate();
    const int64_t whole = ModelPlan(spec, {}, data).parameters() * 4;
    // The largest unit: a 128 x 128 layer with its bias, padded to n x 16 elements.
    const int64_t unit = (128 * 128 + 128 + 16 * n) * 4;
    std::vector<Account> made(static_cast<size_t>(n)), trained(static_cast<size_t>(n));
    set_threads(1);
    collectives::run_local_ranks(n, [&](int p, collectives::Communicator& world) {
      TrainerOptions o;
      o.world = world.shared_from_this();
      o.data = data;
      Account& a = made[static_cast<size_t>(p)];
      t_account = &a;
      {
        Trainer t(spec, o);
        // Now training: the same live bytes, a new high-water mark.
        trained[static_cast<size_t>(p)].live = a.live.load();
        trained[static_cast<size_t>(p)].reset_peak();
        t_account = &trained[static_cast<size_t>(p)];
        t.run();
        t_account = nullptr;
      }
    });
    for (int p = 0; p < n; ++p) {
      const RankEstimate& e = plan[static_cast<size_t>(p)];
      const int64_t share = e.state.total();
      const int64_t built = made[static_cast<size_t>(p)].peak,
                    ran = trained[static_cast<size_t>(p)].peak;
      std::printf(
          "%d ranks, rank %d: the whole model %lld B; its share %lld B (parameters %lld, gradients "
          "%lld, "
          "optimizer %lld, buffers %lld), activations %lld B; made at most %lld B, trained at most "
          "%lld B\n",
          n, p, static_cast<long long>(whole), static_cast<long long>(share),
          static_cast<long long>(e.state.parameters), static_cast<long long>(e.state.gradients),
          static_cast<long long>(e.state.optimizer), static_cast<long long>(e.state.buffers),
          static_cast<long long>(e.activations), static_cast<long long>(built),
          static_cast<long long>(ran));
      // Made: its shards of the parameters, gradients and optimizer state, the unit of
      // gradients on their way, and one more unit at most. Building the whole model first
      // (4 bytes a parameter) would exceed it by far.
      const int64_t shards = e.state.parameters + e.state.gradients + e.state.optimizer;
      EXPECT_LE(built, shards + 2 * unit) << n << " ranks, rank " << p;
      // Trained: the same, the layers gathered at the moment (in the share's buffers), the
      // activations one step keeps, and one unit of gradients autograd has just made.
      EXPECT_LE(ran, share + e.activations + unit) << n << " ranks, rank " << p;
    }
  }
}
