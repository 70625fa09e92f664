// The cost model's arithmetic (Note [Cost model]) on cases worked out by hand.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "collectives/error.h"
#include "tools/planner/cost_model.h"
#include "core/models.h"

namespace fs = std::filesystem;
using namespace tetra::core;
using namespace tetra::planner;
using tetra::collectives::Traffic;

namespace {

const LinkCost kIntra{1e-6, 10e9};  // 1 us, 10 GB/s
const LinkCost kInter{1e-5, 1e9};   // 10 us, 1 GB/s

// Writes `text` to `file` and expects load_calibration to refuse it with a ConfigError
// that says `want`.
void expect_calibration_error(const fs::path& file, const std::string& text, const std::string& want) {
  std::ofstream(file) << text;
  try {
    load_calibration(file.string());
    ADD_FAILURE() << "load_calibration took " << text;
  } catch (const tetra::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}

Calibration calibration() {
  Calibration c;
  c.intra_host = kIntra;
  c.inter_host = kInter;
  c.flops_per_s = 1e9;
  return c;
}

TEST(CostModel, RingAllreduceIsTwiceTheShareOverBetaPlusTwoAlphaPerStep) {
  // 2(n-1)/n x B/beta + 2(n-1) alpha = 1.5 x 1 ms + 6 x 10 us
  EXPECT_NEAR(ring_allreduce_s(4, 1e6, kInter), 1.5e-3 + 6e-5, 1e-12);
  EXPECT_EQ(ring_allreduce_s(1, 1e6, kInter), 0);
  // reduce_scatter / allgather: (n-1)/n x B/beta + (n-1) alpha
  EXPECT_NEAR(ring_collect_s(4, 1e6, kInter), 0.75e-3 + 3e-5, 1e-12);
  EXPECT_NEAR(p2p_s(1e6, kInter), 1e-5 + 1e-3, 1e-12);
}

TEST(CostModel, HierarchicalAllreduceCrossesHostsWithTheWholeBufferOnce) {
  // 2 hosts x 2 ranks, 1 MB: inside, reduce_scatter and allgather of 2: 2 x (0.5 x 1e6 /
  // 1e10 + 1e-6); across, each rank's 0.5 MB at half the host's 1 GB/s:
  // 2 x 1/2 x 5e5 / 5e8 + 2 x 1e-5.
  const double want = 2 * (5e-5 + 1e-6) + (1e-3 + 2e-5);
  EXPECT_NEAR(hierarchical_allreduce_s(2, 2, 1e6, kIntra, kInter), want, 1e-12);
  // Against a flat ring of the 4 ranks at the across-hosts link: 1.5 ms + 60 us.
  EXPECT_LT(hierarchical_allreduce_s(2, 2, 1e6, kIntra, kInter), ring_allreduce_s(4, 1e6, kInter));
}

TEST(CostModel, BubbleIsStagesLessOneOverMicroBatchesPlusStagesLessOne) {
  EXPECT_DOUBLE_EQ(bubble_fraction(4, 8), 3.0 / 11);
  EXPECT_DOUBLE_EQ(bubble_fraction(4, 8, 2), 3.0 / 19);  // interleaved: v m + p - 1
  EXPECT_EQ(bubble_fraction(1, 8), 0);
}

TEST(CostModel, AnAxisIsPricedByKindWithTheLinkItsGroupsUse) {
  Traffic t;
  t.record(Traffic::kAllreduce, 500'000, 4);
  t.record(Traffic::kAllreduce, 500'000, 4);
  t.record(Traffic::kAllgather, 1'000'000, 4);
  const Calibration c = calibration();
  const AxisTime inside = axis_time(t, {"data", 4, 1, 4, false}, c);
  EXPECT_NEAR(inside.seconds, 2 * ring_allreduce_s(4, 5e5, kIntra) + ring_collect_s(4, 1e6, kIntra), 1e-12);
  EXPECT_EQ(inside.how, "ring of 4 inside a host");
  const AxisTime flat = axis_time(t, {"data", 4, 2, 2, false}, c);
  EXPECT_NEAR(flat.seconds, 2 * ring_allreduce_s(4, 5e5, kInter) + ring_collect_s(4, 1e6, kInter), 1e-12);
  EXPECT_EQ(flat.how, "ring of 4 across hosts");
  const AxisTime hier = axis_time(t, {"data", 4, 2, 2, true}, c);
  EXPECT_NEAR(hier.seconds,
              2 * hierarchical_allreduce_s(2, 2, 5e5, kIntra, kInter) + ring_collect_s(4, 1e6, kInter), 1e-12);
  EXPECT_EQ(hier.how, "hierarchical (2 hosts x 2) across hosts");
  EXPECT_EQ(hier.ops, 3);
  Traffic sends;
  sends.record(Traffic::kSend, 4000, 2);
  sends.record(Traffic::kRecv, 4000, 2);  // the sender counts it
  EXPECT_NEAR(axis_time(sends, {"pipeline", 2, 2, 1, false}, c).seconds, p2p_s(4000, kInter), 1e-15);
}

TEST(CostModel, AStepIsTheSlowestStageStretchedByTheBubblePlusTheOtherAxes) {
  const Calibration c = calibration();
  // Two stages at 1 GFLOP/s: 1 s and 2 s of compute; the second sends 1 MB across hosts
  // and receives 1 MB;
  // each allreduces 1 MB over a data group of 2 inside a host. m = 4: bubble 1/5.
  StageWork a, b;
  a.flops = 1e9;
  b.flops = 2e9;
  b.traffic["pipeline"].record(Traffic::kSend, 1'000'000, 2);
  b.traffic["pipeline"].record(Traffic::kRecv, 1'000'000, 2);  // it waits for it too
  for (StageWork* w : {&a, &b}) w->traffic["data"].record(Traffic::kAllreduce, 1'000'000, 2);
  const std::vector<AxisLinks> links = {{"pipeline", 2, 2, 1, false}, {"data", 2, 1, 2, false}};
  const StepPrediction p = predict_step({a, b}, links, 4, 1, 64, 12e9, 4, c);
  const double busy = 2 + 2 * p2p_s(1e6, kInter);
  EXPECT_NEAR(p.compute_s, 2, 1e-12);
  EXPECT_NEAR(p.pipeline_s, 2 * p2p_s(1e6, kInter), 1e-12);
  EXPECT_NEAR(p.bubble_s, busy / 0.8 - busy, 1e-12);
  EXPECT_NEAR(p.other_s, ring_allreduce_s(2, 1e6, kIntra), 1e-12);
  EXPECT_NEAR(p.total_s, busy / 0.8 + ring_allreduce_s(2, 1e6, kIntra), 1e-12);
  EXPECT_NEAR(p.single_rank_s, 12, 1e-12);
  EXPECT_NEAR(p.efficiency, 12 / (4 * p.total_s), 1e-12);
  EXPECT_NEAR(p.samples_per_s, 64 / p.total_s, 1e-9);
  const std::string text = prediction_text(p, c);
  EXPECT_NE(text.find("efficiency"), std::string::npos) << text;
}

TEST(CostModel, ACalibrationFileOverridesWhatItSaysAndNamesWhatIsWrong) {
  const fs::path dir = fs::temp_directory_path() / ("cost_model_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path good = dir / "good.json";
  std::ofstream(good) << R"({"format": "tetra calibration 1", "inter_host": {"alpha_us": 40, "beta_gbytes_per_s": 0.125},
                             "compute": {"gflops_per_s": 20}, "measured": "2 test hosts"})";
  const Calibration c = load_calibration(good.string());
  EXPECT_DOUBLE_EQ(c.inter_host.alpha_s, 40e-6);
  EXPECT_DOUBLE_EQ(c.inter_host.bytes_per_s, 0.125e9);
  EXPECT_DOUBLE_EQ(c.flops_per_s, 20e9);
  EXPECT_DOUBLE_EQ(c.intra_host.bytes_per_s, Calibration{}.intra_host.bytes_per_s);  // left out: the default
  EXPECT_NE(c.source.find("2 test hosts"), std::string::npos);
  expect_calibration_error(dir / "bad.json", R"({"format": "tetra calibration 1", "intra_host": {"beta_gbytes_per_s": -1}})",
                           "bad.json: intra_host.beta_gbytes_per_s must be a number > 0");
  EXPECT_THROW(load_calibration((dir / "missing.json").string()), tetra::ConfigError);
  // What calibration_json writes, load_calibration reads back.
  const fs::path round = dir / "round.json";
  std::ofstream(round) << calibration_json(c, "here").dump();
  const Calibration back = load_calibration(round.string());
  EXPECT_DOUBLE_EQ(back.inter_host.alpha_s, c.inter_host.alpha_s);
  EXPECT_DOUBLE_EQ(back.flops_per_s, c.flops_per_s);
  fs::remove_all(dir);
}

// Note [Fitted collectives]: times that follow a ring exactly give back its alpha and beta,
// which then price a group of another size by the same formula.
TEST(CostModel, AFittedCollectiveGivesBackTheRingsStep) {
  const LinkCost truth{20e-6, 2e9};
  const std::vector<double> bytes = {8, 1 << 20, 4 << 20, 16 << 20};
  for (const char* kind : {"allreduce", "allgather", "send"}) {
    std::vector<double> seconds;
    for (double b : bytes)
      seconds.push_back(std::string(kind) == "allreduce" ? ring_allreduce_s(4, b, truth)
                        : std::string(kind) == "send"    ? p2p_s(b, truth)
                                                         : ring_collect_s(4, b, truth));
    const LinkCost fit = fit_collective(kind, 4, bytes, seconds);
    // The smallest size's bytes land in alpha (8 bytes at 2 GB/s: 4 ns a step at most).
    EXPECT_NEAR(fit.alpha_s, truth.alpha_s, 5e-9) << kind;
    EXPECT_NEAR(fit.bytes_per_s / truth.bytes_per_s, 1, 1e-6) << kind;
  }
  // A calibration with a fitted kind prices that kind with it, the others with the link.
  Calibration c = calibration();
  c.intra_kinds["allreduce"] = truth;
  Traffic t;
  t.record(Traffic::kAllreduce, 1'000'000, 8);
  t.record(Traffic::kAllgather, 1'000'000, 8);
  const AxisTime a = axis_time(t, {"data", 8, 1, 8, false}, c);
  EXPECT_NEAR(a.seconds, ring_allreduce_s(8, 1e6, truth) + ring_collect_s(8, 1e6, kIntra), 1e-12);
  // The ops that run chained (a prefetched gather) take the chained fit, the rest theirs.
  const LinkCost chained{1e-6, 4e9};
  c.intra_chained["allgather"] = chained;
  Traffic ahead;
  ahead.record(Traffic::kAllgather, 1'000'000, 8);
  t.record(Traffic::kAllgather, 1'000'000, 8);  // two gathers, one of them chained
  const AxisTime b = axis_time(t, {"data", 8, 1, 8, false}, c, &ahead);
  EXPECT_NEAR(b.seconds,
              ring_allreduce_s(8, 1e6, truth) + ring_collect_s(8, 1e6, kIntra) + ring_collect_s(8, 1e6, chained), 1e-12);
}

// Note [Ranks sharing cores]: 4 single-thread ranks on 2 cores each get half; timed work
// stretches by it, a calibrated FLOP rate (measured with the ranks running) does not.
TEST(CostModel, RanksThatOutnumberTheCoresShareThemAndTimedWorkStretches) {
  EXPECT_DOUBLE_EQ(core_share(2, 4, 1), 0.5);
  EXPECT_DOUBLE_EQ(core_share(2, 1, 2), 1.0);
  EXPECT_DOUBLE_EQ(core_share(16, 4, 8), 0.5);
  EXPECT_DOUBLE_EQ(core_share(0, 64, 1), 1.0);  // unknown cores: a device per rank
  const Calibration c = calibration();
  StageWork w;
  w.flops = 1e9;  // 1 s at the rate
  w.timed_s = 0.25;
  w.optimizer_s = 0.05;
  w.loading_s = 0.01;
  w.traffic["data"].record(Traffic::kAllreduce, 1'000'000, 4);
  const std::vector<AxisLinks> links = {{"data", 4, 1, 4, false}};
  const StepPrediction p = predict_step({w}, links, 1, 1, 64, 4e9, 4, c, -1, 0.5);
  EXPECT_TRUE(p.timed);
  EXPECT_DOUBLE_EQ(p.core_share, 0.5);
  EXPECT_NEAR(p.compute_s, 0.5, 1e-12);
  EXPECT_NEAR(p.optimizer_s, 0.1, 1e-12);
  EXPECT_NEAR(p.loading_s, 0.02, 1e-12);
  EXPECT_NEAR(p.other_s, ring_allreduce_s(4, 1e6, kIntra), 1e-12);
  EXPECT_NEAR(p.total_s, 0.62 + p.other_s, 1e-12);
  EXPECT_NEAR(p.single_rank_s, 4e9 * 0.25 / 1e9, 1e-12);  // the timed rate, a core to itself
  w.timed_s = -1;  // untimed: FLOPs over the rate, not stretched
  EXPECT_NEAR(predict_step({w}, links, 1, 1, 64, 4e9, 4, c, -1, 0.5).compute_s, 1.0, 1e-12);
  // The dry run names the terms with their shares and the one that dominates.
  const std::string text = prediction_text(p, c);
  for (const char* want : {"each rank gets 50% of a core", "optimizer", "loading", "dominated by compute"})
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
}

// A pipeline simulated with measured times: its makespan is the step's pipeline part, the
// bubble what it idles without transfers, the transfers what they add.
TEST(CostModel, ASimulatedPipelineIsItsMakespan) {
  const Calibration c = calibration();
  StageWork a, b;
  a.timed_s = 0.004;
  b.timed_s = 0.006;
  a.timed_forward_s = b.timed_forward_s = 0.002;
  b.optimizer_s = 0.001;
  const SimulatedPipeline sim{0.010, 0.008};
  const StepPrediction p = predict_step({a, b}, {}, 4, 1, 64, 1e9, 2, c, 0.2, 1, sim);
  EXPECT_NEAR(p.compute_s, 0.006, 1e-12);
  EXPECT_NEAR(p.bubble_s, 0.002, 1e-12);
  EXPECT_NEAR(p.pipeline_s, 0.002, 1e-12);
  EXPECT_NEAR(p.total_s, 0.010 + 0.001, 1e-12);
}

TEST(CostModel, FittedKindsAndHostCoresRoundTripThroughTheFile) {
  const fs::path dir = fs::temp_directory_path() / ("cost_kinds_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  Calibration c = calibration();
  c.intra_kinds["allreduce"] = {7e-6, 3e9};
  c.inter_kinds["allgather"] = {30e-6, 0.1e9};
  c.inter_chained["allgather"] = {3e-6, 0.12e9};
  c.cores_per_host = 0.5;  // 2 hosts on one core: half each (Note [Ranks sharing cores])
  const fs::path f = dir / "kinds.json";
  std::ofstream(f) << calibration_json(c, "here").dump();
  const Calibration back = load_calibration(f.string());
  EXPECT_DOUBLE_EQ(back.link(false, "allreduce").alpha_s, 7e-6);
  EXPECT_DOUBLE_EQ(back.link(true, "allgather").bytes_per_s, 0.1e9);
  EXPECT_DOUBLE_EQ(back.link(false, "broadcast").bytes_per_s, kIntra.bytes_per_s);  // not fitted: the link
  EXPECT_DOUBLE_EQ(back.link(true, "allgather", /*chained=*/true).alpha_s, 3e-6);
  EXPECT_DOUBLE_EQ(back.link(false, "allreduce", /*chained=*/true).alpha_s, 7e-6);  // no chained fit: the kind's
  EXPECT_DOUBLE_EQ(back.cores_per_host, 0.5);
  expect_calibration_error(dir / "bad.json",
                           R"({"format": "tetra calibration 1", "inter_host": {"chained": {"gather": {}}}})",
                           "bad.json: inter_host.chained.gather: not a collective");
  expect_calibration_error(dir / "bad.json",
                           R"({"format": "tetra calibration 1", "intra_host": {"kinds": {"allreduse": {"alpha_us": 1}}}})",
                           "bad.json: intra_host.kinds.allreduse: not a collective");
  fs::remove_all(dir);
}

TEST(CostModel, ForwardFlopsCountTheMatmulsAndAttention) {
  ModelSpec mlp;
  mlp.type = "mlp";
  mlp.hidden = {32};
  DataInfo images;
  images.input_shape = {784};
  images.num_classes = 10;
  torch::manual_seed(0);
  auto m = build_model(mlp, images, 1);
  std::vector<double> f = forward_flops(m, torch::zeros({1, 784}));
  double sum = 0;
  for (double x : f) sum += x;
  EXPECT_DOUBLE_EQ(sum, 2.0 * 784 * 32 + 2.0 * 32 * 10);

  ModelSpec gpt;
  gpt.type = "gpt";
  gpt.layers = 1;
  gpt.d_model = 16;
  gpt.heads = 2;
  DataInfo text;
  text.input_shape = {8};
  text.num_classes = 256;
  text.language_model = true;
  text.seq_len = 8;
  auto g = build_model(gpt, text, 1);
  f = forward_flops(g, torch::zeros({1, 8}, torch::kLong));
  sum = 0;
  for (double x : f) sum += x;
  const double d = 16, ff = 64, seq = 8, vocab = 256;
  // the block's qkv, proj, fc1, fc2 per token, attention's QK^T and AV, the head
  EXPECT_DOUBLE_EQ(sum, 2 * (3 * d * d + d * d + 2 * d * ff) * seq + 4 * seq * seq * d + 2 * d * vocab * seq);

  // A 256-token sample is probed by its first 64 tokens and scaled: the same count as the
  // formula at 256.
  DataInfo longer = text;
  longer.input_shape = {256};
  longer.seq_len = 256;
  torch::manual_seed(0);
  auto g256 = build_model(gpt, longer, 1);
  const LayerProbe probe = probe_layers(g256, torch::zeros({1, 256}, torch::kLong));
  EXPECT_EQ(probe.scale, 4);
  EXPECT_EQ(probe.layers.back().output.size(1), 64);
  f = forward_flops(g256, torch::zeros({1, 256}, torch::kLong));
  sum = 0;
  for (double x : f) sum += x;
  const double s256 = 256;
  EXPECT_DOUBLE_EQ(sum, 2 * (3 * d * d + d * d + 2 * d * ff) * s256 + 4 * s256 * s256 * d + 2 * d * vocab * s256);
}

}  // namespace
