#include "tools/planner/pricing.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "collectives/launch.h"
#include "core/models.h"
#include "core/runtime.h"
#include "core/model_plan.h"
#include "hardware/host.h"
#include "pipeline/pipeline.h"
#include "pipeline/schedule.h"
#include "replicate/replicate.h"
#include "tools/planner/measure.h"

namespace tetra::planner {

using namespace tetra::core;

namespace {

// Rank -> (pipeline, data, replica) and where it runs, for --dry-run with a world size.
// Every process is taken to run on this host (the one --dry-run runs on) unless a
// launcher says how many share it: `hosts`, local_processes consecutive ones a host.
std::vector<RankPlace> rank_rows(const Plan& plan, int local_processes, const collectives::HostMap& hosts) {
  const MeshLayout layout(plan.processes());
  const int R = plan.replicas();
  std::vector<replicate::Placement> where =
      R > 1 ? replicate::place_replicas(R, plan.spec().train.threads, local_processes)
            : std::vector<replicate::Placement>(1);
  if (R == 1) {
    where[0].threads = plan.spec().train.threads > 0 ? plan.spec().train.threads
                                                     : std::max(1, hardware::usable_cores() / local_processes);
    where[0].why = "one rank per process, placed by the launcher (mpirun --bind-to)";
  }
  std::vector<RankPlace> rows;
  for (int p = 0; p < plan.process_count(); ++p)
    for (int r = 0; r < R; ++r) {
      const replicate::Placement& w = where[static_cast<size_t>(r)];
      rows.push_back({p * R + r, p, r, hosts.host_of.at(static_cast<size_t>(p)), layout.coords(p), w.threads,
                      w.cpus.empty() ? "" : hardware::format_cpu_list(w.cpus), w.why});
    }
  return rows;
}

}  // namespace

DataGroupFit data_group_fit(const Plan& plan, const collectives::HostMap& hosts) {
  DataGroupFit out;
  if (plan.processes().size("data") == 1) return out;  // nothing to reduce: data_parallel asks no hosts
  const MeshLayout layout(plan.processes());
  std::vector<bool> seen(static_cast<size_t>(plan.process_count()), false);
  for (int p = 0; p < plan.process_count(); ++p) {
    if (seen[static_cast<size_t>(p)]) continue;
    const std::vector<int> members = layout.group(p, "data");
    for (int m : members) seen[static_cast<size_t>(m)] = true;
    const collectives::HostMap group = hosts.of(members);
    if (hierarchical_fits(group)) {
      ++out.fit;
      continue;
    }
    if (group.hosts.size() > 1)
      ++out.unfit_across;
    else
      ++out.one_host;
    if (out.first_unfit.empty()) out.first_unfit = group.describe();
  }
  return out;
}

namespace {

// The cost model's view of the plan (Note [Cost model]): each pipeline stage's FLOPs and
// traffic per step from the per-rank estimate, and where each axis's groups lie on `hosts`
// (each process's host). With `timed`, a stage's compute is its
// layers' measured seconds for the step's rows and its optimizer update is timed too,
// both shared out when the host's ranks outnumber its cores (Note [Ranks sharing cores]).
StepPrediction predict(const Plan& plan, ModelPlan& job, const std::vector<RankEstimate>& estimates,
                       const collectives::HostMap& hosts,
                       const Calibration& cal, const LayerTimes* timed, int threads) {
  const int R = plan.replicas();
  const std::vector<double> fwd = forward_flops(job.model(), job.probe());
  const int64_t batch = plan.spec().data.batch_size;
  const double per_rank = double(batch) / std::max(1, plan.data_ranks());
  std::map<int, StageWork> stages;  // by pipeline coordinate: its first rank's work
  for (const RankEstimate& r : estimates) {
    auto it = r.coord.find("pipeline");
    const int stage = it == r.coord.end() ? 0 : it->second;
    if (stages.count(stage)) continue;
    StageWork& w = stages[stage];
    for (int l : r.layers) w.flops += 3 * fwd[static_cast<size_t>(l)] * per_rank;  // backward = 2 forwards
    if (timed) {
      // Timed on one micro-batch; a step runs per_rank rows through the stage.
      w.timed_s = w.timed_forward_s = 0;
      for (int l : r.layers) {
        const pipeline::LayerCost& c = timed->costs[static_cast<size_t>(l)];
        w.timed_s += (c.forward_s + c.backward_s) * per_rank / double(timed->micro);
        w.timed_forward_s += c.forward_s * per_rank / double(timed->micro);
      }
      w.optimizer_s = time_optimizer(plan.spec().optimizer, r.updated_elements);
      // The first stage reads the inputs, the last the targets.
      const bool loads = r.layers.empty() || r.layers.front() == 0 || r.layers.back() + 1 == static_cast<int>(fwd.size());
      if (loads) w.loading_s = timed->load_s * per_rank / double(timed->micro);
    }
    w.traffic = r.traffic;
    w.chained = r.chained;
  }
  // Replicas compose the data group hierarchically (collectives/hierarchical.h); otherwise
  // data_parallel.hierarchical does where the run would: not where a data group spans hosts
  // that it does not fit (data_group_fit).
  const MeshLayout layout(plan.processes());
  const bool hierarchical = R > 1 || (!estimates.empty() && estimates.front().hierarchical_data &&
                                      data_group_fit(plan, hosts).unfit_across == 0);
  const int virtual_stages = estimates.empty() ? 1 : estimates.front().virtual_stages;
  const double bubble = estimates.empty() ? -1 : estimates.front().pipeline_bubble;
  std::vector<AxisLinks> links;
  bool data_seen = false;
  const int host_ranks = hosts.most_on_one_host() * R;
  for (const AxisSpan& a : layout.axis_spans(hosts)) {
    AxisLinks l{a.axis, a.size, a.most_hosts, a.most_per_host, false};
    if (a.axis == "data") {
      data_seen = true;
      l.size *= R;
      l.per_host *= R;
      l.hierarchical = hierarchical;
    }
    l.groups_per_host = std::max(1, host_ranks / std::max(1, l.per_host));
    links.push_back(l);
  }
  if (!data_seen && R > 1) links.push_back({"data", R, 1, R, false});  // replica threads of one process
  std::vector<StageWork> work;
  for (auto& [stage, w] : stages) work.push_back(std::move(w));
  double total = 0;  // the whole model's FLOPs on one rank
  for (double f : fwd) total += 3 * f * double(batch);
  // Under tensor parallelism the model is this rank's parts, and every matrix the FLOPs
  // count (forward_flops: Linears and attention) is split into T.
  total *= plan.spec().mesh.size("tensor");
  const double share = core_share(cal.cores_per_host, host_ranks, threads);
  const int m = static_cast<int>(plan.micro_batches());
  // A timed pipeline: its schedule simulated with the slowest stage's measured forward and
  // backward per micro-batch and chunk (B and W half each) and its activations' transfer
  // over the pipeline's link, so a slow link stalls the schedule as it does in a run.
  SimulatedPipeline simulated;
  const std::string kind = estimates.empty() ? "" : estimates.front().pipeline_schedule;
  if (timed && work.size() > 1 && !kind.empty()) {
    const StageWork& slow = *std::max_element(work.begin(), work.end(),
                                              [](const StageWork& a, const StageWork& b) { return a.timed_s < b.timed_s; });
    const double units = double(m) * virtual_stages * share;
    pipeline::Costs costs;
    costs.forward = slow.timed_forward_s / units;
    costs.input = costs.weight = (slow.timed_s - slow.timed_forward_s) / units / 2;
    auto t = slow.traffic.find("pipeline");
    auto l = std::find_if(links.begin(), links.end(), [](const AxisLinks& a) { return a.axis == "pipeline"; });
    if (t != slow.traffic.end() && l != links.end() && t->second.count[collectives::Traffic::kSend] > 0) {
      collectives::Traffic one;
      one.record(collectives::Traffic::kSend,
                 t->second.payload[collectives::Traffic::kSend] / t->second.count[collectives::Traffic::kSend], l->size);
      // The wire's time (the chained fit: both ends idle); when the message moves is the
      // simulation's. Across hosts (TCP) both ends' progress threads move each fragment;
      // where ranks outnumber cores those threads get a core when their ranks wait: the
      // message leaves when its sender waits and travels while its receiver does
      // (measured on the test hosts: activations, whose senders compute on, took 5-9 ms
      // to arrive, gradients 0.5-0.9 ms). Inside a host the receiver copies it from the
      // sender's memory (Open MPI's single-copy shared memory): posting it is enough.
      costs.transfer = axis_time(one, *l, cal, &one).seconds;
      costs.progress_when_waiting = share < 1 && l->hosts > 1;
    }
    const pipeline::Schedule sched = pipeline::make_schedule(kind, static_cast<int>(work.size()), m,
                                                             virtual_stages);
    const pipeline::Simulation with = pipeline::simulate(sched, costs);
    costs.transfer = 0;
    costs.progress_when_waiting = false;
    const pipeline::Simulation without = pipeline::simulate(sched, costs);
    if (with.ok && without.ok) simulated = {with.makespan, without.makespan};
  }
  return predict_step(work, links, m, virtual_stages, batch, total, plan.process_count() * R, cal, bubble, share,
                      simulated);
}

}  // namespace

std::string dry_run(const JobSpec& spec, const ModelSource& options, int np, bool json) {
  DryRunOptions how;
  how.np = np;
  how.json = json;
  return dry_run(spec, options, how);
}

PlanReport plan_report(const JobSpec& spec, const ModelSource& options, const DryRunOptions& how) {
  ModelPlan job(spec, options.model, options.data);
  const Plan& plan = job.plan();
  PlanReport r(plan);
  r.threads = set_threads(spec.train.threads, plan.replicas());
  // The world the plan is for: np, else the launch this runs in, else the mesh's.
  const collectives::LaunchInfo launch = collectives::detect_launch();
  const int np = how.np;
  const int world_size = np > 0 ? np : launch.multi_process() ? launch.world_size : 0;
  if (world_size > 0)
    plan.check_world(world_size, np > 0 ? "--np " + std::to_string(np) : launch.launcher + ": " + launch.evidence);
  int local = np > 0 ? np : launch.multi_process() ? std::max(1, launch.local_world_size) : plan.process_count();
  if (how.ranks_per_host > 0) local = std::min(how.ranks_per_host, plan.process_count());
  r.per_host = local;
  r.host_map = collectives::consecutive_hosts(plan.process_count(), local);
  r.ranks = rank_rows(plan, local, r.host_map);
  // Each rank's threads as the launch will give them (its ranks share the host's cores),
  // which the layers are timed at.
  if (!r.ranks.empty()) r.threads = set_threads(r.ranks.front().threads, plan.replicas());
  std::optional<LayerTimes> layers;
  r.machine = look_at_machine();
  r.calibration = calibration_of(how, job, plan.micro_batch_size(), r.hosts() > 1, layers);
  // Worked out once (a probe forward of the model): the table, the JSON and the cost model.
  r.estimates = job.estimate();
  r.prediction = predict(plan, job, r.estimates, r.host_map, r.calibration, layers ? &*layers : nullptr, r.threads);
  if (layers) {
    // Note [Figures with their spread]: the compute timed twice more, a prediction each;
    // the median round is the answer, the others its spread.
    std::vector<StepPrediction> rounds = {r.prediction};
    for (int i = 1; i < how.timing_rounds; ++i) {
      const LayerTimes again = time_layers(job, layers->micro);
      rounds.push_back(predict(plan, job, r.estimates, r.host_map, r.calibration, &again, r.threads));
    }
    std::sort(rounds.begin(), rounds.end(),
              [](const StepPrediction& a, const StepPrediction& b) { return a.samples_per_s < b.samples_per_s; });
    r.prediction = rounds[rounds.size() / 2];
    for (const StepPrediction& p : rounds) r.rounds_samples_per_s.push_back(p.samples_per_s);
    const PlanReport::Machine after = look_at_machine();  // busy at either look
    r.machine.busy = r.machine.busy || after.busy;
    r.machine.load = std::max(r.machine.load, after.load);
    r.machine.others_running = std::max(r.machine.others_running, after.others_running);
  }
  r.data = job.dataset().info().description;
  r.model = options.model ? "the program's own" : spec.model.type;
  r.parameters = job.parameters();
  r.model_text = describe(job.model());
  if (spec.mesh.size("tensor") > 1)  // the layers as tensor rank 0 builds them
    r.model_text.insert(r.model_text.size() - 1, " (tensor rank 0's parts of the split layers)");
  r.strategies_text = job.strategies_text();
  r.steps = job.total_steps();
  return r;
}

struct JobPricer::Impl {
  ModelSource options;
  DryRunOptions how;
  std::map<int, std::unique_ptr<ModelPlan>> models;  // by tensor degree
  std::map<std::tuple<int, int64_t, int>, LayerTimes> times;  // (tensor, micro-batch rows, threads)
  std::optional<Calibration> calibration;
  bool timed = false;
};

JobPricer::JobPricer(const ModelSource& options, const DryRunOptions& how) : impl_(std::make_unique<Impl>()) {
  impl_->options = options;
  impl_->how = how;
}

JobPricer::~JobPricer() = default;

const Calibration* JobPricer::calibration() const { return impl_->calibration ? &*impl_->calibration : nullptr; }

PlanReport JobPricer::price(const JobSpec& spec) {
  Impl& m = *impl_;
  Plan plan(spec);
  PlanReport r(plan);
  const int np = m.how.np > 0 ? m.how.np : plan.process_count();
  plan.check_world(np, "--np " + std::to_string(np));
  const int local = m.how.ranks_per_host > 0 ? std::min(m.how.ranks_per_host, plan.process_count()) : np;
  r.per_host = local;
  r.host_map = collectives::consecutive_hosts(plan.process_count(), local);
  r.ranks = rank_rows(plan, local, r.host_map);
  r.threads = set_threads(r.ranks.front().threads, plan.replicas());
  const int tensor = spec.mesh.size("tensor");
  std::unique_ptr<ModelPlan>& built = m.models[tensor];
  if (!built) built = std::make_unique<ModelPlan>(spec, m.options.model, m.options.data);
  ModelPlan& job = *built;
  const PlanInput in = job.input(plan);
  if (const std::string problems = model_problems(in); !problems.empty()) throw ConfigError(problems);
  const auto key = std::make_tuple(tensor, std::max<int64_t>(1, plan.micro_batch_size()), r.threads);
  if (!m.calibration) {
    std::optional<LayerTimes> layers;
    m.calibration = calibration_of(m.how, job, std::get<1>(key), r.hosts() > 1, layers);
    m.timed = layers.has_value();
    if (layers) {
      m.times.emplace(key, std::move(*layers));
      m.calibration->source += "; each plan's layers timed at its own threads and micro-batch";
    }
  }
  const LayerTimes* timed = nullptr;
  if (m.timed) {
    auto it = m.times.find(key);
    if (it == m.times.end()) it = m.times.emplace(key, time_layers(job, std::get<1>(key))).first;
    timed = &it->second;
  }
  r.calibration = *m.calibration;
  r.estimates = estimate_ranks(in);
  r.prediction = predict(plan, job, r.estimates, r.host_map, r.calibration, timed, r.threads);
  r.parameters = job.parameters();
  return r;
}

std::string dry_run(const JobSpec& spec, const ModelSource& options, const DryRunOptions& how) {
  const PlanReport r = plan_report(spec, options, how);
  return how.json ? r.json().dump(2) + "\n" : r.text();
}

}  // namespace tetra::planner
