// TensorBoard event files (Note [Event files]) read back by an independent decoder:
// python3-protobuf parsing the records with classes protoc generates from a .proto that
// declares the messages by the official field numbers (tensorboard/compat/proto/event.proto
// and summary.proto), and a CRC-32C written in Python checking every record's framing.
// Nothing of tetra's writer is used to read. Needs protoc and python3-protobuf (Debian's
// protobuf-compiler, python3-protobuf, for Debian's /usr/bin/python3; tools/setup.sh installs them); without them the
// cases skip and say so.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/tensorboard.h"
#include "core/trainer.h"
#include "core/job_spec.h"
#include "core/runtime.h"
#include "tests/common/job.h"

namespace fs = std::filesystem;
using namespace tetra;

namespace {

const char* kProto = R"(syntax = "proto3";
package tensorboard;
message SessionLog {
  enum SessionStatus { STATUS_UNSPECIFIED = 0; START = 1; STOP = 2; CHECKPOINT = 3; }
  SessionStatus status = 1;
  string checkpoint_path = 2;
  string msg = 3;
}
message Summary {
  message Value {
    string tag = 1;
    oneof value { float simple_value = 2; }
  }
  repeated Value value = 1;
}
message Event {
  double wall_time = 1;
  int64 step = 2;
  oneof what {
    string file_version = 3;
    Summary summary = 5;
    SessionLog session_log = 7;
  }
}
)";

// Reads every events.out.tfevents.* file of a folder (in name order), checks both CRCs of
// every record, and prints one JSON document: the files' records in order.
const char* kDecoder = R"(import glob, json, os, struct, sys
sys.path.insert(0, sys.argv[1])
import event_pb2

def crc32c(data):
    table = crc32c.table
    c = 0xFFFFFFFF
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF
crc32c.table = []
for n in range(256):
    c = n
    for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    crc32c.table.append(c)

def masked(c):
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

out = []
for path in sorted(glob.glob(os.path.join(sys.argv[2], "events.out.tfevents.*"))):
    data = open(path, "rb").read()
    i = 0
    while i < len(data):
        header = data[i:i + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[i + 8:i + 12])
        assert length_crc == masked(crc32c(header)), "length CRC at byte %d of %s" % (i, path)
        body = data[i + 12:i + 12 + length]
        (body_crc,) = struct.unpack("<I", data[i + 12 + length:i + 16 + length])
        assert body_crc == masked(crc32c(body)), "data CRC at byte %d of %s" % (i, path)
        i += 16 + length
        e = event_pb2.Event()
        e.ParseFromString(body)
        rec = {"file": os.path.basename(path), "wall_time": e.wall_time, "step": e.step, "what": e.WhichOneof("what")}
        if rec["what"] == "file_version":
            rec["file_version"] = e.file_version
        elif rec["what"] == "summary":
            rec["values"] = [[v.tag, v.simple_value] for v in e.summary.value]
        elif rec["what"] == "session_log":
            rec["status"] = e.session_log.status
        out.append(rec)
print(json.dumps(out))
)";

bool have_decoder(std::string& why) {
  if (std::system("command -v protoc >/dev/null 2>&1") != 0) {
    why = "no protoc (Debian's protobuf-compiler; tools/setup.sh installs it)";
    return false;
  }
  if (std::system("/usr/bin/python3 -c 'import google.protobuf' >/dev/null 2>&1") != 0) {
    why = "no python3-protobuf (tools/setup.sh installs it)";
    return false;
  }
  return true;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The records of every event file in `dir`, as the Python decoder read them.
nlohmann::json decode(const fs::path& dir) {
  const fs::path work = dir / "decoder";
  fs::create_directories(work);
  std::ofstream(work / "event.proto") << kProto;
  std::ofstream(work / "decode.py") << kDecoder;
  const std::string gen = "cd '" + work.string() + "' && protoc --python_out=. event.proto 2>'" +
                          (work / "protoc.err").string() + "'";
  if (std::system(gen.c_str()) != 0) {
    ADD_FAILURE() << "protoc failed: " << slurp(work / "protoc.err");
    return nlohmann::json::array();
  }
  const std::string run = "/usr/bin/python3 '" + (work / "decode.py").string() + "' '" + work.string() + "' '" + dir.string() +
                          "' >'" + (work / "out.json").string() + "' 2>'" + (work / "err.txt").string() + "'";
  if (std::system(run.c_str()) != 0) {
    ADD_FAILURE() << "the decoder failed: " << slurp(work / "err.txt");
    return nlohmann::json::array();
  }
  return nlohmann::json::parse(slurp(work / "out.json"));
}

const char* kJob = R"(
model: {type: mlp, hidden: [32]}
data: {type: fashion-mnist, batch_size: 32, eval_samples: 200}
optimizer: {type: adamw, lr: 1.0e-3, clip_grad_norm: 1.0}
train: {max_steps: 12, eval_every: 6, seed: 3, threads: 1}
checkpoint: {dir: ""}
log: {every: 3, progress: off}
)";

