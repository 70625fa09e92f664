// The job-spec reader (Note [Config diagnostics] in config.h).
#include "core/config.h"

#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/parser.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <utility>

#include "collectives/error.h"
#include "core/text.h"

namespace tetra::core {

// ---- the document's shared state ---------------------------------------------------

struct ConfigDocument::State {
  std::string file;  // as given; prefixes every location
  YAML::Node root{YAML::NodeType::Map};
  YAML::Node resolved{YAML::NodeType::Map};
  // Dotted paths set on the command line -> the `--set` argument that set them.
  std::map<std::string, std::string> overrides;
};

namespace {

using State = ConfigDocument::State;

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return parts;
}


std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

// Shortest text that reads back as the same double ("0.1", not "0.10000000000000001").
std::string format_number(double x) {
  if (std::isnan(x)) return ".nan";
  if (std::isinf(x)) return x > 0 ? ".inf" : "-.inf";
  char buf[40];
  // A whole number is written out (timeout_s: 300), not as %g's shortest (3e+02).
  if (x == std::floor(x) && std::abs(x) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", x);
    return buf;
  }
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  return buf;
}

// The origin of the longest overridden prefix of `path`, or "".
std::string override_origin(const State& st, const std::string& path) {
  std::string best;
  size_t best_len = 0;
  for (const auto& [p, origin] : st.overrides) {
    bool prefix = path == p || (path.size() > p.size() && path.compare(0, p.size(), p) == 0 &&
                                path[p.size()] == '.');
    if (prefix && p.size() >= best_len) {
      best = origin;
      best_len = p.size();
    }
  }
  return best;
}

SourceLocation mark_location(const State& st, const YAML::Mark& mark) {
  SourceLocation loc;
  loc.file = st.file;
  if (mark.line >= 0 && mark.column >= 0) {
    loc.line = mark.line + 1;
    loc.column = mark.column + 1;
  }
  return loc;
}

// Where the node `n` at dotted `path` came from: its --set argument, its mark, or
// `fallback` when it has no position (nodes built by an override).
SourceLocation node_location(const State& st, const std::string& path, const YAML::Node& n,
                             const SourceLocation& fallback) {
  std::string origin = override_origin(st, path);
  if (!origin.empty()) {
    SourceLocation loc;
    loc.file = st.file;
    loc.origin = origin;
    return loc;
  }
  if (n.IsDefined() && n.Mark().line >= 0) return mark_location(st, n.Mark());
  // A mapping made by an override (`--set zero.stage=2` without a zero: section) has no
  // position: name the first --set argument beneath it.
  for (const auto& [p, o] : st.overrides) {
    if (p.size() > path.size() && p.compare(0, path.size(), path) == 0 && p[path.size()] == '.') {
      SourceLocation loc;
      loc.file = st.file;
      loc.origin = o;
      return loc;
    }
  }
  return fallback;
}

struct Entry {
  bool found = false;
  YAML::Node key;
  YAML::Node value;
};

// The first entry of mapping `map` whose key is `key` (const access: never inserts).
Entry find_entry(const YAML::Node& map, const std::string& key) {
  Entry e;
  if (!map.IsDefined() || !map.IsMap()) return e;
  for (auto it = map.begin(); it != map.end(); ++it) {
    if (it->first.IsScalar() && it->first.Scalar() == key) {
      e.found = true;
      e.key = it->first;
      e.value = it->second;
      return e;
    }
  }
  return e;
}

bool is_null(const YAML::Node& n) { return !n.IsDefined() || n.IsNull(); }

// Writes `value` into the resolved tree at `path`, creating mappings on the way.
void put_resolved(State& st, const std::string& path, const YAML::Node& value) {
  std::vector<std::string> parts = split_path(path);
  YAML::Node cur = st.resolved;  // shares identity; move with reset(), never operator=
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node next = cur[parts[i]];
    if (!next.IsMap()) cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
    YAML::Node child = cur[parts[i]];
    cur.reset(child);
  }
  cur[parts.back()] = value;
}

YAML::Node number_node(double x) { return YAML::Node(format_number(x)); }

template <typename T>
YAML::Node list_node(const std::vector<T>& items) {
  YAML::Node n(YAML::NodeType::Sequence);
  for (const T& x : items) {
    if constexpr (std::is_floating_point_v<T>)
      n.push_back(number_node(x));
    else
      n.push_back(x);
  }
  n.SetStyle(YAML::EmitterStyle::Flow);
  return n;
}

// ---- scalar recognition --------------------------------------------------------------

