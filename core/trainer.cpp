#include "core/trainer.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "core/checkpoint.h"
#include "collectives/auth.h"
#include "collectives/build_config.h"
#include "collectives/error.h"
#include "collectives/topology_gather.h"
#include "collectives/hierarchical.h"
#include "core/models.h"
#include "core/preflight.h"
#include "core/random.h"
#include "core/runtime.h"
#include "core/safetensors.h"
#include "core/text.h"
#include "core/torch_compat.h"
#include "core/trace_merge.h"
#include "hardware/host.h"

namespace tetra::core {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

torch::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const torch::Tensor& state) {
  // Not while another thread-rank seeds the generator and draws its model.
  std::lock_guard<std::mutex> rank_lock(global_rng_mutex());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Rank 0's `text` on every rank of `group`.
std::string broadcast_string(collectives::Communicator& group, const std::string& text) {
  at::Tensor len = at::full({1}, static_cast<int64_t>(text.size()), at::kLong);
  group.broadcast(len)->wait();
  at::Tensor bytes = at::zeros({len.item<int64_t>()}, at::kByte);
  if (group.rank() == 0 && !text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  if (bytes.numel() == 0) return "";
  group.broadcast(bytes)->wait();
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
}

// Note [One decision per step]
// A NaN or an infinity may show up on one rank only: the rank whose shard of the batch
// holds the bad sample, the pipeline's last stage (where the loss lives), the ZeRO rank
// that owns the gradient's shard. And a stop request (Note [Stop requests]) may reach one
// rank only. After the gradients are final and before anything changes the model, every
// rank therefore puts what it saw into one allreduce (min) of four integers over every
// rank of the job (the world x replicas), and all take the same decision from the same
// numbers — step, skip the update, or stop — for one tiny collective per step:
//   kLossBad    -1 when the step's loss on this rank is not finite
//   kMicro      the first micro-batch whose loss was not finite, ordered by micro-batch
//               then data rank: (m x data ranks + data rank) x 4 + kind (1 nan, 2 inf, 3 -inf)
//   kParam      the model-order index of the first parameter whose gradient is not finite
//   kStop       minus the stop request (a signal number; the largest wins)
// kNone (the largest int64) says "nothing" in the middle two.
enum Flag { kLossBad, kMicro, kParam, kStop, kFlags };
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

int64_t loss_kind(double loss) { return std::isnan(loss) ? 1 : loss > 0 ? 2 : 3; }
const char* kind_name(int64_t kind) { return kind == 1 ? "nan" : kind == 2 ? "inf" : "-inf"; }

// The names of the parameters whose gradient holds a NaN or an infinity. One sum over
// each gradient first (the common, finite case costs one pass); a sum that overflows
// from finite values is cleared by the exact pass.
std::vector<std::string> nonfinite_gradients(const std::vector<NamedParam>& params) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> sums;
  for (const auto& p : params)
    if (p.tensor.grad().defined()) sums.push_back(p.tensor.grad().sum().to(at::kDouble));
  std::vector<std::string> out;
  if (sums.empty() || std::isfinite(at::stack(sums).sum().item<double>())) return out;
  for (const auto& p : params)
    if (p.tensor.grad().defined() && !at::isfinite(p.tensor.grad()).all().item<bool>()) out.push_back(p.name);
  return out;
}

}  // namespace

Trainer::Trainer(JobSpec spec, TrainerOptions options)
    : plan_(std::move(spec)), spec_(plan_.spec()), options_(std::move(options)) {
  // A Trainer is one rank: the replica threads of `replicate` are made by whoever starts
  // the job (tetra::run, replicate::train), never silently dropped.
  const int group = options_.replica ? options_.replica->size() : 1;
  if (!options_.dry_run && group != plan_.replicas())
    throw ConfigError("the job runs " + std::to_string(plan_.replicas()) + " replica thread" +
                      (plan_.replicas() == 1 ? "" : "s") + " per process (replicate.replicas) but this trainer got a replica group of " +
                      std::to_string(group) + "; start the job with tetra::run or replicate::train, which make the replicas");
  if (options_.world) {
    mesh_ = std::make_unique<Mesh>(options_.world, spec_.mesh, options_.replica);
    // Every rank of the job, replicas included: checkpoints write a file per rank of it.
    ranks_ = options_.replica && options_.replica->size() > 1
                 ? collectives::make_hierarchical(options_.replica->split(0, options_.replica->rank()), options_.world,
                                                  "every rank (processes x replicas)")
                 : options_.world;
    data_group_ = mesh_->axis("data");
    data_rank_ = data_group_->rank();
    data_size_ = data_group_->size();
  } else if (options_.replica && options_.replica->size() > 1) {
    throw ConfigError("the trainer got a replica group of " + std::to_string(options_.replica->size()) +
                      " but no world; replicas need the process world (a communicator of 1 for one process)");
  }
  if (options_.data) {
    data_ = options_.data;
  } else {
    try {
      data_ = make_dataset(spec_.data, spec_.train.seed);
    } catch (const DataError& e) {
      throw DataError(std::string("data.path: ") + e.what());  // the key to change
    }
  }
  if (options_.model) {
    // A program's own builder may draw from torch's generator, which thread-ranks share.
    std::lock_guard<std::mutex> lock(global_rng_mutex());
    torch::manual_seed(static_cast<uint64_t>(spec_.train.seed));
    model_ = options_.model(data_->info());
  } else {
    model_ = model_shapes(spec_.model, data_->info());  // no storage: strategies decide what is created
  }
  if (!model_ || model_->size() == 0)
    throw ConfigError("the model the program gave the trainer (TrainerOptions::model) is empty: it needs at least one layer");
  for (const auto& p : model_->named_parameters()) {
    param_index_[p.key()] = static_cast<int64_t>(param_names_.size());
    param_names_.push_back(p.key());
    params_.push_back({p.key(), p.value()});
  }
  model_parameters_ = parameter_count(*model_);
  // The whole model's layers, before a pipeline keeps only its stage's (Note [Export config]).
  for (size_t i = 0; i < model_->size(); ++i) {
    nlohmann::json params = nlohmann::json::array();
    for (const auto& p : model_->ptr(i)->named_parameters(/*recurse=*/true))
      params.push_back(std::to_string(i) + "." + p.key());
    layers_.push_back({{"index", i}, {"layer", layer_text(*model_->ptr(i))}, {"parameters", params}});
  }
  weights_ = std::make_unique<Materializer>(*model_, static_cast<uint64_t>(spec_.train.seed));
  batches_ = std::make_unique<BatchPlan>(data_->size(Split::kTrain), spec_.data.batch_size,
                                      spec_.train.seed, spec_.data.shuffle);
  total_steps_ = spec_.train.max_steps ? *spec_.train.max_steps
                                       : spec_.train.epochs * batches_->steps_per_epoch();
  schedule_ = std::make_unique<LrSchedule>(spec_.schedule, spec_.optimizer.lr, total_steps_);
  // The plan's active strategies, in its composition order (outermost first): the
  // pipeline keeps its stage's layers before the data-parallel strategy buckets their
  // gradients; the plan already left out a synchroniser whose axis another owns.
  if (!options_.dry_run)
    for (const auto& cfg : plan_.strategies())
      if (auto s = cfg->build()) strategies_.push_back(std::move(s));
  state_ = std::make_unique<TrainState>(TrainState{spec_, model_, params_, mesh_.get(), trace_, data_.get(), weights_.get()});
  for (auto& s : strategies_) {
    s->attach(*state_);
    if (s->owns_forward_backward()) {
      if (stepper_)
        throw ConfigError("strategies " + stepper_->name() + " and " + s->name() +
                          " both run the forward and backward; a job can have one of them");
      stepper_ = s.get();
    }
  }
  for (auto& s : strategies_)
    if (auto* o = dynamic_cast<ModelStateOwner*>(s.get())) owner_ = o;
  // What no strategy created is this rank's whole (one process, a pipeline's stage); a
  // dry run creates nothing.
  if (!options_.dry_run) weights_->create_all(*model_);
  // After attach: the optimizer steps (and keeps state for) the parameters this rank
  // holds — unless a strategy keeps the model state in its own layout and steps it.
  if (!owner_) optimizer_ = std::make_unique<Optimizer>(spec_.optimizer, params_);
}

