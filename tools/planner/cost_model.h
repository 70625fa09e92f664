// The cost model: what one training step of a plan should take on a cluster that a
// calibration describes, worked out on paper for any number of ranks (train --dry-run
// --np N --ranks-per-host R).
//
// Note [Cost model]
// A link class is an alpha-beta pair: a message of B bytes takes alpha + B/beta. There
// are two classes: inside a host (shared memory, NVLink) and across hosts (the host's
// network; beta is what one host sends at once, shared by its ranks). The collectives:
//   ring allreduce          2(n-1)/n x B/beta + 2(n-1) alpha
//   reduce_scatter, allgather, broadcast (pipelined)
//                           (n-1)/n x B/beta + (n-1) alpha
//   send                    alpha + B/beta
//   hierarchical allreduce  of k ranks on each of H hosts: reduce_scatter inside the
//                           host, allreduce of B/k across hosts (the k ranks share the
//                           host's link, so each gets beta/k), allgather inside:
//                           2 x [(k-1)/k x B/beta_in + (k-1) alpha_in]
//                           + 2(H-1)/H x B/beta_out + 2(H-1) alpha_out
// A flat ring whose group spans hosts runs at its slowest link: each of its steps waits
// for the hop that crosses hosts, so it takes the across-hosts alpha and beta.
// Each mesh axis's traffic for one step (the per-rank estimate's, Note [Per-rank
// estimate]: the same ops the run issues, counted by kind) is priced with the link its
// groups use (inside a host when every group is; otherwise across) and with the
// algorithm the plan runs (hierarchical when data parallelism turns it on).
// Each collective kind may have its own alpha and beta, fitted from that op timed at
// several sizes on the backend in use (Note [Fitted collectives]); a kind without is
// priced with its link class.
// Compute: a stage's layers timed forward and backward on this machine for the rows it
// runs in a step (Note [This machine's figures]), or, for a cluster known by a
// calibration file alone, its FLOPs per step (forward x 3: backward costs two forwards)
// over the calibrated rate. Timed work is divided by the share of a core each rank gets
// when a host's ranks x threads outnumber its cores (Note [Ranks sharing cores]). A
// pipeline of p stages and m micro-batches (v virtual stages each) is busy for a
// fraction 1 - bubble of its time (the schedule's simulated bubble, else (p-1)/(v m + p
// - 1)); its slowest stage's compute and point-to-point transfers (what it sends and
// what it waits to receive) are spread over the step that way. The other axes'
// communication (data parallelism's allreduce, ZeRO's gathers) is added after it, and
// then the optimizer's update of what the rank owns (timed alike), and before it all the
// rank's batch read from the dataset (timed alike, on the stages that load). What
// overlaps: an op issued while others run or compute (a prefetched gather) costs its own
// time, chained, not the wait for late ranks that an op after compute pays (Note [Fitted
// collectives]); none of it is taken to hide behind compute. On a CPU host whose cores
// the ranks fill, communication is CPU work too and cannot hide behind backward; on GPUs
// the prediction is an upper bound for a run that hides it. Efficiency is one rank's
// time for the whole global batch (its FLOPs at the same rate, no communication) over N
// ranks' time x N.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "collectives/communicator.h"