bool parse_double(const std::string& raw, double& out) {
  std::string s = trim(raw);
  if (s.empty()) return false;
  std::string l = lower(s);
  if (l == ".inf" || l == "+.inf") {
    out = HUGE_VAL;
    return true;
  }
  if (l == "-.inf") {
    out = -HUGE_VAL;
    return true;
  }
  if (l == ".nan") {
    out = std::nan("");
    return true;
  }
  bool digit = false;
  for (char c : s) {
    if (std::isdigit(static_cast<unsigned char>(c)))
      digit = true;
    else if (c != '+' && c != '-' && c != '.' && c != 'e' && c != 'E')
      return false;
  }
  if (!digit) return false;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size()) return false;
  out = v;  // overflow gives ±inf, rejected by the caller as not finite
  return true;
}

enum class IntParse { kOk, kNotInteger, kOverflow };

IntParse parse_int(const std::string& raw, int64_t& out) {
  std::string s = trim(raw);
  if (s.empty()) return IntParse::kNotInteger;
  size_t i = (s[0] == '+' || s[0] == '-') ? 1 : 0;
  int base = 10;
  std::string body = s.substr(i);
  if (body.size() > 2 && body[0] == '0' && (body[1] == 'x' || body[1] == 'X'))
    base = 16;
  else if (body.size() > 2 && body[0] == '0' && body[1] == 'o')
    base = 8;
  std::string digits = base == 10 ? body : body.substr(2);
  if (digits.empty()) return IntParse::kNotInteger;
  for (char c : digits) {
    bool ok = base == 16 ? std::isxdigit(static_cast<unsigned char>(c)) != 0
                         : (c >= '0' && c <= (base == 8 ? '7' : '9'));
    if (!ok) return IntParse::kNotInteger;
  }
  std::string text = (i ? s.substr(0, 1) : std::string()) + digits;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, base);
  if (errno == ERANGE) return IntParse::kOverflow;
  out = static_cast<int64_t>(v);
  return IntParse::kOk;
}

bool parse_bool(const std::string& raw, bool& out) {
  static const char* kTrue[] = {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"};
  static const char* kFalse[] = {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"};
  for (const char* t : kTrue)
    if (raw == t) {
      out = true;
      return true;
    }
  for (const char* f : kFalse)
    if (raw == f) {
      out = false;
      return true;
    }
  return false;
}

std::string quote(const std::string& s) {
  std::string body = s.size() > 60 ? s.substr(0, 57) + "..." : s;
  std::string out = "\"";
  for (char c : body) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned char>(c));
      out += buf;
    } else
      out += c;
  }
  return out + "\"";
}

// How a value reads in a message: `2.5`, `true`, `"fast"`, `a list`, `a mapping`.
std::string describe(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "null";
  if (n.IsSequence()) return n.size() == 0 ? "an empty list" : "a list";
  if (n.IsMap()) return "a mapping";
  const std::string& s = n.Scalar();
  if (n.Tag() != "!") {  // a plain scalar: numbers and booleans read as themselves
    double d;
    bool b;
    if (parse_double(s, d) || parse_bool(s, b)) return s;
  }
  return quote(s);
}

std::string describe_int_bounds(int64_t min, int64_t max) {
  if (min != Section::kNoMin && max != Section::kNoMax)
    return "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  if (min != Section::kNoMin) return "must be >= " + std::to_string(min);
  return "must be <= " + std::to_string(max);
}

// Optimal-string-alignment distance (an adjacent swap counts as one edit).
size_t edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

}  // namespace

// ---- locations and diagnostics --------------------------------------------------------

std::string SourceLocation::str() const {
  if (!origin.empty()) return origin;
  std::string out = file;
  if (line > 0) {
    if (!out.empty()) out += ":";
    out += std::to_string(line);
    if (column > 0) out += ":" + std::to_string(column);
  }
  return out;
}

std::string Diagnostic::str() const {
  std::string where_text = where.str();
  return (where_text.empty() ? std::string() : where_text + ": ") + "error: " + message;
}

void Diagnostics::error(SourceLocation where, std::string message) {
  entries_.push_back(Diagnostic{std::move(where), std::move(message)});
}

namespace {
// File diagnostics in (line, column) order, then the --set ones in theirs.
bool document_order(const Diagnostic* a, const Diagnostic* b) {
  bool a_set = !a->where.origin.empty(), b_set = !b->where.origin.empty();
  if (a_set != b_set) return b_set;  // file diagnostics first
  if (a_set) return false;           // --set ones keep their order
  if (a->where.line != b->where.line) return a->where.line < b->where.line;
  return a->where.column < b->where.column;
}
}  // namespace

