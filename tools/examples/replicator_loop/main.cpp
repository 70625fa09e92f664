// replicator-loop: a training loop of one's own on tetra's Replicator (TF-Replicator's API).
//
// A small MLP learns y = sin(x.a) + x.b / 2 from synthetic data in which 5% of the targets
// are gross outliers (+10), under the Huber loss (quadratic near zero, linear past delta,
// so the outliers do not steer the fit): a loss tetra's trainer does not know. Every
// replica holds its own copy of the model; each step each one takes its slice of the
// global batch, computes its gradient with autograd, averages it over every replica of the
// job (all_reduce_mean) and takes the same SGD step, so the copies stay equal.
//
//   replicator-loop [replicas per process, 2] [steps, 300]
//   mpirun -np 2 replicator-loop               # 2 processes x 2 replicas
//
// It checks itself and exits 1 unless every replica ends with the same weights and the
// model's mean squared error to the clean targets, over the whole data set, fell below a
// fifth of what it was at the start.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <vector>

#include "tetra/tetra.h"

namespace {

using tetra::collectives::ReduceOp;
using tetra::replicate::ReplicaContext;

constexpr int64_t kFeatures = 8, kSamples = 4096;
constexpr int64_t kPerReplica = 32;  // samples per replica per step
constexpr double kLr = 0.1, kDelta = 1.0;
constexpr int kEvery = 50;  // steps per line of output

// The Huber loss, averaged over the slice.
at::Tensor huber(const at::Tensor& prediction, const at::Tensor& target) {
  const at::Tensor r = (prediction - target).abs();
  return at::where(r <= kDelta, 0.5 * r * r, kDelta * (r - 0.5 * kDelta)).mean();
}

struct Slice {
  at::Tensor x, y;
};

// Runs fn(ctx) on every replica, without input.
template <typename Result, typename Fn>
tetra::replicate::PerReplica<Result> on_every_replica(tetra::replicate::Replicator& repl, Fn fn) {
  return repl.run<int, Result>([](ReplicaContext&) { return 0; },
                               [&](ReplicaContext& ctx, int&) { return fn(ctx); });
}

}  // namespace

int main(int argc, char** argv) {
  tetra::core::prepare_process(argc, argv);
  const int replicas = argc > 1 ? std::atoi(argv[1]) : 2;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 300;
  try {
    // Under mpirun the processes' world over MPI; alone, none.
    const tetra::collectives::LaunchInfo launch = tetra::collectives::detect_launch();
    tetra::replicate::ReplicatorOptions options;
    options.replicas = replicas;
    options.threads = 1;
    if (launch.multi_process()) {
      tetra::collectives::BackendRegistry backends;
      tetra::collectives::register_builtin_backends(backends);
      options.world = backends.create_world("mpi", launch);
    }
    tetra::replicate::Replicator repl(options);
    const bool speak = launch.rank == 0;

    // The data set, the same in every process (seeded): Y is Y_clean plus the outliers.
    at::manual_seed(7);
    const at::Tensor X = at::randn({kSamples, kFeatures});
    const at::Tensor a = at::randn({kFeatures, 1}), b = at::randn({kFeatures, 1});
    const at::Tensor Y_clean = at::sin(X.matmul(a)) + 0.5 * X.matmul(b);
    const at::Tensor Y = Y_clean + 10.0 * (at::rand({kSamples, 1}) < 0.05).to(at::kFloat);

    // One model per replica, started from replica 0's weights.
    std::vector<torch::nn::Sequential> models;
    for (int r = 0; r < repl.local_replicas(); ++r)
      models.emplace_back(torch::nn::Linear(kFeatures, 32), torch::nn::Tanh(),
                          torch::nn::Linear(32, 1));
    auto model_of = [&](const ReplicaContext& ctx) -> torch::nn::Sequential& {
      return models[static_cast<size_t>(ctx.local_replica_id())];
    };
    on_every_replica<int>(repl, [&](ReplicaContext& ctx) {
      torch::NoGradGuard no_grad;
      for (auto& p : model_of(ctx)->parameters()) p.copy_(ctx.broadcast(p, 0));
      return 0;
    });

    // How well the model fits the clean function, over the whole data set: each replica
    // measures its shard, and the shards' means are averaged.
    auto shard_error = [&](ReplicaContext& ctx) {
      torch::NoGradGuard no_grad;
      const int64_t per = kSamples / ctx.num_replicas();
      const at::Tensor x = X.narrow(0, per * ctx.replica_id(), per);
      const at::Tensor y = Y_clean.narrow(0, per * ctx.replica_id(), per);
      return (model_of(ctx)->forward(x) - y).pow(2).mean().item<double>();
    };
    auto clean_error = [&] {
      return repl.reduce(ReduceOp::kAvg, on_every_replica<double>(repl, shard_error));
    };
    const double error_before = clean_error();

    double block = 0;  // the losses of the steps since the last line
    for (int step = 0; step < steps; ++step) {
      auto losses = repl.run<Slice, double>(
          [&](ReplicaContext& ctx) {  // this replica's slice of the step's global batch
            const int64_t begin =
                (int64_t{step} * ctx.num_replicas() + ctx.replica_id()) * kPerReplica;
            const at::Tensor rows =
                at::arange(begin, begin + kPerReplica, at::kLong).remainder(kSamples);
            return Slice{X.index_select(0, rows), Y.index_select(0, rows)};
          },
          [&](ReplicaContext& ctx, Slice& slice) {
            torch::nn::Sequential& model = model_of(ctx);
            model->zero_grad();
            const at::Tensor loss = huber(model->forward(slice.x), slice.y);
            loss.backward();
            torch::NoGradGuard no_grad;
            for (auto& p : model->parameters()) p.sub_(kLr * ctx.all_reduce_mean(p.grad()));
            return loss.item<double>();
          });
      block += repl.reduce(ReduceOp::kAvg, losses);  // the global batch's loss
      if (speak && ((step + 1) % kEvery == 0 || step + 1 == steps)) {
        const int from = step / kEvery * kEvery;
        std::printf("steps %4d-%-4d  huber loss %.4f\n", from, step, block / (step + 1 - from));
        block = 0;
      }
    }
    const double error_after = clean_error();

    // Every replica's weights, gathered on each: how far any of them is from replica 0's.
    const double differ = repl.reduce(
        ReduceOp::kMax, on_every_replica<double>(repl, [&](ReplicaContext& ctx) {
          std::vector<at::Tensor> flat;
          for (const auto& p : model_of(ctx)->parameters())
            flat.push_back(p.detach().reshape({-1}));
          const at::Tensor all = ctx.all_gather(at::cat(flat));  // [replicas, parameters]
          return (all - all[0]).abs().max().item<double>();
        }));

    const bool learned = error_after < 0.2 * error_before;
    if (speak) {
      std::printf(
          "%d replica%s (%d per process), %d steps: squared error to the clean targets %.4f -> "
          "%.4f (%s)\n",
          repl.num_replicas(), repl.num_replicas() == 1 ? "" : "s", repl.local_replicas(), steps,
          error_before, error_after, learned ? "learned" : "did not learn");
      if (differ == 0)
        std::printf("weights equal on all %d replicas\n", repl.num_replicas());
      else
        std::printf("weights differ between replicas by up to %g\n", differ);
    }
    return learned && differ == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "replicator-loop: %s\n", e.what());
    return 1;
  }
}
