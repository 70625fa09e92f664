// The members of the Topology structs (hardware/topology.h), each listed once.
//
// Note [Topology fields]
// Each struct of a Topology lists its members once, with their JSON keys, as a function
// template over a visitor (core/fields.h's Note [Fields declared once] for the job spec;
// hardware/ sits below core/ and cannot include it):
//
//   template <> struct Fields<Package> {
//     template <class V> static void declare(V& v) {
//       v.field("index", &Package::index);
//       ...
//     }
//   };
//
// and every visitor that needs the members runs that one list:
//   Equal       (topology.cpp)       operator==: every member;
//   JsonWriter  (topology_json.cpp)  to_json: every member under its key;
//   JsonReader  (topology_json.cpp)  topology_from_json: each key that is present, its
//               type checked, an error naming its path ("$.hosts[0].gpus[1].name").
// A member is a scalar (bool, an integer, a string), a list of strings, a list of
// structs, or a list of lists of structs (the GPU link matrix), each struct read and
// written through its own Fields. Rules that span keys, or require one, sit beside the
// keys they guard in `if constexpr (V::kReads)` blocks: they are the reader's alone, and
// run in the order written (which error a broken document gets depends on it).
// A member added to a struct and to its list is compared, written and read; one left out
// of the list is none of these (the round-trip tests catch it).
#pragma once

#include <string>

#include "hardware/topology.h"

namespace tetra::hardware {

template <typename S>
struct Fields;

template <>
struct Fields<Package> {
  template <class V>
  static void declare(V& v) {
    v.field("index", &Package::index);
    v.field("model", &Package::model);
    v.field("cpus", &Package::cpus);
    v.field("cores", &Package::cores);
    v.field("pus", &Package::pus);
  }
};

template <>
struct Fields<NumaNode> {
  template <class V>
  static void declare(V& v) {
    v.field("index", &NumaNode::index);
    v.field("os_index", &NumaNode::os_index);
    v.field("package", &NumaNode::package);
    v.field("memory_bytes", &NumaNode::memory_bytes);
    v.field("cpus", &NumaNode::cpus);
  }
};

template <>
struct Fields<Core> {
  template <class V>
  static void declare(V& v) {
    v.field("index", &Core::index);
    v.field("package", &Core::package);
    v.field("numa", &Core::numa);
    v.field("pus", &Core::pus);
  }
};

template <>
struct Fields<Cache> {
  template <class V>
  static void declare(V& v) {
    v.field("name", &Cache::name);
    v.field("level", &Cache::level);
    v.field("size_bytes", &Cache::size_bytes);
    v.field("line_bytes", &Cache::line_bytes);
    v.field("instances", &Cache::instances);
    v.field("pus_per_instance", &Cache::pus_per_instance);
  }
};

template <>
struct Fields<Gpu> {
  template <class V>
  static void declare(V& v) {
    v.field("index", &Gpu::index);
    v.field("name", &Gpu::name);
    v.field("uuid", &Gpu::uuid);
    v.field("pci_bus_id", &Gpu::pci_bus_id);
    v.field("memory_bytes", &Gpu::memory_bytes);
    v.field("compute_major", &Gpu::compute_major);
    v.field("compute_minor", &Gpu::compute_minor);
    v.field("numa_node", &Gpu::numa_node);
    v.field("cpu_affinity", &Gpu::cpu_affinity);
  }
};

template <>
struct Fields<GpuLink> {
  template <class V>
  static void declare(V& v) {
    v.field("pcie", &GpuLink::pcie);
    v.field("nvlinks", &GpuLink::nvlinks);
    v.field("p2p", &GpuLink::p2p);
  }
};

template <>
struct Fields<HostTopology> {
  template <class V>
  static void declare(V& v) {
    v.field("hostname", &HostTopology::hostname);
    if constexpr (V::kReads)
      if (v.value().hostname.empty()) v.fail("\"hostname\" is missing or empty");
    v.field("packages", &HostTopology::packages);
    v.field("numa_nodes", &HostTopology::numa_nodes);
    v.field("cores", &HostTopology::cores);
    v.field("pus", &HostTopology::pus);
    v.field("allowed_cpus", &HostTopology::allowed_cpus);
    v.field("caches", &HostTopology::caches);
    v.field("memory_bytes", &HostTopology::memory_bytes);
    v.field("gpus", &HostTopology::gpus);
    v.field("gpu_links", &HostTopology::gpu_links);
    if constexpr (V::kReads) {
      const HostTopology& h = v.value();
      if (!h.gpu_links.empty() || !h.gpus.empty()) {
        bool square = h.gpu_links.size() == h.gpus.size();
        for (const auto& row : h.gpu_links) square = square && row.size() == h.gpus.size();
        if (!square)
          v.fail("gpu_links must be " + std::to_string(h.gpus.size()) + " x " + std::to_string(h.gpus.size()) +
                 " (one row and column per GPU)");
      }
    }
    v.field("gpu_status", &HostTopology::gpu_status);
    v.field("driver_version", &HostTopology::driver_version);
    v.field("cuda_driver", &HostTopology::cuda_driver);
    v.field("cuda_runtime", &HostTopology::cuda_runtime);
    v.field("hwloc_version", &HostTopology::hwloc_version);
    v.field("warnings", &HostTopology::warnings);
  }
};

template <>
struct Fields<RankPlacement> {
  template <class V>
  static void declare(V& v) {
    if constexpr (V::kReads) v.require("rank");
    v.field("rank", &RankPlacement::rank);
    v.field("host", &RankPlacement::host);
    v.field("local_rank", &RankPlacement::local_rank);
    v.field("cpus", &RankPlacement::cpus);
    v.field("device", &RankPlacement::device);
  }
};

// The document's "format" key is the JSON's own (topology_json.cpp), no member.
template <>
struct Fields<Topology> {
  template <class V>
  static void declare(V& v) {
    if constexpr (V::kReads) v.require("hosts");
    v.field("hosts", &Topology::hosts);
    v.field("ranks", &Topology::ranks);
  }
};

}  // namespace tetra::hardware
