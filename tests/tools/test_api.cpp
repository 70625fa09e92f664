// tetra/tetra.h, the umbrella header of tetra::tetra, as a program uses it: it compiles on
// its own under tetra's warnings, and register_builtin_plugins registers the sections a
// job file may name, as `train` does. The Plan builder gives the same plan, and the same
// messages, as the same YAML; the trainer takes a program's own model and data.
// (tests/tools/install_example.cmake builds programs on it against an install.)
#include "tetra/tetra.h"

#include <gtest/gtest.h>

#include <regex>
#include <string>
#include <vector>

#include "core/job_file.h"
#include "core/preflight.h"
#include "tests/common/numerics.h"
#include "tools/examples/custom_model/own_model.h"

namespace {

TEST(Api, RegistersTheBuiltinPlugins) {
  tetra::core::SectionRegistry registry;
  tetra::register_builtin_plugins(registry);
  EXPECT_EQ(registry.names(),
            (std::vector<std::string>{"data_parallel", "pipeline", "replicate", "tensor", "zero"}));
  const tetra::core::ParsedJob parsed = tetra::core::parse_job_string(
      "model: {type: mlp}\ndata: {type: synthetic}\nreplicate: {replicas: 2}\n", "api.yaml", {},
      registry);
  const auto replicate = parsed.spec.plugin<tetra::replicate::Options>("replicate");
  ASSERT_NE(replicate, nullptr);
  EXPECT_EQ(replicate->replicas, 2);
}

}  // namespace

// ---- the C++ composition API --------------------------------------------------------

namespace api_plans {

using namespace tetra;

// The builder's calls for configs/3d.yaml's composition, on the quickstart data.
PlanBuilder three_d(int batch = 32) {
  PlanBuilder b("api");
  core::ModelSpec model;
  model.type = "mlp";
  model.hidden = {64, 64, 32};
  b.model(model);
  core::DataSpec data;
  data.batch_size = batch;
  data.eval_samples = 200;
  b.data(data);
  core::OptimizerSpec opt;
  opt.type = "sgd";
  opt.lr = 0.05;
  b.optimizer(opt);
  core::TrainSpec train;
  train.max_steps = 6;
  train.threads = 1;
  b.train(train);
  b.mesh({2, 2});
  pipeline::Options pp;
  pp.schedule = pipeline::ScheduleKind::kGPipe;
  pp.micro_batches = 4;
  pp.balance = pipeline::Balance::kByParams;
  b.pipeline(pp);
  zero::Options z;
  z.stage = 1;
  b.zero(z);
  replicate::Options r;
  r.replicas = 2;
  b.replicate(r);
  return b;
}

const char* kThreeDYaml = R"(name: api
model: {type: mlp, hidden: [64, 64, 32]}
data: {type: fashion-mnist, batch_size: 32, eval_samples: 200}
optimizer: {type: sgd, lr: 0.05}
train: {max_steps: 6, threads: 1}
mesh: {pipeline: 2, data: 2}
pipeline: {schedule: gpipe, micro_batches: 4, balance: by_params}
zero: {stage: 1}
replicate: {replicas: 2}
)";

// The measured columns of --dry-run (milliseconds per layer) differ from run to run.
std::string without_timings(std::string text) {
  static const std::regex ms("[0-9]+\\.[0-9]{3}");
  return std::regex_replace(text, ms, "#.###");
}

