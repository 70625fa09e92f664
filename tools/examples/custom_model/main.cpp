// custom-model: a model and a dataset tetra does not know, composed as pipeline x data x
// ZeRO in C++ — the plan a job file would declare, built with tetra::PlanBuilder.
//
// The data: points in 16 dimensions drawn around 8 seeded centres, labelled by centre.
// The model: a torch::nn::Sequential of the program's own layers (residual tanh blocks,
// own_model.h), which
// the pipeline cuts into 2 stages; each stage is trained by 2 data-parallel processes whose
// optimizer state ZeRO-1 shards between them.
//
//   custom-model            prints the plan for 4 processes, and how to launch it
//   mpirun -np 4 custom-model
//
// Under the launcher it trains, and exits 1 unless the test accuracy beats 90% (chance is
// 12.5%).
#include <torch/torch.h>

#include <cstdio>
#include <exception>
#include <memory>

#include "own_model.h"
#include "tetra/tetra.h"

namespace {

using namespace tetra;

torch::nn::Sequential make_model(const core::DataInfo& data) { return own::residual_model(data, 64, 3); }

core::JobSpec make_job() {
  PlanBuilder b("custom-model");
  core::DataSpec data;
  data.type = "synthetic";  // the trainer is given the program's own data instead
  data.batch_size = 64;
  b.data(data);
  core::OptimizerSpec opt;
  opt.type = "sgd";
  opt.lr = 0.05;
  opt.momentum = 0.9;
  b.optimizer(opt);
  core::TrainSpec train;
  train.max_steps = 200;
  train.threads = 1;
  b.train(train);
  b.checkpoint(core::CheckpointSpec{});  // dir "": no checkpoints
  core::LogSpec log;
  log.every = 50;
  log.progress = "plain";
  b.log(log);
  b.mesh({2, 2});
  pipeline::Options pp;
  pp.micro_batches = 4;
  pp.schedule = pipeline::ScheduleKind::k1F1B;
  pp.balance = pipeline::Balance::kByParams;
  b.pipeline(pp);
  zero::Options z;
  z.stage = 1;
  b.zero(z);
  return b.build();
}

}  // namespace

int main(int argc, char** argv) {
  core::prepare_process(argc, argv);
  try {
    const core::JobSpec job = make_job();
    RunOptions run_options;
    run_options.model = make_model;
    run_options.data = std::make_shared<own::Clusters>(7, 8, 16, 8192, 1024);
    const collectives::LaunchInfo launch = collectives::detect_launch();
    if (!launch.multi_process()) {
      std::printf("%s\nLaunch it on the %d processes of its mesh: mpirun -np %d custom-model\n",
                  dry_run(job, run_options, core::Plan(job).process_count()).c_str(), core::Plan(job).process_count(),
                  core::Plan(job).process_count());
      return 0;
    }
    const core::TrainResult r = run(job, run_options);
    if (launch.rank != 0) return 0;
    const double accuracy = r.final_eval && r.final_eval->accuracy ? *r.final_eval->accuracy : 0;
    std::printf("custom model, pipeline 2 x data 2 x ZeRO-1: loss %.4f -> %.4f, test accuracy %.1f%%\n", r.losses.front(),
                r.losses.back(), 100 * accuracy);
    return accuracy > 0.9 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "custom-model: %s\n", e.what());
    return 1;
  }
}
