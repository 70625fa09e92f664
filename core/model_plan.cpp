#include "core/model_plan.h"

#include <mutex>
#include <set>

#include "collectives/error.h"
#include "core/random.h"
#include "core/runtime.h"
#include "core/text.h"
#include "core/torch_compat.h"

namespace tetra::core {

// Note [Model plan]
// What a plan on paper knows of a job's model: its data, its layers built as shapes (no
// storage; a tensor-split job's as tensor rank 0 builds them), one training sample probed
// through them, and the strategies' rules, lines and per-rank estimate on them. `train
// --check`, `train --dry-run`, the tuner (tools/planner) and report's estimate work from a
// ModelPlan; it never communicates, attaches no strategy and creates no tensor. A Trainer
// builds its own data and model with the same functions (load_data, build_job_model,
// whole_parameters, weights_from_elsewhere), on its rank's device and tensor coordinate.

namespace {

// Note [Weights from elsewhere]
// checkpoint.init_from starts a run from another run's weights, and from nothing else of
// it: no optimizer state, no step, no data position (fine-tuning; DeepSpeed's
// load_module_only, torchtitan's initial_load_path). The source is a checkpoint folder of
// any job and any layout, or a safetensors export (CheckpointReader::weights_of: its
// tensors as model/<name>). Its names and shapes are checked against the whole model
// before any tensor is created, every mismatch listed at once; then the Materializer takes
// each tensor's values from it instead of the seeded draw (Materializer::take_values_from),
// so the weights land resharded on whatever this rank creates: a ZeRO-3 shard, a tensor
// rank's columns, a pipeline stage's layers. The run is its own: its checkpoints carry its
// own name, and once it has one, resuming takes that (init_from is then not read).

// Whether the run will resume a checkpoint of its own (then init_from is not read): an
// explicit checkpoint.resume, or auto with a checkpoint in checkpoint.dir.
bool resumes_its_own(const CheckpointSpec& ck) {
  if (ck.resume == "never") return false;
  if (ck.resume != "auto") return true;
  if (ck.dir.empty()) return false;
  try {
    return CheckpointStore(ck.dir, ck.keep).latest().has_value();
  } catch (const std::exception&) {
    return true;  // a damaged folder: the resume decision says so
  }
}

CheckpointReader weights_from(const std::string& path) {
  try {
    return CheckpointReader::weights_of(path);
  } catch (const ConfigError&) {
    throw;
  } catch (const Error& e) {
    throw ConfigError("checkpoint.init_from: " + std::string(e.what()));
  }
}

std::string listed(const std::vector<std::string>& names) {
  const size_t shown = 8;
  std::string s;
  for (size_t i = 0; i < names.size() && i < shown; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > shown) s += " and " + std::to_string(names.size() - shown) + " more";
  return s;
}

// The source's tensors against the whole model's (`whole`: parameter -> whole shape; the
// buffers, which a source may leave out): a ConfigError listing every mismatch, or what the
// run starts from, in one line.
std::string check_weights(const CheckpointReader& source, const std::map<std::string, std::vector<int64_t>>& whole,
                          const torch::OrderedDict<std::string, at::Tensor>& buffers, const CheckpointSpec& ck) {
  std::vector<std::string> wrong, missing, extra;
  std::set<std::string> known;
  for (const auto& [name, shape] : whole) {
    known.insert(name);
    const std::string key = "model/" + name;
    if (!source.contains(key))
      missing.push_back(name);
    else if (source.shape(key) != shape)
      wrong.push_back(name + " " + shape_str(source.shape(key)) + " there, " + shape_str(shape) + " here");
  }
  for (const auto& b : buffers) {
    known.insert(b.key());
    const std::string key = "model/" + b.key();
    if (source.contains(key) && source.shape(key) != b.value().sizes().vec())
      wrong.push_back(b.key() + " " + shape_str(source.shape(key)) + " there, " + shape_str(b.value().sizes().vec()) +
                      " here");
  }
  for (const std::string& key : source.names())
    if (!known.count(key.substr(6))) extra.push_back(key.substr(6));
  const std::string from = ck.init_from + (source.meta().contains("job") && source.meta()["job"].is_string()
                                               ? " (job \"" + source.meta()["job"].get<std::string>() + "\", step " +
                                                     std::to_string(source.step()) + ")"
                                               : " (step " + std::to_string(source.step()) + ")");
  std::string problems;
  auto add = [&](const std::string& what, const std::vector<std::string>& names) {
    if (!names.empty()) problems += "; " + std::to_string(names.size()) + " " + what + ": " + listed(names);
  };
  add("of another shape", wrong);
  if (ck.init_strict) {
    add("of this model not in it", missing);
    add("in it that this model does not have", extra);
  }
  if (!problems.empty())
    throw ConfigError("checkpoint.init_from: " + from + " does not fit this model" + problems +
                      (wrong.empty() ? ". checkpoint.init_strict: false starts from the tensors that match" : ""));
  std::string note = "weights from " + from + ": " + std::to_string(whole.size() - missing.size()) + " of the model's " +
                     std::to_string(whole.size()) + " parameters";
  if (!missing.empty()) note += "; not in it, initialised as usual: " + listed(missing);
  if (!extra.empty()) note += "; in it, not in this model, left: " + listed(extra);
  return note + " (no optimizer state, no step: a run of its own)";
}

}  // namespace

std::shared_ptr<const Dataset> load_data(const JobSpec& spec, std::shared_ptr<const Dataset> given) {
  if (given) return given;
  try {
    return make_dataset(spec.data, spec.train.seed);
  } catch (const DataError& e) {
    throw DataError(std::string("data.path: ") + e.what());  // the key to change
  }
}

torch::nn::Sequential build_job_model(const Plan& plan, const DataInfo& data, const ModelFactory& own, int tensor_rank) {
  const JobSpec& spec = plan.spec();
  torch::nn::Sequential model{nullptr};
  if (own) {
    // A program's own builder may draw from torch's generator, which thread-ranks share.
    std::lock_guard<std::mutex> lock(global_rng_mutex());
    torch::manual_seed(static_cast<uint64_t>(spec.train.seed));
    model = own(data);
  } else {
    // No storage: strategies decide what is created. Under tensor parallelism, this rank's
    // parts of the split layers.
    TensorSlot slot{spec.mesh.size("tensor"), tensor_rank};
    for (const auto& cfg : plan.strategies()) cfg->shape_model(slot);
    model = model_shapes(spec.model, data, slot);
    set_recompute(model, spec.train.recompute);  // Note [Recompute]
  }
  if (!model || model->size() == 0)
    throw ConfigError("the model the program gave the trainer (TrainerOptions::model) is empty: it needs at least one layer");
  return model;
}

int64_t whole_parameters(torch::nn::Sequential& model, const Materializer& weights) {
  int64_t n = 0;
  for (const auto& p : model->named_parameters()) {
    const Placement* part = weights.placement(p.key());
    n += part ? part->whole_numel() : p.value().numel();
  }
  return n;
}

std::optional<WeightsFrom> weights_from_elsewhere(const CheckpointSpec& ck, torch::nn::Sequential& model,
                                                  const Materializer& weights) {
  if (ck.init_from.empty() || resumes_its_own(ck)) return std::nullopt;
  if (weights.given())
    throw ConfigError("checkpoint.init_from: the program's own model came with its values (TrainerOptions::model "
                      "built real tensors); init_from gives values to a model tetra builds as shapes");
  WeightsFrom from;
  from.source = std::make_shared<CheckpointReader>(weights_from(ck.init_from));
  std::map<std::string, std::vector<int64_t>> whole;  // the whole model's tensors, whatever this rank keeps
  for (const auto& p : model->named_parameters()) {
    const Placement* part = weights.placement(p.key());
    whole[p.key()] = part ? part->whole_shape() : p.value().sizes().vec();
  }
  from.note = check_weights(*from.source, whole, model->named_buffers(), ck);
  return from;
}

ModelPlan::ModelPlan(JobSpec spec, ModelFactory model, std::shared_ptr<const Dataset> data)
    : plan_(std::move(spec)), own_model_(static_cast<bool>(model)) {
  const JobSpec& s = plan_.spec();
  data_ = load_data(s, std::move(data));
  model_ = build_job_model(plan_, data_->info(), model, 0);
  const Materializer weights(*model_, static_cast<uint64_t>(s.train.seed));
  parameters_ = whole_parameters(model_, weights);
  if (std::optional<WeightsFrom> from = weights_from_elsewhere(s.checkpoint, model_, weights)) init_note_ = from->note;
  const BatchPlan batches(data_->size(Split::kTrain), s.data.batch_size, s.train.seed, s.data.shuffle);
  total_steps_ = s.train.max_steps ? *s.train.max_steps : s.train.epochs * batches.steps_per_epoch();
}

const LayerProbe& ModelPlan::probe() {
  if (!probe_) {
    compat::Autocast autocast(spec().train.precision == Precision::kBf16);
    probe_ = probe_layers(model_, data_->range(Split::kTrain, 0, 1).inputs);
    measure_kept(model_, *probe_);  // Note [Kept bytes]
  }
  return *probe_;
}

PlanInput ModelPlan::input(const Plan& plan) { return PlanInput{plan, plan.spec(), model_, *data_, probe()}; }

std::string ModelPlan::strategies_text() {
  std::string out;
  const PlanInput in = input();
  for (const auto& cfg : plan_.strategies()) out += cfg->plan(in);
  return out;
}

void ModelPlan::check() {
  if (const std::string msg = model_problems(input()); !msg.empty()) throw ConfigError(msg);
}

std::vector<RankEstimate> ModelPlan::estimate() { return estimate_ranks(input()); }

}  // namespace tetra::core