TEST(PlanBuilder, BuildsTheSameDryRunAsTheSameYaml) {
  // The same cost model on both sides: this machine's figures are measured each time.
  ::setenv("TETRA_CALIBRATION", "gpu-cluster", 1);
  core::SectionRegistry plugins;
  register_builtin_plugins(plugins);
  const core::JobSpec from_yaml = core::parse_job_string(kThreeDYaml, "api.yaml", {}, plugins).spec;
  const core::JobSpec built = three_d().build();
  const std::string a = without_timings(dry_run(from_yaml, {}, 4)), b = without_timings(dry_run(built, {}, 4));
  EXPECT_EQ(a, b);
  EXPECT_NE(b.find("1. pipeline"), std::string::npos) << b;
  EXPECT_NE(b.find("ranks      8 (4 processes x 2 replicas)"), std::string::npos) << b;
  EXPECT_EQ(without_timings(dry_run(from_yaml, {}, 4, true)), without_timings(dry_run(built, {}, 4, true)));
  // The typed options come back as they went in.
  const core::Plan plan(built);
  auto pp = built.plugin<pipeline::Options>("pipeline");
  ASSERT_NE(pp, nullptr);
  EXPECT_EQ(pp->schedule, pipeline::ScheduleKind::kGPipe);
  EXPECT_EQ(pp->balance, pipeline::Balance::kByParams);
  EXPECT_EQ(plan.data_ranks(), 4);
  EXPECT_EQ(plan.micro_batch_size(), 2);
  EXPECT_EQ(three_d().yaml(),
            "name: api\nmodel:\n  type: mlp\n  hidden: [64, 64, 32]\ndata:\n  type: fashion-mnist\n  batch_size: 32\n"
            "  eval_samples: 200\noptimizer:\n  type: sgd\n  lr: 0.05\ntrain:\n  max_steps: 6\n  threads: 1\n"
            "mesh:\n  pipeline: 2\n  data: 2\npipeline:\n  schedule: gpipe\n  micro_batches: 4\n  balance: by_params\n"
            "zero:\n  stage: 1\nreplicate:\n  replicas: 2\n");
}

// The fifth axis from code: mesh.tensor and the tensor section's typed options, checked as
// a file's are.
TEST(PlanBuilder, BuildsATensorParallelPlan) {
  PlanBuilder b("tp");
  core::ModelSpec m;
  m.type = "gpt";
  m.layers = 2;
  m.d_model = 32;
  m.heads = 4;
  b.model(m);
  core::DataSpec d;
  d.type = "text";
  d.path = "/usr/share/common-licenses/GPL-3";
  d.seq_len = 16;
  d.batch_size = 8;
  b.data(d);
  b.mesh({1, 2, 2});
  tensor_parallel::Options t;
  t.sequence_parallel = true;
  b.tensor_parallel(t);
  const core::JobSpec job = b.build();
  EXPECT_EQ(job.mesh.size("tensor"), 2);
  auto got = job.plugin<tensor_parallel::Options>("tensor");
  ASSERT_NE(got, nullptr);
  EXPECT_TRUE(got->sequence_parallel);
  EXPECT_TRUE(got->overlap);
  EXPECT_NE(b.yaml().find("tensor:\n  sequence_parallel: true\n"), std::string::npos) << b.yaml();
  b.mesh({1, 2, 3});
  try {
    b.build();
    ADD_FAILURE() << "tensor 3 over 4 heads was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("PlanBuilder::mesh(): error: mesh.tensor: mesh.tensor 3 does not divide "
                                         "model.heads 4"),
              std::string::npos)
        << e.what();
  }
}

// The dry run is a report (a struct) rendered as text or JSON: its parts are what the
// renderings print, so a tool reads a part (report's memory chart: the estimates) without
// parsing either.
TEST(PlanBuilder, ThePlanReportIsWhatTheDryRunPrints) {
  ::setenv("TETRA_CALIBRATION", "gpu-cluster", 1);
  const core::JobSpec built = three_d().build();
  DryRunOptions how;
  how.np = 4;
  const PlanReport report = plan_report(built, {}, how);
  EXPECT_EQ(without_timings(report.text()), without_timings(dry_run(built, {}, how)));
  ASSERT_EQ(report.estimates.size(), 4u);  // one per process
  EXPECT_EQ(report.ranks.size(), 8u);      // 4 processes x 2 replicas
  EXPECT_EQ(report.plan.data_ranks(), 4);
  const nlohmann::json j = report.json();
  EXPECT_EQ(j["estimate"], core::estimate_json(report.estimates));
  EXPECT_EQ(j["ranks"].size(), 8u);
  EXPECT_GT(report.parameters, 0);
  EXPECT_EQ(j["parameters"], report.parameters);
}