void Diagnostics::relocate(const std::function<std::string(int line)>& name_of) {
  std::vector<const Diagnostic*> sorted;
  for (const Diagnostic& d : entries_) sorted.push_back(&d);
  std::stable_sort(sorted.begin(), sorted.end(), document_order);
  std::vector<Diagnostic> moved;
  for (const Diagnostic* d : sorted) moved.push_back(*d);
  for (Diagnostic& d : moved)
    if (d.where.origin.empty() && d.where.line > 0) d.where.origin = name_of(d.where.line);
  entries_ = std::move(moved);
}

std::string Diagnostics::str() const {
  std::vector<const Diagnostic*> sorted;
  for (const Diagnostic& d : entries_) sorted.push_back(&d);
  std::stable_sort(sorted.begin(), sorted.end(), document_order);
  std::string out;
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (i) out += "\n";
    out += sorted[i]->str();
  }
  return out;
}

void Diagnostics::throw_if_errors() const {
  if (!ok()) throw tetra::ConfigError(str());
}

std::string nearest(const std::string& word, const std::vector<std::string>& candidates) {
  const std::string w = lower(word);
  for (const std::string& c : candidates)
    if (lower(c) == w) return c;
  const size_t limit = std::clamp<size_t>(w.size() / 3, 1, 3);
  std::string best;
  size_t best_d = limit + 1;
  for (const std::string& c : candidates) {
    size_t d = edit_distance(w, lower(c));
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  if (!best.empty()) return best;
  // "warmup" for "warmup_steps": one is a prefix of the other, and it is unambiguous.
  if (w.size() < 4) return "";
  std::string found;
  for (const std::string& c : candidates) {
    std::string lc = lower(c);
    bool prefix = lc.size() >= 4 && (lc.rfind(w, 0) == 0 || w.rfind(lc, 0) == 0);
    if (prefix) {
      if (!found.empty()) return "";
      found = c;
    }
  }
  return found;
}

// ---- the document ----------------------------------------------------------------------

ConfigDocument::ConfigDocument() : state_(std::make_shared<State>()) {}
ConfigDocument::~ConfigDocument() = default;
ConfigDocument::ConfigDocument(ConfigDocument&&) noexcept = default;
ConfigDocument& ConfigDocument::operator=(ConfigDocument&&) noexcept = default;

ConfigDocument ConfigDocument::load_file(const std::string& path, Diagnostics& diag) {
  SourceLocation here;
  here.file = path;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    int err = errno;
    diag.error(here, std::string("cannot read job file: ") + std::strerror(err));
    ConfigDocument doc;
    doc.state_->file = path;
    return doc;
  }
  std::string text;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  bool failed = std::ferror(f) != 0;
  int err = errno;
  std::fclose(f);
  if (failed) {
    diag.error(here, std::string("cannot read job file: ") + std::strerror(err));
    ConfigDocument doc;
    doc.state_->file = path;
    return doc;
  }
  return from_string(text, path, diag);
}

namespace {

// The offset of the first byte that does not start or continue a well-formed UTF-8
// sequence, or npos. YAML is UTF-8 text, and yaml-cpp 0.7 can spin for minutes on bytes
// such as 0xFF (found by tools/fuzz): they are refused before it sees them.
size_t first_non_utf8(const std::string& text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || (len == 2 && c < 0xC2) || (len == 4 && c > 0xF4) || i + len > n) return i;
    for (size_t k = 1; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return i;
    i += len;
  }
  return std::string::npos;
}

// yaml-cpp 0.7's LoadAll never returns on a document that starts at a token no rule takes,
// such as a ',' outside [ ] or { } (",\n", "- a\n,\n"; found by tools/fuzz; upstream
// jbeder/yaml-cpp#1040, fixed by #1319 in 0.8.x): each round yields another empty document
// at the same place, forever, in growing memory. This pass walks the documents through the
// event parser first and stops at a document that starts where the one before did.
class DocumentStarts : public YAML::EventHandler {
 public:
  YAML::Mark start;
  void OnDocumentStart(const YAML::Mark& mark) override { start = mark; }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

void check_documents_advance(const std::string& text) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentStarts docs;
  std::optional<YAML::Mark> before;
  while (parser.HandleNextDocument(docs)) {
    if (before && docs.start.pos == before->pos) {
      const bool comma = docs.start.pos >= 0 && static_cast<size_t>(docs.start.pos) < text.size() &&
                         text[static_cast<size_t>(docs.start.pos)] == ',';
      throw YAML::ParserException(docs.start, comma ? "a ',' outside [ ] or { } (a comma separates the items of a flow list or mapping)"
                                                    : "cannot parse past this point");
    }
    before = docs.start;
  }
}

// "byte 0xff at line 3, column 7"
std::string describe_byte(const std::string& text, size_t at) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < at; ++i) {
    if (text[i] == '\n') ++line, col = 1;
    else ++col;
  }
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02x", static_cast<unsigned char>(text[at]));
  return std::string("byte ") + hex + " at line " + std::to_string(line) + ", column " + std::to_string(col);
}

}  // namespace

