// topo — what this build has and what the job runs on.
//
//   topo [--json] [--plan JOB.yaml] [--backend mpi|gloo] [--timeout S]
//
// Sections: (a) the build (backends, CUDA, LibTorch, BLAS); (b) each host's tree
// (packages, NUMA nodes, cores, caches) with (c) its GPUs and their link matrix when it
// has any; (d) the launch view: rank -> host, local rank, cores, device. Under a launcher
// (mpirun, srun, torchrun) every rank discovers its host and the topology is gathered
// over the world; only rank 0 prints. (e) --plan: how the job's mesh axes land on the
// hosts (the job read as train reads it, into the same core::Plan). --json prints all of
// it as one JSON document.
//
// Exit status: 0 done; 2 the command line or the job file is wrong; 1 anything else.
#include <CLI/CLI.hpp>
#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/version.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "collectives/backends.h"
#include "collectives/build_config.h"
#include "collectives/error.h"
#include "collectives/launch.h"
#include "collectives/topology_gather.h"
#include "core/job_file.h"
#include "core/mesh.h"
#include "core/runtime.h"
#include "hardware/topology.h"
#include "tetra/tetra.h"

namespace {

using namespace tetra;
using nlohmann::json;

// ---- (a) the build --------------------------------------------------------------------

struct BackendRow {
  const char* name;     // registry name
  const char* display;  // as printed
  bool built;           // from the generated build_config.h
};

json build_report(const collectives::BackendRegistry& registry, const hardware::HostTopology& host) {
  const BackendRow rows[] = {{"mpi", "MPI", TETRA_HAVE_MPI != 0},
                             {"nccl", "NCCL", TETRA_HAVE_NCCL != 0},
                             {"gloo", "Gloo", TETRA_HAVE_GLOO != 0}};
  json j;
  j["backends"] = json::array();
  for (const auto& r : rows) {
    json b{{"name", r.name}, {"display", r.display}, {"built", r.built}, {"description", ""}, {"unavailable", ""}};
    if (r.built && registry.contains(r.name)) {
      const auto& e = registry.at(r.name);
      b["description"] = e.description;
      b["unavailable"] = e.unavailable ? e.unavailable() : "";
    } else if (r.built) {
      b["unavailable"] = "built but not registered";
    }
    j["backends"].push_back(std::move(b));
  }
  j["mpiexec"] = TETRA_MPIEXEC;
  j["cuda"] = {{"runtime", host.cuda_runtime},
               {"driver", host.cuda_driver},
               {"driver_version", host.driver_version},
               {"gpu_status", host.gpu_status}};
  j["torch"] = {{"version", TORCH_VERSION}, {"has_cuda", at::hasCUDA()}, {"cuda_available", torch::cuda::is_available()}};
  j["blas"] = core::blas_description();
  j["hwloc"] = host.hwloc_version;
  return j;
}

std::string format_build(const json& b) {
  std::ostringstream os;
  os << "build\n";
  for (const auto& r : b["backends"]) {
    bool built = r["built"].get<bool>();
    std::string desc = r["description"].get<std::string>(), why = r["unavailable"].get<std::string>();
    os << "  [" << (built ? "X" : " ") << "] " << r["display"].get<std::string>();
    if (!built)
      os << " (not built)";
    else if (!desc.empty())
      os << " (" << desc << ")";
    if (built && !why.empty()) os << ": cannot run here: " << why;
    os << "\n";
  }
  const json& c = b["cuda"];
  std::string runtime = c["runtime"], driver = c["driver"], dv = c["driver_version"];
  os << "  CUDA runtime " << (runtime.empty() ? "none found" : runtime) << ", driver ";
  if (driver.empty() && dv.empty())
    os << "none (" << c["gpu_status"].get<std::string>() << ")";
  else
    os << (driver.empty() ? "?" : driver) << (dv.empty() ? "" : " (NVIDIA " + dv + ")");
  os << "\n";
  os << "  LibTorch " << b["torch"]["version"].get<std::string>() << " ("
     << (b["torch"]["has_cuda"].get<bool>() ? (b["torch"]["cuda_available"].get<bool>() ? "CUDA, available"
                                                                                          : "CUDA, no device")
                                            : "CPU only")
     << ")\n";
  os << "  BLAS " << b["blas"].get<std::string>() << "\n";
  if (!b["hwloc"].get<std::string>().empty()) os << "  hwloc " << b["hwloc"].get<std::string>() << "\n";
  return os.str();
}

// ---- (d) the launch -------------------------------------------------------------------

json launch_json(const collectives::LaunchInfo& l, const std::string& backend) {
  return {{"launcher", l.launcher},
          {"rank", l.rank},
          {"world_size", l.world_size},
          {"local_rank", l.local_rank},
          {"local_world_size", l.local_world_size},
          {"evidence", l.evidence},
          {"backend", backend},
          {"description", collectives::describe(l)}};
}

// ---- (e) the plan ---------------------------------------------------------------------
//
// How the job's mesh axes land on the hosts: each rank's coordinates, and for each axis
// whether its groups stay inside one host. The job is read as `train` reads it — every
// section, through the built-in plugins, into the core::Plan that the trainer, --check and
// --dry-run use — so a job train rejects is rejected here with the same messages. When the
// mesh does not match the world this topo ran in, the mismatch is reported and the layout
// is shown as if the launcher had placed mesh-size ranks consecutively on the hosts seen,
// the same number on each.
json print_plan(const hardware::Topology& topo, const std::string& job_path) {
  core::SectionRegistry plugins;
  register_builtin_plugins(plugins);
  const core::Plan plan(core::parse_job_file(job_path, {}, plugins).spec);
  const core::MeshSpec& spec = plan.processes();
  const int n = spec.world_size();
  json j{{"job", job_path}, {"mesh", spec.str()}, {"mesh_ranks", n}, {"world", topo.ranks_count()},
         {"replicas_per_process", plan.replicas()}, {"data_ranks", plan.data_ranks()},
         {"batch", plan.batch_equation()}};
  j["composition"] = json::array();
  for (const core::PlanStep& step : plan.composition())
    j["composition"].push_back({{"section", step.section}, {"axis", step.role.axis}, {"active", step.active},
                                {"what", step.active ? step.role.why : "off: " + step.note}});

  // rank -> host: the real placement, or a hypothetical consecutive one.
  std::vector<std::string> host_of(n);
  bool real = n == topo.ranks_count();
  if (real) {
    for (const auto& r : topo.ranks) host_of[r.rank] = r.host;
    j["placement"] = "actual";
  } else {
    try {
      core::check_mesh_fits(spec, topo.ranks_count(), "this topo run");
    } catch (const ConfigError& e) {
      j["mismatch"] = e.what();
    }
    int hosts = std::max(1, topo.hosts_count());
    int per = (n + hosts - 1) / hosts;
    for (int r = 0; r < n; ++r)
      host_of[r] = topo.hosts.empty() ? "?" : topo.hosts[std::min(r / per, hosts - 1)].hostname;
    j["placement"] = "hypothetical: " + std::to_string(per) + " consecutive rank" + (per == 1 ? "" : "s") +
                     " per host on the " + std::to_string(hosts) + " host" + (hosts == 1 ? "" : "s") + " seen";
  }

  core::MeshLayout layout(spec);
  j["ranks"] = json::array();
  for (int r = 0; r < n; ++r) {
    json coords = json::object();
    auto c = layout.coords(r);
    for (size_t i = 0; i < c.size(); ++i) coords[spec.axes[i].name] = c[i];
    j["ranks"].push_back({{"rank", r}, {"host", host_of[r]}, {"coords", coords}});
  }
  j["axes"] = json::array();
  for (const auto& a : spec.axes) {
    std::set<std::vector<int>> groups;
    for (int r = 0; r < n; ++r) groups.insert(layout.group(r, a.name));
    int crossing = 0;
    json gs = json::array();
    for (const auto& g : groups) {
      std::set<std::string> hosts;
      for (int r : g) hosts.insert(host_of[r]);
      if (hosts.size() > 1) ++crossing;
      gs.push_back({{"ranks", g}, {"hosts", std::vector<std::string>(hosts.begin(), hosts.end())}});
    }
    j["axes"].push_back({{"name", a.name},
                         {"size", a.size},
                         {"groups", gs},
                         {"groups_crossing_hosts", crossing},
                         {"intra_host", crossing == 0}});
  }
  return j;
}

std::string format_plan(const json& p) {
  std::ostringstream os;
  const int replicas = p["replicas_per_process"];
  os << "plan: mesh " << p["mesh"].get<std::string>() << " = " << p["mesh_ranks"].get<int>() << (p["mesh_ranks"].get<int>() == 1 ? " process" : " processes");
  if (replicas > 1) os << " x " << replicas << " replica threads (the data group is " << p["data_ranks"].get<int>() << " wide)";
  os << " (" << p["job"].get<std::string>() << ")\n";
  os << "  batch " << p["batch"].get<std::string>() << "\n";
  for (const auto& c : p["composition"])
    os << "  " << c["section"].get<std::string>() << " (" << c["axis"].get<std::string>() << "): " << c["what"].get<std::string>()
       << "\n";
  if (p.contains("mismatch")) os << "  note: " << p["mismatch"].get<std::string>() << "\n";
  os << "  placement: " << p["placement"].get<std::string>() << "\n";
  std::vector<std::string> names;
  for (const auto& a : p["axes"]) names.push_back(a["name"]);
  size_t hw = 4;
  for (const auto& r : p["ranks"]) hw = std::max(hw, r["host"].get<std::string>().size());
  auto pad = [](std::string s, size_t w) { return s.size() >= w ? s + " " : s + std::string(w - s.size(), ' '); };
  auto put = [&](std::string line) {
    while (!line.empty() && line.back() == ' ') line.pop_back();
    os << line << "\n";
  };
  std::string head = "  " + pad("rank", 6) + pad("host", hw + 2);
  for (const auto& nm : names) head += pad(nm, nm.size() + 2);
  put(head);
  for (const auto& r : p["ranks"]) {
    std::string line = "  " + pad(std::to_string(r["rank"].get<int>()), 6) + pad(r["host"].get<std::string>(), hw + 2);
    for (const auto& nm : names) line += pad(std::to_string(r["coords"][nm].get<int>()), nm.size() + 2);
    put(line);
  }
  for (const auto& a : p["axes"]) {
    int groups = static_cast<int>(a["groups"].size()), crossing = a["groups_crossing_hosts"];
    os << "  axis " << a["name"].get<std::string>() << " (size " << a["size"].get<int>() << "): " << groups
       << " group" << (groups == 1 ? "" : "s") << ", ";
    if (crossing == 0)
      os << (groups == 1 ? "inside one host" : "each inside one host");
    else
      os << crossing << " crossing hosts";
    os << ":";
    for (const auto& g : a["groups"]) {
      os << " [";
      bool first = true;
      for (int r : g["ranks"]) {
        os << (first ? "" : " ") << r;
        first = false;
      }
      os << "]";
      if (g["hosts"].size() > 1) os << "*";
    }
    os << (crossing ? "   (* spans hosts)" : "") << "\n";
    if (crossing && a["name"] == "tensor")
      os << "    warning: every block's activation sums cross the hosts' link; keep mesh.tensor within a host's ranks\n";
  }
  return os.str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"topo: what this build has and what the job runs on", "topo"};
  bool as_json = false;
  std::string plan_path, backend = "mpi";
  double timeout_s = 120;
  app.add_flag("--json", as_json, "print everything as one JSON document");
  app.add_option("--plan", plan_path, "a job file (YAML): show how its mesh axes land on the hosts");
  app.add_option("--backend", backend, "the world backend under a launcher (mpi, gloo)")->capture_default_str();
  app.add_option("--timeout", timeout_s, "seconds to wait for the other ranks")->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }

  int rank = 0;
  try {
    collectives::LaunchInfo launch = collectives::detect_launch();
    collectives::BackendRegistry registry;
    collectives::register_builtin_backends(registry);
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));

    hardware::HostTopology host = hardware::discover_host();
    hardware::Topology topo;
    if (launch.multi_process()) {
      collectives::WorldOptions options;
      options.timeout = timeout;
      // The topology is host memory: it travels over the host plane (Note [Two planes]).
      collectives::CommunicatorPtr world = registry.create_planes(backend, launch, options).host;
      rank = world->rank();
      topo = collectives::gather_topology(*world, launch, host, timeout);
    } else {
      topo = hardware::local_topology(host, 0, launch.local_rank);
    }
    if (rank != 0) return 0;

    json doc;
    doc["build"] = build_report(registry, host);
    doc["launch"] = launch_json(launch, launch.multi_process() ? backend : "");
    doc["topology"] = json::parse(hardware::to_json(topo));
    if (!plan_path.empty()) doc["plan"] = print_plan(topo, plan_path);

    if (as_json) {
      std::cout << doc.dump(2) << "\n";
      return 0;
    }
    std::cout << format_build(doc["build"]) << "\n";
    for (size_t i = 0; i < topo.hosts.size(); ++i) std::cout << hardware::format_host(topo.hosts[i]) << "\n";
    std::cout << "launch: " << collectives::describe(launch);
    if (launch.multi_process()) std::cout << " (" << launch.evidence << "; gathered over " << backend << ")";
    std::cout << "\n" << hardware::format_ranks(topo);
    if (doc.contains("plan")) std::cout << "\n" << format_plan(doc["plan"]);
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "topo: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "topo (rank %d): %s\n", rank, e.what());
    return 1;
  }
}
