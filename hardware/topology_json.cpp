// A Topology as JSON (hardware/topology.h: to_json, topology_from_json, merge of
// documents): "tetra.topology/1", what `topo --json` prints and what ranks exchange
// (collectives/topology_gather.h). The members and their keys are Note [Topology
// fields]'s lists; this file holds only the two visitors that write and read them.
#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "hardware/topology.h"
#include "hardware/topology_fields.h"

namespace tetra::hardware {

namespace {

using nlohmann::json;

constexpr const char* kFormat = "tetra.topology/1";

template <typename T>
struct IsVector : std::false_type {};
template <typename T>
struct IsVector<std::vector<T>> : std::true_type {};

// ---- writing ---------------------------------------------------------------------------

template <typename S>
json write(const S& s);

// A member's value: a scalar as itself, a struct as an object, a list as an array.
template <typename T>
json value_of(const T& v) {
  if constexpr (IsVector<T>::value) {
    json a = json::array();
    for (const auto& item : v) a.push_back(value_of(item));
    return a;
  } else if constexpr (std::is_class_v<T> && !std::is_same_v<T, std::string>) {
    return write(v);
  } else {
    return v;
  }
}

// Every member under its key (Note [Topology fields]).
template <typename S>
struct JsonWriter {
  static constexpr bool kReads = false;
  const S& s;
  json& j;
  template <typename T>
  void field(const char* key, T S::*member) {
    j[key] = value_of(s.*member);
  }
};

template <typename S>
json write(const S& s) {
  json j;
  JsonWriter<S> w{s, j};
  Fields<S>::declare(w);
  return j;
}

// ---- reading ---------------------------------------------------------------------------

// Where in the document a value is, to read it: a missing key keeps the default
// (hand-written documents may leave fields out); a present key of the wrong type is an
// error naming its path.
struct Reader {
  const json& j;
  std::string path;

  bool has(const char* key) const { return j.is_object() && j.contains(key); }
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument("topology JSON: " + path + ": " + what);
  }
  void object() const {
    if (!j.is_object()) fail("expected an object");
  }
  Reader at(const char* key) const { return Reader{j.at(key), path + "." + key}; }
  Reader item(size_t i) const { return Reader{j[i], path + "[" + std::to_string(i) + "]"}; }
};

template <typename S>
S read(const Reader& r);

template <typename T>
void read_value(const Reader& r, T& out);

// A list at `r`; `not_a_list`: the error when it is none.
template <typename T>
void read_list(const Reader& r, std::vector<T>& out, const char* not_a_list) {
  if (!r.j.is_array()) r.fail(not_a_list);
  for (size_t i = 0; i < r.j.size(); ++i) {
    T item{};
    if constexpr (IsVector<T>::value)  // the GPU link matrix: its rows
      read_list(r.item(i), item, "expected an array (a row of the link matrix)");
    else
      read_value(r.item(i), item);
    out.push_back(std::move(item));
  }
}

// A value of type T at `r`, checked.
template <typename T>
void read_value(const Reader& r, T& out) {
  if constexpr (std::is_same_v<T, bool>) {
    if (!r.j.is_boolean()) r.fail("expected true or false");
    out = r.j.get<T>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!r.j.is_number_integer()) r.fail("expected an integer");
    out = r.j.get<T>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!r.j.is_string()) r.fail("expected a string");
    out = r.j.get<T>();
  } else if constexpr (IsVector<T>::value) {
    read_list(r, out, "expected an array");
  } else {
    out = read<T>(r);
  }
}

// Each key that is present (Note [Topology fields]), into `s`.
template <typename S>
struct JsonReader {
  static constexpr bool kReads = true;
  const Reader& r;
  S& s;
  const S& value() const { return s; }
  [[noreturn]] void fail(const std::string& what) const { r.fail(what); }
  void require(const char* key) const {
    if (!r.has(key)) r.fail("\"" + std::string(key) + "\" is missing");
  }
  template <typename T>
  void field(const char* key, T S::*member) {
    if (r.has(key)) read_value(r.at(key), s.*member);
  }
};

template <typename S>
S read(const Reader& r) {
  r.object();
  S s;
  JsonReader<S> v{r, s};
  Fields<S>::declare(v);
  return s;
}

Topology read_topology(const json& j) {
  Reader r{j, "$"};
  r.object();
  if (r.has("format")) {
    std::string format;
    read_value(r.at("format"), format);
    if (format != kFormat) r.fail("format \"" + format + "\" is not " + kFormat);
  }
  return read<Topology>(r);
}

}  // namespace

// ---- entry points ----------------------------------------------------------------------

std::string to_json(const Topology& topology, int indent) {
  json j = write(topology);
  j["format"] = kFormat;
  return j.dump(indent);
}

std::string to_json(const HostTopology& host, int indent) { return write(host).dump(indent); }

Topology topology_from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw std::invalid_argument(std::string("topology JSON does not parse: ") + e.what());
  }
  try {
    return read_topology(j);
  } catch (const json::exception& e) {  // a type nlohmann rejects below our checks
    throw std::invalid_argument(std::string("topology JSON: ") + e.what());
  }
}

Topology merge(const std::vector<std::string>& per_rank_json) {
  std::vector<Topology> parts;
  parts.reserve(per_rank_json.size());
  for (size_t i = 0; i < per_rank_json.size(); ++i) {
    try {
      parts.push_back(topology_from_json(per_rank_json[i]));
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("topology merge: part " + std::to_string(i) + ": " + e.what());
    }
  }
  return merge(parts);
}

}  // namespace tetra::hardware