ConfigDocument ConfigDocument::from_string(const std::string& text, const std::string& name,
                                           Diagnostics& diag) {
  ConfigDocument doc;
  State& st = *doc.state_;
  st.file = name;
  SourceLocation here;
  here.file = name;
  std::vector<YAML::Node> docs;
  if (const size_t bad = first_non_utf8(text); bad != std::string::npos) {
    diag.error(here, "the job file is not UTF-8 text (" + describe_byte(text, bad) +
                         "); YAML files are UTF-8: save it as UTF-8 or remove that byte");
    return doc;
  }
  try {
    check_documents_advance(text);
    docs = YAML::LoadAll(text);
  } catch (const YAML::DeepRecursion& e) {
    diag.error(mark_location(st, e.mark), "invalid YAML: lists or mappings nested too deeply (" +
                                              std::to_string(e.depth()) + " levels)");
    return doc;
  } catch (const YAML::Exception& e) {
    std::string msg = "invalid YAML: " + e.msg;
    // yaml-cpp 0.8 (Debian 13) names the anchor an alias refers to and nobody defined
    // ("... not defined: nowhere"), 0.7 (Debian 12) does not: named here on both.
    if (e.msg == "the referenced anchor is not defined" && e.mark.pos >= 0 &&
        static_cast<size_t>(e.mark.pos) < text.size() && text[e.mark.pos] == '*') {
      const size_t from = static_cast<size_t>(e.mark.pos) + 1;
      const size_t to = std::min(text.find_first_of(" \t\r\n,[]{}", from), text.size());
      msg += ": " + text.substr(from, to - from);
    }
    // yaml-cpp's word for a tab in the indentation is "illegal map value" or the like.
    if (e.mark.line >= 0) {
      std::istringstream lines(text);
      std::string line;
      for (int i = 0; i <= e.mark.line && std::getline(lines, line); ++i) {
      }
      size_t indent = line.find_first_not_of(" \t");
      if (line.substr(0, indent == std::string::npos ? line.size() : indent).find('\t') !=
          std::string::npos)
        msg += " (this line is indented with a tab; YAML needs spaces)";
    }
    diag.error(mark_location(st, e.mark), msg);
    return doc;
  } catch (const std::exception& e) {
    diag.error(here, std::string("invalid YAML: ") + e.what());
    return doc;
  }
  if (docs.empty() || (docs.size() == 1 && docs[0].IsNull())) {
    diag.error(here, "job file is empty");
    return doc;
  }
  if (docs.size() > 1) {
    // The second document's position is unknown to yaml-cpp's nodes; report its root.
    SourceLocation second =
        docs[1].IsDefined() && docs[1].Mark().line >= 0 ? mark_location(st, docs[1].Mark()) : here;
    diag.error(second, "a job file holds one YAML document, found " + std::to_string(docs.size()));
  }
  const YAML::Node& top = docs[0];
  if (!top.IsMap()) {
    SourceLocation at = top.Mark().line >= 0 ? mark_location(st, top.Mark()) : here;
    diag.error(at,
               "the top level of a job file must be a mapping of sections "
               "(model:, data:, optimizer:, ...), got " +
                   describe(top));
    return doc;
  }
  st.root = top;
  return doc;
}

