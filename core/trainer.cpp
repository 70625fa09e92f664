#include "core/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

#include "collectives/error.h"
#include "collectives/hierarchical.h"
#include "collectives/launch.h"
#include "core/device.h"
#include "core/model_plan.h"
#include "core/preflight.h"
#include "core/random.h"
#include "core/resume.h"
#include "core/runtime.h"
#include "core/safetensors.h"
#include "core/text.h"
#include "core/torch_compat.h"
#include "hardware/host.h"

namespace tetra::core {

namespace fs = std::filesystem;

Trainer::Trainer(JobSpec spec, TrainerOptions options)
    : plan_(std::move(spec)), spec_(plan_.spec()), options_(std::move(options)) {
  // A Trainer is one rank: the replica threads of `replicate` are made by whoever starts
  // the job (tetra::run, replicate::train), never silently dropped.
  const int group = options_.replica ? options_.replica->size() : 1;
  if (group != plan_.replicas())
    throw ConfigError("the job runs " + std::to_string(plan_.replicas()) + " replica thread" +
                      (plan_.replicas() == 1 ? "" : "s") + " per process (replicate.replicas) but this trainer got a replica group of " +
                      std::to_string(group) + "; start the job with tetra::run or replicate::train, which make the replicas");
  if (options_.world) {
    mesh_ = std::make_unique<Mesh>(options_.world, spec_.mesh, options_.replica, options_.host);
    // Every rank of the job, replicas included, on the host plane: checkpoints write a file
    // per rank of it, and the step's decision and the records go over it.
    ranks_ = options_.replica && options_.replica->size() > 1
                 ? collectives::make_hierarchical(options_.replica->split(0, options_.replica->rank()),
                                                  mesh_->host_world(), "every rank (processes x replicas)")
                 : mesh_->host_world();
    data_group_ = mesh_->host("data");
    data_rank_ = data_group_->rank();
    data_size_ = data_group_->size();
  } else if (options_.host) {
    throw ConfigError("the trainer got a host plane (TrainerOptions::host) but no world to go beside it");
  } else if (options_.replica && options_.replica->size() > 1) {
    throw ConfigError("the trainer got a replica group of " + std::to_string(options_.replica->size()) +
                      " but no world; replicas need the process world (a communicator of 1 for one process)");
  }
  // Note [One device]: a device this machine cannot give is exit 2 before anything is
  // built (a plan on paper, core::ModelPlan, plans for another machine and builds nothing
  // on a device).
  if (const std::string problem = device_problem(spec_); !problem.empty()) throw ConfigError(problem);
  device_ = options_.device ? *options_.device
                            : rank_device(spec_, collectives::detect_launch().local_rank,
                                          options_.replica ? options_.replica->rank() : 0, plan_.replicas());
  data_ = load_data(spec_, options_.data);
  model_ = build_job_model(plan_, data_->info(), options_.model, mesh_ ? mesh_->coord("tensor") : 0);
  if (options_.model && !in_host_memory(device_)) model_->to(device_);  // a program's own model, built with its values
  for (const auto& p : model_->named_parameters()) {
    param_index_[p.key()] = static_cast<int64_t>(param_names_.size());
    param_names_.push_back(p.key());
    params_.push_back({p.key(), p.value()});
  }
  weights_ = std::make_unique<Materializer>(*model_, static_cast<uint64_t>(spec_.train.seed), device_);
  // The whole model's: a checkpoint's identity does not depend on the layout.
  model_parameters_ = whole_parameters(model_, *weights_);
  // The whole model's layers, before a pipeline keeps only its stage's (Note [Export config]).
  nlohmann::json layers = nlohmann::json::array();
  for (size_t i = 0; i < model_->size(); ++i) {
    nlohmann::json params = nlohmann::json::array();
    for (const auto& p : model_->ptr(i)->named_parameters(/*recurse=*/true))
      params.push_back(std::to_string(i) + "." + p.key());
    layers.push_back({{"index", i}, {"layer", layer_text(*model_->ptr(i))}, {"parameters", params}});
  }
  identity_ = std::make_unique<RunIdentity>(
      RunIdentity{spec_, data_->info(), static_cast<bool>(options_.model), std::move(layers), model_parameters_});
  // Note [Weights from elsewhere]: checked against the whole model, before any tensor exists.
  if (std::optional<WeightsFrom> from = weights_from_elsewhere(spec_.checkpoint, model_, *weights_)) {
    init_note_ = from->note;
    std::shared_ptr<CheckpointReader> source = from->source;
    weights_->take_values_from([source](const std::string& name, int64_t begin, const at::Tensor& out) {
      const std::string key = "model/" + name;
      if (!source->contains(key)) return false;
      out.copy_(source->read_flat(key, begin, out.numel()));
      return true;
    });
  }
  batches_ = std::make_unique<BatchPlan>(data_->size(Split::kTrain), spec_.data.batch_size,
                                      spec_.train.seed, spec_.data.shuffle);
  total_steps_ = spec_.train.max_steps ? *spec_.train.max_steps
                                       : spec_.train.epochs * batches_->steps_per_epoch();
  schedule_ = std::make_unique<LrSchedule>(spec_.schedule, spec_.optimizer.lr, total_steps_);
  // The plan's active strategies, in its composition order (outermost first): the
  // pipeline keeps its stage's layers before the data-parallel strategy buckets their
  // gradients; the plan already left out a synchroniser whose axis another owns.
  for (const auto& cfg : plan_.strategies())
    if (auto s = cfg->build()) strategies_.push_back(std::move(s));
  state_ = std::make_unique<TrainState>(
      TrainState{spec_, model_, params_, mesh_.get(), trace_, data_.get(), weights_.get(), device_});
  for (auto& s : strategies_) s->attach(*state_);
  // Note [Capabilities]: looked for once. A job has at most one runner and one owner
  // besides core's (the plan admits one pipeline and one ZeRO section).
  StepRunner* runner = nullptr;
  std::string runner_name;
  ModelStateOwner* owner = nullptr;
  for (auto& s : strategies_) {
    if (auto* r = dynamic_cast<StepRunner*>(s.get())) {
      if (runner)
        throw ConfigError("strategies " + runner_name + " and " + s->name() +
                          " both run the forward and backward; a job can have one of them");
      runner = r;
      runner_name = s->name();
    }
    if (auto* o = dynamic_cast<ModelStateOwner*>(s.get())) owner = o;
    if (auto* g = dynamic_cast<StateGatherer*>(s.get())) gatherers_.push_back(g);
  }
  // What no strategy created is this rank's whole (one process, a pipeline's stage).
  weights_->create_all(*model_);
  if (!runner) local_runner_ = std::make_unique<LocalRunner>(model_, trace_, spec_.train.accumulation_steps, state_->loss);
  runner_ = runner ? runner : local_runner_.get();
  weights_->take_values_from({});  // every tensor is created: the source's files close
  // After attach: the parameters this rank holds, stepped by core's optimizer — unless a
  // strategy keeps the model state in its own layout and steps it.
  if (!owner)
    replicated_ = std::make_unique<ReplicatedState>(spec_.optimizer, params_, weights_.get(),
                                                    mesh_ ? mesh_->coord("tensor") : 0);
  owner_ = owner ? owner : replicated_.get();
}
Trainer::~Trainer() = default;

ModelStateBytes Trainer::memory() const { return owner_->memory(); }

Batch Trainer::on_device(Batch b) const {
  if (in_host_memory(device_)) return b;
  return {b.inputs.to(device_, /*non_blocking=*/true), b.targets.to(device_, /*non_blocking=*/true)};
}

RankState Trainer::rank_state(const ModelStateBytes& m) const { return {m, phases_, runner_->idle(), step_}; }

TensorMap Trainer::weights() {
  TensorMap weights;
  owner_->gather_parameters(weights);
  for (StateGatherer* g : gatherers_) g->gather_state(weights);
  if (!writer()) weights.clear();
  return weights;
}

double Trainer::data_average(double v) {
  if (!data_group_ || data_size_ == 1) return v;
  at::Tensor t = at::full({1}, v, at::kDouble);
  collectives::AllreduceOptions o;
  o.op = collectives::ReduceOp::kAvg;
  data_group_->allreduce(t, o)->wait();
  return t.item<double>();
}

// One step: the runner's forward and backward over this data rank's slice of the global
// batch, the strategies' gradient synchronisation, one decision over every rank (Note
// [One decision per step]), then the owner's clipping and optimizer step.
Trainer::StepOutcome Trainer::train_step(const torch::Tensor& global_indices) {
  StepInput in;
  in.indices = data_size_ == 1 ? global_indices : BatchPlan::slice(global_indices, data_rank_, data_size_);
  in.load = [this](const torch::Tensor& idx) { return on_device(data_->get(Split::kTrain, idx)); };
  in.before_backward = [this](bool last) {
    for (auto& s : strategies_) s->before_backward(last);
  };
  in.bf16 = spec_.train.precision == Precision::kBf16;
  in.device = device_;
  // Dropout draws by each row's place in the global batch, so every split draws what one
  // process draws (Note [Layout-invariant dropout]).
  in.random.seed = static_cast<uint64_t>(spec_.train.seed);
  in.random.step = step_;
  in.random.first_sample = BatchPlan::slice_begin(global_indices.size(0), data_rank_, data_size_);
  in.random.active = true;
  owner_->zero_grad();
  const StepOutput out = runner_->run(in);
  phases_.data += out.data_s;
  phases_.forward += out.forward_s;
  phases_.backward += out.backward_s;

  Stopwatch t;
  for (auto& s : strategies_) s->finish_gradients();
  StepSeen seen;
  seen.loss = data_average(out.loss);  // over the whole global batch (equal shards: the mean of the means)
  seen.nonfinite_micro_batch = out.nonfinite_micro_batch;
  seen.nonfinite_loss = out.nonfinite_loss;
  seen.nonfinite_param = first_nonfinite_gradient();
  seen.stop = stop_requested();
  const StepVerdict verdict = agree_on_step(
      seen, {step_, epoch_, data_rank_, data_size_, plan_.micro_batches(), &param_names_}, ranks_.get());
  phases_.gradients += t.lap();
  StepOutcome outcome;
  outcome.loss = seen.loss;
  outcome.stop = verdict.stop;
  if (verdict.nonfinite) {
    if (spec_.train.on_nonfinite == OnNonfinite::kStop)
      throw Error(verdict.why + " (train.on_nonfinite: stop; lower optimizer.lr, set optimizer.clip_grad_norm, or use skip)");
    // skip: nothing of this step reaches the parameters or the optimizer state.
    owner_->zero_grad();
    outcome.skipped = true;
    outcome.why = verdict.why;
    return outcome;
  }
  {
    Trace::Scope s(trace_, "compute", "optimizer");
    if (const double max_norm = spec_.optimizer.clip_grad_norm; max_norm > 0) {
      // The norm from this rank's part (its stage, its shards), summed over the axes.
      double sq = owner_->grad_norm_sq();
      for (auto& s : strategies_) sq = s->reduce_grad_norm_sq(sq);
      const double norm = std::sqrt(sq);
      if (norm > max_norm) owner_->scale_gradients(clip_scale(max_norm, norm));
      outcome.grad_norm = norm;
    }
    owner_->step(schedule_->at(step_));
  }
  phases_.optimizer += t.lap();
  return outcome;
}

int64_t Trainer::first_nonfinite_gradient() {
  int64_t first = -1;
  for (const std::string& name : owner_->nonfinite_gradients()) {
    auto it = param_index_.find(name);
    if (it != param_index_.end() && (first < 0 || it->second < first)) first = it->second;
  }
  return first;
}

EvalResult Trainer::evaluate() {
  Trace::Scope scope(trace_, "compute", "evaluate");
  torch::NoGradGuard no_grad;
  model_->eval();
  const int64_t total = spec_.data.eval_samples > 0
                            ? std::min(spec_.data.eval_samples, data_->size(Split::kTest))
                            : data_->size(Split::kTest);
  // Each data-parallel rank evaluates its own part; the sums are added up.
  const int64_t begin = total * data_rank_ / data_size_, end = total * (data_rank_ + 1) / data_size_;
  const bool bf16 = spec_.train.precision == Precision::kBf16;
  EvalSums sums;
  // Every data rank runs the same number of forwards, as a runner or an owner may
  // communicate inside one (a pipeline's stages, ZeRO-3's gathers): a rank whose part ran
  // out runs one sample again and counts nothing.
  const int64_t eb = spec_.data.eval_batch_size;
  const int64_t forwards = ((total + data_size_ - 1) / data_size_ + eb - 1) / eb;
  for (int64_t i = 0; i < forwards; ++i) {
    const int64_t b = begin + i * eb;
    if (b >= end) {
      const int64_t k = std::min(begin, std::max<int64_t>(0, data_->size(Split::kTest) - 1));
      runner_->evaluate(on_device(data_->range(Split::kTest, k, k + 1)), bf16);
      continue;
    }
    const EvalSums s = runner_->evaluate(on_device(data_->range(Split::kTest, b, std::min(end, b + eb))), bf16);
    sums.loss_sum += s.loss_sum;
    sums.correct += s.correct;
    sums.predictions += s.predictions;
  }
  model_->train();
  if (data_group_ && data_size_ > 1) {
    at::Tensor t = at::tensor({sums.loss_sum, static_cast<double>(sums.correct), static_cast<double>(sums.predictions)},
                              at::kDouble);
    data_group_->allreduce(t)->wait();
    sums.loss_sum = t[0].item<double>();
    sums.correct = static_cast<int64_t>(t[1].item<double>());
    sums.predictions = static_cast<int64_t>(t[2].item<double>());
  }
  EvalResult r;
  r.samples = total;
  r.test_loss = total ? sums.loss_sum / static_cast<double>(total) : 0;
  if (sums.predictions) r.accuracy = static_cast<double>(sums.correct) / static_cast<double>(sums.predictions);
  if (data_->info().language_model) r.perplexity = std::exp(r.test_loss);
  return r;
}

std::string Trainer::save_checkpoint(int64_t step, int64_t epoch, int64_t step_in_epoch) {
  Trace::Scope scope(trace_, "checkpoint", "save");
  Checkpoint ckpt;
  ckpt.step = step;
  ckpt.epoch = epoch;
  ckpt.step_in_epoch = step_in_epoch;
  for (const auto& b : model_->named_buffers()) ckpt.tensors["model/" + b.key()] = b.value();
  owner_->save_state(ckpt);  // a sharding owner: each rank its slices (collective)
  // A pipeline's stages send their whole tensors to the writer (collective: every rank is here).
  for (StateGatherer* g : gatherers_) g->gather_state(ckpt.tensors);
  if (writer()) {
    ckpt.tensors["rng/cpu"] = cpu_rng_state();
    identity_->describe(ckpt.meta, batches_->steps_per_epoch(), data_size_);  // Note [Checkpoint identity]
    if (best_accuracy_) ckpt.meta["best_accuracy"] = *best_accuracy_;
  } else {
    ckpt.tensors.clear();  // replicated state: the writer's copy is the one written
  }
  CheckpointStore store(spec_.checkpoint.dir, spec_.checkpoint.keep);
  std::string folder = store.save(ckpt, ranks_.get());
  return writer() ? folder : "";
}

void Trainer::restore(const CheckpointReader& ckpt) {
  // Another job's, or another model's, is refused before any tensor is read.
  resume_changes_ = identity_->check_resumable(ckpt, batches_->steps_per_epoch());
  torch::NoGradGuard no_grad;
  // Every tensor is checked before any is changed: a checkpoint that does not fit the
  // model leaves it as it was.
  auto buffers = model_->named_buffers();
  for (auto& b : buffers) ckpt.expect_shape("model/" + b.key(), b.value().sizes(), "model tensor " + b.key());
  owner_->load_state(ckpt);  // checks its own tensors first
  for (auto& b : buffers) b.value().copy_(ckpt.read("model/" + b.key()).view(b.value().sizes()));
  if (ckpt.contains("rng/cpu")) set_cpu_rng_state(ckpt.read("rng/cpu"));
  step_ = ckpt.step();
  epoch_ = ckpt.epoch();
  step_in_epoch_ = ckpt.step_in_epoch();
  const nlohmann::json& meta = ckpt.meta();
  if (meta.contains("best_accuracy")) {
    // meta.json may come from elsewhere: a value of another type is an error naming it,
    // not a nlohmann::json::type_error.
    if (!meta["best_accuracy"].is_number())
      throw Error("checkpoint " + ckpt.folder() + ": its meta.json has best_accuracy " +
                  meta["best_accuracy"].dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
                  ", not a number");
    best_accuracy_ = meta["best_accuracy"].get<double>();
  }
  resumed_from_ = ckpt.folder();
}

// Note [A finished run stays]
// A run folder (log.dir) whose run finished holds its summary.json, and a run of the same
// name never writes over it: re-running a job file, or the run folder's job.yaml, must not
// turn a finished run's figures into zeros. So before anything is written:
//   - resumed at or past the last step (its checkpoint): nothing to train. Said, exit 0,
//     nothing written (no job.yaml, no records, no eval, no export, no summary).
//   - not resumed, and summary.json is there: its identity (Note [Checkpoint identity])
//     must be this job's, else exit 2 naming what differs (so also with checkpoints off,
//     where no checkpoint refuses it); a run that reached this job's last step leaves
//     nothing to train; one that stopped short, with no checkpoint to continue from, would
//     be trained again from step 0 over its files: exit 2, naming a new name.
// Raising train.max_steps or train.epochs continues a finished run from its checkpoint and
// appends to its records; a summary is written only by a run that trained. Rank 0 reads
// the folder and decides; the decision travels to every rank (as choose_checkpoint's).
std::string Trainer::finished_run() const {
  auto nothing = [&](const std::string& folder, int64_t at) {
    return folder + ": finished at step " + std::to_string(at) +
           (at > total_steps_ ? " (this job stops at step " + std::to_string(total_steps_) + ")" : "") +
           ": nothing to train; " +
           (spec_.checkpoint.dir.empty() ? "it kept no checkpoint to continue from, so --set name=NEW for a new run"
                                         : "raise train.max_steps or train.epochs to continue it, or --set name=NEW "
                                           "for a new run");
  };
  if (!resumed_from_.empty())
    return step_ < total_steps_ ? "" : nothing(spec_.log.dir.empty() ? resumed_from_ : spec_.log.dir, step_);
  if (spec_.log.dir.empty()) return "";
  // The decision: "" train; "\n0" + what to say; "\n2" + the error.
  std::string verdict;
  if (writer()) {
    const fs::path path = fs::path(spec_.log.dir) / "summary.json";
    std::error_code ec;
    nlohmann::json summary;
    if (fs::is_regular_file(path, ec)) {
      std::ifstream in(path);
      summary = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);  // not whole: nothing to compare
    }
    // Another job's folder is the preflight's refusal (run_folder_problem).
    if (summary.is_object() && summary.value("job", spec_.name) == spec_.name) {
      const int64_t done = summary.value("final_step", int64_t{0});
      const std::string there = "log.dir: " + spec_.log.dir + " holds a finished run of job \"" + spec_.name + "\"";
      const nlohmann::json ours = identity_->identity();
      if (summary.contains("identity") && summary["identity"] != ours)
        verdict = "\n2" + there + " with another model or data (" + differences(summary["identity"], ours) +
                  "), which this run would write over. --set name=NEW gives this run a folder of its own";
      else if (done >= total_steps_)
        verdict = "\n0" + nothing(spec_.log.dir, done);
      else
        verdict = "\n2" + there + " that stopped at step " + std::to_string(done) + ", and this job trains to step " +
                  std::to_string(total_steps_) + ", but " +
                  (spec_.checkpoint.dir.empty() ? std::string("it kept no checkpoints (checkpoint.dir \"\")")
                                                : "no checkpoint of it is left in " + spec_.checkpoint.dir) +
                  " to continue from, and training from step 0 would write over it. --set name=NEW gives this run a "
                  "folder of its own";
    }
  }
  if (ranks_ && ranks_->size() > 1) verdict = collectives::broadcast_string(*ranks_, verdict);
  if (verdict.empty()) return "";
  if (verdict[1] == '2') throw ConfigError(verdict.substr(2));
  return verdict.substr(2);
}

