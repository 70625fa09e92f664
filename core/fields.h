// Note [Fields declared once]
// Each section of the job spec declares its keys once, as a function template over a
// visitor:
//
//   template <class V> void train_fields(V& v, TrainSpec& t) {
//     v.integer("epochs", t.epochs, 1);
//     v.word("precision", t.precision, precision_names());
//     ...
//   }
//
// and that one declaration is run by every visitor that needs the keys:
//   Reader      parses: each key through Section's getter (its message with line:col,
//               did-you-mean, the schema recorder's note, so --schema and --list-keys
//               follow), the field's value before the call being the default;
//   Writer      to_yaml: each key whose value differs from the section's default (the
//               same declaration run over a default struct), in declaration order, and
//               the keys marked kAlways; the C++ PlanBuilder writes its structs with it
//               and parses them back through the Reader, so a job built in code meets
//               the same rules, with the same messages, as a file;
//   KeyLister   the keys a variant of a typed section reads (the model's for each
//               model.type), for the error that names the variant a key belongs to.
// Rules that span keys, or turn a bad value into an error and a fallback, sit beside
// the keys they guard in `if constexpr (V::kReads)` blocks: they are the reader's alone.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/job_spec.h"

namespace tetra::core::fields {

enum Write { kChanged, kAlways };  // the Writer: a key at its default is left out, or not

inline constexpr int64_t kNoMin = Section::kNoMin;
inline constexpr int64_t kNoMax = Section::kNoMax;
inline constexpr double kInf = std::numeric_limits<double>::infinity();

class Reader {
 public:
  static constexpr bool kReads = true;
  explicit Reader(Section& s) : s_(s) {}
  Section& section() { return s_; }
  // Whether reading `key` added a diagnostic (a typed section's type: then the keys of
  // other variants are let be, to avoid a cascade).
  bool failed(const std::string& key) const {
    for (const auto& k : failed_)
      if (k == key) return true;
    return false;
  }

  template <typename I>
  void integer(const std::string& key, I& v, int64_t min = kNoMin, int64_t max = kNoMax, Write = kChanged) {
    v = static_cast<I>(s_.integer(key, static_cast<int64_t>(v), min, max));
  }
  void optional_integer(const std::string& key, std::optional<int64_t>& v, int64_t min = kNoMin, int64_t max = kNoMax) {
    v = s_.optional_integer(key, min, max);
  }
  void number(const std::string& key, double& v, double min = -kInf, double max = kInf) { v = s_.number(key, v, min, max); }
  void positive(const std::string& key, double& v) { v = s_.positive_number(key, v); }
  void boolean(const std::string& key, bool& v) { v = s_.boolean(key, v); }
  void optional_boolean(const std::string& key, std::optional<bool>& v) {
    if (const std::optional<bool> read = s_.optional_boolean(key)) v = read;
  }
  void string(const std::string& key, std::string& v, Write = kChanged) { v = s_.string(key, v); }
  void choice(const std::string& key, std::string& v, const std::vector<std::string>& words, Write = kChanged) {
    const size_t before = s_.diagnostics().entries().size();
    v = s_.choice(key, v, words);
    if (s_.diagnostics().entries().size() != before) failed_.push_back(key);
  }
  template <typename E>
  void word(const std::string& key, E& v, const std::vector<std::string>& names) {
    v = s_.word(key, v, names);
  }
  void integers(const std::string& key, std::vector<int64_t>& v, int64_t min = kNoMin) { v = s_.integers(key, v, min); }
  void numbers(const std::string& key, std::vector<double>& v) { v = s_.numbers(key, v); }

 private:
  Section& s_;
  std::vector<std::string> failed_;
};

// Writes a struct's keys. Run the declaration over the section's default struct first
// (defaults()), then over the struct to write.
class Writer {
 public:
  static constexpr bool kReads = false;

  void defaults() { recording_ = true; }
  void values() { recording_ = false; }
  const YAML::Node& node() const { return node_; }

  template <typename I>
  void integer(const std::string& key, I& v, int64_t = kNoMin, int64_t = kNoMax, Write w = kChanged) {
    put(key, YAML::Node(static_cast<int64_t>(v)), w);
  }
  void optional_integer(const std::string& key, std::optional<int64_t>& v, int64_t = kNoMin, int64_t = kNoMax) {
    if (v) put(key, YAML::Node(*v), kChanged);
  }
  void number(const std::string& key, double& v, double = -kInf, double = kInf) { put(key, yaml_number(v), kChanged); }
  void positive(const std::string& key, double& v) { put(key, yaml_number(v), kChanged); }
  void boolean(const std::string& key, bool& v) { put(key, YAML::Node(v), kChanged); }
  void optional_boolean(const std::string& key, std::optional<bool>& v) {
    if (v) put(key, YAML::Node(*v), kChanged);
  }
  void string(const std::string& key, std::string& v, Write w = kChanged) { put(key, YAML::Node(v), w); }
  void choice(const std::string& key, std::string& v, const std::vector<std::string>&, Write w = kChanged) {
    put(key, YAML::Node(v), w);
  }
  template <typename E>
  void word(const std::string& key, E& v, const std::vector<std::string>& names) {
    put(key, YAML::Node(names.at(static_cast<size_t>(v))), kChanged);
  }
  void integers(const std::string& key, std::vector<int64_t>& v, int64_t = kNoMin) {
    YAML::Node list(YAML::NodeType::Sequence);
    for (int64_t x : v) list.push_back(x);
    list.SetStyle(YAML::EmitterStyle::Flow);
    put(key, list, kChanged);
  }
  void numbers(const std::string& key, std::vector<double>& v) {
    YAML::Node list(YAML::NodeType::Sequence);
    for (double x : v) list.push_back(yaml_number(x));
    list.SetStyle(YAML::EmitterStyle::Flow);
    put(key, list, kChanged);
  }

