#include "core/mesh.h"

#include <algorithm>
#include <iomanip>
#include <sstream>

#include "collectives/error.h"
#include "collectives/hierarchical.h"

namespace tetra::core {

int MeshSpec::world_size() const {
  int n = 1;
  for (const auto& a : axes) n *= a.size;
  return n;
}

int MeshSpec::size(const std::string& axis) const {
  for (const auto& a : axes)
    if (a.name == axis) return a.size;
  return 1;
}

std::string MeshSpec::str() const {
  if (axes.empty()) return "(one rank)";
  std::string s;
  for (const auto& a : axes) s += (s.empty() ? "" : " x ") + a.name + "=" + std::to_string(a.size);
  return s;
}

MeshSpec make_mesh_spec(const std::vector<MeshAxis>& axes) {
  MeshSpec spec;
  for (const auto& name : kAxisOrder)
    for (const auto& a : axes)
      if (a.name == name) spec.axes.push_back(a);
  for (const auto& a : axes) {
    if (std::find(kAxisOrder.begin(), kAxisOrder.end(), a.name) == kAxisOrder.end()) {
      std::string known;
      for (const auto& n : kAxisOrder) known += (known.empty() ? "" : ", ") + n;
      throw ConfigError("mesh axis \"" + a.name + "\" is not known (axes: " + known + ")");
    }
    if (a.size < 1) throw ConfigError("mesh." + a.name + ": must be >= 1, got " + std::to_string(a.size));
  }
  return spec;
}

void check_mesh_fits(const MeshSpec& spec, int world_size, const std::string& world_origin) {
  if (spec.world_size() == world_size) return;
  std::ostringstream os;
  if (spec.axes.empty())
    os << "the job has no mesh (one rank)";
  else
    os << "mesh " << spec.str() << " = " << spec.world_size() << " rank" << (spec.world_size() == 1 ? "" : "s");
  os << ", but the world has " << world_size;
  if (!world_origin.empty()) os << " (" << world_origin << ")";
  if (!spec.auto_axis.empty()) {  // sized when the job was read, without this world's size
    const int others = spec.world_size() / spec.size(spec.auto_axis);
    if (world_size % others == 0)
      os << "; mesh." << spec.auto_axis << " is auto, and the launch did not say the world's size when the job was "
         << "read: --set mesh." << spec.auto_axis << "=" << world_size / others;
  }
  // The hint as a command-line user types it (--set), not as YAML (issue 33, item 7).
  os << "; make the product of the mesh axes equal the number of processes";
  if (spec.axes.empty()) {
    os << " (--set mesh.data=" << world_size << ")";
  } else if (world_size == 1) {
    std::string here;
    for (const auto& a : spec.axes)
      if (a.size > 1) here += " --set mesh." + a.name + "=1";
    os << ": launch " << spec.world_size() << " (mpirun -np " << spec.world_size() << " train ...), or run on one with"
       << here;
  }
  throw ConfigError(os.str());
}

MeshLayout::MeshLayout(MeshSpec spec) : spec_(std::move(spec)), strides_(spec_.axes.size(), 1) {
  for (int i = static_cast<int>(spec_.axes.size()) - 2; i >= 0; --i)
    strides_[i] = strides_[i + 1] * spec_.axes[i + 1].size;
}

int MeshLayout::axis_index(const std::string& axis) const {
  for (size_t i = 0; i < spec_.axes.size(); ++i)
    if (spec_.axes[i].name == axis) return static_cast<int>(i);
  return -1;
}

std::vector<int> MeshLayout::coords(int rank) const {
  std::vector<int> c(spec_.axes.size());
  for (size_t i = 0; i < c.size(); ++i) c[i] = (rank / strides_[i]) % spec_.axes[i].size;
  return c;
}

int MeshLayout::coord(int rank, const std::string& axis) const {
  int i = axis_index(axis);
  return i < 0 ? 0 : coords(rank)[i];
}

int MeshLayout::rank_of(const std::vector<int>& c) const {
  int r = 0;
  for (size_t i = 0; i < c.size(); ++i) r += c[i] * strides_[i];
  return r;
}

std::vector<int> MeshLayout::group(int rank, const std::string& axis) const {
  int i = axis_index(axis);
  if (i < 0) return {rank};
  std::vector<int> c = coords(rank), out;
  for (int k = 0; k < spec_.axes[i].size; ++k) {
    c[i] = k;
    out.push_back(rank_of(c));
  }
  return out;
}

std::string MeshLayout::table() const {
  std::ostringstream os;
  for (int r = 0; r < spec_.world_size(); ++r) {
    os << "rank " << r << ":";
    auto c = coords(r);
    for (size_t i = 0; i < c.size(); ++i) os << (i ? ", " : " ") << spec_.axes[i].name << " " << c[i];
    os << "\n";
  }
  return os.str();
}

std::vector<AxisSpan> MeshLayout::axis_spans(const collectives::HostMap& hosts) const {
  std::vector<AxisSpan> out;
  for (const MeshAxis& a : spec_.axes) {
    if (a.size == 1) continue;
    // Every group of the axis: how many hosts it spans, and its most ranks on one host.
    AxisSpan span{a.name, a.size, 1, 1 << 30, 0};
    std::vector<bool> seen(static_cast<size_t>(spec_.world_size()), false);
    for (int r = 0; r < spec_.world_size(); ++r) {
      if (seen[static_cast<size_t>(r)]) continue;
      const std::vector<int> members = group(r, a.name);
      for (int g : members) seen[static_cast<size_t>(g)] = true;
      const collectives::HostMap on = hosts.of(members);
      const int spanned = static_cast<int>(on.hosts.size());
      span.most_per_host = std::max(span.most_per_host, on.most_on_one_host());
      span.most_hosts = std::max(span.most_hosts, spanned);
      span.fewest_hosts = std::min(span.fewest_hosts, spanned);
    }
    out.push_back(span);
  }
  return out;
}

std::vector<std::string> MeshLayout::host_placement(const collectives::HostMap& hosts) const {
  std::vector<std::string> out;
  for (const AxisSpan& a : axis_spans(hosts)) {
    std::ostringstream os;
    os << std::left << std::setw(9) << a.axis << " x" << std::setw(3) << a.size << " ";
    if (a.most_hosts == 1)
      os << "inside a host (every group on one host)";
    else
      os << "across " << (a.fewest_hosts == a.most_hosts ? "" : std::to_string(a.fewest_hosts) + "-") << a.most_hosts
         << " hosts (" << (a.most_per_host == 1 ? "1 rank" : "up to " + std::to_string(a.most_per_host) + " ranks")
         << " of each group per host)";
    if (a.axis == "tensor" && a.most_hosts > 1)
      os << "; warning: mesh.tensor " << a.size << " is more than the " << hosts.most_on_one_host()
         << " ranks of a host, so every block's activation sums (4 per block per micro-batch) cross the hosts' "
            "link; use a tensor degree of at most the ranks per host";
    out.push_back(os.str());
  }
  return out;
}

Mesh::Mesh(collectives::CommunicatorPtr world, MeshSpec spec, collectives::CommunicatorPtr replica,
           collectives::CommunicatorPtr host)
    : world_(std::move(world)), host_world_(host ? std::move(host) : world_), layout_(std::move(spec)),
      replica_(std::move(replica)) {
  check_mesh_fits(layout_.spec(), world_->size(), world_->backend() + " world");
  if (host_world_->size() != world_->size() || host_world_->rank() != world_->rank())
    throw Error("the host plane (" + host_world_->name() + ", rank " + std::to_string(host_world_->rank()) + " of " +
                std::to_string(host_world_->size()) + ") is not the world's processes (" + world_->name() + ", rank " +
                std::to_string(world_->rank()) + " of " + std::to_string(world_->size()) + ")");
  groups_ = split_axes(world_);
  if (host_world_ != world_) host_groups_ = split_axes(host_world_);
}

Mesh::Groups Mesh::split_axes(const collectives::CommunicatorPtr& world) const {
  Groups groups;
  const int rank = world->rank();
  // Every rank makes the same splits in the same order (they are collective): one per
  // axis of the mesh, and a group of one for each known axis the job leaves out.
  for (const auto& name : kAxisOrder) {
    if (layout_.spec().size(name) == 1 &&
        std::none_of(layout_.spec().axes.begin(), layout_.spec().axes.end(),
                     [&](const MeshAxis& a) { return a.name == name; })) {
      groups.emplace_back(name, world->split(rank, 0, name + " (absent axis)"));
    }
  }
  for (const auto& a : layout_.spec().axes) {
    // color: this rank's coordinates on every other axis; key: its place on this one.
    std::vector<int> c = layout_.coords(rank);
    const int key = layout_.coord(rank, a.name);
    for (size_t i = 0; i < c.size(); ++i)
      if (layout_.spec().axes[i].name == a.name) c[i] = 0;
    const int color = layout_.rank_of(c);
    groups.emplace_back(a.name, world->split(color, key, a.name + " (of mesh " + layout_.spec().str() + ")"));
  }
  // Replicas: the data group is this process's replicas (shared memory) inside, the data
  // processes of this replica index outside — data processes x R ranks in one group.
  if (replica_ && replica_->size() > 1) {
    for (auto& [name, group] : groups)
      if (name == "data")
        // Its own duplicate of the replica group: a hierarchical group owns its inner group.
        group = collectives::make_hierarchical(
            replica_->split(0, replica_->rank(), replica_->name() + " / data"), group,
            "data (of mesh " + layout_.spec().str() + " x replica=" + std::to_string(replica_->size()) + ")");
    groups.emplace_back("replica", replica_);
  } else {
    groups.emplace_back("replica", world->split(rank, 0, "replica (one per process)"));
  }
  return groups;
}

int Mesh::size(const std::string& axis) const { return this->axis(axis)->size(); }

namespace {

const collectives::CommunicatorPtr& group_of(const std::vector<std::pair<std::string, collectives::CommunicatorPtr>>& groups,
                                             const std::string& name) {
  for (const auto& [n, g] : groups)
    if (n == name) return g;
  throw Error("mesh has no axis \"" + name + "\"");
}

}  // namespace

collectives::CommunicatorPtr Mesh::axis(const std::string& name) const { return group_of(groups_, name); }

collectives::CommunicatorPtr Mesh::host(const std::string& name) const {
  return group_of(host_groups_.empty() ? groups_ : host_groups_, name);
}

collectives::HostMap Mesh::hosts(const std::string& name) const { return collectives::gather_hosts(*host(name)); }

bool hierarchical_fits(const collectives::HostMap& group_hosts) {
  return group_hosts.hosts.size() > 1 && group_hosts.ranks_per_host() > 1;
}

collectives::CommunicatorPtr Mesh::hierarchical(const std::string& name, const collectives::HostMap& hosts,
                                                collectives::Duration timeout) const {
  const collectives::CommunicatorPtr group = axis(name);
  if (!hierarchical_fits(hosts))
    throw ConfigError("a hierarchical " + name + " group needs the same number (> 1) of its ranks on each of "
                      "more than one host; it runs " + hosts.describe());
  const int host = hosts.host_of[static_cast<size_t>(group->rank())];
  collectives::CommunicatorPtr inside = group->split(host, group->rank(), group->name() + " / host");
  collectives::CommunicatorPtr across = group->split(inside->rank(), host, group->name() + " / across hosts");
  collectives::HierarchicalOptions o;
  o.split_min_bytes = 0;
  o.timeout = timeout;
  return collectives::make_hierarchical(inside, across, group->name() + " (hierarchical)", o);
}

}  // namespace tetra::core
