// The job-spec reader: YAML with positions, typed getters, every error at once.
//
// Note [Config diagnostics]
// A job file is read through Section views. Each getter checks the type and range of
// one key and, when the key is absent, takes the default; a wrong value becomes a
// Diagnostic at the key's own line and column and the default stands in, so reading goes
// on and the user sees every error of the file in one run, compiler-style:
//
//   job.yaml:7:9: error: optimizer.lr: expected a number, got "fast"
//
// Every key a getter reads is remembered; Section::finish() reports the keys nobody
// read as unknown, with `did you mean "..."?` against the keys that were read. So a
// section's schema is simply the code that reads it, and plugins validate their own
// sections with the same calls. Every value read (given or default) is also written to
// the document's resolved tree, which is what `train --print-config` prints.
//
// Values set on the command line (`--set a.b=c`) carry their origin, so an error in one
// names the `--set` argument instead of a line.
#pragma once

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tetra::core {

// Where a value came from: "job.yaml:7:9" or "--set optimizer.lr=fast".
struct SourceLocation {
  std::string file;   // file name as given by the user, or "" for none
  int line = 0;       // 1-based; 0 when unknown
  int column = 0;     // 1-based; 0 when unknown
  std::string origin; // when non-empty, replaces file:line:col (e.g. "--set a.b=c")
  std::string str() const;
};

struct Diagnostic {
  SourceLocation where;
  std::string message;  // "optimizer.lr: expected a number, got \"fast\""
  std::string str() const;  // "job.yaml:7:9: error: <message>"
};

class Diagnostics {
 public:
  void error(SourceLocation where, std::string message);
  bool ok() const { return entries_.empty(); }
  const std::vector<Diagnostic>& entries() const { return entries_; }
  // All diagnostics, one per line, in file order (line, column), --set ones last.
  std::string str() const;
  // Throws tetra::ConfigError(str()) when there is any error.
  void throw_if_errors() const;
  // For a document a program wrote (the C++ Plan builder): each diagnostic with a line
  // gets origin = name_of(line) — the call that wrote that line — instead of file:line:col.
  // The order stays the document's.
  void relocate(const std::function<std::string(int line)>& name_of);

 private:
  std::vector<Diagnostic> entries_;
};

class Section;

// One parsed job file plus its command-line overrides.
class ConfigDocument {
 public:
  // Syntax errors (and a missing or unreadable file) are reported as diagnostics with
  // their line and column, never as a bare yaml-cpp exception. The top level must be a
  // mapping.
  static ConfigDocument load_file(const std::string& path, Diagnostics& diag);
  static ConfigDocument from_string(const std::string& text, const std::string& name,
                                    Diagnostics& diag);

  // "a.b.c=value": value is parsed as YAML (so 1e-3, true, [1, 2] and {k: v} work);
  // intermediate mappings are created. A malformed assignment is a diagnostic.
  void apply_override(const std::string& assignment, Diagnostics& diag);

  // The top-level section (path ""). Sections share this document's state.
  Section root(Diagnostics& diag);

  // Every key read so far, with its resolved value (given or default).
  YAML::Node resolved() const;
  const std::string& name() const;

  ConfigDocument();
  ~ConfigDocument();
  ConfigDocument(ConfigDocument&&) noexcept;
  ConfigDocument& operator=(ConfigDocument&&) noexcept;

  struct State;  // shared with Section

 private:
  std::shared_ptr<State> state_;
};

// Note [Schema]: while a SchemaRecorder lives on a thread, every getter of a Section on
// that thread notes the key's dotted path and the JSON Schema of what it accepts (type,
// bounds, the words of a choice, its default), and section() notes a mapping. The job
// spec's JSON Schema (core::job_schema) is made from what the parsers read, so the
// schema and the parser cannot disagree about keys, types, bounds or words; rules across
// keys (a mesh that fits the world, hidden is for mlp) stay the parser's. is_list()
// notes {"$list": true}: the key is read one way or another by its shape, and the
// explorer tries it as a list too.
class SchemaRecorder {
 public:
  SchemaRecorder();
  ~SchemaRecorder();
  SchemaRecorder(const SchemaRecorder&) = delete;
  SchemaRecorder& operator=(const SchemaRecorder&) = delete;
  static SchemaRecorder* current();  // this thread's, or null
  void note(const std::string& path, const nlohmann::json& schema);
  // path -> the distinct schemas noted for it (a key read two ways has two).
  const std::map<std::string, std::vector<nlohmann::json>>& notes() const { return notes_; }

 private:
  std::map<std::string, std::vector<nlohmann::json>> notes_;
  SchemaRecorder* previous_;
};

// A view on one mapping of the document, at a dotted path ("", "optimizer",
// "model.block"). A key that is absent reads as its default; a section that is absent
// reads as an empty mapping (all defaults).
class Section {
 public:
  static constexpr int64_t kNoMin = std::numeric_limits<int64_t>::min();
  static constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();

  bool has(const std::string& key) const;
  // The key is present and holds a list (for keys that take a word or a list, such as
  // pipeline.balance).
  bool is_list(const std::string& key) const;

  // Numbers accept YAML ints and floats. [min, max] inclusive; NaN bounds mean "none".
  double number(const std::string& key, double def,
                double min = -std::numeric_limits<double>::infinity(),
                double max = std::numeric_limits<double>::infinity());
  // Like number() but the bound is exclusive at min (e.g. lr > 0).
  double positive_number(const std::string& key, double def);
  int64_t integer(const std::string& key, int64_t def, int64_t min = kNoMin,
                  int64_t max = kNoMax);
  std::optional<int64_t> optional_integer(const std::string& key, int64_t min = kNoMin,
                                          int64_t max = kNoMax);
  // An integer in [min, max], or the word `word` (mesh.data: 4, or auto), which reads as
  // nullopt; `def` likewise (nullopt: the word is the default).
  std::optional<int64_t> integer_or(const std::string& key, const std::string& word, std::optional<int64_t> def,
                                    int64_t min = kNoMin, int64_t max = kNoMax);
  bool boolean(const std::string& key, bool def);
  // true, false, or nullopt when absent (or null): the caller's default decides.
  std::optional<bool> optional_boolean(const std::string& key);
  std::string string(const std::string& key, const std::string& def);
  // One of `allowed`; otherwise an error listing them (and the nearest one).
  std::string choice(const std::string& key, const std::string& def,
                     const std::vector<std::string>& allowed);
  // One word of `names`, read into the enum whose values are the list's indices (the
  // value is parsed once; the code then compares enums, never strings).
  template <typename E>
  E word(const std::string& key, E def, const std::vector<std::string>& names) {
    const std::string w = choice(key, names.at(static_cast<size_t>(def)), names);
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == w) return static_cast<E>(i);
    return def;
  }
  // A list of integers, each >= min. A scalar is an error ("expected a list").
  std::vector<int64_t> integers(const std::string& key, const std::vector<int64_t>& def,
                                int64_t min = kNoMin);
  std::vector<double> numbers(const std::string& key, const std::vector<double>& def);

  // A nested mapping. A non-mapping value is an error (and reads as empty).
  Section section(const std::string& key);

  // Position of the key (or of this section when the key is absent).
  SourceLocation location(const std::string& key) const;
  // Adds an error at the key's position, prefixed with the key's dotted path.
  void error(const std::string& key, const std::string& message);

  // Reports every key of this mapping that no getter read as unknown, with the nearest
  // read key as a suggestion. Call once, after all reads of this section. Keys listed in
  // `ignore` are skipped (they are read elsewhere, e.g. plugin sections at the root).
  void finish(const std::vector<std::string>& ignore = {});

  // Keys present in this mapping, in file order.
  std::vector<std::string> keys() const;
  const std::string& path() const { return path_; }
  std::string key_path(const std::string& key) const;  // path + "." + key
  Diagnostics& diagnostics() { return *diag_; }

 private:
  friend class ConfigDocument;
  Section(std::shared_ptr<ConfigDocument::State> state, Diagnostics* diag, std::string path,
          YAML::Node node, SourceLocation where);
  std::shared_ptr<ConfigDocument::State> state_;
  Diagnostics* diag_;
  std::string path_;
  YAML::Node node_;
  SourceLocation where_;
  std::vector<std::string> read_;
};

// Levenshtein-nearest candidate within a small distance, or "" when none is close.
std::string nearest(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace tetra::core