// The YAML path's messages, each naming the call that wrote the setting.
TEST(PlanBuilder, ErrorsNameTheBuilderCall) {
  try {
    three_d(36).build();
    FAIL() << "built";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("PlanBuilder::pipeline(): error: pipeline.micro_batches: data.batch_size 36 does not split "
                                          "into 4 data-parallel ranks (mesh.data 2 x replicate.replicas 2) x 4 micro-batches",
                                          0),
              0u)
        << e.what();
  }
  try {
    PlanBuilder b = three_d();
    core::OptimizerSpec opt;
    opt.lr = -1;
    b.optimizer(opt);
    data_parallel::Options dp;
    dp.bucket_mb = 0;
    b.data_parallel(dp);
    b.build();
    FAIL() << "built";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    for (const char* want : {"PlanBuilder::optimizer(): error: optimizer.lr: must be > 0, got -1",
                             "PlanBuilder::data_parallel(): error: data_parallel.bucket_mb: must be > 0, got 0"})
      EXPECT_NE(what.find(want), std::string::npos) << want << "\n" << what;
    EXPECT_EQ(what.find("PlanBuilder:1"), std::string::npos) << what;  // no line numbers
  }
  try {
    PlanBuilder b = three_d(16);
    b.mesh({2, 1});
    replicate::Options one;
    one.replicas = 1;
    b.replicate(one);
    b.build();
    FAIL() << "built";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("PlanBuilder::zero(): error: zero.stage: "), std::string::npos) << e.what();
  }
  // And a composition that does not fit the launch, before anything communicates.
  EXPECT_THROW(dry_run(three_d().build(), {}, 3), ConfigError);
}

}  // namespace api_plans

// ---- the program's own model and data ------------------------------------------------

namespace own_model {

using namespace tetra;

torch::nn::Sequential model(const core::DataInfo& data) { return own::residual_model(data, 32, 2); }

core::JobSpec plan(const std::vector<std::string>& sets) {
  PlanBuilder b("own");
  core::DataSpec data;
  data.type = "synthetic";  // stands in for the program's data, which the trainer is given
  data.batch_size = 64;
  b.data(data);
  core::OptimizerSpec opt;
  opt.type = "sgd";
  opt.lr = 0.1;
  b.optimizer(opt);
  core::TrainSpec train;
  train.max_steps = 12;
  b.train(train);
  core::CheckpointSpec ck;
  b.checkpoint(ck);
  core::LogSpec log;
  log.progress = "off";
  b.log(log);
  for (const auto& s : sets) b.set(s);
  return b.build();
}

// The trainer takes the program's Sequential and dataset, and they follow one process
// under every strategy at once: pipeline 2 x data 2 x ZeRO-1..3 x 2 replicas, plain SGD.
TEST(OwnModel, FollowsOneProcessUnderPipelineDataZeroAndReplicas) {
  core::TrainerOptions mine;
  mine.model = model;
  mine.data = std::make_shared<own::Clusters>(5, 4, 16, 2048, 256);
  const numerics::Outcome ref = numerics::run_single(plan({}), mine);
  ASSERT_EQ(ref.result.losses.size(), 12u);
  EXPECT_LT(ref.result.losses.back(), ref.result.losses.front());
  EXPECT_NE(ref.weights.find("1.inner.weight"), ref.weights.end());
  for (const char* stage : {"zero.stage=1", "zero.stage=3"})
    numerics::expect_follows(ref,
                             numerics::run_parallel(plan({"mesh.pipeline=2", "mesh.data=2", "pipeline.micro_batches=2",
                                                          stage, "replicate.replicas=2"}),
                                                    4, mine),
                             1e-5, stage);
  // tetra::run, as a program calls it: replicas as threads in this process.
  RunOptions run_options;
  run_options.model = model;
  run_options.data = mine.data;
  run_options.out = nullptr;
  const core::TrainResult r = run(plan({"replicate.replicas=2"}), run_options);
  ASSERT_EQ(r.losses.size(), ref.result.losses.size());
  for (size_t i = 0; i < r.losses.size(); ++i) EXPECT_NEAR(r.losses[i], ref.result.losses[i], 1e-5 * ref.result.losses[i]);
}

}  // namespace own_model

// The program's own dataset (RunOptions::data): data.path is never read, so a job whose
// path does not exist here is no preflight error (Note [Preflight]); without one it is.
TEST(Preflight, TheProgramsOwnDataIsNotLookedForAtDataPath) {
  tetra::core::SectionRegistry plugins;
  tetra::register_builtin_plugins(plugins);
  const tetra::core::JobSpec spec = tetra::core::parse_job_string(
      "name: own\ndata: {type: fashion-mnist, path: /nonexistent/fashion}\ncheckpoint: {dir: \"\"}\n"
      "log: {dir: \"\", metrics: \"\"}\n",
      "own.yaml", {}, plugins).spec;
  EXPECT_THROW(tetra::core::check_paths(spec), tetra::ConfigError);
  EXPECT_NO_THROW(tetra::core::check_paths(spec, /*own_data=*/true));
}