// One run() of the loop: what it writes to (the metrics, the run folder's records, the
// progress line), its counters, and the result it fills.
struct Trainer::Loop {
  explicit Loop(Trainer& trainer)
      : t(trainer),
        write(trainer.writer()),  // rank 0 writes the replicated state and the logs
        trace_path(rank_trace_path(trainer.spec_.log.trace, trainer.ranks_ ? trainer.ranks_->rank() : 0,
                                   trainer.ranks_ ? trainer.ranks_->size() : 1)) {}

  Trainer& t;
  const Stopwatch since_start;
  const std::string started_at = utc_now();
  const bool write;
  const std::string trace_path;
  MetricsWriter metrics;
  std::optional<RunRecords> records;
  std::optional<Progress> progress;
  TrainResult result;
  int64_t spe = 1, epochs_shown = 1;
  double train_seconds = 0, interval_seconds = 0;
  int64_t interval_samples = 0;
  std::string last_checkpoint;
  int64_t last_saved = -1;  // the last step on disk
  int64_t checkpoint_failures = 0;
  std::optional<EvalResult> last_eval;
  int64_t last_eval_step = -1;

  // The metrics, the records, the progress line and what it says first.
  void open() {
    const JobSpec& spec = t.spec_;
    const bool resumed = !t.resumed_from_.empty();
    if (write && !spec.log.metrics.empty()) metrics.open(spec.log.metrics, resumed);
    if (write && !spec.log.tensorboard.empty()) metrics.open_tensorboard(spec.log.tensorboard, resumed ? t.step_ : -1);
    records.emplace(spec, t.plan_, t.mesh_.get(), t.ranks_);
    if (write && !spec.log.dir.empty()) records->write_run_start();
    progress.emplace(write ? spec.log.progress : "off", spec.log.every, t.options_.out);
    if (!resumed && !t.init_note_.empty()) progress->message(t.init_note_);
    if (resumed)
      progress->message("resumed from " + t.resumed_from_ + " at step " + std::to_string(t.step_) +
                        (t.resume_changes_.empty() ? "" : "; changed since it was written: " + t.resume_changes_));
    result.resumed_from = t.resumed_from_;
    spe = t.batches_->steps_per_epoch();
    epochs_shown = (t.total_steps_ + spe - 1) / spe;
    last_saved = resumed ? t.step_ : -1;  // a resumed step is on disk
  }

