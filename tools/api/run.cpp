#include "tetra/run.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "collectives/backends.h"
#include "collectives/build_config.h"
#include "collectives/launch.h"
#include "collectives/local.h"
#include "collectives/monitor.h"
#include "collectives/topology_gather.h"
#include "collectives/watchdog.h"
#include "core/cost_model.h"
#include "core/models.h"
#include "core/optim.h"
#include "core/plan.h"
#include "core/preflight.h"
#include "core/report.h"
#include "core/runtime.h"
#include "hardware/host.h"
#include "hardware/topology.h"
#include "pipeline/pipeline.h"
#include "replicate/replicate.h"

namespace tetra {

namespace {

using namespace tetra::core;

// printf into a string.
void appendf(std::string& out, const char* format, ...) {
  char line[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  out += line;
}

TrainerOptions trainer_options(const RunOptions& options) {
  TrainerOptions t;
  t.out = options.out;
  t.model = options.model;
  t.data = options.data;
  t.on_step = options.on_step;
  return t;
}

// Rank -> (pipeline, data, replica) and where it runs, for --dry-run with a world size.
// Every process is taken to run on this host (the one --dry-run runs on) unless a
// launcher says how many share it.
std::vector<RankPlace> rank_rows(const Plan& plan, int local_processes) {
  // local_processes consecutive processes share a host.
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
      rows.push_back({p * R + r, p, r, p / std::max(1, local_processes), layout.coords(p), w.threads,
                      w.cpus.empty() ? "" : hardware::format_cpu_list(w.cpus), w.why});
    }
  return rows;
}

// The job's layers timed on this machine (Note [This machine's figures]): each layer's
// forward and backward on one rank's micro-batch, at the job's threads, this process
// alone.
struct LayerTimes {
  std::vector<pipeline::LayerCost> costs;
  int64_t micro = 1;  // the rows they were timed on
  int threads = 1;
  double load_s = 0;  // those rows read from the training set (Dataset::get), the best of 5
};

// Note [Figures with their spread]
// A figure timed once on a shared machine is one draw of its noise: the quickstart's three
// dry runs predicted 5,767 to 8,962 samples/s, and under load the dry run predicted 2.5-4.5x
// what ran without saying the machine was busy. So the dry run times this machine's compute
// DryRunOptions::timing_rounds times (3), prices each, answers with the median round and prints the spread;
// and it looks at the machine before and after (the 1-minute load against the cores this
// process may use, the other processes runnable at that moment): on a busy machine it says
// its figures are pessimistic for a quiet one. (The tuner measures its trials in rounds of
// its own: tools/api/tune.cpp.)
PlanReport::Machine look_at_machine() {
  PlanReport::Machine m;
  m.cores = std::max(1, static_cast<int>(hardware::usable_cores()));
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &m.load) != 1) m.load = 0;
    std::fclose(f);
  }
  std::error_code ec;
  const std::string self = std::to_string(::getpid());
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name == self || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    const size_t close = stat.rfind(')');
    if (close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'R') ++m.others_running;
  }
  m.busy = m.load > 0.75 * m.cores || m.others_running >= std::max(1, m.cores / 2);
  return m;
}