// The job on one process, one thread.
void train(const std::vector<std::string>& sets) {
  core::set_threads(1);
  core::Trainer t(tetra::numerics::job_without_run_folder(kJob, "tb", sets, core::SectionRegistry{}));
  t.run();
}

// tag -> step -> value, of every summary record
std::map<std::string, std::map<int64_t, double>> scalars(const nlohmann::json& records) {
  std::map<std::string, std::map<int64_t, double>> out;
  for (const auto& r : records)
    if (r["what"] == "summary")
      for (const auto& v : r["values"]) out[v[0].get<std::string>()][r["step"].get<int64_t>()] = v[1].get<double>();
  return out;
}

}  // namespace

// Every number of every metrics record is a scalar at its step, equal to the JSONL's
// (as a float): the train loss, learning rate, throughput, gradient norm, memory and
// per-step phases, and the evaluation's loss and accuracy.
TEST(TensorBoard, EventFilesReadBackByAnIndependentDecoderMatchTheMetrics) {
  std::string why;
  if (!have_decoder(why)) GTEST_SKIP() << why;
  const fs::path d = fs::path(testing::TempDir()) / ("tensorboard_" + std::to_string(::getpid()));
  fs::remove_all(d);
  train({"log.tensorboard=" + (d / "tb").string(), "log.metrics=" + (d / "metrics.jsonl").string()});
  const nlohmann::json records = decode(d / "tb");
  ASSERT_FALSE(records.empty());
  EXPECT_EQ(records[0]["what"], "file_version");
  EXPECT_EQ(records[0]["file_version"], "brain.Event:2");
  EXPECT_GT(records[0]["wall_time"].get<double>(), 1.6e9);  // seconds since 1970, as TensorBoard expects
  const auto tb = scalars(records);
  for (const char* tag : {"train/loss", "train/lr", "train/samples_per_s", "train/grad_norm",
                          "memory/model_state_bytes/total", "memory/peak_rss_bytes", "time/step_ms/forward",
                          "time/step_ms/backward", "time/step_ms/optimizer", "eval/test_loss", "eval/test_accuracy"})
    EXPECT_TRUE(tb.count(tag)) << "no scalar " << tag;
  // Each JSONL number, at its step, under its tag.
  std::ifstream in(d / "metrics.jsonl");
  int compared = 0;
  for (std::string line; std::getline(in, line);) {
    const auto rec = nlohmann::json::parse(line);
    const int64_t step = rec["step"];
    const std::string group = rec.value("eval", false) ? "eval/" : "train/";
    for (const char* key : {"loss", "lr", "grad_norm", "test_loss", "test_accuracy"}) {
      if (!rec.contains(key)) continue;
      const std::string tag = group + key;
      ASSERT_TRUE(tb.count(tag) && tb.at(tag).count(step)) << tag << " at step " << step;
      const double want = rec[key].get<double>();
      EXPECT_NEAR(tb.at(tag).at(step), want, 1e-6 * std::max(1.0, std::abs(want))) << tag << " at step " << step;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 4 * 3 + 2 * 2);  // 4 train records of loss, lr, grad_norm; 2 evals of loss, accuracy
  EXPECT_EQ(tb.at("train/loss").size(), 4u);  // steps 3, 6, 9, 12
}

// A resumed run starts a file of its own with a SessionLog START at the step it resumed
// from, which TensorBoard reads as "drop the earlier files' points past this step".
TEST(TensorBoard, AResumedRunMarksWhereItResumed) {
  std::string why;
  if (!have_decoder(why)) GTEST_SKIP() << why;
  const fs::path d = fs::path(testing::TempDir()) / ("tensorboard_resume_" + std::to_string(::getpid()));
  fs::remove_all(d);
  const std::vector<std::string> sets = {"log.tensorboard=" + (d / "tb").string(), "log.metrics=",
                                         "checkpoint.dir=" + (d / "ckpt").string(), "train.eval_every=0"};
  auto first = sets;
  first.push_back("train.max_steps=6");
  train(first);
  // the files are named by the second they were opened in: the next one must sort after
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  train(sets);
  const nlohmann::json records = decode(d / "tb");
  std::vector<std::string> files;
  for (const auto& r : records)
    if (files.empty() || files.back() != r["file"]) files.push_back(r["file"]);
  ASSERT_EQ(files.size(), 2u) << records.dump();
  bool marked = false;
  for (const auto& r : records)
    if (r["file"] == files[1] && r["what"] == "session_log") {
      EXPECT_EQ(r["status"], 1);  // START
      EXPECT_EQ(r["step"], 6);
      marked = true;
    }
  EXPECT_TRUE(marked) << records.dump();
  EXPECT_EQ(scalars(records).at("train/loss").size(), 4u);  // 3, 6 then 9, 12
}

// Per-rank numbers (a record's `ranks`) that differ go to a run per rank, rank<N>/ beside
// the main file, under one tag, so TensorBoard overlays the ranks on one chart; numbers
// equal on every rank do not, and one that differed once stays per rank; communication
// time per axis is under time/comm_ms/.
TEST(TensorBoard, RanksThatDifferGetARunEach) {
  std::string why;
  if (!have_decoder(why)) GTEST_SKIP() << why;
  const fs::path d = fs::path(testing::TempDir()) / ("tensorboard_ranks_" + std::to_string(::getpid()));
  fs::remove_all(d);
  {
    core::EventWriter w;
    w.open((d / "tb").string());
    w.record({{"step", 3}, {"loss", 0.5}, {"comm_ms", {{"pipeline", 1.5}}}, {"pipeline_bubble", 0.25},
              {"ranks", {{{"model_state_bytes", 100}, {"peak_rss_bytes", 7}, {"pipeline_bubble", 0.2}},
                         {{"model_state_bytes", 300}, {"peak_rss_bytes", 7}, {"pipeline_bubble", 0.3}}}}});
    // Later equal on both ranks: the bubble stays per rank (no gap in either line).
    w.record({{"step", 6}, {"loss", 0.4},
              {"ranks", {{{"model_state_bytes", 100}, {"peak_rss_bytes", 7}, {"pipeline_bubble", 0.25}},
                         {{"model_state_bytes", 300}, {"peak_rss_bytes", 7}, {"pipeline_bubble", 0.25}}}}});
  }
  const auto main_run = scalars(decode(d / "tb"));
  EXPECT_NEAR(main_run.at("time/comm_ms/pipeline").at(3), 1.5, 1e-6);
  EXPECT_NEAR(main_run.at("train/pipeline_bubble").at(3), 0.25, 1e-6);
  for (int r = 0; r < 2; ++r) {
    const auto run = scalars(decode(d / "tb" / ("rank" + std::to_string(r))));
    EXPECT_NEAR(run.at("per_rank/model_state_bytes").at(3), r == 0 ? 100 : 300, 1e-3) << r;
    EXPECT_NEAR(run.at("per_rank/pipeline_bubble").at(3), r == 0 ? 0.2 : 0.3, 1e-6) << r;
    EXPECT_NEAR(run.at("per_rank/pipeline_bubble").at(6), 0.25, 1e-6) << r;
    EXPECT_EQ(run.count("per_rank/peak_rss_bytes"), 0u) << r << ": equal on every rank";
  }
}

// The framing's CRC on the known answer of CRC-32C ("123456789" -> 0xE3069283), masked.
TEST(TensorBoard, MaskedCrc32cOfTheCheckString) {
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(core::masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}