namespace tetra::planner {

struct LinkCost {
  double alpha_s = 0;      // per message
  double bytes_per_s = 1;  // per direction
};

struct Calibration {
  // The defaults: an A100-class GPU cluster (NVLink inside a host; 8 x 100 Gbit/s
  // InfiniBand per host across; 150 TFLOP/s sustained per GPU, about half of bf16 peak).
  LinkCost intra_host{3e-6, 150e9};
  LinkCost inter_host{10e-6, 100e9};
  double flops_per_s = 150e12;  // sustained, per rank
  // Each collective kind's own ring-step alpha and beta, fitted from that op timed at
  // several sizes on a group of every rank (bench-collectives --calibrate; Note [Fitted
  // collectives]), by Traffic::name ("allreduce", "send", ...). A kind left out is priced
  // with the link above.
  std::map<std::string, LinkCost> intra_kinds, inter_kinds;
  // The same kinds timed chained: an op issued right behind another of its group, with no
  // compute between, so that no rank is late to it (as a prefetched gather, issued before
  // the compute it overlaps). What a chained op costs is its own time; an op after
  // compute also pays for the ranks that finish their compute later (Note [Fitted
  // collectives]).
  std::map<std::string, LinkCost> intra_chained, inter_chained;
  // Cores of a host that its ranks share (0: every rank has its own, as a GPU does).
  // Ranks x threads beyond them divide the compute rate (Note [Ranks sharing cores]).
  // Fractional where several hosts share one machine's cores (containers, test hosts).
  double cores_per_host = 0;
  std::string source = "built-in defaults (an A100-class GPU cluster)";
  // The link an op of `kind` crosses, fitted for its kind where the calibration has it
  // (chained: its chained fit, else its fit after compute).
  const LinkCost& link(bool across, const std::string& kind, bool chained = false) const;
};

// A calibration file (JSON, as `bench-collectives --calibrate` writes it):
//   {"format": "tetra calibration 1",
//    "intra_host": {"alpha_us": 3, "beta_gbytes_per_s": 150,
//                   "kinds": {"allreduce": {"alpha_us": 4, "beta_gbytes_per_s": 90}, ...},
//                   "chained": {"allgather": {...}, ...}},
//    "inter_host": {"alpha_us": 10, "beta_gbytes_per_s": 100, "kinds": {...}, "chained": {...}},
//    "compute": {"gflops_per_s": 150000}, "host": {"cores": 64}, "measured": "..."}
// Keys left out keep the defaults. A ConfigError names the file and what is wrong.
Calibration load_calibration(const std::string& path);
nlohmann::json calibration_json(const Calibration& c, const std::string& measured = "");

// alpha and beta of the link between ranks a and b of `comm` (collective: every rank of
// it calls): alpha is half the best round trip of 8 bytes, beta the slope between 4 MiB
// and 16 MiB ping-pongs. What `bench-collectives --calibrate` and a dry run without a
// calibration measure (Note [This machine's figures]).
LinkCost measure_link(collectives::Communicator& comm, int a, int b);

double ring_allreduce_s(int n, double bytes, const LinkCost& link);
double ring_collect_s(int n, double bytes, const LinkCost& link);  // reduce_scatter, allgather, broadcast
double hierarchical_allreduce_s(int hosts, int per_host, double bytes, const LinkCost& intra, const LinkCost& inter);
double p2p_s(double bytes, const LinkCost& link);
double bubble_fraction(int stages, int micro_batches, int virtual_stages = 1);

// How the groups of one mesh axis lie on the hosts, and how it reduces.
struct AxisLinks {
  std::string axis;
  int size = 1;      // ranks in a group (replica threads included)
  int hosts = 1;     // hosts one group spans
  int per_host = 1;  // ranks of one group on one host
  bool hierarchical = false;  // allreduce inside hosts, across, inside again
  // Groups of this axis with ranks on one host: they cross at once (a step's ops are
  // issued together), so each gets 1/groups_per_host of the host's link across.
  int groups_per_host = 1;
};

// One axis's communication in one step of one rank.
struct AxisTime {
  std::string axis;
  std::string how;  // "ring across hosts", "hierarchical (2 hosts x 2)", "point-to-point inside a host"
  double seconds = 0;
  int64_t ops = 0;
};
// `chained`: which of `traffic`'s ops run chained (priced with the chained fits).
AxisTime axis_time(const collectives::Traffic& traffic, const AxisLinks& links, const Calibration& c,
                   const collectives::Traffic* chained = nullptr);

// What one rank of a pipeline stage does in a step.
struct StageWork {
  double flops = 0;                                     // forward + backward, its share of the batch
  // Its layers' forward and backward timed on this machine for the step's rows (Note
  // [This machine's figures]), one rank alone: when set (>= 0), compute is this, not
  // flops over the calibrated rate.
  double timed_s = -1;
  double timed_forward_s = -1;  // the forward part of timed_s
  double optimizer_s = 0;  // the optimizer's update of what the rank owns, timed alike
  double loading_s = 0;    // its batch read and assembled from the dataset, timed alike
  std::map<std::string, collectives::Traffic> traffic;  // per mesh axis
  std::map<std::string, collectives::Traffic> chained;  // of `traffic`, the ops that run chained
};

// Note [Ranks sharing cores]
// A host's ranks x threads beyond its cores take turns on them: each rank computes at
// cores / (ranks x threads) of the rate it has alone (4 single-thread ranks on 2 cores:
// half). Timings taken alone are divided by that share; so is the optimizer. The
// collectives' figures are not: bench-collectives --calibrate times them with every rank
// of the host running, so they already pay for the turns. Hosts that are containers or
// network namespaces of one machine (one kernel: one boot id) share its cores: the
// calibration gives each host its part, cores / hosts on the machine (the 2 test hosts
// of a 2-core machine: 1 core each). Not priced: a pipeline stage idle in its bubble
// leaves part of its turns to the ranks it shares cores with (4 ranks of a 2-stage 1F1B
// on 2 cores measured 18.9 ms of compute where a half core each gives 25, and 10.5 ms of
// waits); taking the whole bubble as absorbed predicted those layouts 20-26% fast, so
// the bubble stays priced whole until a simulation shares the cores op by op.
double core_share(double cores_per_host, int ranks_per_host, int threads_per_rank);

struct StepPrediction {
  int ranks = 1;
  double core_share = 1;  // of a core's rate each rank gets (Note [Ranks sharing cores])
  bool timed = false;     // compute from the layers timed here, not FLOPs over a rate
  double compute_s = 0;   // the slowest stage's forward and backward
  double pipeline_s = 0;  // its point-to-point sends
  double bubble_s = 0;    // idle while the pipeline fills and drains
  double other_s = 0;     // the other axes' communication (the slowest stage's)
  double optimizer_s = 0; // its optimizer update, after the pipeline has drained
  double loading_s = 0;   // its batch loaded, before the step
  double total_s = 0;
  double samples_per_s = 0;
  double single_rank_s = 0;  // the whole global batch on one rank
  double efficiency = 0;     // single_rank_s / (ranks x total_s)
  std::vector<AxisTime> axes;  // the slowest stage's
};

// `stages`: one entry per pipeline stage (one for no pipeline); `total_flops`: the whole
// step's FLOPs (every sample of the global batch through the whole model, forward and
// backward). `bubble`: the schedule's own idle fraction (RankEstimate::pipeline_bubble,
// which knows zero-bubble schedules); below 0, the 1F1B formula bubble_fraction().
// A pipeline's step as its schedule's simulation finds it with the measured times of a
// forward, B and W per micro-batch and chunk (pipeline::simulate): with each message's
// transfer, and without (the fill and drain alone).
struct SimulatedPipeline {
  double makespan_s = -1;            // with the transfers; < 0: not simulated
  double without_transfers_s = -1;
};

// `share`: core_share() of the layout (timed work is divided by it; a rate from a
// calibration file was measured per rank and is not). `simulated`: when set, the
// pipeline's compute, bubble and transfers are its makespan (the bubble what it idles
// without transfers, the transfers what they add), not the slowest stage stretched by
// the bubble fraction.
StepPrediction predict_step(const std::vector<StageWork>& stages, const std::vector<AxisLinks>& links,
                            int micro_batches, int virtual_stages, int64_t global_batch, double total_flops,
                            int ranks, const Calibration& c, double bubble = -1, double share = 1,
                            const SimulatedPipeline& simulated = {});

// A fitted collective (Note [Fitted collectives]): the ring-step alpha and beta of `kind`
// on a group of n whose measured times were seconds[i] for bytes[i] (least squares of
// t = A + B x bytes, then A and B read through the kind's ring formula).
LinkCost fit_collective(const std::string& kind, int n, const std::vector<double>& bytes,
                        const std::vector<double>& seconds);

std::string prediction_text(const StepPrediction& p, const Calibration& c);
nlohmann::json prediction_json(const StepPrediction& p, const Calibration& c);

}  // namespace tetra::planner