  // Every rank saves (a collective); a failed save is the same CheckpointSaveError on every
  // rank, so all take the same checkpoint.on_error decision.
  void save_now() {
    try {
      std::string saved = t.save_checkpoint(t.step_, t.epoch_, t.step_in_epoch_);
      if (write) last_checkpoint = saved;
    } catch (const CheckpointSaveError& e) {
      if (t.spec_.checkpoint.on_error == OnCheckpointError::kStop) throw;
      ++checkpoint_failures;
      if (write) {
        std::fprintf(stderr, "warning: %s (checkpoint.on_error: warn, training goes on)\n", e.what());
        CheckpointFailureRecord rec;
        rec.step = t.step_;
        rec.checkpoint_failures = checkpoint_failures;
        rec.checkpoint_error = e.what();
        metrics.write(to_json(rec));
      }
    }
    last_saved = t.step_;
  }

  void eval() {
    EvalResult e = t.evaluate();
    const int64_t step = t.step_;
    EvalRecord rec;
    rec.step = step;
    rec.epoch = t.epoch_;
    rec.test_loss = e.test_loss;
    rec.time_s = since_start.elapsed();
    std::string line = "eval  step " + std::to_string(step) + "  test_loss " + fmt("%.4f", e.test_loss);
    if (e.perplexity) {
      rec.perplexity = *e.perplexity;
      rec.test_accuracy = *e.accuracy;
      line += "  perplexity " + fmt("%.3f", *e.perplexity) + "  next-byte accuracy " + fmt("%.2f%%", 100 * *e.accuracy);
    } else if (e.accuracy) {
      rec.test_accuracy = *e.accuracy;
      line += "  accuracy " + fmt("%.2f%%", 100 * *e.accuracy);
      if (!t.best_accuracy_ || *e.accuracy > *t.best_accuracy_) t.best_accuracy_ = e.accuracy;
    }
    metrics.write(to_json(rec));
    progress->message(line);
    last_eval = e;
    last_eval_step = step;
  }