ModelStateBytes Trainer::memory() const {
  if (owner_) return owner_->memory();
  // Each storage once: data parallelism's gradients are views of its buckets.
  std::set<const void*> seen;
  auto bytes = [&seen](const torch::Tensor& t) -> int64_t {
    if (!t.defined() || !seen.insert(t.storage().unsafeGetStorageImpl()).second) return 0;
    return static_cast<int64_t>(t.storage().nbytes());
  };
  ModelStateBytes m;
  for (const auto& p : params_) m.parameters += bytes(p.tensor);
  for (const auto& p : params_) m.gradients += bytes(p.tensor.grad());
  if (optimizer_)
    for (const auto& [k, v] : optimizer_->state_dict())
      if (k != "__step__") m.optimizer += bytes(v);
  return m;
}

// Note [Export config]: beside the safetensors export, what it takes to use the weights
// without the job file or tetra: the model section with its defaults resolved, the input
// it was built for and how a raw example becomes that input (DataInfo::preprocessing:
// Fashion-MNIST's scaling and normalisation, text's byte vocabulary and sequence length),
// every layer in order (its text is torch.nn's repr, so a reader builds the same
// nn.Sequential) with its parameter names, and each tensor's shape and dtype. The Hugging
// Face layout when the export is model.safetensors (config.json beside it); for another
// name, NAME.config.json beside NAME.safetensors, so that two exports in one folder keep
// their own. Every checkpoint carries the same description (meta "export"), so that
// `ckpt export` writes the config too.
nlohmann::json Trainer::export_description() const {
  const DataInfo& info = data_->info();
  return {{"framework", "tetra"},
          {"job", spec_.name},
          {"model", model_json(/*with_dropout=*/true)},
          {"input", {{"shape", info.input_shape},
                     {"dtype", info.language_model ? "int64 token ids (bytes, 0-255)" : "float32"},
                     {"classes", info.num_classes},
                     {"language_model", info.language_model},
                     {"preprocessing", info.preprocessing.is_null()
                                           ? nlohmann::json("unknown: the program's own dataset")
                                           : info.preprocessing}}},
          {"output", info.language_model ? "logits [N, seq_len, vocab] over the next byte"
                                         : "logits [N, classes]; the prediction is their argmax"},
          {"layers", layers_},
          {"parameters", model_parameters_},
          {"how", "the layers in order form the model; the tensor names are the layers' (index.parameter), as "
                  "torch.nn.Sequential.state_dict() names them. An mlp's and a cnn's layer texts are torch.nn's "
                  "reprs (Linear(in_features=784, ...), ReLU(), ...); a gpt's blocks are tetra's (core/layers.h). "
                  "tetra's C++ zoo builds it as core::build_model(ModelSpec from \"model\", DataInfo from "
                  "\"input\")"}};
}

std::string export_config_path(const std::string& safetensors_path) {
  const fs::path st(safetensors_path);
  return (st.parent_path() / (st.stem() == "model" ? std::string("config.json") : st.stem().string() + ".config.json"))
      .string();
}

void write_export_config(const std::string& safetensors_path, nlohmann::json description, const TensorMap& weights,
                         int64_t step) {
  const fs::path st(safetensors_path);
  const std::string path = export_config_path(safetensors_path);
  nlohmann::json tensors = nlohmann::json::object();
  for (const auto& [name, t] : weights)
    tensors[name] = {{"shape", t.sizes().vec()}, {"dtype", safetensors_dtype_name(t.scalar_type())}};
  description["weights"] = st.filename().string();
  description["tensors"] = tensors;
  description["step"] = step;
  write_file_atomic(path, description.dump(1) + "\n");
}

// Note [Checkpoint identity]: what makes a checkpoint's state mean something, and so must
// match to resume it: the job's name, the model (its section, but dropout, which changes
// no tensor), the data's shapes (an example's shape, the classes or vocabulary; not its
// path, as a moved dataset is the same, nor whether the program or the job made it), and
// the parameter count. The layout (mesh, ZeRO stage, pipeline cut) is not in it:
// checkpoints reshard. What may change across a resume (the optimizer's settings, the
// schedule, dropout, precision) is recorded as settings and listed when it differs.
nlohmann::json Trainer::model_json(bool with_dropout) const {
  nlohmann::json model;
  if (options_.model) {
    model["type"] = "custom";
    return model;
  }
  const ModelSpec& m = spec_.model;
  const DataInfo& info = data_->info();
  model["type"] = m.type;
  if (m.type == "gpt") {
    model.update({{"layers", m.layers}, {"heads", m.heads}, {"d_model", m.d_model},
                  {"d_ff", m.d_ff > 0 ? m.d_ff : 4 * m.d_model}, {"seq_len", info.seq_len}, {"vocab", info.num_classes}});
  } else {
    model.update({{"hidden", m.hidden}, {"activation", m.activation}});
    if (m.type == "cnn") model["channels"] = m.channels;
  }
  if (with_dropout) model["dropout"] = m.dropout;
  return model;
}

namespace {
// A short, stable name for an identity (Note [Checkpoint identity]): 16 hex digits of the
// SHA-256 of its JSON (nlohmann sorts keys, so equal identities hash alike).
std::string fingerprint(const nlohmann::json& identity) {
  return collectives::to_hex(collectives::sha256(identity.dump())).substr(0, 16);
}

// Appends "key theirs there, ours here" to `out` for each value under `at` (a key path,
// a.b) that differs, descending into objects (in key order); a missing one is "(none)".
void list_differences(const nlohmann::json& theirs, const nlohmann::json& ours, const std::string& at,
                      std::string& out) {
  if (theirs.is_object() && ours.is_object()) {
    std::set<std::string> keys;
    for (const auto& [k, v] : theirs.items()) keys.insert(k);
    for (const auto& [k, v] : ours.items()) keys.insert(k);
    for (const std::string& k : keys)
      list_differences(theirs.contains(k) ? theirs.at(k) : nlohmann::json(), ours.contains(k) ? ours.at(k) : nlohmann::json(),
                       at.empty() ? k : at + "." + k, out);
    return;
  }
  if (theirs == ours) return;
  auto text = [](const nlohmann::json& v) { return v.is_null() ? std::string("(none)") : v.dump(); };
  out += (out.empty() ? "" : ", ") + at + " " + text(theirs) + " there, " + text(ours) + " here";
}
}  // namespace

