// Every strategy and composition over two planes (Note [Two planes], collectives/backends.h),
// as a cuda job runs them, on this machine: a real Open MPI job (mpirun -np 4) whose data
// plane is the device double (tests/common/plane_double.h: it refuses host memory, as NCCL
// refuses CPU tensors) and whose host plane is mpi wrapped in the host double (it refuses
// device memory, as Debian's Open MPI cannot read a GPU's). The job trains on the pretend
// device (Note [Pretend device]), which tells each tensor's bytes apart as a GPU would.
// A collective on a host tensor that reached the data plane (or the reverse) fails its
// case with the op, the group and the tensor named; every case must also follow one
// process (losses of every step, every parameter, the final evaluation), so the planes
// change where bytes travel and nothing of the arithmetic.
//
// Cases: data parallel (plain SGD, and AdamW with clipping, whose norm goes over the host
// plane), ZeRO 1-3, a pipeline under each schedule, tensor parallelism with sequence
// parallelism, replica threads, 3D and 4D, a checkpoint written under one layout and
// resumed under another, evaluation and metrics records in each. The planes themselves are
// built as run() builds them: BackendRegistry::create_planes with the double registered as
// a backend that carries no host tensors, so mpi is built beside it.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "collectives/backends.h"
#include "collectives/monitor.h"
#include "core/checkpoint.h"
#include "tests/collectives/mpi_gtest.h"
#include "tests/common/numerics.h"
#include "tests/common/plane_double.h"

using namespace tetra;
namespace fs = std::filesystem;

namespace {

collectives::Planes g_planes;  // data: the device double; host: mpi in the host double
std::string g_dir;             // one folder for the job, the same on every rank

const char* const kGpt = R"(
model: {type: gpt, layers: 4, d_model: 32, heads: 4, d_ff: 64, dropout: 0.1}
data: {type: text, seq_len: 16, batch_size: 16, eval_samples: 32}
optimizer: {type: sgd, lr: 0.05}
train: {max_steps: 4, seed: 5, threads: 1, eval_every: 2}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

const char* const kMlp = R"(
model: {type: mlp, hidden: [32, 32], dropout: 0.3}
data: {type: synthetic, shape: [24], classes: 4, train_samples: 512, test_samples: 64, batch_size: 16}
optimizer: {type: sgd, lr: 0.2}
train: {max_steps: 6, seed: 3, threads: 1, eval_every: 3}
checkpoint: {dir: ""}
log: {metrics: "", progress: off}
)";

const std::vector<std::string> kAdamWClipped = {"optimizer.type=adamw", "optimizer.lr=2.0e-3",
                                                "optimizer.weight_decay=0.01", "optimizer.clip_grad_norm=0.05"};

std::vector<std::string> plus(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The job's keys with the GPT's text (one file for every rank).
std::vector<std::string> gpt(const std::vector<std::string>& sets) {
  return plus({"data.path=" + g_dir + "/text.txt"}, sets);
}

// The job on this mpirun's four processes over the two planes, on the pretend device,
// with its metrics recorded (the records' gathers go over the host plane).
numerics::Outcome over_planes(const char* yaml, const std::vector<std::string>& sets) {
  core::set_threads(1);
  const core::JobSpec spec = numerics::job(yaml, plus(sets, {"log.metrics=" + g_dir + "/metrics.jsonl"}), "planes");
  core::TrainerOptions o;
  o.world = g_planes.data;
  o.host = g_planes.host;
  o.device = doubles::PretendDevice::device();
  numerics::Outcome out;
  core::train(spec, o, [&](int replica, core::Trainer& t, const core::TrainResult& r) {
    core::TensorMap w = t.weights();  // collective: every rank and replica
    if (replica == 0) {
      out.result = r;
      out.weights = std::move(w);
    }
  });
  return out;
}

// `got` follows `ref` (numerics::expect_follows, on the writer, where the weights are) and
// evaluated the same.
void expect_same_run(const numerics::Outcome& ref, const numerics::Outcome& got, double rel, const std::string& what) {
  ASSERT_EQ(ref.result.losses.size(), got.result.losses.size()) << what;
  if (g_planes.data->rank() == 0) numerics::expect_follows(ref, got, rel, what);
  ASSERT_TRUE(ref.result.final_eval && got.result.final_eval) << what << ": no evaluation";
  EXPECT_NEAR(got.result.final_eval->test_loss, ref.result.final_eval->test_loss,
              rel * std::abs(ref.result.final_eval->test_loss))
      << what << ": evaluation";
}

void follows(const char* yaml, const std::vector<std::string>& sets, const std::vector<std::string>& layout,
             double rel, const std::string& what) {
  const numerics::Outcome ref = numerics::run_single(yaml, sets);  // each rank alone
  const numerics::Outcome got = over_planes(yaml, plus(sets, layout));
  expect_same_run(ref, got, rel, what);
}

}  // namespace

TEST(TwoPlanes, DataParallelFollowsOneProcess) {
  follows(kMlp, {}, {"mesh.data=4"}, 1e-5, "data 4, sgd");
  follows(kMlp, kAdamWClipped, {"mesh.data=4"}, 1e-5, "data 4, adamw clipped");
}

TEST(TwoPlanes, ZeroStagesFollowOneProcess) {
  for (const char* stage : {"1", "2", "3"})
    follows(kMlp, {}, {"mesh.data=4", std::string("zero.stage=") + stage}, 1e-5, std::string("zero ") + stage + ", sgd");
  follows(kMlp, kAdamWClipped, {"mesh.data=4", "zero.stage=3"}, 1e-5, "zero 3, adamw clipped");
}

