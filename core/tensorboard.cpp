#include "core/tensorboard.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>

#include "collectives/error.h"
#include "core/crc32c.h"

namespace tetra::core {

namespace {

namespace fs = std::filesystem;

// ---- protocol buffer wire format (Note [Event files]) --------------------------------

void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void key(std::string& out, int field, int wire) { varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire)); }
template <typename T>
void fixed(std::string& out, T v) {  // little-endian, as x86 and the wire format are
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
void field_double(std::string& out, int field, double v) { key(out, field, 1), fixed(out, v); }
void field_float(std::string& out, int field, float v) { key(out, field, 5), fixed(out, v); }
void field_int(std::string& out, int field, int64_t v) { key(out, field, 0), varint(out, static_cast<uint64_t>(v)); }
void field_bytes(std::string& out, int field, const std::string& v) {
  key(out, field, 2);
  varint(out, v.size());
  out += v;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string event(int64_t step) {
  std::string e;
  field_double(e, 1, now_s());  // wall_time
  if (step >= 0) field_int(e, 2, step);
  return e;
}

// Every number in `v`, under `tag`, nested keys joined with '/'.
void numbers(EventWriter& w, const std::string& tag, const nlohmann::json& v, int64_t step) {
  if (v.is_number()) {
    w.scalar(tag, step, v.get<double>());
  } else if (v.is_object()) {
    for (const auto& [k, x] : v.items()) numbers(w, tag + "/" + k, x, step);
  }
}

}  // namespace

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

void EventWriter::open(const std::string& dir, int64_t resumed_at) {
  dir_ = dir;
  resumed_at_ = resumed_at;
  std::error_code ec;
  fs::create_directories(dir, ec);
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  path_ = (fs::path(dir) / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now_s())) + "." + host + "." +
                            std::to_string(::getpid())))
              .string();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw Error("log.tensorboard: cannot write " + path_ + (ec ? " (" + ec.message() + ")" : ""));
  std::string first = event(-1);
  field_bytes(first, 3, "brain.Event:2");  // file_version
  write_event(first);
  if (resumed_at >= 0) {
    std::string start = event(resumed_at), log;
    field_int(log, 1, 1);  // SessionLog.status = START
    field_bytes(start, 7, log);
    write_event(start);
  }
}

void EventWriter::write_event(const std::string& e) {
  if (!out_.is_open()) return;
  std::string head;
  fixed(head, static_cast<uint64_t>(e.size()));
  fixed(head, masked_crc32c(head.data(), 8));
  out_ << head << e;
  fixed(head.erase(), masked_crc32c(e.data(), e.size()));
  out_ << head;
  out_.flush();  // a killed run keeps every point up to its last record
  if (!out_) throw Error("log.tensorboard: writing " + path_ + " failed (is the disk full?)");
}

void EventWriter::scalar(const std::string& tag, int64_t step, double value) {
  std::string v, summary, e = event(step);
  field_bytes(v, 1, tag);
  field_float(v, 2, static_cast<float>(value));
  field_bytes(summary, 1, v);
  field_bytes(e, 5, summary);
  write_event(e);
}

void EventWriter::record(const nlohmann::json& rec) {
  if (!out_.is_open() || !rec.is_object() || !rec.contains("step")) return;
  const int64_t step = rec["step"].get<int64_t>();
  const bool eval = rec.value("eval", false);
  const std::string group = eval ? "eval" : rec.contains("loss") ? "train" : "";
  for (const auto& [k, v] : rec.items()) {
    if (k == "step" || k == "epoch") continue;
    if (k == "model_state_bytes" || k == "peak_rss_bytes") {
      numbers(*this, "memory/" + k, v, step);
    } else if (k == "step_ms" || k == "comm_ms") {
      numbers(*this, "time/" + k, v, step);
    } else if (k == "ranks" && v.is_array() && !v.empty() && v[0].is_object()) {
      for (const auto& [key, first] : v[0].items()) {
        if (!first.is_number()) continue;
        // Once a number has differed it stays per rank, so no rank's line has gaps.
        bool differ = per_rank_.count(key) > 0;
        for (const auto& r : v) differ = differ || r.value(key, nlohmann::json()) != first;
        if (!differ) continue;
        per_rank_.insert(key);
        for (size_t i = 0; i < v.size(); ++i) {
          auto& w = ranks_[i];
          if (!w) {
            w = std::make_unique<EventWriter>();
            w->open((fs::path(dir_) / ("rank" + std::to_string(i))).string(), resumed_at_);
          }
          numbers(*w, "per_rank/" + key, v[i].value(key, nlohmann::json()), step);
        }
      }
    } else {
      numbers(*this, group.empty() ? k : group + "/" + k, v, step);
    }
  }
}

}  // namespace tetra::core