  // A step taken: its loss kept (a skipped one warned of), its train record when the log
  // is due, the progress line.
  void note(const StepOutcome& outcome, int64_t samples, double lr, double seconds) {
    interval_samples += samples;
    if (outcome.skipped) {
      if (write) {
        const std::string line = "warning: " + outcome.why + "; skipped, no update (train.on_nonfinite: skip; " +
                                 std::to_string(t.skipped_steps_) + " skipped so far)";
        if (t.spec_.log.progress == "off")
          std::fprintf(stderr, "%s\n", line.c_str());
        else
          progress->message(line);
      }
    } else {
      result.losses.push_back(outcome.loss);
      result.final_loss = outcome.loss;
    }
    const bool log_now = t.step_ % t.spec_.log.every == 0 || t.step_ == t.total_steps_;
    // Training time counts everything a step costs, logging included; not eval or checkpoints.
    train_seconds += seconds;
    interval_seconds += seconds;
    const double sps = interval_seconds > 0 ? static_cast<double>(interval_samples) / interval_seconds : 0;
    if (log_now) {
      StepRecord rec;
      rec.step = t.step_;
      rec.epoch = t.epoch_;
      rec.loss = outcome.loss;
      rec.lr = lr;
      rec.samples_per_s = sps;
      rec.time_s = since_start.elapsed();
      rec.skipped_steps = t.skipped_steps_;
      rec.skipped = outcome.skipped;
      rec.grad_norm = outcome.grad_norm;
      metrics.write(to_json(records->train_record(rec, t.rank_state(t.memory()))));
    }
    Progress::Status st;
    st.step = t.step_;
    st.total = t.total_steps_;
    st.epoch = t.epoch_ + 1;
    st.epochs = epochs_shown;
    st.loss = outcome.loss;
    st.lr = lr;
    st.samples_per_s = sps;
    st.elapsed_s = train_seconds;
    st.peak_rss = hardware::peak_rss_bytes();
    progress->update(st);
    if (log_now) {
      interval_seconds = 0;
      interval_samples = 0;
    }
  }