TEST(TwoPlanes, PipelineUnderEveryScheduleFollowsOneProcess) {
  for (const char* schedule : {"gpipe", "1f1b", "interleaved_1f1b", "zbh1", "zbv"}) {
    std::vector<std::string> layout = {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4",
                                       std::string("pipeline.schedule=") + schedule};
    if (std::string(schedule) == "interleaved_1f1b") layout.push_back("pipeline.virtual_stages=2");
    follows(kGpt, gpt({}), layout, 1e-5, std::string("pipeline 2 x data 2, ") + schedule);
  }
  follows(kGpt, gpt(kAdamWClipped), {"mesh.pipeline=4", "pipeline.micro_batches=4"}, 1e-5,
          "pipeline 4, 1f1b, adamw clipped");
}

TEST(TwoPlanes, TensorWithSequenceParallelismFollowsOneProcess) {
  follows(kGpt, gpt({}), {"mesh.tensor=2", "mesh.data=2", "tensor.sequence_parallel=true"}, 1e-5,
          "tensor 2 (sp) x data 2, sgd");
  follows(kGpt, gpt(kAdamWClipped), {"mesh.tensor=4", "tensor.sequence_parallel=true"}, 1e-5,
          "tensor 4 (sp), adamw clipped");
}

TEST(TwoPlanes, ReplicaThreadsFollowOneProcess) {
  follows(kMlp, {}, {"mesh.data=4", "replicate.replicas=2"}, 1e-5, "data 4 x 2 replicas, sgd");
  follows(kMlp, kAdamWClipped, {"mesh.data=4", "replicate.replicas=2", "zero.stage=2"}, 1e-5,
          "data 4 x 2 replicas, zero 2, adamw clipped");
}

TEST(TwoPlanes, ThreeAndFourAxesFollowOneProcess) {
  follows(kGpt, gpt(kAdamWClipped), {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4", "zero.stage=1"}, 1e-5,
          "3D: pipeline 2 x data 2, zero 1, adamw clipped");
  follows(kGpt, gpt(kAdamWClipped),
          {"mesh.tensor=2", "mesh.pipeline=2", "pipeline.micro_batches=2", "tensor.sequence_parallel=true",
           "replicate.replicas=2", "zero.stage=1"},
          1e-5, "4D: tensor 2 (sp) x pipeline 2 x 2 replicas, zero 1, adamw clipped");
}

TEST(TwoPlanes, CheckpointWrittenUnderOneLayoutResumesUnderAnother) {
  const std::string dir = g_dir + "/ckpt";
  const numerics::Outcome whole = numerics::run_single(kGpt, gpt(plus(kAdamWClipped, {"train.max_steps=6"})));
  // Steps 1-3 under pipeline 2 x data 2 with ZeRO-2, written at the end; steps 4-6 resumed
  // under tensor 2 x data 2 with ZeRO-3 (resharded from the layout-free checkpoint).
  over_planes(kGpt,
              gpt(plus(kAdamWClipped, {"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=4", "zero.stage=2",
                                       "checkpoint.dir=" + dir, "train.max_steps=3"})));
  const numerics::Outcome rest =
      over_planes(kGpt,
                  gpt(plus(kAdamWClipped, {"mesh.tensor=2", "mesh.data=2", "zero.stage=3", "checkpoint.dir=" + dir,
                                           "train.max_steps=6"})));
  EXPECT_NE(rest.result.resumed_from.find("step-00000003"), std::string::npos) << rest.result.resumed_from;
  if (g_planes.data->rank() == 0) numerics::expect_resumed_follows(whole, rest, 3, 1e-5, "resumed on another layout");
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  doubles::PretendDevice::install();  // before any tensor of the jobs exists
  int rank = 0, failed = 0;
  try {
    collectives::BackendRegistry backends;
    collectives::register_builtin_backends(backends);
    backends.add(doubles::device_double_backend());
    const collectives::LaunchInfo launch = collectives::detect_launch();
    collectives::Planes planes = backends.create_planes("device-double", launch);
    if (planes.shared() || planes.host->backend() != "mpi") {
      std::fprintf(stderr, "test_two_planes: expected the device double with mpi beside it, got %s\n",
                   planes.describe().c_str());
      return 1;
    }
    g_planes.data = planes.data;
    g_planes.host = doubles::PlaneDouble::wrap(planes.host, doubles::Plane::kHost);
    rank = g_planes.host->rank();
    // One folder for the job: rank 0's, named on every rank.
    g_dir = collectives::broadcast_string(
        *g_planes.host, rank == 0 ? fs::temp_directory_path().string() + "/tetra_two_planes_" + std::to_string(::getpid()) : "");
    if (rank == 0) {
      fs::remove_all(g_dir);
      fs::create_directories(g_dir);
      std::ofstream f(g_dir + "/text.txt");
      for (int i = 0; i < 400; ++i) f << "the quick brown fox " << i << " jumps over the lazy dog. ";
    }
    g_planes.host->barrier()->wait();
    // The monitor's handshake is host traffic too (Note [Monitor]).
    {
      collectives::Monitor monitor(*g_planes.host, {});
      failed = collectives::mpi_gtest::run_all_tests(rank, "test_two_planes");
      monitor.stop();
    }
    g_planes.host->barrier()->wait();
    if (rank == 0) fs::remove_all(g_dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] test_two_planes: %s\n", rank, e.what());
    return 1;
  }
  g_planes = {};
  return failed;
}
