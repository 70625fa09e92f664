// TensorBoard event files: what `log.tensorboard: DIR` writes, for `tensorboard --logdir`.
//
// Note [Event files]: an event file is a TFRecord stream of serialized `Event` protocol
// buffers (tensorboard/compat/proto/event.proto, summary.proto). Each record is
//   uint64 length | uint32 masked CRC-32C of the length bytes | data | uint32 masked CRC-32C of data
// little-endian, where mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (core/crc32c.h, the
// checkpoints' CRC-32C). The few messages written are encoded here by hand, by their
// field numbers, which is smaller than a protobuf dependency for four messages:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
//             Summary summary = 5; SessionLog session_log = 7; }
//   Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
//   SessionLog { enum SessionStatus status = 1; }   (START = 1)
// The first record says "brain.Event:2". A resumed run starts its own file with a
// SessionLog START at the step it resumed from: TensorBoard then drops the points of the
// earlier files past that step (the steps the interrupted run took and the resumed one
// takes again), instead of drawing both. Scalars are simple_value, which TensorBoard's
// scalars plugin reads (its data compatibility layer turns them into scalar tensors).
// tests/core/test_tensorboard.cpp reads the files back with python3-protobuf and its own
// CRC, not with code of this file.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>

namespace tetra::core {

class EventWriter {
 public:
  EventWriter() = default;
  // A new file events.out.tfevents.<seconds>.<host>.<pid> in `dir` (made if missing).
  // `resumed_at` >= 0: the run resumed from that step (the SessionLog START above).
  // Throws tetra::Error naming the path when it cannot be written.
  void open(const std::string& dir, int64_t resumed_at = -1);
  bool is_open() const { return out_.is_open(); }
  const std::string& path() const { return path_; }

  void scalar(const std::string& tag, int64_t step, double value);
  // Every number of a metrics record (MetricsWriter's), one scalar each, at its "step":
  // a train record's under train/ (memory sizes under memory/, step phases under time/),
  // an eval record's under eval/, anything else under its first key's name. Nested objects
  // add their keys to the tag ("memory/model_state_bytes/total"); null (a loss that was
  // not finite), strings and booleans are left out. Communication time per axis goes
  // under time/comm_ms/, the pipeline bubble under train/pipeline_bubble.
  // Per rank (a record's `ranks`, Note [Per-rank records] in core/trainer.cpp): a number
  // that differs between the ranks is written for every rank, under the same tag
  // (per_rank/peak_rss_bytes, ...) in a run of its own, the folder rank<N> beside this
  // file: TensorBoard draws one line per run on one chart, so the ranks overlay. Numbers
  // equal on every rank add nothing to rank 0's own; one that has differed once is written
  // per rank from then on, so no rank's line has gaps.
  void record(const nlohmann::json& rec);

 private:
  void write_event(const std::string& event);
  std::ofstream out_;
  std::string path_;
  std::string dir_;
  int64_t resumed_at_ = -1;
  std::map<size_t, std::unique_ptr<EventWriter>> ranks_;  // opened when a rank first differs
  std::set<std::string> per_rank_;                          // the numbers that have differed
};

// The masked CRC-32C of TFRecord framing (Note [Event files]).
uint32_t masked_crc32c(const void* data, size_t size);

}  // namespace tetra::core