nlohmann::json Trainer::identity() const {
  const DataInfo& info = data_->info();
  return {{"model", model_json(/*with_dropout=*/false)},
          {"data", {{"input_shape", info.input_shape}, {"classes", info.num_classes},
                    {"language_model", info.language_model}}},
          {"parameters", model_parameters_}};
}

nlohmann::json Trainer::settings() const {
  const OptimizerSpec& o = spec_.optimizer;
  const ScheduleSpec& s = spec_.schedule;
  nlohmann::json j = {{"optimizer.lr", o.lr},
                      {"optimizer.weight_decay", o.weight_decay},
                      {"optimizer.clip_grad_norm", o.clip_grad_norm},
                      {"schedule.type", s.type},
                      {"schedule.warmup_steps", s.warmup_steps},
                      {"schedule.min_lr", s.min_lr},
                      {"schedule.decay_steps", s.decay_steps},
                      {"model.dropout", spec_.model.dropout},
                      {"train.precision", to_string(spec_.train.precision)},
                      {"train.accumulation_steps", spec_.train.accumulation_steps}};
  if (o.type == "sgd") {
    j["optimizer.momentum"] = o.momentum;
    j["optimizer.nesterov"] = o.nesterov;
  } else {
    j["optimizer.betas"] = {o.beta1, o.beta2};
    j["optimizer.eps"] = o.eps;
  }
  return j;
}

TensorMap Trainer::weights() {
  TensorMap weights;
  if (owner_) {
    owner_->gather_parameters(weights);
  } else {
    for (const auto& p : model_->named_parameters()) weights[p.key()] = p.value();
  }
  for (auto& s : strategies_) s->gather_state(weights);
  if (!writer()) weights.clear();
  return weights;
}

const LayerProbe& Trainer::probe() const {
  if (!probe_) {
    compat::CpuAutocast autocast(spec_.train.precision == Precision::kBf16);
    probe_ = probe_layers(const_cast<torch::nn::Sequential&>(model_), data_->range(Split::kTrain, 0, 1).inputs);
  }
  return *probe_;
}

std::string Trainer::plan() const {
  std::string out;
  PlanInput in{plan_, spec_, const_cast<torch::nn::Sequential&>(model_), *data_, probe()};
  for (const auto& cfg : plan_.strategies()) out += cfg->plan(in);
  return out;
}

std::vector<RankEstimate> Trainer::estimate() const {
  PlanInput in{plan_, spec_, const_cast<torch::nn::Sequential&>(model_), *data_, probe()};
  return estimate_ranks(in);
}

double Trainer::data_average(double v) {
  if (!data_group_ || data_size_ == 1) return v;
  at::Tensor t = at::full({1}, v, at::kDouble);
  collectives::AllreduceOptions o;
  o.op = collectives::ReduceOp::kAvg;
  data_group_->allreduce(t, o)->wait();
  return t.item<double>();
}

Trainer::~Trainer() = default;

Trainer::StepOutcome Trainer::train_step(const torch::Tensor& global_indices) {
  const int64_t micro = spec_.train.accumulation_steps;
  // This data-parallel rank's slice of the global batch.
  const torch::Tensor indices =
      data_size_ == 1 ? global_indices : BatchPlan::slice(global_indices, data_rank_, data_size_);
  const int64_t n = indices.size(0);
  // Dropout draws by each row's place in the global batch, so every split draws what one
  // process draws (Note [Layout-invariant dropout]).
  RandomContext random;
  random.seed = static_cast<uint64_t>(spec_.train.seed);
  random.step = step_;
  random.first_sample = BatchPlan::slice_begin(global_indices.size(0), data_rank_, data_size_);
  random.active = true;
  const bool bf16 = spec_.train.precision == Precision::kBf16;
  if (owner_)
    owner_->zero_grad();
  else
    optimizer_->zero_grad();
  double loss_sum = 0;
  // The first of this rank's micro-batches whose loss was not finite (-1: none), and that loss.
  int64_t bad_micro = -1;
  double bad_loss = 0;
  if (stepper_) {
    // The pipeline runs the micro-batches; the others' hooks still run before backward.
    StepInput in;
    in.indices = indices;
    in.load = [this](const torch::Tensor& idx) { return data_->get(Split::kTrain, idx); };
    in.before_backward = [this](bool last) {
      for (auto& s : strategies_)
        if (s.get() != stepper_) s->before_backward(last);
    };
    in.bf16 = bf16;
    in.random = random;
    StepOutput out = stepper_->forward_backward(in);
    loss_sum = out.loss;
    bad_micro = out.nonfinite_micro_batch;
    bad_loss = out.nonfinite_loss;
    phases_.data += out.data_s;
    phases_.forward += out.forward_s;
    phases_.backward += out.backward_s;
  }
  for (int64_t m = 0; m < (stepper_ ? 0 : micro); ++m) {
    torch::Tensor idx = micro == 1 ? indices : BatchPlan::slice(indices, m, micro);
    RandomContext::Scope random_scope(random.offset(BatchPlan::slice_begin(n, m, micro)));
    Batch batch;
    auto t = Clock::now();
    auto lap = [&t](double& into) {
      auto now = Clock::now();
      into += std::chrono::duration<double>(now - t).count();
      t = now;
    };
    {
      Trace::Scope s(trace_, "data", "batch");
      batch = data_->get(Split::kTrain, idx);
    }
    lap(phases_.data);
    // Each micro-batch's mean loss, weighted by its share, sums to the batch mean.
    const double weight = static_cast<double>(batch.size()) / static_cast<double>(n);
    torch::Tensor loss;
    {
      Trace::Scope s(trace_, "compute", "forward");
      compat::CpuAutocast autocast(bf16);
      loss = model_loss(model_->forward(batch.inputs), batch.targets);
    }
    lap(phases_.forward);
    for (auto& s : strategies_) s->before_backward(m == micro - 1);
    {
      Trace::Scope s(trace_, "compute", "backward");
      (weight == 1.0 ? loss : loss * weight).backward();
    }
    const double l = loss.item<double>();
    loss_sum += l * weight;
    if (!std::isfinite(l) && bad_micro < 0) {
      bad_micro = m;
      bad_loss = l;
    }
    lap(phases_.backward);
  }
  auto t = Clock::now();
  for (auto& s : strategies_) s->finish_gradients();
  // The step's loss over the whole global batch (equal shards: the mean of the means).
  loss_sum = data_average(loss_sum);
  StepOutcome outcome;
  outcome.loss = loss_sum;
  // Note [One decision per step]: what this rank saw, agreed over every rank.
  at::Tensor flags = at::empty({kFlags}, at::kLong);
  int64_t* f = flags.data_ptr<int64_t>();
  f[kLossBad] = std::isfinite(loss_sum) ? 0 : -1;
  f[kMicro] = bad_micro < 0 ? kNone : (bad_micro * data_size_ + data_rank_) * 4 + loss_kind(bad_loss);
  f[kParam] = first_nonfinite_gradient();
  f[kStop] = -static_cast<int64_t>(stop_requested());
  if (ranks_ && ranks_->size() > 1) {
    collectives::AllreduceOptions o;
    o.op = collectives::ReduceOp::kMin;
    ranks_->allreduce(flags, o)->wait();
  }
  outcome.stop = static_cast<int>(-f[kStop]);
  phases_.gradients += seconds_since(t);
  if (f[kLossBad] != 0 || f[kMicro] != kNone || f[kParam] != kNone) {
    // What was not finite, and where: the same words on every rank.
    std::string where = "step " + std::to_string(step_ + 1) + " (epoch " + std::to_string(epoch_ + 1) + ")";
    std::string what;
    if (f[kMicro] != kNone) {
      const int64_t m = f[kMicro] / 4 / data_size_, rank = f[kMicro] / 4 % data_size_;
      const int64_t of = plan_.micro_batches();
      if (of > 1) where += ", micro-batch " + std::to_string(m + 1) + " of " + std::to_string(of);
      if (data_size_ > 1) where += (of > 1 ? " on data rank " : ", data rank ") + std::to_string(rank);
      what = std::string("the loss is ") + kind_name(f[kMicro] % 4);
    } else if (f[kLossBad] != 0) {
      what = std::string("the loss is ") + kind_name(loss_kind(loss_sum));
    } else {
      what = "the loss is " + fmt("%.6g", loss_sum) + " but a gradient is not finite";
    }
    what += f[kParam] != kNone ? "; first parameter whose gradient is not finite: " + param_names_.at(static_cast<size_t>(f[kParam]))
                               : "; every gradient is finite";
    if (spec_.train.on_nonfinite == OnNonfinite::kStop)
      throw Error(where + ": " + what +
                  " (train.on_nonfinite: stop; lower optimizer.lr, set optimizer.clip_grad_norm, or use skip)");
    // skip: nothing of this step reaches the parameters or the optimizer state.
    if (owner_)
      owner_->zero_grad();
    else
      optimizer_->zero_grad();
    outcome.skipped = true;
    outcome.why = where + ": " + what;
    return outcome;
  }
  t = Clock::now();
  {
    Trace::Scope s(trace_, "compute", "optimizer");
    auto reduce_sq = [this](double sq) {
      for (auto& s : strategies_) sq = s->reduce_grad_norm_sq(sq);
      return sq;
    };
    if (owner_) {
      // The norm from the shards: each rank's part, summed over the axes.
      const double max_norm = spec_.optimizer.clip_grad_norm;
      if (max_norm > 0) {
        const double norm = std::sqrt(reduce_sq(owner_->grad_norm_sq()));
        if (norm > max_norm) owner_->scale_gradients(max_norm / (norm + 1e-6));
        outcome.grad_norm = norm;
      }
      owner_->step(schedule_->at(step_));
    } else {
      if (spec_.optimizer.clip_grad_norm > 0)
        outcome.grad_norm = clip_grad_norm(params_, spec_.optimizer.clip_grad_norm, reduce_sq);
      optimizer_->step(schedule_->at(step_));
    }
  }
  phases_.optimizer += seconds_since(t);
  return outcome;
}