void ConfigDocument::apply_override(const std::string& assignment, Diagnostics& diag) {
  State& st = *state_;
  SourceLocation where;
  where.file = st.file;
  where.origin = "--set " + assignment;
  size_t eq = assignment.find('=');
  if (eq == std::string::npos) {
    diag.error(where,
               "expected KEY=VALUE (e.g. --set optimizer.lr=3e-4), got " + quote(assignment));
    return;
  }
  std::string key = trim(assignment.substr(0, eq));
  std::string value_text = assignment.substr(eq + 1);
  if (key.empty()) {
    diag.error(where, "missing key before '=' (expected KEY=VALUE, e.g. --set train.epochs=3)");
    return;
  }
  std::vector<std::string> parts = split_path(key);
  for (const std::string& p : parts) {
    if (trim(p).empty()) {
      diag.error(where, "malformed key " + quote(key) + ": empty component in the dotted path");
      return;
    }
  }
  YAML::Node value;
  if (trim(value_text).empty()) {
    value = YAML::Node(std::string());  // `--set log.metrics=` sets the empty string
  } else if (const size_t bad = first_non_utf8(value_text); bad != std::string::npos) {
    diag.error(where, key + ": the value is not UTF-8 text (" + describe_byte(value_text, bad) + ")");
    return;
  } else {
    try {
      value = YAML::Load(value_text);
    } catch (const YAML::Exception& e) {
      diag.error(where, key + ": invalid YAML value: " + e.msg);
      return;
    }
  }
  // Walk down, creating mappings; a scalar or list in the way is an error.
  YAML::Node cur = st.root;
  std::string walked;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    walked += (i ? "." : "") + parts[i];
    Entry e = find_entry(cur, parts[i]);
    if (e.found && !is_null(e.value) && !e.value.IsMap()) {
      diag.error(where, "cannot set " + key + ": " + walked + " is " + describe(e.value) +
                            ", not a mapping");
      return;
    }
    if (!e.found || is_null(e.value)) cur[parts[i]] = YAML::Node(YAML::NodeType::Map);
    YAML::Node child = cur[parts[i]];
    cur.reset(child);
  }
  cur[parts.back()] = value;
  // Later overrides win; one of a whole mapping replaces those inside it.
  for (auto it = st.overrides.begin(); it != st.overrides.end();) {
    const std::string& p = it->first;
    bool inside =
        p.size() > key.size() && p.compare(0, key.size(), key) == 0 && p[key.size()] == '.';
    it = inside ? st.overrides.erase(it) : std::next(it);
  }
  st.overrides[key] = where.origin;
}

Section ConfigDocument::root(Diagnostics& diag) {
  SourceLocation where;
  where.file = state_->file;
  if (state_->root.IsDefined() && state_->root.Mark().line >= 0)
    where = mark_location(*state_, state_->root.Mark());
  return Section(state_, &diag, "", state_->root, where);
}

YAML::Node ConfigDocument::resolved() const { return state_->resolved; }
const std::string& ConfigDocument::name() const { return state_->file; }

// ---- schema (Note [Schema]) ----------------------------------------------------------------

namespace {
thread_local SchemaRecorder* t_recorder = nullptr;

void note_schema(const std::string& path, nlohmann::json schema) {
  if (SchemaRecorder* r = SchemaRecorder::current()) r->note(path, schema);
}
nlohmann::json number_schema(const char* type, double def, double min, double max) {
  nlohmann::json j = {{"type", type}, {"default", def}};
  if (std::isfinite(min)) j["minimum"] = min;
  if (std::isfinite(max)) j["maximum"] = max;
  return j;
}
}  // namespace

SchemaRecorder::SchemaRecorder() : previous_(t_recorder) { t_recorder = this; }
SchemaRecorder::~SchemaRecorder() { t_recorder = previous_; }
SchemaRecorder* SchemaRecorder::current() { return t_recorder; }
void SchemaRecorder::note(const std::string& path, const nlohmann::json& schema) {
  auto& seen = notes_[path];
  if (std::find(seen.begin(), seen.end(), schema) == seen.end()) seen.push_back(schema);
}

// ---- sections ---------------------------------------------------------------------------

Section::Section(std::shared_ptr<ConfigDocument::State> state, Diagnostics* diag, std::string path,
                 YAML::Node node, SourceLocation where)
    : state_(std::move(state)),
      diag_(diag),
      path_(std::move(path)),
      node_(std::move(node)),
      where_(std::move(where)) {}

std::string Section::key_path(const std::string& key) const {
  if (path_.empty()) return key;
  if (key.empty()) return path_;
  return path_ + "." + key;
}

bool Section::has(const std::string& key) const {
  Entry e = find_entry(node_, key);
  return e.found && !is_null(e.value);
}

bool Section::is_list(const std::string& key) const {
  // The schema's explorer then also reads the key as a list (Note [Schema]).
  if (SchemaRecorder* r = SchemaRecorder::current()) r->note(key_path(key), {{"$list", true}});
  Entry e = find_entry(node_, key);
  return e.found && e.value.IsSequence();
}

std::vector<std::string> Section::keys() const {
  std::vector<std::string> out;
  if (!node_.IsDefined() || !node_.IsMap()) return out;
  for (auto it = node_.begin(); it != node_.end(); ++it)
    if (it->first.IsScalar()) out.push_back(it->first.Scalar());
  return out;
}

SourceLocation Section::location(const std::string& key) const {
  Entry e = find_entry(node_, key);
  return node_location(*state_, key_path(key), e.found ? e.key : YAML::Node(), where_);
}

void Section::error(const std::string& key, const std::string& message) {
  std::string p = key_path(key);
  diag_->error(location(key), p.empty() ? message : p + ": " + message);
}

