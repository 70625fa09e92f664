// The device mesh: the job's processes laid out as named axes.
//
// `mesh: {pipeline: 2, data: 2}` on 4 ranks. The axes are ordered outermost to
// innermost by how much they talk, the most talkative innermost so that its groups are
// consecutive ranks — which launchers place on one host — as Megatron orders its
// groups. The order is fixed in one place (kAxisOrder): pipeline (one activation per
// micro-batch) outside, data (every gradient, every step) inside it, tensor (an
// activation per layer, forward and backward) innermost. The mesh is the only
// source of sub-communicators: each axis's group is the ranks that differ only in that
// axis's coordinate.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/topology_gather.h"

namespace tetra::core {

// Axis names outermost first. An axis missing from a job has size 1.
inline const std::vector<std::string> kAxisOrder = {"pipeline", "data", "tensor"};

struct MeshAxis {
  std::string name;
  int size = 1;
};

struct MeshSpec {
  std::vector<MeshAxis> axes;  // in kAxisOrder; sizes >= 1
  // The axis the job left to the world (`data: auto`, Note [Auto axis] in job_spec.cpp),
  // sized when the job was parsed; "" when every axis was given.
  std::string auto_axis;
  int world_size() const;
  int size(const std::string& axis) const;  // 1 when absent
  // "pipeline=2 x data=2"
  std::string str() const;
};

// Builds a MeshSpec from axis sizes in any order; unknown names are a ConfigError.
MeshSpec make_mesh_spec(const std::vector<MeshAxis>& axes);

// Throws tetra::ConfigError with the whole equation when the mesh does not fit:
// "mesh pipeline=2 x data=2 = 4 ranks, but the world has 3 (mpirun -np 3)".
void check_mesh_fits(const MeshSpec& spec, int world_size, const std::string& world_origin = "");

// Where the groups of one axis fall on the hosts (MeshLayout::axis_spans).
struct AxisSpan {
  std::string axis;
  int size = 1;
  int most_hosts = 1, fewest_hosts = 1;  // hosts a group spans (1: inside a host)
  int most_per_host = 1;                 // the most ranks of one group on one host
};

// Rank <-> coordinates, without any communication.
class MeshLayout {
 public:
  explicit MeshLayout(MeshSpec spec);
  const MeshSpec& spec() const { return spec_; }
  // Coordinates of `rank`, one per axis of spec().axes.
  std::vector<int> coords(int rank) const;
  int coord(int rank, const std::string& axis) const;
  int rank_of(const std::vector<int>& coords) const;
  // The ranks of `rank`'s group along `axis`, in coordinate order.
  std::vector<int> group(int rank, const std::string& axis) const;
  // "rank 3: pipeline 1, data 1" lines.
  std::string table() const;
  // Where each axis's groups fall on `hosts`, the host of each of the world's ranks (Note
  // [One host map]; a dry run's: collectives::consecutive_hosts), one line per axis of more
  // than one rank:
  //   "data      x2  inside a host (every group on one host)"
  //   "pipeline  x2  across 2 hosts (1 rank of each group per host)"
  std::vector<std::string> host_placement(const collectives::HostMap& hosts) const;
  // The same as numbers, one per axis of more than one rank (the cost model's links): each
  // group's hosts are hosts.of(the group), as the group's own gather_hosts would find them.
  std::vector<AxisSpan> axis_spans(const collectives::HostMap& hosts) const;

 private:
  int axis_index(const std::string& axis) const;
  MeshSpec spec_;
  std::vector<int> strides_;
};

// Whether a group whose ranks run on `group_hosts` (its HostMap: Mesh::hosts, or
// HostMap::of) can reduce hierarchically: the same number (> 1) of its ranks on each of
// more than one host. What data_parallel's hierarchical setting and Mesh::hierarchical
// decide by.
bool hierarchical_fits(const collectives::HostMap& group_hosts);

class Mesh {
 public:
  // Collective over `world`: checks the fit, then splits one sub-communicator per axis.
  // `replica` (optional): this thread's group of the process's replica threads; the data
  // axis then spans data processes x replicas (collectives/hierarchical.h) and `world` is
  // this replica index's communicator over the processes. `host` (optional): the host
  // plane of the same processes when `world` carries device tensors only (Note [Two
  // planes], collectives/backends.h); its axes are split the same way.
  Mesh(collectives::CommunicatorPtr world, MeshSpec spec, collectives::CommunicatorPtr replica = nullptr,
       collectives::CommunicatorPtr host = nullptr);
  const MeshLayout& layout() const { return layout_; }
  int rank() const { return world_->rank(); }
  int coord(const std::string& axis) const { return layout_.coord(world_->rank(), axis); }
  // Ranks in the group along `axis` (data: processes x replicas; replica: R).
  int size(const std::string& axis) const;
  // The group along `axis` for device tensors, the data plane (a group of one when the
  // job leaves a known axis out).
  collectives::CommunicatorPtr axis(const std::string& name) const;
  // The same ranks for host tensors, the host plane (Note [Two planes]): loss and metric
  // averages, fingerprints, a norm's partial sums. axis(name) itself when one world
  // carries both.
  collectives::CommunicatorPtr host(const std::string& name) const;
  const collectives::CommunicatorPtr& world() const { return world_; }
  const collectives::CommunicatorPtr& host_world() const { return host_world_; }
  int replicas() const { return replica_ ? replica_->size() : 1; }

  // Where the ranks of the group along `axis` run (hardware::hostname on each: the one
  // notion of a host). Collective over that group's host plane; every rank gets the same
  // map.
  collectives::HostMap hosts(const std::string& axis) const;
  // The group along `axis` as one hierarchical communicator (collectives/hierarchical.h):
  // every collective reduce-scatters inside each host, crosses the hosts once per
  // host-rank and allgathers inside, whatever the size (split_min_bytes 0). Collective
  // over the group; `hosts` is what hosts(axis) returned, and must fit
  // (hierarchical_fits; a tetra::ConfigError otherwise, naming the placement).
  collectives::CommunicatorPtr hierarchical(const std::string& axis, const collectives::HostMap& hosts,
                                            collectives::Duration timeout) const;

 private:
  using Groups = std::vector<std::pair<std::string, collectives::CommunicatorPtr>>;
  // One group per axis of `world` (collective over it), the data axis composed with the
  // replica group when there is one.
  Groups split_axes(const collectives::CommunicatorPtr& world) const;
  collectives::CommunicatorPtr world_, host_world_;
  MeshLayout layout_;
  collectives::CommunicatorPtr replica_;
  Groups groups_, host_groups_;  // host_groups_ empty: groups_ carry host tensors too
};

}  // namespace tetra::core