 private:
  static std::string text(const YAML::Node& n) {
    YAML::Emitter e;
    e << YAML::Flow << n;
    return e.c_str();
  }
  void put(const std::string& key, const YAML::Node& value, Write w) {
    if (recording_) {
      defaults_[key] = text(value);
      return;
    }
    auto it = defaults_.find(key);
    if (w == kAlways || it == defaults_.end() || it->second != text(value)) node_[key] = value;
  }
  bool recording_ = false;
  std::map<std::string, std::string> defaults_;
  YAML::Node node_{YAML::NodeType::Map};
};

// The keys a declaration reads for the struct it is given (a typed section's variant).
class KeyLister {
 public:
  static constexpr bool kReads = false;
  const std::vector<std::string>& keys() const { return keys_; }

  template <typename I>
  void integer(const std::string& key, I&, int64_t = kNoMin, int64_t = kNoMax, Write = kChanged) { add(key); }
  void optional_integer(const std::string& key, std::optional<int64_t>&, int64_t = kNoMin, int64_t = kNoMax) { add(key); }
  void number(const std::string& key, double&, double = -kInf, double = kInf) { add(key); }
  void positive(const std::string& key, double&) { add(key); }
  void boolean(const std::string& key, bool&) { add(key); }
  void optional_boolean(const std::string& key, std::optional<bool>&) { add(key); }
  void string(const std::string& key, std::string&, Write = kChanged) { add(key); }
  void choice(const std::string& key, std::string&, const std::vector<std::string>&, Write = kChanged) { add(key); }
  template <typename E>
  void word(const std::string& key, E&, const std::vector<std::string>&) { add(key); }
  void integers(const std::string& key, std::vector<int64_t>&, int64_t = kNoMin) { add(key); }
  void numbers(const std::string& key, std::vector<double>&) { add(key); }

 private:
  void add(const std::string& key) {
    for (const auto& k : keys_)
      if (k == key) return;
    keys_.push_back(key);
  }
  std::vector<std::string> keys_;
};

// `spec` as YAML: the keys that differ from `defaults` (the section's default struct, of
// the same variant for a typed section), and those declared kAlways.
template <typename S, typename Declare>
YAML::Node write(S spec, S defaults, Declare&& declare) {
  Writer w;
  w.defaults();
  declare(w, defaults);
  w.values();
  declare(w, spec);
  return w.node();
}

// The keys a declaration reads for `spec`'s variant.
template <typename S, typename Declare>
std::vector<std::string> keys(S spec, Declare&& declare) {
  KeyLister k;
  declare(k, spec);
  return k.keys();
}

}  // namespace tetra::core::fields

namespace tetra::core {

// What a plugin's section decides beyond its keys. `SectionStart` sets the defaults the job
// decides, before the keys are read (pipeline.stages from the mesh); `SectionDecide` checks
// the rules that span the keys or the job (errors through the section) and says whether the
// strategy is on. `given`: whether the job has the section at all.
template <class Options>
using SectionStart = std::function<void(Options& options, const JobSpec& job)>;
template <class Options>
using SectionDecide = std::function<bool(Section& section, const JobSpec& job, const Options& options, bool given)>;

// Registers a plugin's section with the parser every plugin's is: `Options{}`, then `start`,
// then the keys `declare` declares (Note [Fields declared once]) through the Reader, then
// Section::finish (unknown keys are errors), then `decide`; nullptr (the strategy is off)
// where `decide` says so. Written once so that a plugin says only what is its own.
// `axis`: the mesh axis the strategy owns ("" for none), as SectionRegistry::add.
template <class Options, class Declare>
void register_section(SectionRegistry& registry, const std::string& name, Declare declare, const std::string& axis = "",
                      SectionDecide<Options> decide = {}, SectionStart<Options> start = {}) {
  registry.add(
      name,
      [declare, decide, start](Section& s, const JobSpec& job) -> std::shared_ptr<const PluginConfig> {
        auto o = std::make_shared<Options>();
        const bool given = !s.keys().empty();
        if (start) start(*o, job);
        fields::Reader r(s);
        declare(r, *o);
        s.finish();
        if (decide && !decide(s, job, *o, given)) return nullptr;
        return o;
      },
      axis);
}

}  // namespace tetra::core