int64_t Trainer::first_nonfinite_gradient() {
  int64_t first = kNone;
  for (const std::string& name : owner_ ? owner_->nonfinite_gradients() : nonfinite_gradients(params_)) {
    auto it = param_index_.find(name);
    if (it != param_index_.end()) first = std::min(first, it->second);
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
  const bool lm = data_->info().language_model;
  const bool bf16 = spec_.train.precision == Precision::kBf16;
  double loss_sum = 0;
  int64_t correct = 0, predictions = 0;
  // Every data rank runs the same number of forwards: a strategy that owns the model
  // state may communicate inside one (ZeRO-3 gathers each layer). A rank whose part ran
  // out runs one sample again and counts nothing.
  const int64_t eb = spec_.data.eval_batch_size;
  const int64_t longest = (total + data_size_ - 1) / data_size_;
  const int64_t forwards = owner_ ? (longest + eb - 1) / eb : (end - begin + eb - 1) / eb;
  for (int64_t i = 0; i < forwards; ++i) {
    const int64_t b = begin + i * eb;
    if (b >= end) {
      const int64_t k = std::min(begin, std::max<int64_t>(0, data_->size(Split::kTest) - 1));
      Batch filler = data_->range(Split::kTest, k, k + 1);
      compat::CpuAutocast autocast(bf16);
      if (!stepper_ || !stepper_->evaluate(filler, bf16)) model_->forward(filler.inputs);
      continue;
    }
    Batch batch = data_->range(Split::kTest, b, std::min(end, b + eb));
    if (stepper_) {
      if (auto sums = stepper_->evaluate(batch, bf16)) {
        loss_sum += sums->loss_sum;
        correct += sums->correct;
        predictions += sums->predictions;
        continue;
      }
    }
    torch::Tensor out;
    {
      compat::CpuAutocast autocast(bf16);
      out = model_->forward(batch.inputs);
    }
    out = out.to(torch::kFloat32);
    loss_sum += model_loss(out, batch.targets).item<double>() * static_cast<double>(batch.size());
    correct += count_correct(out, batch.targets);
    predictions += batch.targets.numel();
  }
  model_->train();
  if (data_group_ && data_size_ > 1) {
    at::Tensor sums = at::tensor({loss_sum, static_cast<double>(correct), static_cast<double>(predictions)}, at::kDouble);
    data_group_->allreduce(sums)->wait();
    loss_sum = sums[0].item<double>();
    correct = static_cast<int64_t>(sums[1].item<double>());
    predictions = static_cast<int64_t>(sums[2].item<double>());
  }
  EvalResult r;
  r.samples = total;
  r.test_loss = total ? loss_sum / static_cast<double>(total) : 0;
  if (predictions) r.accuracy = static_cast<double>(correct) / static_cast<double>(predictions);
  if (lm) r.perplexity = std::exp(r.test_loss);
  return r;
}

std::string Trainer::save_checkpoint(int64_t step, int64_t epoch, int64_t step_in_epoch) {
  Trace::Scope scope(trace_, "checkpoint", "save");
  Checkpoint ckpt;
  ckpt.step = step;
  ckpt.epoch = epoch;
  ckpt.step_in_epoch = step_in_epoch;
  for (const auto& b : model_->named_buffers()) ckpt.tensors["model/" + b.key()] = b.value();
  if (owner_) {
    // Sharded state: each rank adds its slices (collective).
    owner_->save_state(ckpt);
  } else {
    for (const auto& p : model_->named_parameters()) ckpt.tensors["model/" + p.key()] = p.value();
    for (const auto& [k, v] : optimizer_->state_dict()) ckpt.tensors["optim/" + k] = v;
  }
  // A pipeline's stages send their whole tensors to the writer (collective: every rank is here).
  for (auto& s : strategies_) s->gather_state(ckpt.tensors);
  if (writer()) {
    ckpt.tensors["rng/cpu"] = cpu_rng_state();
    ckpt.meta["job"] = spec_.name;
    ckpt.meta["identity"] = identity();  // Note [Checkpoint identity]
    ckpt.meta["fingerprint"] = fingerprint(ckpt.meta["identity"]);
    ckpt.meta["settings"] = settings();
    ckpt.meta["export"] = export_description();  // Note [Export config]: for `ckpt export`
    ckpt.meta["batch_size"] = spec_.data.batch_size;
    ckpt.meta["steps_per_epoch"] = batches_->steps_per_epoch();
    ckpt.meta["optimizer"] = spec_.optimizer.type;
    ckpt.meta["mesh"] = spec_.mesh.str();  // informative: any layout resumes it
    ckpt.meta["data_parallel_ranks"] = data_size_;
    if (best_accuracy_) ckpt.meta["best_accuracy"] = *best_accuracy_;
  } else {
    ckpt.tensors.clear();  // replicated state: the writer's copy is the one written
  }
  CheckpointStore store(spec_.checkpoint.dir, spec_.checkpoint.keep);
  std::string folder = store.save(ckpt, ranks_.get());
  return writer() ? folder : "";
}

void Trainer::restore(const CheckpointReader& ckpt) {
  const nlohmann::json& meta = ckpt.meta();
  auto expect = [&](const char* key, const nlohmann::json& now) {
    if (meta.contains(key) && meta[key] != now)
      throw ConfigError("checkpoint " + ckpt.folder() + " was written with " + key + " = " + meta[key].dump() +
                        ", this job has " + now.dump() + " (--set checkpoint.resume=never starts afresh)");
  };
  // Note [Checkpoint identity]: another job's, or another model's, is refused before any
  // tensor is read.
  if (meta.contains("job") && meta["job"].is_string() && meta["job"].get<std::string>() != spec_.name)
    throw ConfigError("checkpoint " + ckpt.folder() + " belongs to job \"" + meta["job"].get<std::string>() +
                      "\", and this job is \"" + spec_.name + "\": resuming it would go on with that job's run. "
                      "--set name=" + meta["job"].get<std::string>() + " goes on with that job; a checkpoint of "
                      "this job's own, or checkpoint.resume=never, starts this one");
  if (const nlohmann::json ours = identity(); meta.contains("fingerprint") && meta["fingerprint"] != fingerprint(ours)) {
    std::string list;  // what differs, key by key: model.hidden [1024,1024] there, [512] here
    list_differences(meta.contains("identity") ? meta["identity"] : nlohmann::json(), ours, "", list);
    throw ConfigError("checkpoint " + ckpt.folder() + " holds another model or data (" +
                      (list.empty() ? "its fingerprint differs" : list) +
                      "). --set checkpoint.resume=never starts afresh, and its saves then replace these "
                      "checkpoints; a new name keeps both runs");
  }
  // What may differ, listed in one line by the run.
  resume_changes_.clear();
  if (meta.contains("settings") && meta["settings"].is_object()) {
    const nlohmann::json now = settings();
    for (const auto& [key, was] : meta["settings"].items())
      if (now.contains(key) && now[key] != was)
        resume_changes_ += (resume_changes_.empty() ? "" : ", ") + key + " " + was.dump() + " -> " + now[key].dump();
  }
  expect("batch_size", spec_.data.batch_size);
  expect("steps_per_epoch", batches_->steps_per_epoch());
  expect("optimizer", spec_.optimizer.type);
  torch::NoGradGuard no_grad;
  // Every tensor is checked before any is changed: a checkpoint that does not fit the
  // model leaves it as it was.
  auto check = [&](const std::string& name, const torch::Tensor& t) {
    ckpt.expect_shape("model/" + name, t.sizes(), "model tensor " + name);
  };
  auto buffers = model_->named_buffers();
  for (auto& b : buffers) check(b.key(), b.value());
  if (owner_) {
    owner_->load_state(ckpt);  // checks its own tensors first
  } else {
    auto params = model_->named_parameters();
    for (auto& p : params) check(p.key(), p.value());
    std::map<std::string, torch::Tensor> opt;
    for (const auto& name : ckpt.names())
      if (name.rfind("optim/", 0) == 0) opt[name.substr(6)] = ckpt.read(name);
    for (auto& p : params) p.value().copy_(ckpt.read("model/" + p.key()).view(p.value().sizes()));
    optimizer_->load_state_dict(opt);
  }
  for (auto& b : buffers) b.value().copy_(ckpt.read("model/" + b.key()).view(b.value().sizes()));
  if (ckpt.contains("rng/cpu")) set_cpu_rng_state(ckpt.read("rng/cpu"));
  step_ = ckpt.step();
  epoch_ = ckpt.epoch();
  step_in_epoch_ = ckpt.step_in_epoch();
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

// Note [Run folder]
// log.dir (runs/<name> by default) is where a run leaves what a person or a tool reads
// afterwards (`report RUN_DIR` renders it as one page):
//   job.yaml      the job as parsed, --set applied, every default written out; written
//                 by the writer when the run starts (a run killed later still has it).
//   summary.json  written by the writer when the run ends: the result, where the metrics
//                 and traces are, and one entry per rank (RankCounter below): its model
//                 state and peak RSS, its mean step split into phases, its seconds of
//                 communication per mesh axis, its pipeline bubble. Gathering the ranks'
//                 entries is one collective at the end; a run that failed or was
//                 preempted has no summary.json, which says it did not finish.
//   metrics.jsonl, trace.rank<N>.json, flight/, ckpt/, model.safetensors and its
//                 config.json: the job's relative paths are taken inside log.dir (Note
//                 [One run folder] in job_spec.h; the trace and the export are off unless
//                 named).
//
// Note [Per-rank records]
// A train record carries what differs between ranks, gathered to the writer by one
// allgather of a few doubles per record (every rank logs at the same steps, so every
// rank joins): each rank's model state and peak RSS, and over the interval since the
// last record its pipeline bubble (the seconds it waited on its neighbours out of the
// seconds its schedules ran) and its communication time per mesh axis (the axis
// communicator's busy_seconds(), Note [Traffic counters]). The record's `comm_ms` (per
// step) and `pipeline_bubble` are the means over the ranks; `ranks` lists each rank's
// numbers, for worlds of up to kRanksInRecords ranks (a record of thousands would be
// larger than the rest of the file); summary.json always has every rank. A job that keeps
// no records (log.metrics and log.tensorboard both "") gathers nothing; one without a
// run folder (log.dir "") skips the summary's gather.
namespace {

// The slots of a rank's counters: memory now, then times summed since the loop began.
enum RankCounter {
  kParameters, kGradients, kOptimizerState, kBuffers, kPeakRss,  // bytes, now
  kData, kForward, kBackward, kGradientSync, kOptimizerStep,    // seconds, summed
  kIdleWait, kIdleWall,                                          // the pipeline's bubble
  kStepsTaken,
  kAxisBusy  // then one per comm axis: seconds its communicator was in use
};
constexpr size_t kRanksInRecords = 256;

// Times since `before`, memory as it is now.
std::vector<double> since(std::vector<double> now, const std::vector<double>& before) {
  for (size_t i = kData; i < now.size(); ++i) now[i] -= before[i];
  return now;
}

// One trace per rank when there are several: trace.json -> trace.rank1.json beside it.
std::string rank_trace_path(const std::string& trace, int rank, int world) {
  return trace.empty() || world == 1 ? trace : rank_trace_file(trace, rank);
}

double bubble_of(const std::vector<double>& c) { return c[kIdleWall] > 0 ? c[kIdleWait] / c[kIdleWall] : -1; }

// The record's share of Note [Per-rank records]: `ranks` holds every rank's counters over
// the interval (memory as it is now).
void add_rank_fields(nlohmann::json& rec, const std::vector<std::vector<double>>& ranks,
                     const std::vector<std::string>& axes) {
  const double steps = std::max(1.0, ranks[0][kStepsTaken]);
  if (!axes.empty()) {
    nlohmann::json comm = nlohmann::json::object();
    for (size_t a = 0; a < axes.size(); ++a) {
      double sum = 0;
      for (const auto& c : ranks) sum += c[kAxisBusy + a];
      comm[axes[a]] = sum / static_cast<double>(ranks.size()) * 1e3 / steps;
    }
    rec["comm_ms"] = comm;
  }
  double bubble = 0;
  int staged = 0;
  for (const auto& c : ranks)
    if (bubble_of(c) >= 0) bubble += bubble_of(c), ++staged;
  if (staged > 0) rec["pipeline_bubble"] = bubble / staged;
  if (ranks.size() < 2 || ranks.size() > kRanksInRecords) return;
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& c : ranks) {
    nlohmann::json row = {{"model_state_bytes", static_cast<int64_t>(c[kParameters] + c[kGradients] + c[kOptimizerState] + c[kBuffers])},
                          {"peak_rss_bytes", static_cast<int64_t>(c[kPeakRss])}};
    if (bubble_of(c) >= 0) row["pipeline_bubble"] = bubble_of(c);
    rows.push_back(row);
  }
  rec["ranks"] = rows;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

std::vector<double> Trainer::rank_counters(const ModelStateBytes& m) const {
  Strategy::Idle idle;
  for (const auto& s : strategies_) {
    const Strategy::Idle i = s->idle();
    idle.wait_s += i.wait_s;
    idle.wall_s += i.wall_s;
  }
  std::vector<double> c = {static_cast<double>(m.parameters), static_cast<double>(m.gradients),
                           static_cast<double>(m.optimizer), static_cast<double>(m.buffers),
                           static_cast<double>(hardware::peak_rss_bytes()),
                           phases_.data, phases_.forward, phases_.backward, phases_.gradients, phases_.optimizer,
                           idle.wait_s, idle.wall_s, static_cast<double>(step_)};
  for (const std::string& a : comm_axes_) c.push_back(mesh_->axis(a)->busy_seconds());
  return c;
}

std::vector<std::vector<double>> Trainer::gather_counters(const std::vector<double>& mine) {
  if (!ranks_ || ranks_->size() == 1) return {mine};
  const int64_t n = static_cast<int64_t>(mine.size());
  at::Tensor in = at::tensor(mine, at::kDouble);
  at::Tensor out = at::empty({ranks_->size() * n}, at::kDouble);
  ranks_->allgather(in, out)->wait();
  const double* p = out.data_ptr<double>();
  std::vector<std::vector<double>> all;
  for (int r = 0; r < ranks_->size(); ++r) all.emplace_back(p + r * n, p + (r + 1) * n);
  return all;
}

void Trainer::write_run_start() const {
  if (spec_.resolved.empty()) return;
  try {
    write_file_atomic((fs::path(spec_.log.dir) / "job.yaml").string(), spec_.resolved);
  } catch (const Error& e) {
    throw Error(std::string("log.dir: ") + e.what() + " (set log.dir to a folder this run may write, or \"\" for none)");
  }
}

void Trainer::write_summary(const TrainResult& r, const std::vector<std::vector<double>>& ranks,
                            const std::vector<std::string>& hosts, const std::string& trace_path) const {
  auto absolute = [](const std::string& p) { return p.empty() ? p : fs::absolute(p).lexically_normal().string(); };
  nlohmann::json j;
  j["job"] = spec_.name;
  j["tetra"] = TETRA_VERSION;
  j["commit"] = TETRA_GIT_COMMIT;
  j["started"] = started_at_;
  j["finished"] = utc_now();
  j["world"] = ranks_ ? ranks_->size() : 1;  // ranks: processes x replica threads
  j["processes"] = plan_.process_count();
  j["replicas"] = plan_.replicas();
  j["mesh"] = nlohmann::json::object();
  for (const MeshAxis& a : spec_.mesh.axes) j["mesh"][a.name] = a.size;
  j["metrics"] = absolute(spec_.log.metrics);
  j["job_yaml"] = spec_.resolved.empty() ? "" : "job.yaml";
  // The files Trace::write left: trace.json alone, else one per rank beside it.
  nlohmann::json traces = nlohmann::json::array();
  if (!trace_path.empty())
    for (size_t i = 0; i < ranks.size(); ++i)
      traces.push_back(absolute(rank_trace_path(spec_.log.trace, static_cast<int>(i), static_cast<int>(ranks.size()))));
  j["traces"] = traces;
  j["steps"] = r.steps;
  j["final_step"] = r.final_step;
  j["skipped_steps"] = r.skipped_steps;
  j["train_seconds"] = r.train_seconds;
  j["total_seconds"] = r.total_seconds;
  j["samples_per_s"] = r.samples_per_s;
  j["final_loss"] = r.final_loss;
  j["resumed_from"] = r.resumed_from;
  j["checkpoint"] = r.checkpoint;
  j["final_eval"] = nullptr;
  if (r.final_eval) {
    j["final_eval"] = {{"test_loss", r.final_eval->test_loss}};
    if (r.final_eval->accuracy) j["final_eval"]["test_accuracy"] = *r.final_eval->accuracy;
    if (r.final_eval->perplexity) j["final_eval"]["perplexity"] = *r.final_eval->perplexity;
  }
  nlohmann::json rows = nlohmann::json::array();
  for (size_t i = 0; i < ranks.size(); ++i) {
    const std::vector<double>& c = ranks[i];
    const double steps = std::max(1.0, c[kStepsTaken]);
    auto bytes = [&](RankCounter k) { return static_cast<int64_t>(c[k]); };
    nlohmann::json row = {
        {"rank", i},
        {"host", i < hosts.size() ? hosts[i] : hardware::hostname()},
        {"model_state_bytes",
         {{"parameters", bytes(kParameters)}, {"gradients", bytes(kGradients)}, {"optimizer", bytes(kOptimizerState)},
          {"buffers", bytes(kBuffers)},
          {"total", bytes(kParameters) + bytes(kGradients) + bytes(kOptimizerState) + bytes(kBuffers)}}},
        {"peak_rss_bytes", bytes(kPeakRss)},
        {"step_ms",
         {{"data", c[kData] * 1e3 / steps}, {"forward", c[kForward] * 1e3 / steps}, {"backward", c[kBackward] * 1e3 / steps},
          {"gradients", c[kGradientSync] * 1e3 / steps}, {"optimizer", c[kOptimizerStep] * 1e3 / steps}}},
        {"comm_s", nlohmann::json::object()}};
    row["comm_ms"] = nlohmann::json::object();  // per step, as step_ms
    for (size_t a = 0; a < comm_axes_.size(); ++a) {
      row["comm_s"][comm_axes_[a]] = c[kAxisBusy + a];
      row["comm_ms"][comm_axes_[a]] = c[kAxisBusy + a] * 1e3 / steps;
    }
    if (bubble_of(c) >= 0) row["pipeline_bubble"] = bubble_of(c);
    rows.push_back(row);
  }
  j["ranks"] = rows;
  // The run is done and its results are elsewhere: a summary that cannot be written
  // (the disk filled up since job.yaml was) is a warning, not a failed run.
  const std::string path = (fs::path(spec_.log.dir) / "summary.json").string();
  try {
    write_file_atomic(path, j.dump(2) + "\n");
  } catch (const Error& e) {
    std::fprintf(stderr, "warning: log.dir: the run's summary was not written: %s\n", e.what());
  }
}

TrainResult Trainer::run() {
  if (options_.on_start) options_.on_start(*this);
  const auto t_start = Clock::now();
  started_at_ = utc_now();
  const auto& ck = spec_.checkpoint;
  const bool checkpoints = !ck.dir.empty();
  const bool write = writer();  // rank 0 writes the replicated state and the logs
  const int world_rank = ranks_ ? ranks_->rank() : 0;
  const int world_size = ranks_ ? ranks_->size() : 1;
  const std::string trace_path = rank_trace_path(spec_.log.trace, world_rank, world_size);
  if (!trace_path.empty()) trace_.enable(world_rank, spec_.name + " rank " + std::to_string(world_rank));

  // Note [Preflight]: room for one checkpoint, on every rank (each writes its part).
  if (checkpoints)
    if (const std::string problem = space_problem(spec_, model_parameters_); !problem.empty())
      throw ConfigError(problem);

  // Resume: auto takes the newest intact checkpoint in checkpoint.dir when there is one.
  if (ck.resume != "never") {
    if (ck.resume != "auto" && !CheckpointStore::resolve(ck.resume))
      throw ConfigError("checkpoint.resume: no checkpoint at " + ck.resume);
    // Rank 0 decides which checkpoint every rank resumes (the ranks could otherwise see
    // the folder at different moments of a save, or through different mounts), after
    // checking its every file's size and CRC-32C: auto skips a damaged one with a warning
    // for the one before; an explicit path that is damaged is an error. The decision
    // travels as the folder, or as "\n" + the error that every rank then throws.
    std::string from;
    std::optional<CheckpointReader> verified;  // rank 0's: its files read and checked once
    if (world_rank == 0) {
      try {
        if (ck.resume != "auto") {
          verified.emplace(ck.resume);
          verified->verify();
        } else if (checkpoints) {
          std::vector<std::string> skipped;
          verified = CheckpointStore(ck.dir, ck.keep).latest_intact(&skipped);
          const std::string then = verified ? "resuming from " + fs::path(verified->folder()).filename().string()
                                            : "no intact checkpoint is left: starting afresh";
          for (const auto& why : skipped) std::fprintf(stderr, "warning: %s; %s\n", why.c_str(), then.c_str());
        }
        if (verified) from = verified->folder();
      } catch (const Error& e) {
        from = std::string("\n") + e.what();
      }
    }
    if (ranks_ && ranks_->size() > 1) from = broadcast_string(*ranks_, from);
    if (!from.empty() && from[0] == '\n') throw Error(from.substr(1));
    if (!from.empty()) {
      if (!verified) verified.emplace(from);
      restore(*verified);
    }
    verified.reset();  // its files stay open while it lives; keep: N may delete the folder later
  }

  MetricsWriter metrics;
  if (write && !spec_.log.metrics.empty()) metrics.open(spec_.log.metrics, !resumed_from_.empty());
  if (write && !spec_.log.tensorboard.empty())
    metrics.open_tensorboard(spec_.log.tensorboard, resumed_from_.empty() ? -1 : step_);
  if (write && !spec_.log.dir.empty()) write_run_start();
  Progress progress(write ? spec_.log.progress : "off", spec_.log.every, options_.out);
  if (!resumed_from_.empty())
    progress.message("resumed from " + resumed_from_ + " at step " + std::to_string(step_) +
                     (resume_changes_.empty() ? "" : "; changed since it was written: " + resume_changes_));

  TrainResult result;
  result.resumed_from = resumed_from_;
  const int64_t spe = batches_->steps_per_epoch();
  const int64_t epochs_shown = (total_steps_ + spe - 1) / spe;
  const int64_t eval_every = spec_.train.eval_every;
  double train_seconds = 0, interval_seconds = 0;
  int64_t interval_samples = 0;
  std::string last_checkpoint;
  int64_t last_saved = resumed_from_.empty() ? -1 : step_;  // a resumed step is on disk
  int64_t checkpoint_failures = 0;
  // Every rank saves (a collective); a failed save is the same CheckpointSaveError on every
  // rank, so all take the same checkpoint.on_error decision.
  auto save_now = [&] {
    try {
      std::string saved = save_checkpoint(step_, epoch_, step_in_epoch_);
      if (write) last_checkpoint = saved;
    } catch (const CheckpointSaveError& e) {
      if (ck.on_error == OnCheckpointError::kStop) throw;
      ++checkpoint_failures;
      if (write) {
        std::fprintf(stderr, "warning: %s (checkpoint.on_error: warn, training goes on)\n", e.what());
        metrics.write({{"step", step_}, {"checkpoint_failures", checkpoint_failures},
                       {"checkpoint_error", e.what()}});
      }
    }
  };

  auto run_eval = [&](int64_t step) {
    EvalResult e = evaluate();
    nlohmann::json rec = {{"step", step}, {"epoch", epoch_}, {"eval", true}, {"test_loss", e.test_loss},
                          {"time_s", seconds_since(t_start)}};
    std::string line = "eval  step " + std::to_string(step) + "  test_loss " + fmt("%.4f", e.test_loss);
    if (e.perplexity) {
      rec["perplexity"] = *e.perplexity;
      rec["test_accuracy"] = *e.accuracy;
      line += "  perplexity " + fmt("%.3f", *e.perplexity) + "  next-byte accuracy " + fmt("%.2f%%", 100 * *e.accuracy);
    } else if (e.accuracy) {
      rec["test_accuracy"] = *e.accuracy;
      line += "  accuracy " + fmt("%.2f%%", 100 * *e.accuracy);
      if (!best_accuracy_ || *e.accuracy > *best_accuracy_) best_accuracy_ = e.accuracy;
    }
    metrics.write(rec);
    progress.message(line);
    return e;
  };

  comm_axes_.clear();
  // Mesh::size counts replica threads in the data axis: a job of replicas alone syncs there.
  for (const std::string& a : kAxisOrder)
    if (mesh_ && mesh_->size(a) > 1) comm_axes_.push_back(a);
  const bool records_kept = !spec_.log.metrics.empty() || !spec_.log.tensorboard.empty();
  const std::vector<double> start_counters = rank_counters(memory());  // the loop's, not the set-up's
  std::vector<double> logged_counters = start_counters;

  model_->train();
  std::optional<EvalResult> last_eval;
  int64_t last_eval_step = -1;
  while (step_ < total_steps_) {
    if (step_in_epoch_ >= spe) {
      ++epoch_;
      step_in_epoch_ = 0;
    }
    const auto t0 = Clock::now();
    torch::Tensor indices = batches_->global_batch(epoch_, step_in_epoch_);
    const double lr = schedule_->at(step_);
    const double step_begin_us = trace_.enabled() ? trace_.now_us() : 0;
    const StepOutcome outcome = train_step(indices);
    // A span per step: report and Perfetto cut one step of a pipeline out by it.
    if (trace_.enabled()) trace_.span("step", "step " + std::to_string(step_ + 1), step_begin_us, trace_.now_us());
    const double loss = outcome.loss;
    // A skipped step is still a step: its batch is consumed and the step count (hence the
    // learning-rate schedule) moves on, so the run ends where it would have, on the same data.
    ++step_;
    ++step_in_epoch_;
    interval_samples += indices.size(0);
    if (outcome.skipped) {
      ++skipped_steps_;
      if (write) {
        const std::string line = "warning: " + outcome.why + "; skipped, no update (train.on_nonfinite: skip; " +
                                 std::to_string(skipped_steps_) + " skipped so far)";
        if (spec_.log.progress == "off")
          std::fprintf(stderr, "%s\n", line.c_str());
        else
          progress.message(line);
      }
    } else {
      result.losses.push_back(loss);
      result.final_loss = loss;
    }

    const bool log_now = step_ % spec_.log.every == 0 || step_ == total_steps_;
    // Training time counts everything a step costs, logging included; not eval or checkpoints.
    const double dt = seconds_since(t0);
    train_seconds += dt;
    interval_seconds += dt;
    const double sps = interval_seconds > 0 ? static_cast<double>(interval_samples) / interval_seconds : 0;
    if (log_now) {
      const ModelStateBytes m = memory();
      nlohmann::json rec = {{"step", step_}, {"epoch", epoch_}, {"loss", loss}, {"lr", lr},
                            {"samples_per_s", sps}, {"time_s", seconds_since(t_start)},
                            {"skipped_steps", skipped_steps_},
                            {"model_state_bytes", {{"parameters", m.parameters}, {"gradients", m.gradients},
                                                   {"optimizer", m.optimizer}, {"buffers", m.buffers},
                                                   {"total", m.total()}}}};
      if (outcome.skipped) rec["skipped"] = true;  // its loss is not finite: JSON null
      if (outcome.grad_norm >= 0) rec["grad_norm"] = outcome.grad_norm;
      rec["peak_rss_bytes"] = hardware::peak_rss_bytes();
      // The interval since the last record, from this rank's counters.
      const std::vector<double> now = rank_counters(m);
      const std::vector<double> interval = since(now, logged_counters);
      logged_counters = now;
      // Where the interval's steps went, per step (this rank's clock).
      const double steps = std::max(1.0, interval[kStepsTaken]);
      auto per_step = [&](RankCounter k) { return interval[k] * 1e3 / steps; };
      rec["step_ms"] = {{"data", per_step(kData)},
                        {"forward", per_step(kForward)},
                        {"backward", per_step(kBackward)},
                        {"gradients", per_step(kGradientSync)},
                        {"optimizer", per_step(kOptimizerStep)}};
      // Note [Per-rank records]: every rank joins (the job's log settings are every
      // rank's), when the records go somewhere; the writer adds what they sent.
      if (records_kept) {
        const auto ranks = gather_counters(interval);
        if (write) add_rank_fields(rec, ranks, comm_axes_);
      }
      metrics.write(rec);
    }
    Progress::Status st;
    st.step = step_;
    st.total = total_steps_;
    st.epoch = epoch_ + 1;
    st.epochs = epochs_shown;
    st.loss = loss;
    st.lr = lr;
    st.samples_per_s = sps;
    st.elapsed_s = train_seconds;
    st.peak_rss = hardware::peak_rss_bytes();
    progress.update(st);
    if (log_now) {
      interval_seconds = 0;
      interval_samples = 0;
    }
    if (options_.on_step) options_.on_step(step_, loss);

    if (outcome.stop && step_ < total_steps_) {
      // Note [Stop requests]: every rank agreed to stop after this step: its checkpoint
      // (collective; before any evaluation this step would run, which the grace period a
      // launcher gives may not cover), then out. The last step just finishes the run.
      progress.finish();
      std::string folder;
      if (checkpoints) {
        folder = save_checkpoint(step_, epoch_, step_in_epoch_);
        if (ranks_ && ranks_->size() > 1) folder = broadcast_string(*ranks_, folder);  // the writer's name for it
        set_stop_exit_status(kExitPreempted);  // a further signal: out at once, and resumable
      }
      if (!trace_path.empty()) trace_.write(trace_path);
      const std::string what = "preempted at step " + std::to_string(step_) + " (" + stop_reason(outcome.stop) + ")";
      if (folder.empty())
        throw PreemptedError(what + "; no checkpoint was written (checkpoint.dir is \"\"): a new run starts afresh", "");
      progress.message(what + ": every rank finished the step; checkpoint " + folder);
      throw PreemptedError(what + "; checkpoint " + folder, folder);
    }

    const bool epoch_end = step_in_epoch_ == spe;
    if ((eval_every > 0 && step_ % eval_every == 0) || (eval_every == 0 && epoch_end)) {
      last_eval = run_eval(step_);
      last_eval_step = step_;
    }
    if (checkpoints && ck.every_steps > 0 && step_ % ck.every_steps == 0 && step_ < total_steps_) {
      save_now();
      last_saved = step_;
    }
  }
  progress.finish();
  if (last_eval_step != step_) last_eval = run_eval(step_);
  if (checkpoints && last_saved != step_) save_now();
  if (!ck.safetensors.empty()) {
    TensorMap weights = this->weights();  // collective
    if (write) {
      save_safetensors(ck.safetensors, weights,
                     {{"format", "pt"}, {"framework", "tetra"}, {"model", options_.model ? "custom" : spec_.model.type},
                      {"step", std::to_string(step_)}});
      write_export_config(ck.safetensors, export_description(), weights, step_);
    }
  }
  if (!trace_path.empty()) trace_.write(trace_path);

  result.steps = static_cast<int64_t>(result.losses.size());
  result.skipped_steps = skipped_steps_;
  result.final_step = step_;
  result.train_seconds = train_seconds;
  result.total_seconds = seconds_since(t_start);
  result.samples_per_s = train_seconds > 0
                             ? static_cast<double>(result.steps * spec_.data.batch_size) / train_seconds
                             : 0;
  result.final_eval = last_eval;
  result.best_accuracy = best_accuracy_;
  result.checkpoint = last_checkpoint;
  result.phases = phases_;
  result.memory = memory();
  // Note [Run folder]: every rank's totals for the summary (collective: every rank joins).
  if (!spec_.log.dir.empty()) {
    const auto totals = gather_counters(since(rank_counters(result.memory), start_counters));
    std::vector<std::string> hosts;
    if (ranks_ && ranks_->size() > 1) {
      const collectives::HostMap map = collectives::gather_hosts(*ranks_);
      for (int h : map.host_of) hosts.push_back(map.hosts.at(static_cast<size_t>(h)));
    }
    if (write) write_summary(result, totals, hosts, trace_path);
  }
  return result;
}

}  // namespace tetra::core