  // Note [Stop requests]: every rank agreed to stop after this step: its checkpoint
  // (collective; before any evaluation this step would run, which the grace period a
  // launcher gives may not cover), then out. The last step just finishes the run.
  [[noreturn]] void stop(int request) {
    progress->finish();
    const std::string folder = save_for_stop(t.ranks_.get(), [&]() -> std::optional<std::string> {
      if (t.spec_.checkpoint.dir.empty()) return std::nullopt;
      return t.save_checkpoint(t.step_, t.epoch_, t.step_in_epoch_);
    });
    if (!trace_path.empty()) t.trace_.write(trace_path);
    throw_preempted(t.step_, request, folder, [&](const std::string& line) { progress->message(line); });
  }

  // After the last step: the last eval and checkpoint, the export, the trace, the result
  // and the summary.
  TrainResult finish() {
    const JobSpec& spec = t.spec_;
    const CheckpointSpec& ck = spec.checkpoint;
    progress->finish();
    if (last_eval_step != t.step_) eval();
    if (!ck.dir.empty() && last_saved != t.step_) save_now();
    if (!ck.safetensors.empty()) {
      TensorMap weights = t.weights();  // collective
      if (write) {
        save_safetensors(ck.safetensors, weights,
                         {{"format", "pt"}, {"framework", "tetra"}, {"model", t.options_.model ? "custom" : spec.model.type},
                          {"step", std::to_string(t.step_)}});
        write_export_config(ck.safetensors, t.identity_->export_description(), weights, t.step_);
      }
    }
    if (!trace_path.empty()) t.trace_.write(trace_path);
    result.steps = static_cast<int64_t>(result.losses.size());
    result.skipped_steps = t.skipped_steps_;
    result.final_step = t.step_;
    result.train_seconds = train_seconds;
    result.total_seconds = since_start.elapsed();
    result.samples_per_s =
        train_seconds > 0 ? static_cast<double>(result.steps * spec.data.batch_size) / train_seconds : 0;
    result.final_eval = last_eval;
    result.best_accuracy = t.best_accuracy_;
    result.checkpoint = last_checkpoint;
    result.phases = t.phases_;
    result.memory = t.memory();
    // Note [Run folder]: every rank's totals for the summary (collective: every rank joins).
    records->write_summary(result, t.rank_state(result.memory), trace_path, started_at, t.identity_->identity());
    return std::move(result);
  }
};

