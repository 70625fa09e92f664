// bench-overhead — what does the framework cost over a bare LibTorch loop?
//
// Runs the same model, global batch, data and thread count N steps through tetra's
// Trainer (what `train` runs) and through a hand-written LibTorch loop (index a batch,
// forward, cross-entropy, backward, torch::optim step), alternating the two `--repeats`
// times in one process so both see the same machine, and prints samples/s of each and
// their ratio (tetra / bare: 1.0 = no overhead). Both share this process's allocator and
// thread settings (core/runtime.h).
//
//   bench-overhead [JOB.yaml] [--steps 300] [--repeats 5] [--threads 1] [--set k=v]...
#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "core/data.h"
#include "core/job_file.h"
#include "core/job_spec.h"
#include "core/models.h"
#include "core/random.h"
#include "core/runtime.h"
#include "core/trainer.h"

using namespace tetra::core;

namespace {

const char* kDefaultJob = R"(
name: bench-overhead
model: {type: mlp, hidden: [1024, 1024]}
data: {type: fashion-mnist, batch_size: 256}
optimizer: {type: adamw, lr: 1.0e-3, weight_decay: 0.01}
log: {progress: off}
)";

double bare_loop(const JobSpec& spec, const Dataset& data, int64_t steps) {
  torch::manual_seed(static_cast<uint64_t>(spec.train.seed));
  torch::nn::Sequential model = build_model(spec.model, data.info(), static_cast<uint64_t>(spec.train.seed));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(spec.optimizer.lr)
                                                   .betas({spec.optimizer.beta1, spec.optimizer.beta2})
                                                   .eps(spec.optimizer.eps)
                                                   .weight_decay(spec.optimizer.weight_decay));
  const int64_t n = data.size(Split::kTrain), b = spec.data.batch_size;
  torch::Tensor order = torch::randperm(n, torch::kInt64);
  auto t0 = std::chrono::steady_clock::now();
  double sink = 0;
  for (int64_t s = 0; s < steps; ++s) {
    int64_t start = (s * b) % (n - b + 1);
    Batch batch = data.get(Split::kTrain, order.slice(0, start, start + b));
    RandomContext::Scope random(static_cast<uint64_t>(spec.train.seed), s, 0);  // what the trainer keys dropout by
    opt.zero_grad();
    torch::Tensor loss = torch::nn::functional::cross_entropy(model->forward(batch.inputs), batch.targets);
    loss.backward();
    opt.step();
    sink += loss.item<double>();  // the trainer reads every step's loss too
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (sink != sink) std::printf("(diverged)\n");
  return static_cast<double>(steps * b) / secs;
}

}  // namespace

int main(int argc, char** argv) {
  prepare_process(argc, argv);
  CLI::App app{"bench-overhead: tetra's Trainer against a bare LibTorch loop", "bench-overhead"};
  std::string job;
  std::vector<std::string> sets;
  int64_t steps = 300;
  int repeats = 5, threads = 1;
  app.add_option("job", job, "job file (default: the Fashion-MNIST MLP 784-1024-1024-10, batch 256)");
  app.add_option("--steps", steps, "steps per measurement")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "measurements of each, alternating")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "intra-op threads (both loops)")->check(CLI::PositiveNumber);
  app.add_option("--set", sets, "override a job key")
      ->type_size(1)->allow_extra_args(false)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  CLI11_PARSE(app, argc, argv);

  try {
    sets.push_back("train.max_steps=" + std::to_string(steps));
    sets.push_back("train.eval_every=0");
    sets.push_back("data.eval_samples=1");  // the trainer's closing evaluation: not timed anyway
    sets.push_back("checkpoint.dir=");
    sets.push_back("log.metrics=");
    sets.push_back("log.dir=");
    sets.push_back("log.progress=off");
    ParsedJob parsed = job.empty() ? parse_job_string(kDefaultJob, "bench-overhead", sets, {})
                                   : parse_job_file(job, sets, {});
    JobSpec spec = parsed.spec;
    spec.train.threads = threads;
    set_threads(threads);
    const auto t_load = std::chrono::steady_clock::now();
    auto data = make_dataset(spec.data, spec.train.seed);
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
    std::printf("bench-overhead: %s, model %s, batch %lld, %lld steps x %d repeats, %d thread%s, %s\n",
                data->info().description.c_str(), spec.model.type.c_str(),
                static_cast<long long>(spec.data.batch_size), static_cast<long long>(steps), repeats,
                threads, threads == 1 ? "" : "s", blas_description().c_str());
    {  // What the data costs: reading it, and gathering one global batch of it.
      BatchPlan plan(data->size(Split::kTrain), spec.data.batch_size, spec.train.seed, spec.data.shuffle);
      const int batches = static_cast<int>(std::min<int64_t>(50, plan.steps_per_epoch()));
      const auto t0 = std::chrono::steady_clock::now();
      for (int step = 0; step < batches; ++step) data->get(Split::kTrain, plan.global_batch(0, step));
      const double per_batch =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / std::max(1, batches);
      std::printf("data: loaded in %.2f s; a batch of %lld gathered in %.2f ms (mean of %d)\n", load_s,
                  static_cast<long long>(spec.data.batch_size), per_batch * 1e3, batches);
    }
    bare_loop(spec, *data, std::max<int64_t>(10, steps / 10));  // warm up both paths once
    std::vector<double> bare, tetra, ratio;
    std::printf("%8s %14s %14s %8s\n", "repeat", "bare (smp/s)", "tetra (smp/s)", "ratio");
    for (int r = 0; r < repeats; ++r) {
      double b = bare_loop(spec, *data, steps);
      Trainer trainer(spec);
      double t = trainer.run().samples_per_s;
      bare.push_back(b);
      tetra.push_back(t);
      ratio.push_back(t / b);
      std::printf("%8d %14.0f %14.0f %8.3f\n", r + 1, b, t, t / b);
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    std::printf("median: bare %.0f samples/s, tetra %.0f samples/s, ratio %.3f (goal >= 0.95)\n",
                median(bare), median(tetra), median(ratio));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-overhead: error: %s\n", e.what());
    return 1;
  }
}