namespace {

// What every getter shares: remember the key, find its value, report at the value.
struct Read {
  Entry entry;
  SourceLocation value_where;
  bool absent() const { return !entry.found || is_null(entry.value); }
};

// Remembers `key` as read and finds its value; errors about the value point at it.
Read begin_read(std::vector<std::string>& read, const State& st, const std::string& key,
                const std::string& path, const YAML::Node& map, const SourceLocation& where) {
  if (std::find(read.begin(), read.end(), key) == read.end()) read.push_back(key);
  Read r;
  r.entry = find_entry(map, key);
  SourceLocation key_where =
      node_location(st, path, r.entry.found ? r.entry.key : YAML::Node(), where);
  r.value_where = node_location(st, path, r.entry.found ? r.entry.value : YAML::Node(), key_where);
  return r;
}

// Reads a number from `n`; on failure returns the message (without the key path).
std::optional<std::string> read_number(const YAML::Node& n, double& out) {
  if (!n.IsScalar() || !parse_double(n.Scalar(), out))
    return "expected a number, got " + describe(n);
  bool b;
  if (parse_bool(n.Scalar(), b)) return "expected a number, got " + describe(n);
  if (!std::isfinite(out)) return "expected a finite number, got " + describe(n);
  return std::nullopt;
}

std::optional<std::string> read_integer(const YAML::Node& n, int64_t& out) {
  if (!n.IsScalar()) return "expected an integer, got " + describe(n);
  IntParse p = parse_int(n.Scalar(), out);
  if (p == IntParse::kOverflow) return "integer out of range: " + trim(n.Scalar());
  if (p == IntParse::kOk) return std::nullopt;
  double d;
  if (parse_double(n.Scalar(), d) && std::isfinite(d) && d == std::floor(d) &&
      std::fabs(d) <= 9007199254740992.0) {  // 1e3 and 3.0 are integers too
    out = static_cast<int64_t>(d);
    return std::nullopt;
  }
  return "expected an integer, got " + describe(n);
}

std::string describe_number_bounds(double min, double max, bool min_exclusive) {
  bool has_min = !std::isnan(min) && !std::isinf(min);
  bool has_max = !std::isnan(max) && !std::isinf(max);
  if (has_min && has_max)
    return std::string("must be in ") + (min_exclusive ? "(" : "[") + format_number(min) + ", " +
           format_number(max) + "]";
  if (has_min) return (min_exclusive ? "must be > " : "must be >= ") + format_number(min);
  return "must be <= " + format_number(max);
}

}  // namespace

double Section::number(const std::string& key, double def, double min, double max) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), number_schema("number", def, min, max));
  double v = def;
  if (!r.absent()) {
    if (auto err = read_number(r.entry.value, v)) {
      diag_->error(r.value_where, key_path(key) + ": " + *err);
      v = def;
    } else if ((!std::isnan(min) && v < min) || (!std::isnan(max) && v > max)) {
      diag_->error(r.value_where, key_path(key) + ": " + describe_number_bounds(min, max, false) +
                                      ", got " + trim(r.entry.value.Scalar()));
      v = def;
    }
  }
  put_resolved(*state_, key_path(key), number_node(v));
  return v;
}

double Section::positive_number(const std::string& key, double def) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), {{"type", "number"}, {"exclusiveMinimum", 0}, {"default", def}});
  double v = def;
  if (!r.absent()) {
    if (auto err = read_number(r.entry.value, v)) {
      diag_->error(r.value_where, key_path(key) + ": " + *err);
      v = def;
    } else if (!(v > 0)) {
      diag_->error(r.value_where,
                   key_path(key) + ": must be > 0, got " + trim(r.entry.value.Scalar()));
      v = def;
    }
  }
  put_resolved(*state_, key_path(key), number_node(v));
  return v;
}

int64_t Section::integer(const std::string& key, int64_t def, int64_t min, int64_t max) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), [&] {
    nlohmann::json j = {{"type", "integer"}, {"default", def}};
    if (min != kNoMin) j["minimum"] = min;
    if (max != kNoMax) j["maximum"] = max;
    return j;
  }());
  int64_t v = def;
  if (!r.absent()) {
    if (auto err = read_integer(r.entry.value, v)) {
      diag_->error(r.value_where, key_path(key) + ": " + *err);
      v = def;
    } else if (v < min || v > max) {
      diag_->error(r.value_where, key_path(key) + ": " + describe_int_bounds(min, max) + ", got " +
                                      std::to_string(v));
      v = def;
    }
  }
  put_resolved(*state_, key_path(key), YAML::Node(v));
  return v;
}