TrainResult Trainer::run() {
  if (options_.on_start) options_.on_start(*this);
  Loop loop(*this);
  const CheckpointSpec& ck = spec_.checkpoint;
  const int world_rank = ranks_ ? ranks_->rank() : 0;
  if (!loop.trace_path.empty()) trace_.enable(world_rank, spec_.name + " rank " + std::to_string(world_rank));
  // Note [Preflight]: room for one checkpoint, on every rank (each writes its part).
  if (!ck.dir.empty())
    if (const std::string problem = space_problem(spec_, model_parameters_); !problem.empty()) throw ConfigError(problem);
  // Resume (core/resume.h): checkpoint.resume auto takes the newest intact checkpoint.
  if (std::optional<CheckpointReader> from = choose_checkpoint(ck, ranks_.get())) restore(*from);
  // Note [A finished run stays]: nothing is written before this.
  if (std::string said = finished_run(); !said.empty()) {
    TrainResult result;
    result.final_step = step_;
    result.resumed_from = resumed_from_;
    result.nothing_to_train = std::move(said);
    return result;
  }
  loop.open();
  loop.records->start(rank_state(memory()));  // the loop's counters, not the set-up's
  model_->train();
  const int64_t eval_every = spec_.train.eval_every;
  while (step_ < total_steps_) {
    if (step_in_epoch_ >= loop.spe) {
      ++epoch_;
      step_in_epoch_ = 0;
    }
    const Stopwatch step_clock;
    torch::Tensor indices = batches_->global_batch(epoch_, step_in_epoch_);
    const double lr = schedule_->at(step_);
    const double step_begin_us = trace_.enabled() ? trace_.now_us() : 0;
    const StepOutcome outcome = train_step(indices);
    // A span per step: report and Perfetto cut one step of a pipeline out by it.
    if (trace_.enabled()) trace_.span("step", "step " + std::to_string(step_ + 1), step_begin_us, trace_.now_us());
    // A skipped step is still a step: its batch is consumed and the step count (hence the
    // learning-rate schedule) moves on, so the run ends where it would have, on the same data.
    ++step_;
    ++step_in_epoch_;
    if (outcome.skipped) ++skipped_steps_;
    loop.note(outcome, indices.size(0), lr, step_clock.elapsed());
    if (options_.on_step) options_.on_step(step_, outcome.loss);
    if (outcome.stop && step_ < total_steps_) loop.stop(outcome.stop);
    const bool epoch_end = step_in_epoch_ == loop.spe;
    if ((eval_every > 0 && step_ % eval_every == 0) || (eval_every == 0 && epoch_end)) loop.eval();
    if (!ck.dir.empty() && ck.every_steps > 0 && step_ % ck.every_steps == 0 && step_ < total_steps_) loop.save_now();
  }
  return loop.finish();
}

TrainResult train(const JobSpec& spec, TrainerOptions options, const RankMaker::AfterRun& after) {
  for (const auto& cfg : Plan(spec).strategies())  // composition order: the outermost maker
    if (const auto* maker = dynamic_cast<const RankMaker*>(cfg.get())) return maker->train(spec, std::move(options), after);
  Trainer trainer(spec, std::move(options));
  TrainResult result = trainer.run();
  if (after) after(0, trainer, result);
  return result;
}

}  // namespace tetra::core
