// The host a process runs on: its name, the cores it may use, its memory use.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tetra::hardware {

// The name of this host as the job knows it: TETRA_HOSTNAME when set (the launcher's or
// the user's name for it, as Horovod's HOROVOD_HOSTNAME: containers that share a machine,
// or several "hosts" on one machine for a test), else the kernel's hostname. The one
// notion of a host: topo, the gathered topology, the hosts of a mesh axis (hierarchical
// allreduce), the banner and the flight recorder all take it from here.
std::string hostname();
// The kernel's hostname (gethostname), what other hosts may resolve: for addresses only.
std::string network_name();
// This host's IPv4 addresses on interfaces that are up, loopback excluded, in the kernel's
// interface order ("10.213.0.1"). What another host may reach this one at when its name
// does not resolve there (test hosts, containers, clusters without DNS for compute nodes).
std::vector<std::string> ipv4_addresses();
// The same for two processes exactly when they share a kernel (its boot id) and a network
// namespace: then one's loopback address reaches the other. Test hosts on one machine
// (network namespaces) differ; two machines differ; containers of one pod agree.
std::string network_namespace_id();
// The kernel's boot id (a UUID, /proc/sys/kernel/random/boot_id): the same for every
// process of one machine, containers and network namespaces included, so hosts that
// report one share its cores. "" where there is none (not Linux, /proc not mounted).
std::string boot_id();
// Logical CPUs in this process's affinity mask (what it may really run on).
int usable_cores();
// Logical CPUs on the host.
int host_cores();
// Peak resident set size of this process so far, in bytes (getrusage).
int64_t peak_rss_bytes();
// Current resident set size, in bytes (/proc/self/statm).
int64_t current_rss_bytes();
// Total physical memory, in bytes.
int64_t total_memory_bytes();

}  // namespace tetra::hardware