std::optional<int64_t> Section::integer_or(const std::string& key, const std::string& word,
                                          std::optional<int64_t> def, int64_t min, int64_t max) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), [&] {
    nlohmann::json count = {{"type", "integer"}};
    if (min != kNoMin) count["minimum"] = min;
    if (max != kNoMax) count["maximum"] = max;
    nlohmann::json j = {{"anyOf", {count, {{"enum", {word}}}}}};
    j["default"] = def ? nlohmann::json(*def) : nlohmann::json(word);
    return j;
  }());
  std::optional<int64_t> v = def;
  if (!r.absent()) {
    const YAML::Node& n = r.entry.value;
    int64_t x = 0;
    if (n.IsScalar() && trim(n.Scalar()) == word) {
      v = std::nullopt;
    } else if (auto err = read_integer(n, x)) {
      std::string msg = key_path(key) + ": expected an integer or " + word + ", got " + describe(n);
      if (n.IsScalar() && !nearest(n.Scalar(), {word}).empty()) msg += "; did you mean " + quote(word) + "?";
      diag_->error(r.value_where, msg);
    } else if (x < min || x > max) {
      diag_->error(r.value_where, key_path(key) + ": " + describe_int_bounds(min, max) + " or " + word + ", got " +
                                      std::to_string(x));
    } else {
      v = x;
    }
  }
  put_resolved(*state_, key_path(key), v ? YAML::Node(*v) : YAML::Node(word));
  return v;
}

std::optional<int64_t> Section::optional_integer(const std::string& key, int64_t min, int64_t max) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), [&] {
    nlohmann::json j = {{"type", {"integer", "null"}}};
    if (min != kNoMin) j["minimum"] = min;
    if (max != kNoMax) j["maximum"] = max;
    return j;
  }());
  std::optional<int64_t> out;
  if (!r.absent()) {
    int64_t v = 0;
    if (auto err = read_integer(r.entry.value, v)) {
      diag_->error(r.value_where, key_path(key) + ": " + *err + " (or null for none)");
    } else if (v < min || v > max) {
      diag_->error(r.value_where, key_path(key) + ": " + describe_int_bounds(min, max) + ", got " +
                                      std::to_string(v));
    } else {
      out = v;
    }
  }
  put_resolved(*state_, key_path(key), out ? YAML::Node(*out) : YAML::Node(YAML::NodeType::Null));
  return out;
}

std::optional<bool> Section::optional_boolean(const std::string& key) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), {{"type", {"boolean", "null"}}});
  std::optional<bool> out;
  if (!r.absent()) {
    bool v = false;
    if (!r.entry.value.IsScalar() || !parse_bool(r.entry.value.Scalar(), v))
      diag_->error(r.value_where, key_path(key) + ": expected true or false (or null for the default), got " +
                                      describe(r.entry.value));
    else
      out = v;
  }
  put_resolved(*state_, key_path(key), out ? YAML::Node(*out) : YAML::Node(YAML::NodeType::Null));
  return out;
}

bool Section::boolean(const std::string& key, bool def) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), {{"type", "boolean"}, {"default", def}});
  bool v = def;
  if (!r.absent()) {
    if (!r.entry.value.IsScalar() || !parse_bool(r.entry.value.Scalar(), v)) {
      diag_->error(r.value_where,
                   key_path(key) + ": expected true or false, got " + describe(r.entry.value));
      v = def;
    }
  }
  put_resolved(*state_, key_path(key), YAML::Node(v));
  return v;
}

std::string Section::string(const std::string& key, const std::string& def) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), {{"type", "string"}, {"default", def}});
  std::string v = def;
  if (!r.absent()) {
    if (!r.entry.value.IsScalar()) {
      diag_->error(r.value_where,
                   key_path(key) + ": expected a string, got " + describe(r.entry.value));
    } else {
      v = r.entry.value.Scalar();
    }
  }
  put_resolved(*state_, key_path(key), YAML::Node(v));
  return v;
}

std::string Section::choice(const std::string& key, const std::string& def,
                            const std::vector<std::string>& allowed) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), {{"enum", allowed}, {"default", def}});
  std::string v = def;
  if (!r.absent()) {
    const YAML::Node& n = r.entry.value;
    bool ok =
        n.IsScalar() && std::find(allowed.begin(), allowed.end(), n.Scalar()) != allowed.end();
    if (ok) {
      v = n.Scalar();
    } else {
      std::string msg = key_path(key) + ": expected one of " + join(allowed) + ", got " +
                        (n.IsScalar() ? quote(n.Scalar()) : describe(n));
      if (n.IsScalar()) {
        std::string near = nearest(n.Scalar(), allowed);
        if (!near.empty()) msg += "; did you mean " + quote(near) + "?";
      }
      diag_->error(r.value_where, msg);
    }
  }
  put_resolved(*state_, key_path(key), YAML::Node(v));
  return v;
}