LayerTimes time_layers(Trainer& trainer, int64_t micro) {
  const Plan& plan = trainer.job_plan();
  LayerTimes t;
  t.micro = std::max<int64_t>(1, micro);
  t.threads = at::get_num_threads();
  t.costs = pipeline::measure_layers(trainer.model(), trainer.dataset(), t.micro,
                                     plan.spec().train.precision == Precision::kBf16, /*time=*/true,
                                     pipeline::kDryRunTimedFlops, &trainer.probe());
  const Dataset& data = trainer.dataset();
  const int64_t rows = std::min<int64_t>(t.micro, data.size(Split::kTrain));
  t.load_s = 1e300;
  for (int i = -1; i < 5 && rows > 0; ++i) {  // -1: a warm-up (a lazily read set's first touch)
    const at::Tensor idx = at::randint(data.size(Split::kTrain), {rows}, at::kLong);
    const auto t0 = std::chrono::steady_clock::now();
    data.get(Split::kTrain, idx);
    if (i >= 0) t.load_s = std::min(t.load_s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  if (rows <= 0) t.load_s = 0;
  return t;
}

// One step of the optimizer over `elements` (the trainer's fused update, then the
// gradients zeroed for the next step), the best of a few: what a rank spends after its
// backward on what it owns. A large model's is timed on 16 Mi elements and scaled (the
// update is one pass over memory, linear in its length), so a dry run allocates little.
double time_optimizer(const OptimizerSpec& spec, int64_t owned) {
  if (owned <= 0) return 0;
  const int64_t elements = std::min<int64_t>(owned, int64_t{1} << 24);
  at::Tensor param = at::randn({elements}), grad = at::randn({elements}).mul_(1e-3);
  UpdateSlots slots;
  if (spec.type != "sgd") {
    slots.exp_avg = at::zeros({elements});
    slots.exp_avg_sq = at::zeros({elements});
  } else if (spec.momentum != 0) {
    slots.momentum = at::zeros({elements});
  }
  double best = 1e300;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fused_update(spec, spec.lr, i + 1, param, grad, slots);
    grad.zero_();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    grad.normal_().mul_(1e-3);
  }
  return best * double(owned) / double(elements);
}

// The cost model's view of the plan (Note [Cost model]): each pipeline stage's FLOPs and
// traffic per step from the per-rank estimate, and where each axis's groups lie when
// `per_host` consecutive processes share a host. With `timed`, a stage's compute is its
// layers' measured seconds for the step's rows and its optimizer update is timed too,
// both shared out when the host's ranks outnumber its cores (Note [Ranks sharing cores]).
StepPrediction predict(const Plan& plan, Trainer& trainer, const std::vector<RankEstimate>& estimates, int per_host,
                       const Calibration& cal, const LayerTimes* timed, int threads) {
  const int R = plan.replicas();
  const std::vector<double> fwd = forward_flops(trainer.model(), trainer.probe());
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
  // Replicas compose the data group hierarchically (collectives/hierarchical.h).
  const bool hierarchical = R > 1 || (!estimates.empty() && estimates.front().hierarchical_data);
  const int virtual_stages = estimates.empty() ? 1 : estimates.front().virtual_stages;
  const double bubble = estimates.empty() ? -1 : estimates.front().pipeline_bubble;
  std::vector<AxisLinks> links;
  bool data_seen = false;
  const int host_ranks = std::min(per_host, plan.process_count()) * R;
  for (const AxisSpan& a : MeshLayout(plan.processes()).axis_spans(per_host)) {
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

// A host's cores as the calibration holds them: "2", or "0.5" where hosts share a machine.
std::string cores_text(double cores) {
  char b[32];
  std::snprintf(b, sizeof(b), "%g", cores);
  return b;
}

// Note [This machine's figures]
// A dry run without a calibration prices the step on the machine it runs on, not on a
// cluster it has never seen:
//   compute  the model's layers timed forward and backward on one rank's micro-batch at
//            the job's threads (pipeline::measure_layers, the timings a by_time cut
//            takes; a large model's are taken on a sample and scaled, Note [Layer
//            costs]), each stage's for the rows it runs in a step, and the optimizer's
//            update of what a rank owns; both divided by the share of a core each rank
//            gets when the host's ranks x threads outnumber its cores.
//   inside   a measured local pair: two thread-ranks of this process over the local
//            backend (shared memory), alpha and beta as bench-collectives measures them.
//   across   nothing here to measure: when the layout spans hosts (--np beyond
//            --ranks-per-host), the GPU-cluster defaults, named as assumed.
// `--calibration gpu-cluster` asks for the GPU-cluster defaults throughout (what
// tools/predict_scale.sh plans with); a calibration file measures a real cluster's links
// (each collective fitted by kind for the backend it ran, Note [Fitted collectives]) and
// its compute rate; with --time-layers the compute is timed here as above instead, for a
// file measured on machines like this one.
Calibration this_machine(Trainer& trainer, const LayerTimes& layers, bool spans_hosts) {
  double seconds = 0, flops = 0;
  for (const auto& c : layers.costs) seconds += c.forward_s + c.backward_s;
  for (double f : forward_flops(trainer.model(), trainer.probe())) flops += 3 * f * double(layers.micro);
  Calibration c;
  if (seconds > 0 && flops > 0) c.flops_per_s = flops / seconds;
  c.cores_per_host = hardware::usable_cores();
  // The pair: two thread-ranks measuring each other.
  std::vector<collectives::CommunicatorPtr> pair = collectives::make_local_group(2, "dry-run pair");
  LinkCost link;
  std::thread other([&] { measure_link(*pair[1], 0, 1); });
  link = measure_link(*pair[0], 0, 1);
  other.join();
  c.intra_host = link;
  const int threads = layers.threads;
  c.source = "this machine, measured: compute from the layers timed forward and backward on a micro-batch of " +
             std::to_string(layers.micro) + " at " + std::to_string(threads) + " thread" + (threads == 1 ? "" : "s") +
             " on " + cores_text(c.cores_per_host) + " cores" +
             "; inside a host a local pair (2 thread-ranks, shared memory); across hosts " +
             (spans_hosts ? "assumed: the GPU-cluster defaults (8 x 100 Gbit/s InfiniBand per host), as no second "
                            "host is here to measure (--calibration FILE from bench-collectives --calibrate measures it)"
                          : "not used (every rank on this host)");
  return c;
}

// The calibration the dry run prices with, and whether its compute is the layers timed
// here (`layers` is filled then).
Calibration calibration_of(const DryRunOptions& how, Trainer& trainer, int64_t micro, bool spans_hosts,
                           std::optional<LayerTimes>& layers) {
  std::string file = how.calibration;
  if (file.empty())
    if (const char* env = std::getenv("TETRA_CALIBRATION"); env && *env) file = env;
  // A job on cuda runs on GPUs this dry run does not time (it builds nothing on a device):
  // this host's CPU says nothing of them, so without a file measured on them it is priced
  // on the GPU-cluster defaults, and says so.
  const bool on_gpus = trainer.spec().train.device == DeviceKind::kCuda && file.empty() && !how.time_layers;
  if (file == "gpu-cluster" || on_gpus) {
    Calibration c;
    c.source = std::string("the GPU-cluster defaults, ") +
               (on_gpus ? "as train.device is cuda and no --calibration file measured its GPUs"
                        : "as --calibration gpu-cluster asks") +
               " (an A100-class cluster: NVLink inside a host, 8 x 100 Gbit/s InfiniBand across, 150 TFLOP/s per GPU)";
    return c;
  }
  if (file.empty() || how.time_layers) layers = time_layers(trainer, micro);
  if (file.empty()) return this_machine(trainer, *layers, spans_hosts);
  Calibration c = load_calibration(file);
  if (how.time_layers) {
    if (c.cores_per_host <= 0) c.cores_per_host = hardware::usable_cores();
    c.source += "; compute: the layers timed here (--time-layers) at " + std::to_string(layers->threads) + " thread" +
                (layers->threads == 1 ? "" : "s") + ", " + cores_text(c.cores_per_host) + " cores per host";
  }
  return c;
}

}  // namespace

std::string dry_run(const JobSpec& spec, const RunOptions& options, int np, bool json) {
  DryRunOptions how;
  how.np = np;
  how.json = json;
  return dry_run(spec, options, how);
}

PlanReport plan_report(const JobSpec& spec, const RunOptions& options, const DryRunOptions& how) {
  TrainerOptions topts = trainer_options(options);
  topts.dry_run = true;
  Trainer trainer(spec, topts);
  const Plan& plan = trainer.job_plan();
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
  r.ranks = rank_rows(plan, local);
  // Each rank's threads as the launch will give them (its ranks share the host's cores),
  // which the layers are timed at.
  if (!r.ranks.empty()) r.threads = set_threads(r.ranks.front().threads, plan.replicas());
  std::optional<LayerTimes> layers;
  r.machine = look_at_machine();
  r.calibration = calibration_of(how, trainer, plan.micro_batch_size(), r.hosts() > 1, layers);
  // Worked out once (a probe forward of the model): the table, the JSON and the cost model.
  r.estimates = trainer.estimate();
  r.prediction = predict(plan, trainer, r.estimates, local, r.calibration, layers ? &*layers : nullptr, r.threads);
  if (layers) {
    // Note [Figures with their spread]: the compute timed twice more, a prediction each;
    // the median round is the answer, the others its spread.
    std::vector<StepPrediction> rounds = {r.prediction};
    for (int i = 1; i < how.timing_rounds; ++i) {
      const LayerTimes again = time_layers(trainer, layers->micro);
      rounds.push_back(predict(plan, trainer, r.estimates, local, r.calibration, &again, r.threads));
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
  r.data = trainer.dataset().info().description;
  r.model = options.model ? "the program's own" : spec.model.type;
  r.parameters = trainer.model_parameters();
  r.model_text = describe(trainer.model());
  if (spec.mesh.size("tensor") > 1)  // the layers as tensor rank 0 builds them
    r.model_text.insert(r.model_text.size() - 1, " (tensor rank 0's parts of the split layers)");
  r.strategies_text = trainer.plan();
  r.steps = trainer.total_steps();
  return r;
}

struct JobPricer::Impl {
  RunOptions options;
  DryRunOptions how;
  std::map<int, std::unique_ptr<Trainer>> models;  // by tensor degree
  std::map<std::tuple<int, int64_t, int>, LayerTimes> times;  // (tensor, micro-batch rows, threads)
  std::optional<Calibration> calibration;
  bool timed = false;
};

JobPricer::JobPricer(const RunOptions& options, const DryRunOptions& how) : impl_(std::make_unique<Impl>()) {
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
  r.ranks = rank_rows(plan, local);
  r.threads = set_threads(r.ranks.front().threads, plan.replicas());
  const int tensor = spec.mesh.size("tensor");
  std::unique_ptr<Trainer>& built = m.models[tensor];
  if (!built) {
    TrainerOptions topts = trainer_options(m.options);
    topts.dry_run = true;
    built = std::make_unique<Trainer>(spec, topts);
  }
  Trainer& trainer = *built;
  PlanInput in{plan, spec, trainer.model(), trainer.dataset(), trainer.probe()};
  if (const std::string problems = model_problems(in); !problems.empty()) throw ConfigError(problems);
  const auto key = std::make_tuple(tensor, std::max<int64_t>(1, plan.micro_batch_size()), r.threads);
  if (!m.calibration) {
    std::optional<LayerTimes> layers;
    m.calibration = calibration_of(m.how, trainer, std::get<1>(key), r.hosts() > 1, layers);
    m.timed = layers.has_value();
    if (layers) {
      m.times.emplace(key, std::move(*layers));
      m.calibration->source += "; each plan's layers timed at its own threads and micro-batch";
    }
  }
  const LayerTimes* timed = nullptr;
  if (m.timed) {
    auto it = m.times.find(key);
    if (it == m.times.end()) it = m.times.emplace(key, time_layers(trainer, std::get<1>(key))).first;
    timed = &it->second;
  }
  r.calibration = *m.calibration;
  r.estimates = estimate_ranks(in);
  r.prediction = predict(plan, trainer, r.estimates, local, r.calibration, timed, r.threads);
  r.parameters = trainer.model_parameters();
  return r;
}

std::string dry_run(const JobSpec& spec, const RunOptions& options, const DryRunOptions& how) {
  const PlanReport r = plan_report(spec, options, how);
  return how.json ? r.json().dump(2) + "\n" : r.text();
}

int PlanReport::hosts() const { return ranks.empty() ? 1 : ranks.back().host + 1; }

nlohmann::json PlanReport::json() const {
  nlohmann::json j;
  j["job"] = plan.spec().name;
  j["processes"] = plan.process_count();
  j["replicas_per_process"] = plan.replicas();
  j["mesh"] = nlohmann::json::object();
  for (const std::string& axis : kAxisOrder) j["mesh"][axis] = plan.processes().size(axis);
  j["mesh"]["replica"] = plan.replicas();
  j["batch"] = {{"global", plan.spec().data.batch_size}, {"data_ranks", plan.data_ranks()},
                {"micro_batches", plan.micro_batches()}, {"micro_batch_size", plan.micro_batch_size()}};
  j["steps"] = steps;
  j["parameters"] = parameters;
  j["composition"] = nlohmann::json::array();
  for (const PlanStep& s : plan.composition())
    j["composition"].push_back({{"section", s.section}, {"axis", s.role.axis}, {"active", s.active},
                                {"what", s.active ? s.role.why : s.note}});
  j["estimate"] = estimate_json(estimates);  // per rank: memory, and bytes per axis per step
  j["hosts"] = {{"count", hosts()}, {"processes_per_host", per_host},
                {"placement", MeshLayout(plan.processes()).host_placement(per_host)}};
  j["cost"] = prediction_json(prediction, calibration);
  if (!rounds_samples_per_s.empty()) j["cost"]["rounds_samples_per_s"] = rounds_samples_per_s;
  if (!rounds_samples_per_s.empty())
    j["machine"] = {{"load", machine.load}, {"cores", machine.cores}, {"others_running", machine.others_running},
                    {"busy", machine.busy}};
  j["ranks"] = nlohmann::json::array();
  const auto& axes = plan.processes().axes;
  for (const RankPlace& r : ranks) {
    nlohmann::json row = {{"rank", r.rank},         {"process", r.process}, {"host", r.host},
                          {"replica", r.replica},   {"threads", r.threads}};
    for (size_t i = 0; i < axes.size(); ++i) row[axes[i].name] = r.coords[i];
    if (!r.cpus.empty()) row["cpus"] = r.cpus;
    if (r.cpus.empty()) row["not_pinned"] = r.why;
    j["ranks"].push_back(row);
  }
  return j;
}

std::string PlanReport::text() const {
  const JobSpec& spec = plan.spec();
  std::string out;
  appendf(out, "job        %s (%s)\n", spec.name.c_str(), spec.source.empty() ? "built in C++" : spec.source.c_str());
  const int world = plan.process_count(), R = plan.replicas();
  const std::string per_rank = std::to_string(threads) + " intra-op thread" + (threads == 1 ? "" : "s");
  if (world == 1 && R == 1)
    appendf(out, "world      1 process, %s\n", per_rank.c_str());
  else if (world == 1)
    appendf(out, "world      1 process x %d replica threads, %s each\n", R, per_rank.c_str());
  else
    appendf(out, "world      mesh %s = %d processes (launch with mpirun -np %d)%s, %s each\n", spec.mesh.str().c_str(),
            world, world, R > 1 ? (" x " + std::to_string(R) + " replica threads").c_str() : "", per_rank.c_str());
  appendf(out, "data       %s\n", data.c_str());
  appendf(out, "batch      %s\n", plan.batch_equation().c_str());
  appendf(out, "steps      %lld (%s)\n", static_cast<long long>(steps),
          spec.train.max_steps ? "train.max_steps" : "train.epochs x steps per epoch");
  appendf(out, "model      %s, %lld parameters\n", model.c_str(), static_cast<long long>(parameters));
  out += model_text;
  out += plan.describe_composition();
  out += strategies_text;
  out += estimate_table(plan, estimates);  // per rank: memory, and bytes per axis per step
  const int hosts = this->hosts();
  if (hosts > 1) {
    out += "hosts      " + std::to_string(hosts) + " x " + std::to_string(per_host) +
          " processes (consecutive ranks share a host, as mpirun --map-by slot and srun place them)\n";
    for (const std::string& line : MeshLayout(plan.processes()).host_placement(per_host)) out += "  " + line + "\n";
  }
  out += "ranks      " + std::to_string(ranks.size()) + " (" + std::to_string(plan.process_count()) + " process" +
         (plan.process_count() == 1 ? "" : "es") +
         (plan.replicas() > 1 ? " x " + std::to_string(plan.replicas()) + " replicas" : std::string()) + ")" +
         (hosts == 1 ? " on " + hardware::hostname() : std::string()) + "\n";
  const bool tensor = spec.mesh.size("tensor") > 1;  // its column only where the plan has the axis
  appendf(out, "  %-5s %-8s %-5s %-9s %-5s %s%-8s %-8s %s\n", "rank", "process", "host", "pipeline", "data",
          tensor ? "tensor " : "", "replica", "threads", "cpus");
  const auto& axes = plan.processes().axes;
  for (const RankPlace& r : ranks) {
    auto coord = [&](const std::string& axis) {
      for (size_t i = 0; i < axes.size(); ++i)
        if (axes[i].name == axis) return r.coords[i];
      return 0;
    };
    char t[16] = "";
    if (tensor) std::snprintf(t, sizeof t, "%-6d ", coord("tensor"));
    appendf(out, "  %-5d %-8d %-5d %-9d %-5d %s%-8d %-8d %s\n", r.rank, r.process, r.host, coord("pipeline"), coord("data"),
            t, r.replica, r.threads, r.cpus.empty() ? ("not pinned: " + r.why).c_str() : r.cpus.c_str());
  }
  out += prediction_text(prediction, calibration);
  if (!rounds_samples_per_s.empty()) {
    const auto [lo, hi] = std::minmax_element(rounds_samples_per_s.begin(), rounds_samples_per_s.end());
    appendf(out, "  spread       this machine's compute timed %zu times: %.0f to %.0f samples/s (%.0f%%); the median above\n",
            rounds_samples_per_s.size(), *lo, *hi, *lo > 0 ? 100 * (*hi - *lo) / *lo : 0.0);
  }
  // The machine's load says what the timings here are worth: said where compute was timed
  // here (a priced calibration times nothing, and its text stays the same run to run).
  if (!rounds_samples_per_s.empty())
    appendf(out, "  machine      %s: load %.2f on %d core%s, %d other process%s running%s\n", machine.busy ? "busy" : "quiet",
            machine.load, machine.cores, machine.cores == 1 ? "" : "s", machine.others_running,
            machine.others_running == 1 ? "" : "es",
            machine.busy ? "; figures timed here are pessimistic for a quiet machine (run the dry run again when it is)" : "");
  return out;
}

namespace {

// The collectives' health settings from the job, before any communicator exists
// (Note [Health checks], Note [Flight recorder]).
void set_up_health(const JobSpec& spec) {
  collectives::HealthOptions health = collectives::health_options();
  if (spec.collectives.check) health.check = *spec.collectives.check;
  health.stall_warning = collectives::Duration(static_cast<int64_t>(spec.collectives.stall_warning_s * 1000));
  health.timeout = collectives::Duration(static_cast<int64_t>(spec.collectives.timeout_s * 1000));
  collectives::set_health_options(health);
  if (!spec.log.dir.empty()) collectives::FlightRecorder::set_dump_dir(spec.log.dir + "/flight");
  collectives::install_flight_recorder_signals();
}

TrainResult run_in(const JobSpec& spec, const RunOptions& options, const Plan& plan,
                   const collectives::LaunchInfo& launch, const collectives::Planes& planes);

}  // namespace

TrainResult run(const JobSpec& spec, const RunOptions& options) {
  const Plan plan(spec);  // a broken composition never launches
  // SIGTERM/SIGINT from here on: finish the step, checkpoint, PreemptedError (Note [Stop requests]).
  install_stop_handlers();
  const collectives::LaunchInfo launch = collectives::detect_launch();
  // The mesh must fit the launch before any rank communicates.
  if (launch.world_size != 0)
    plan.check_world(launch.world_size,
                     launch.launcher != "single"  ? launch.launcher + ": " + launch.evidence
                     : launch.evidence.empty()    ? "a single process, no launcher"
                                                  : "a single process (" + launch.evidence + "; srun starts the ranks)");
  // Every path the job reads and writes, before anything is loaded or trained (Note [Preflight]).
  check_paths(spec, /*own_data=*/static_cast<bool>(options.data));
  set_up_health(spec);
  collectives::Planes planes;  // Note [Two planes]
  std::optional<collectives::Monitor> monitor;  // a job of several processes alone
  if (launch.multi_process()) {
    collectives::BackendRegistry backends;
    collectives::register_builtin_backends(backends);
    collectives::WorldOptions wo;
    wo.timeout = collectives::Duration(static_cast<int64_t>(spec.collectives.timeout_s * 1000));
    planes = backends.create_planes(core::backend_of(spec), launch, wo);
    // The out-of-band channel that names a dead or failed rank to the others (Note [Monitor]).
    collectives::MonitorOptions mo;
    mo.timeout = wo.timeout;
    mo.silence = collectives::Duration(static_cast<int64_t>(spec.collectives.peer_silence_s * 1000));
    monitor.emplace(*planes.host, mo);
  }
  try {
    TrainResult result = run_in(spec, options, plan, launch, planes);
    if (monitor) monitor->stop();
    return result;
  } catch (const PreemptedError&) {
    if (monitor) monitor->stop();  // every rank stops at the agreed step: a clean goodbye
    throw;
  } catch (const std::exception& e) {
    // A communication error may be the echo of a peer's death: let the monitor say so
    // (it ends this process with kExitPeerLost) before this rank reports its own failure.
    if (monitor && dynamic_cast<const CommError*>(&e)) monitor->settle(std::chrono::seconds(2));
    if (monitor) monitor->report_failure(e.what());
    throw;
  }
}

namespace {
TrainResult run_in(const JobSpec& spec, const RunOptions& options, const Plan& plan,
                   const collectives::LaunchInfo& launch, const collectives::Planes& planes) {
  const collectives::CommunicatorPtr& world = planes.data;
  const collectives::HostMap hosts = world ? collectives::gather_hosts(*planes.host) : collectives::HostMap{};
  const int threads = set_threads(spec.train.threads, plan.replicas());
  TrainerOptions topts = trainer_options(options);
  topts.world = world;
  if (world && !planes.shared()) topts.host = planes.host;
  const bool speak = launch.rank == 0;
  topts.on_start = [&](const Trainer& trainer) {
    if (!speak || !trainer.writer() || !options.out) return;
    const std::string ranks = plan.replicas() > 1 ? " x " + std::to_string(plan.replicas()) + " replica threads" : "";
    const size_t n_hosts = std::max<size_t>(1, hosts.hosts.size());
    // Where the launcher put rank 0 (tetra keeps a launcher's binding): its CPUs.
    const std::string where =
        (n_hosts == 1 ? "1 host (" + hardware::hostname() + ")" : std::to_string(n_hosts) + " hosts (" + hosts.describe() + ")") +
        (world ? ", rank 0 on cpus " + hardware::affinity_cpus() : "");
    std::fprintf(options.out, "tetra %s | job %s | %s%s, %s | backend %s | device %s | %d thread%s | %s | %s\n",
                 TETRA_VERSION, spec.name.c_str(), collectives::describe(launch).c_str(), ranks.c_str(), where.c_str(),
                 planes.describe().c_str(), trainer.device().str().c_str(), threads, threads == 1 ? "" : "s",
                 to_string(spec.train.precision).c_str(), blas_description().c_str());
    std::fprintf(options.out, "%s; model %s, %lld parameters; %lld steps\n", trainer.dataset().info().description.c_str(),
                 options.model ? "the program's own" : spec.model.type.c_str(),
                 static_cast<long long>(trainer.model_parameters()), static_cast<long long>(trainer.total_steps()));
    for (const auto& strategy : trainer.strategies())
      if (const std::string d = strategy->decision(); !d.empty()) std::fprintf(options.out, "%s\n", d.c_str());
    std::fflush(options.out);
  };
  return core::train(spec, topts);  // on the ranks the plan makes (Note [Ranks a plan makes])
}

}  // namespace

}  // namespace tetra
