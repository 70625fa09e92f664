// The run folder's records (core/run_folder.h): the bytes each record writes, the same
// record read back, and metrics.jsonl read as the report reads it (Note [Resumed runs]).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "collectives/error.h"
#include "core/run_folder.h"

namespace fs = std::filesystem;
using namespace tetra::core;

namespace {

fs::path temp_file(const std::string& name, const std::string& text) {
  const fs::path p = fs::path(testing::TempDir()) / (name + "_" + std::to_string(::getpid()) + ".jsonl");
  std::ofstream(p) << text;
  return p;
}

TrainRecord two_rank_record() {
  TrainRecord r;
  r.step = 10;
  r.epoch = 0;
  r.loss = 1.5;
  r.lr = 0.001;
  r.samples_per_s = 250.5;
  r.time_s = 2.25;
  r.skipped_steps = 0;
  r.model_state_bytes = StateBytesRecord{100, 100, 200, 0, 400};
  r.peak_rss_bytes = 4096;
  r.step_ms = StepMsRecord{0.5, 1.0, 2.0, 0.25, 0.125};
  r.comm_ms = AxisTimes{{"data", 0.75}};
  r.ranks.emplace();
  for (int i = 0; i < 2; ++i) {
    TrainRecord::Rank row;
    row.model_state_bytes = 400 - i;
    row.peak_rss_bytes = 4096 + i;
    row.step_ms = StepMsRecord{0.5, 1.0, 2.0, 0.25, 0.125};
    row.comm_ms = AxisTimes{{"data", 0.5 + i}};
    r.ranks->push_back(row);
  }
  return r;
}

}  // namespace

// The bytes the trainer wrote before the records were types: a key per figure, sorted;
// skipped only when true, grad_norm only when clipped, a skipped step's loss null.
TEST(RunFolderRecords, TrainRecordWritesTheTrainersBytes) {
  EXPECT_EQ(to_json(two_rank_record()).dump(),
            R"({"comm_ms":{"data":0.75},"epoch":0,"loss":1.5,"lr":0.001,)"
            R"("model_state_bytes":{"buffers":0,"gradients":100,"optimizer":200,"parameters":100,"total":400},)"
            R"("peak_rss_bytes":4096,"ranks":[)"
            R"({"comm_ms":{"data":0.5},"model_state_bytes":400,"peak_rss_bytes":4096,)"
            R"("step_ms":{"backward":2.0,"data":0.5,"forward":1.0,"gradients":0.25,"optimizer":0.125}},)"
            R"({"comm_ms":{"data":1.5},"model_state_bytes":399,"peak_rss_bytes":4097,)"
            R"("step_ms":{"backward":2.0,"data":0.5,"forward":1.0,"gradients":0.25,"optimizer":0.125}}],)"
            R"("samples_per_s":250.5,"skipped_steps":0,)"
            R"("step":10,"step_ms":{"backward":2.0,"data":0.5,"forward":1.0,"gradients":0.25,"optimizer":0.125},)"
            R"("time_s":2.25})");
  TrainRecord skipped;
  skipped.step = 3;
  skipped.loss = std::nan("");
  skipped.skipped = true;
  skipped.grad_norm = 2.5;
  EXPECT_EQ(to_json(skipped).dump(), R"({"grad_norm":2.5,"loss":null,"skipped":true,"step":3})");
}

TEST(RunFolderRecords, EvalFailureAndSummaryWriteTheTrainersBytes) {
  EvalRecord e;
  e.step = 4;
  e.epoch = 1;
  e.test_loss = 0.5;
  e.time_s = 1.0;
  e.test_accuracy = 0.75;
  EXPECT_EQ(to_json(e).dump(), R"({"epoch":1,"eval":true,"step":4,"test_accuracy":0.75,"test_loss":0.5,"time_s":1.0})");
  CheckpointFailureRecord f;
  f.step = 6;
  f.checkpoint_failures = 1;
  f.checkpoint_error = "disk full";
  EXPECT_EQ(to_json(f).dump(), R"({"checkpoint_error":"disk full","checkpoint_failures":1,"step":6})");
  Summary s;
  const nlohmann::json j = to_json(s);
  EXPECT_TRUE(j.at("final_eval").is_null());  // written as null when the run had none
  EXPECT_FALSE(j.contains("ranks"));          // what the writer did not fill is not there
  s.final_eval = EvalFigures{0.5, std::nullopt, 0.9};
  EXPECT_EQ(to_json(s).at("final_eval").dump(), R"({"test_accuracy":0.9,"test_loss":0.5})");
}

// What a record writes reads back as it was; absent stays absent.
TEST(RunFolderRecords, ARecordReadsBackAsItWasWritten) {
  const TrainRecord w = two_rank_record();
  TrainRecord skipped;
  skipped.step = 11;
  skipped.loss = std::nan("");
  skipped.skipped = true;
  const fs::path p = temp_file("records_roundtrip", to_json(w).dump() + "\n" + to_json(skipped).dump() + "\n");
  const MetricsFile m = read_metrics(p.string());
  ASSERT_EQ(m.train.size(), 2u);
  const TrainRecord& r = m.train.at(10);
  EXPECT_EQ(to_json(r).dump(), to_json(w).dump());
  EXPECT_FALSE(r.grad_norm.has_value());
  EXPECT_FALSE(r.pipeline_bubble.has_value());
  const TrainRecord& s = m.train.at(11);
  EXPECT_TRUE(s.skipped);
  EXPECT_FALSE(s.loss.has_value());  // null: no loss
  EXPECT_FALSE(s.step_ms.has_value());
  fs::remove(p);
}

// Note [Resumed runs]: the later run's records win; unknown kinds are counted and left
// out; a line that is not JSON names file:line (or is skipped, for a trial).
TEST(RunFolderRecords, MetricsAreReadAsTheReportReadsThem) {
  const std::string text =
      R"({"step":1,"loss":3.0})" "\n"
      R"({"step":2,"loss":2.0})" "\n"
      R"({"step":2,"eval":true,"test_loss":2.5})" "\n"
      R"({"step":3,"loss":1.0})" "\n"
      R"({"step":3,"checkpoint_failures":1,"checkpoint_error":"full"})" "\n"
      R"({"step":4,"something_new":1})" "\n"
      R"({"loss":1.0})" "\n"
      R"({"step":2,"loss":1.9})" "\n";
  const fs::path p = temp_file("records_resumed", text);
  const MetricsFile m = read_metrics(p.string());
  EXPECT_EQ(m.records, 8u);
  EXPECT_EQ(m.other, 2u);
  EXPECT_EQ(m.resumed_at, std::vector<int64_t>{2});
  ASSERT_EQ(m.train.size(), 2u);
  EXPECT_DOUBLE_EQ(*m.train.at(2).loss, 1.9);
  EXPECT_TRUE(m.eval.empty());      // at step 2: dropped with the rest from there
  EXPECT_TRUE(m.failures.empty());  // at step 3
  fs::remove(p);

  const fs::path bad = temp_file("records_bad", R"({"step":1,"loss":3.0})" "\n" R"({"step":2,)" "\n");
  try {
    read_metrics(bad.string());
    ADD_FAILURE() << "a line that is not JSON was read";
  } catch (const tetra::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(bad.string() + ":2: not JSON"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_metrics(bad.string(), BadLines::kSkip).train.size(), 1u);
  EXPECT_TRUE(read_metrics(bad.string() + ".none", BadLines::kSkip).train.empty());
  fs::remove(bad);
}