std::vector<int64_t> Section::integers(const std::string& key, const std::vector<int64_t>& def,
                                       int64_t min) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), [&] {
    nlohmann::json item = {{"type", "integer"}};
    if (min != kNoMin) item["minimum"] = min;
    return nlohmann::json{{"type", "array"}, {"items", item}, {"default", def}};
  }());
  std::vector<int64_t> v = def;
  if (!r.absent()) {
    const YAML::Node& n = r.entry.value;
    if (!n.IsSequence()) {
      diag_->error(r.value_where, key_path(key) + ": expected a list of integers, got " +
                                      describe(n) + " (write [" +
                                      (n.IsScalar() ? n.Scalar() : std::string("...")) + "])");
    } else {
      std::vector<int64_t> items;
      bool ok = true;
      for (size_t i = 0; i < n.size(); ++i) {
        const YAML::Node item = n[i];
        std::string item_path = key_path(key) + "[" + std::to_string(i) + "]";
        SourceLocation at = node_location(*state_, key_path(key), item, r.value_where);
        int64_t x = 0;
        if (auto err = read_integer(item, x)) {
          diag_->error(at, item_path + ": " + *err);
          ok = false;
        } else if (x < min) {
          diag_->error(
              at, item_path + ": must be >= " + std::to_string(min) + ", got " + std::to_string(x));
          ok = false;
        } else {
          items.push_back(x);
        }
      }
      if (ok) v = items;
    }
  }
  put_resolved(*state_, key_path(key), list_node(v));
  return v;
}

std::vector<double> Section::numbers(const std::string& key, const std::vector<double>& def) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), {{"type", "array"}, {"items", {{"type", "number"}}}, {"default", def}});
  std::vector<double> v = def;
  if (!r.absent()) {
    const YAML::Node& n = r.entry.value;
    if (!n.IsSequence()) {
      diag_->error(r.value_where,
                   key_path(key) + ": expected a list of numbers, got " + describe(n));
    } else {
      std::vector<double> items;
      bool ok = true;
      for (size_t i = 0; i < n.size(); ++i) {
        const YAML::Node item = n[i];
        SourceLocation at = node_location(*state_, key_path(key), item, r.value_where);
        double x = 0;
        if (auto err = read_number(item, x)) {
          diag_->error(at, key_path(key) + "[" + std::to_string(i) + "]: " + *err);
          ok = false;
        } else {
          items.push_back(x);
        }
      }
      if (ok) v = items;
    }
  }
  put_resolved(*state_, key_path(key), list_node(v));
  return v;
}

Section Section::section(const std::string& key) {
  Read r = begin_read(read_, *state_, key, key_path(key), node_, where_);
  note_schema(key_path(key), {{"type", "object"}});
  SourceLocation where =
      node_location(*state_, key_path(key), r.entry.found ? r.entry.key : YAML::Node(), where_);
  if (!r.absent() && r.entry.value.IsMap())
    return Section(state_, diag_, key_path(key), r.entry.value, where);
  if (!r.absent()) {
    diag_->error(r.value_where, key_path(key) + ": expected a mapping (key: value lines), got " +
                                    describe(r.entry.value));
  }
  return Section(state_, diag_, key_path(key), YAML::Node(YAML::NodeType::Map), where);
}

void Section::finish(const std::vector<std::string>& ignore) {
  if (!node_.IsDefined() || !node_.IsMap()) return;
  const bool top = path_.empty();
  const std::string what = top ? "section" : "key";
  std::map<std::string, YAML::Mark> seen;
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    const YAML::Node k = it->first;  // a copy: *it is a temporary
    if (!k.IsScalar()) {
      SourceLocation at = node_location(*state_, path_, k, where_);
      diag_->error(at, (top ? std::string() : path_ + ": ") + "a " + what +
                           " name must be a plain string, got " + describe(k));
      continue;
    }
    const std::string& name = k.Scalar();
    SourceLocation at = node_location(*state_, key_path(name), k, where_);
    auto [prev, fresh] = seen.emplace(name, k.Mark());
    if (!fresh) {
      std::string first = prev->second.line >= 0 ? " (first given at line " +
                                                       std::to_string(prev->second.line + 1) + ")"
                                                 : "";
      diag_->error(at, key_path(name) + ": duplicate " + what + first);
      continue;
    }
    if (std::find(read_.begin(), read_.end(), name) != read_.end()) continue;
    if (std::find(ignore.begin(), ignore.end(), name) != ignore.end()) continue;
    std::string msg = key_path(name) + ": unknown " + what;
    std::string near = nearest(name, read_);
    if (!near.empty())
      msg += "; did you mean " + quote(near) + "?";
    else if (!read_.empty())
      msg += " (known " + what + "s: " + join(read_) + ")";
    diag_->error(at, msg);
  }
}

}  // namespace tetra::core
