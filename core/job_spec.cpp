// The job spec's schema: one function per section, each reading its keys through
// Section getters (Note [Config diagnostics] in config.h), then the cross-field rules.
#include "core/job_spec.h"

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <limits>
#include <set>

#include "collectives/error.h"
#include "core/plan.h"
#include "core/text.h"

namespace tetra::core {

namespace {

const std::vector<std::string> kCoreSections = {
    "name", "model", "data", "optimizer", "schedule", "train", "checkpoint", "log", "mesh",
    "collectives"};


std::string fmt(double x) {
  char buf[40];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  return buf;
}


// The keys each variant of a typed section reads (besides the common ones). Used only to
// word the error for a key that belongs to another variant: `model.channels: unknown key
// for model type mlp (channels is for cnn)`. Every other unknown key is finish()'s.
using Variants = std::vector<std::pair<std::string, std::vector<std::string>>>;

// Reports keys of other variants, then finishes the section. `type_ok` is false when the
// type itself was wrong: then keys of any variant are let be, to avoid a cascade.
void finish_typed(Section& s, const std::string& kind, const std::string& type, bool type_ok,
                  const Variants& variants) {
  std::vector<std::string> own;
  for (const auto& [t, keys] : variants)
    if (t == type) own = keys;
  std::vector<std::string> handled;
  for (const std::string& key : s.keys()) {
    if (std::find(own.begin(), own.end(), key) != own.end()) continue;
    std::vector<std::string> owners;
    for (const auto& [t, keys] : variants)
      if (t != type && std::find(keys.begin(), keys.end(), key) != keys.end()) owners.push_back(t);
    if (owners.empty()) continue;
    if (std::find(handled.begin(), handled.end(), key) != handled.end()) continue;
    handled.push_back(key);
    if (type_ok)
      s.error(key, "unknown key for " + kind + " " + type + " (" + key + " is for " +
                       join(owners, " and ") + ")");
  }
  s.finish(handled);
}

// Runs `read` and tells whether it added a diagnostic.
template <typename F>
bool clean(Section& s, F&& read) {
  size_t before = s.diagnostics().entries().size();
  read();
  return s.diagnostics().entries().size() == before;
}

double fraction(Section& s, const std::string& key, double def, bool open_low) {
  double v = s.number(key, def, 0.0, 1.0);
  if ((open_low && v <= 0.0) || v >= 1.0) {
    s.error(key, std::string("must be in ") + (open_low ? "(" : "[") + "0, 1), got " + fmt(v));
    return def;
  }
  return v;
}

ModelSpec parse_model(Section& m) {
  ModelSpec spec;
  const ModelSpec def;
  bool type_ok = clean(m, [&] { spec.type = m.choice("type", def.type, {"mlp", "cnn", "gpt"}); });
  const std::vector<std::string> activations = {"relu", "gelu", "tanh"};
  if (spec.type == "mlp") {
    spec.hidden = m.integers("hidden", def.hidden, 1);
    spec.activation = m.choice("activation", def.activation, activations);
    spec.dropout = fraction(m, "dropout", def.dropout, false);
  } else if (spec.type == "cnn") {
    spec.channels = m.integers("channels", def.channels, 1);
    if (spec.channels.empty()) {
      m.error("channels", "must not be empty (a cnn needs at least one conv block)");
      spec.channels = def.channels;
    }
    spec.hidden = m.integers("hidden", {128}, 1);
    spec.activation = m.choice("activation", def.activation, activations);
    spec.dropout = fraction(m, "dropout", def.dropout, false);
  } else {  // gpt
    spec.layers = m.integer("layers", def.layers, 1);
    spec.heads = m.integer("heads", def.heads, 1);
    spec.d_model = m.integer("d_model", def.d_model, 1);
    spec.d_ff = m.integer("d_ff", def.d_ff, 0);
    if (spec.d_ff == 0) spec.d_ff = 4 * spec.d_model;
    spec.dropout = fraction(m, "dropout", def.dropout, false);
    if (spec.d_model % spec.heads != 0)
      m.error("heads", std::to_string(spec.heads) + " heads do not divide model.d_model " +
                           std::to_string(spec.d_model) + " (d_model must be a multiple of heads)");
  }
  finish_typed(m, "model type", spec.type, type_ok,
               {{"mlp", {"type", "hidden", "activation", "dropout"}},
                {"cnn", {"type", "channels", "hidden", "activation", "dropout"}},
                {"gpt", {"type", "layers", "heads", "d_model", "d_ff", "dropout"}}});
  return spec;
}

DataSpec parse_data(Section& d) {
  DataSpec spec;
  const DataSpec def;
  bool type_ok = clean(d, [&] {
    spec.type = d.choice("type", def.type, {"fashion-mnist", "text", "synthetic"});
  });
  spec.batch_size = d.integer("batch_size", def.batch_size, 1);
  spec.eval_batch_size = d.integer("eval_batch_size", def.eval_batch_size, 1);
  spec.eval_samples = d.integer("eval_samples", def.eval_samples, 0);
  spec.shuffle = d.boolean("shuffle", def.shuffle);
  if (spec.type == "fashion-mnist") {
    spec.path = d.string("path", def.path);
    if (spec.path.empty()) {
      d.error("path", "must not be empty (the folder with the Fashion-MNIST IDX files)");
      spec.path = def.path;
    }
  } else if (spec.type == "text") {
    bool given = d.has("path");
    spec.path = d.string("path", "");
    if (!given)
      d.error("path", "required for data type text (the text file to train on)");
    else if (spec.path.empty())
      d.error("path", "must not be empty");
    spec.seq_len = d.integer("seq_len", def.seq_len, 1);
    spec.test_fraction = fraction(d, "test_fraction", def.test_fraction, true);
  } else {  // synthetic
    spec.shape = d.integers("shape", def.shape, 1);
    if (spec.shape.empty()) {
      d.error("shape", "must not be empty (the shape of one input, e.g. [784] or [1, 28, 28])");
      spec.shape = def.shape;
    }
    spec.classes = d.integer("classes", def.classes, 2);
    spec.train_samples = d.integer("train_samples", def.train_samples, 1);
    spec.test_samples = d.integer("test_samples", def.test_samples, 1);
  }
  const std::vector<std::string> common = {"type", "batch_size", "eval_batch_size", "eval_samples",
                                           "shuffle"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), common.begin(), common.end());
    return extra;
  };
  finish_typed(d, "data type", spec.type, type_ok,
               {{"fashion-mnist", with({"path"})},
                {"text", with({"path", "seq_len", "test_fraction"})},
                {"synthetic", with({"shape", "classes", "train_samples", "test_samples"})}});
  return spec;
}

OptimizerSpec parse_optimizer(Section& o) {
  OptimizerSpec spec;
  const OptimizerSpec def;
  bool type_ok = clean(o, [&] {
    spec.type = o.choice("type", def.type, {"sgd", "adam", "adamw"});
  });
  spec.lr = o.positive_number("lr", def.lr);
  spec.weight_decay = o.number("weight_decay", def.weight_decay, 0.0);
  spec.clip_grad_norm = o.number("clip_grad_norm", def.clip_grad_norm, 0.0);
  if (spec.type == "sgd") {
    spec.momentum = fraction(o, "momentum", def.momentum, false);
    spec.nesterov = o.boolean("nesterov", def.nesterov);
    if (spec.nesterov && spec.momentum <= 0.0)
      o.error("nesterov", "requires optimizer.momentum > 0, got momentum " + fmt(spec.momentum));
  } else {
    std::vector<double> betas = o.numbers("betas", {def.beta1, def.beta2});
    if (betas.size() != 2) {
      o.error("betas", "expected a list of 2 numbers [beta1, beta2], got " +
                           std::to_string(betas.size()) +
                           (betas.size() == 1 ? " number" : " numbers"));
    } else {
      bool ok = true;
      for (size_t i = 0; i < 2; ++i) {
        if (betas[i] < 0.0 || betas[i] >= 1.0) {
          o.error("betas",
                  "beta" + std::to_string(i + 1) + " must be in [0, 1), got " + fmt(betas[i]));
          ok = false;
        }
      }
      if (ok) {
        spec.beta1 = betas[0];
        spec.beta2 = betas[1];
      }
    }
    spec.eps = o.positive_number("eps", def.eps);
  }
  const std::vector<std::string> common = {"type", "lr", "weight_decay", "clip_grad_norm"};
  std::vector<std::string> sgd = common, adam = common;
  sgd.insert(sgd.end(), {"momentum", "nesterov"});
  adam.insert(adam.end(), {"betas", "eps"});
  finish_typed(o, "optimizer type", spec.type, type_ok,
               {{"sgd", sgd}, {"adam", adam}, {"adamw", adam}});
  return spec;
}

ScheduleSpec parse_schedule(Section& s, const OptimizerSpec& opt) {
  ScheduleSpec spec;
  const ScheduleSpec def;
  bool type_ok = clean(s, [&] {
    spec.type = s.choice("type", def.type, {"constant", "cosine", "linear"});
  });
  spec.warmup_steps = s.integer("warmup_steps", def.warmup_steps, 0);
  if (spec.type != "constant") {
    spec.min_lr = s.number("min_lr", def.min_lr, 0.0);
    if (spec.min_lr > opt.lr)
      s.error("min_lr", fmt(spec.min_lr) + " is above optimizer.lr " + fmt(opt.lr) +
                            " (the decay ends at min_lr, so it must be <= lr)");
    spec.decay_steps = s.integer("decay_steps", def.decay_steps, 0);
  }
  finish_typed(s, "schedule type", spec.type, type_ok,
               {{"constant", {"type", "warmup_steps"}},
                {"cosine", {"type", "warmup_steps", "min_lr", "decay_steps"}},
                {"linear", {"type", "warmup_steps", "min_lr", "decay_steps"}}});
  return spec;
}

TrainSpec parse_train(Section& t) {
  TrainSpec spec;
  const TrainSpec def;
  spec.epochs = t.integer("epochs", def.epochs, 1);
  spec.max_steps = t.optional_integer("max_steps", 1);
  spec.eval_every = t.integer("eval_every", def.eval_every, 0);
  spec.seed = t.integer("seed", def.seed);
  spec.threads =
      static_cast<int>(t.integer("threads", def.threads, 0, std::numeric_limits<int>::max()));
  spec.precision = t.word("precision", def.precision, precision_names());
  spec.device = t.word("device", def.device, device_names());
  // Bounded like pipeline.micro_batches: the plan multiplies it by the data ranks, and an
  // unbounded value overflowed that product (a division by zero in `train --check`).
  spec.accumulation_steps = t.integer("accumulation_steps", def.accumulation_steps, 1, 1 << 20);
  spec.on_nonfinite = t.word("on_nonfinite", def.on_nonfinite, on_nonfinite_names());
  t.finish();
  return spec;
}

CheckpointSpec parse_checkpoint(Section& c) {
  CheckpointSpec spec;
  spec.dir = c.string("dir", "ckpt");  // in the run folder (Note [One run folder]); "" = off
  spec.every_steps = c.integer("every_steps", 0, 0);
  spec.keep = c.integer("keep", 3, 1);
  spec.resume = c.string("resume", "auto");
  if (spec.resume.empty()) {
    c.error("resume", "must be auto, never or the path of a checkpoint, got \"\"");
    spec.resume = "auto";
  }
  spec.safetensors = c.string("safetensors", "");
  spec.on_error = c.word("on_error", spec.on_error, on_checkpoint_error_names());
  c.finish();
  return spec;
}

LogSpec parse_log(Section& l, const std::string& name) {
  LogSpec spec;
  spec.metrics = l.string("metrics", "metrics.jsonl");  // in the run folder; "" = off
  spec.every = l.integer("every", 50, 1);
  spec.trace = l.string("trace", "");
  spec.progress = l.choice("progress", "auto", {"auto", "line", "plain", "off"});
  spec.dir = l.string("dir", "runs/" + name);
  spec.tensorboard = l.string("tensorboard", "");
  l.finish();
  return spec;
}

// mesh: {axis: size, ...}; axis names from kAxisOrder, in any order.
MeshSpec parse_mesh(Section& m) {
  std::vector<MeshAxis> axes;
  for (const std::string& name : kAxisOrder) {
    const bool given = m.has(name);  // every axis is read, so a misspelt one gets a suggestion
    const int size = static_cast<int>(m.integer(name, 1, 1, 1 << 20));
    if (given) axes.push_back({name, size});
  }
  m.finish();
  return make_mesh_spec(axes);
}

CollectivesSpec parse_collectives(Section& c) {
  CollectivesSpec spec;
  spec.backend = c.choice("backend", spec.backend, {"mpi", "gloo", "nccl"});
  spec.timeout_s = c.number("timeout_s", spec.timeout_s, 0.001);
  if (c.has("check")) spec.check = c.boolean("check", false);
  spec.stall_warning_s = c.number("stall_warning_s", spec.stall_warning_s, 0);
  spec.peer_silence_s = c.number("peer_silence_s", spec.peer_silence_s, 1);
  c.finish();
  return spec;
}

// The rules that tie sections together. Each error points at the key to change.
// The rules within core's sections; the rules across the composition (how the batch
// splits over ranks and micro-batches, ...) are the plan's (core/plan.h).
void check_cross_fields(const JobSpec& spec, Section& model, Section& data) {
  const ModelSpec& m = spec.model;
  const DataSpec& d = spec.data;
  if (m.type == "gpt" && d.type != "text") {
    model.error("type", "model type gpt needs data.type text, got data.type " + d.type);
  } else if (m.type != "gpt" && d.type == "text") {
    model.error("type", "model type " + m.type +
                            " needs data.type fashion-mnist or synthetic, got data.type text "
                            "(use model type gpt for text)");
  }
  if (m.type == "cnn" && d.type != "text") {
    std::vector<int64_t> shape = d.type == "synthetic" ? d.shape : std::vector<int64_t>{1, 28, 28};
    if (shape.size() != 3) {
      data.error("shape", "model type cnn needs an image shape [C, H, W], got " + shape_str(shape));
    } else {
      // Each conv block ends in a 2x2 max-pool, halving height and width.
      int64_t h = shape[1], w = shape[2];
      size_t blocks = 0;
      while (blocks < m.channels.size() && h / 2 >= 1 && w / 2 >= 1) {
        h /= 2;
        w /= 2;
        ++blocks;
      }
      if (blocks < m.channels.size())
        model.error("channels", std::to_string(m.channels.size()) + " conv blocks halve the " +
                                    std::to_string(shape[1]) + "x" + std::to_string(shape[2]) +
                                    " input below 1x1; use at most " + std::to_string(blocks));
    }
  }
}

std::string stem_of(const std::string& name) {
  std::string stem = std::filesystem::path(name).stem().string();
  return stem.empty() ? "job" : stem;
}

ParsedJob parse_document(ConfigDocument& doc, Diagnostics& diag, const std::string& source,
                         const std::vector<std::string>& overrides,
                         const SectionRegistry& plugins,
                         const std::function<std::string(int)>& origin_of_line = {}) {
  bool loaded = diag.ok();
  for (const std::string& o : overrides) doc.apply_override(o, diag);
  ParsedJob out;
  if (!loaded) {  // nothing to read: report the file's and the overrides' errors
    diag.throw_if_errors();
    return out;
  }
  JobSpec& spec = out.spec;
  spec.source = source;
  Section root = doc.root(diag);
  spec.name = root.string("name", stem_of(doc.name()));
  if (spec.name.empty()) {
    root.error("name", "must not be empty (it names the run's output folder)");
    spec.name = stem_of(doc.name());
  }
  Section model = root.section("model");
  spec.model = parse_model(model);
  Section data = root.section("data");
  spec.data = parse_data(data);
  Section optimizer = root.section("optimizer");
  spec.optimizer = parse_optimizer(optimizer);
  Section schedule = root.section("schedule");
  spec.schedule = parse_schedule(schedule, spec.optimizer);
  Section train = root.section("train");
  spec.train = parse_train(train);
  Section checkpoint = root.section("checkpoint");
  spec.checkpoint = parse_checkpoint(checkpoint);
  Section log = root.section("log");
  spec.log = parse_log(log, spec.name);
  Section mesh = root.section("mesh");
  spec.mesh = parse_mesh(mesh);
  Section collectives = root.section("collectives");
  spec.collectives = parse_collectives(collectives);
  check_cross_fields(spec, model, data);
  // Note [One run folder]: the written paths, resolved once, here.
  for (std::string* path : {&spec.checkpoint.dir, &spec.checkpoint.safetensors, &spec.log.metrics, &spec.log.trace,
                            &spec.log.tensorboard})
    *path = in_run_folder(spec.log.dir, *path);

  // d_ff: 0 means 4 * d_model; print what will be built.
  if (spec.model.type == "gpt") {
    YAML::Node resolved = doc.resolved();
    resolved["model"]["d_ff"] = spec.model.d_ff;
  }

  std::vector<std::string> absent;  // plugin sections the job leaves out: their strategies are off
  for (const std::string& name : plugins.names()) {
    if (!root.has(name)) absent.push_back(name);
    Section section = root.section(name);
    try {
      std::shared_ptr<const PluginConfig> cfg = plugins.at(name)(section, spec);
      if (cfg) spec.plugins[name] = std::move(cfg);
    } catch (const YAML::Exception& e) {
      section.error("", e.msg);
    } catch (const std::exception& e) {
      section.error("", e.what());
    }
  }
  // A mesh axis wider than one rank needs the strategy that owns it.
  for (const MeshAxis& a : spec.mesh.axes)
    if (a.size > 1 && plugins.owner_of_axis(a.name).empty())
      mesh.error(a.name, std::to_string(a.size) + " ranks on the " + a.name +
                             " axis need its strategy plugin, which this build does not have");
  // The composition's rules, once the sections they read are sound, each at the line of
  // the setting to change.
  if (diag.ok())
    for (const PlanIssue& issue : Plan::issues(spec)) {
      const size_t dot = issue.key.find('.');
      Section at = dot == std::string::npos ? root : root.section(issue.key.substr(0, dot));
      at.error(dot == std::string::npos ? issue.key : issue.key.substr(dot + 1), issue.message);
    }
  root.finish();
  if (origin_of_line) diag.relocate(origin_of_line);
  diag.throw_if_errors();
  out.resolved = doc.resolved();
  // A strategy's section left out of the job is not written out with its defaults: read
  // back (the run folder's job.yaml), a present section turns its strategy on, and
  // `pipeline: {micro_batches: 4}` made a one-stage pipeline of four micro-batches.
  for (const std::string& name : absent)
    if (!spec.plugins.count(name)) out.resolved.remove(name);
  out.spec.resolved = resolved_yaml(out.resolved);
  return out;
}

// Every failure leaves as a ConfigError: a bug deeper down must not surface as a bare
// yaml-cpp message or a crash of the command line tool.
template <typename F>
ParsedJob guarded(const std::string& where, F&& body) {
  try {
    return body();
  } catch (const tetra::ConfigError&) {
    throw;
  } catch (const YAML::Exception& e) {
    throw tetra::ConfigError((where.empty() ? "" : where + ": ") + "error: " + e.msg);
  } catch (const std::exception& e) {
    throw tetra::ConfigError((where.empty() ? "" : where + ": ") + "error: " + e.what());
  }
}

}  // namespace

const std::vector<std::string>& precision_names() {
  static const std::vector<std::string> names = {"fp32", "bf16"};
  return names;
}
const std::string& to_string(Precision precision) { return precision_names().at(static_cast<size_t>(precision)); }

const std::vector<std::string>& device_names() {
  static const std::vector<std::string> names = {"cpu", "cuda"};
  return names;
}
const std::string& to_string(DeviceKind device) { return device_names().at(static_cast<size_t>(device)); }

const std::vector<std::string>& on_nonfinite_names() {
  static const std::vector<std::string> names = {"stop", "skip"};
  return names;
}
const std::string& to_string(OnNonfinite action) { return on_nonfinite_names().at(static_cast<size_t>(action)); }
const std::vector<std::string>& on_checkpoint_error_names() {
  static const std::vector<std::string> names = {"stop", "warn"};
  return names;
}
const std::string& to_string(OnCheckpointError on_error) {
  return on_checkpoint_error_names().at(static_cast<size_t>(on_error));
}

// ---- writing a spec back (the C++ Plan builder) ----------------------------------------

YAML::Node yaml_number(double value) {
  char text[64];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, value);
    if (std::strtod(text, nullptr) == value) break;
  }
  std::string s = text;
  // A whole number stays a float in YAML's eyes only with a point or exponent.
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return YAML::Node(s);
}

namespace {
// Writes `key: value` unless value is the parser's default.
template <typename T>
void put(YAML::Node& node, const std::string& key, const T& value, const T& def) {
  if (!(value == def)) node[key] = value;
}
void put(YAML::Node& node, const std::string& key, double value, double def) {
  if (value != def) node[key] = yaml_number(value);
}
void put(YAML::Node& node, const std::string& key, const std::vector<double>& value, const std::vector<double>& def) {
  if (value == def) return;
  YAML::Node list(YAML::NodeType::Sequence);
  for (double v : value) list.push_back(yaml_number(v));
  list.SetStyle(YAML::EmitterStyle::Flow);
  node[key] = list;
}
}  // namespace

YAML::Node to_yaml(const ModelSpec& m) {
  YAML::Node n(YAML::NodeType::Map);
  const ModelSpec def;
  n["type"] = m.type;
  put(n, "dropout", m.dropout, def.dropout);
  if (m.type != "gpt") {
    put(n, "hidden", m.hidden, def.hidden);
    put(n, "activation", m.activation, def.activation);
  }
  if (m.type == "cnn") put(n, "channels", m.channels, def.channels);
  if (m.type == "gpt") {
    put(n, "layers", m.layers, def.layers);
    put(n, "heads", m.heads, def.heads);
    put(n, "d_model", m.d_model, def.d_model);
    put(n, "d_ff", m.d_ff, m.d_ff == 4 * m.d_model ? m.d_ff : def.d_ff);
  }
  return n;
}

YAML::Node to_yaml(const DataSpec& d) {
  YAML::Node n(YAML::NodeType::Map);
  const DataSpec def;
  n["type"] = d.type;
  put(n, "batch_size", d.batch_size, def.batch_size);
  put(n, "eval_batch_size", d.eval_batch_size, def.eval_batch_size);
  put(n, "eval_samples", d.eval_samples, def.eval_samples);
  put(n, "shuffle", d.shuffle, def.shuffle);
  if (d.type == "fashion-mnist") put(n, "path", d.path, def.path);
  if (d.type == "text") {
    n["path"] = d.path;
    put(n, "seq_len", d.seq_len, def.seq_len);
    put(n, "test_fraction", d.test_fraction, def.test_fraction);
  }
  if (d.type == "synthetic") {
    put(n, "shape", d.shape, def.shape);
    put(n, "classes", d.classes, def.classes);
    put(n, "train_samples", d.train_samples, def.train_samples);
    put(n, "test_samples", d.test_samples, def.test_samples);
  }
  return n;
}

YAML::Node to_yaml(const OptimizerSpec& o) {
  YAML::Node n(YAML::NodeType::Map);
  const OptimizerSpec def;
  n["type"] = o.type;
  put(n, "lr", o.lr, def.lr);
  put(n, "weight_decay", o.weight_decay, def.weight_decay);
  put(n, "clip_grad_norm", o.clip_grad_norm, def.clip_grad_norm);
  if (o.type == "sgd") {
    put(n, "momentum", o.momentum, def.momentum);
    put(n, "nesterov", o.nesterov, def.nesterov);
  } else {
    put(n, "betas", std::vector<double>{o.beta1, o.beta2}, std::vector<double>{def.beta1, def.beta2});
    put(n, "eps", o.eps, def.eps);
  }
  return n;
}

YAML::Node to_yaml(const ScheduleSpec& s) {
  YAML::Node n(YAML::NodeType::Map);
  const ScheduleSpec def;
  n["type"] = s.type;
  put(n, "warmup_steps", s.warmup_steps, def.warmup_steps);
  if (s.type != "constant") {
    put(n, "min_lr", s.min_lr, def.min_lr);
    put(n, "decay_steps", s.decay_steps, def.decay_steps);
  }
  return n;
}

YAML::Node to_yaml(const TrainSpec& t) {
  YAML::Node n(YAML::NodeType::Map);
  const TrainSpec def;
  put(n, "epochs", t.epochs, def.epochs);
  if (t.max_steps) n["max_steps"] = *t.max_steps;
  put(n, "eval_every", t.eval_every, def.eval_every);
  put(n, "seed", t.seed, def.seed);
  put(n, "threads", t.threads, def.threads);
  if (t.precision != def.precision) n["precision"] = to_string(t.precision);
  if (t.device != def.device) n["device"] = to_string(t.device);
  put(n, "accumulation_steps", t.accumulation_steps, def.accumulation_steps);
  if (t.on_nonfinite != def.on_nonfinite) n["on_nonfinite"] = to_string(t.on_nonfinite);
  return n;
}

// The paths are written even when empty: "" turns checkpoints (metrics) off, while an
// absent key means the default under runs/<name>/.
YAML::Node to_yaml(const CheckpointSpec& c) {
  YAML::Node n(YAML::NodeType::Map);
  const CheckpointSpec def;
  n["dir"] = c.dir;
  put(n, "every_steps", c.every_steps, def.every_steps);
  put(n, "keep", c.keep, def.keep);
  put(n, "resume", c.resume, def.resume);
  put(n, "safetensors", c.safetensors, def.safetensors);
  if (c.on_error != def.on_error) n["on_error"] = to_string(c.on_error);
  return n;
}

YAML::Node to_yaml(const LogSpec& l) {
  YAML::Node n(YAML::NodeType::Map);
  const LogSpec def;
  n["metrics"] = l.metrics;
  put(n, "every", l.every, def.every);
  put(n, "trace", l.trace, def.trace);
  put(n, "progress", l.progress, def.progress);
  n["dir"] = l.dir;
  put(n, "tensorboard", l.tensorboard, def.tensorboard);
  return n;
}

YAML::Node to_yaml(const CollectivesSpec& c) {
  YAML::Node n(YAML::NodeType::Map);
  const CollectivesSpec def;
  put(n, "backend", c.backend, def.backend);
  put(n, "timeout_s", c.timeout_s, def.timeout_s);
  if (c.check) n["check"] = *c.check;
  put(n, "stall_warning_s", c.stall_warning_s, def.stall_warning_s);
  put(n, "peer_silence_s", c.peer_silence_s, def.peer_silence_s);
  return n;
}

// ---- the registry ---------------------------------------------------------------------

std::string SectionRegistry::owner_of_axis(const std::string& axis) const {
  auto it = axis_owner_.find(axis);
  return it == axis_owner_.end() ? "" : it->second;
}

void SectionRegistry::add(const std::string& name, SectionParser parser, const std::string& axis) {
  TETRA_CHECK(!name.empty(), "a plugin section needs a name");
  TETRA_CHECK(std::find(kCoreSections.begin(), kCoreSections.end(), name) == kCoreSections.end(),
              "section name \"", name, "\" is a core section and cannot be registered");
  TETRA_CHECK(parser, "plugin section \"", name, "\" was registered without a parser");
  TETRA_CHECK(!parsers_.count(name), "plugin section \"", name, "\" is registered twice");
  parsers_.emplace(name, std::move(parser));
  if (!axis.empty()) {
    TETRA_CHECK(!axis_owner_.count(axis), "mesh axis \"", axis, "\" is owned by both ", axis_owner_[axis],
                " and ", name);
    axis_owner_[axis] = name;
  }
}

bool SectionRegistry::contains(const std::string& name) const { return parsers_.count(name) > 0; }

const SectionParser& SectionRegistry::at(const std::string& name) const {
  auto it = parsers_.find(name);
  if (it == parsers_.end()) {
    std::vector<std::string> known = names();
    throw tetra::Error("no plugin section \"" + name + "\" is registered (known: " +
                       (known.empty() ? std::string("none") : join(known)) + ")");
  }
  return it->second;
}

std::vector<std::string> SectionRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, parser] : parsers_) out.push_back(name);
  return out;
}

// ---- parsing ----------------------------------------------------------------------------

std::string in_run_folder(const std::string& run_dir, const std::string& path) {
  if (path.empty() || run_dir.empty() || std::filesystem::path(path).is_absolute()) return path;
  return (std::filesystem::path(run_dir) / path).lexically_normal().string();
}

ParsedJob parse_job_file(const std::string& path, const std::vector<std::string>& overrides,
                         const SectionRegistry& plugins) {
  return guarded(path, [&] {
    Diagnostics diag;
    ConfigDocument doc = ConfigDocument::load_file(path, diag);
    return parse_document(doc, diag, path, overrides, plugins);
  });
}

ParsedJob parse_job_string(const std::string& yaml, const std::string& name,
                           const std::vector<std::string>& overrides,
                           const SectionRegistry& plugins,
                           const std::function<std::string(int line)>& origin_of_line) {
  return guarded(name, [&] {
    Diagnostics diag;
    ConfigDocument doc = ConfigDocument::from_string(yaml, name, diag);
    return parse_document(doc, diag, "", overrides, plugins, origin_of_line);
  });
}

std::string resolved_yaml(const YAML::Node& resolved) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::set<std::string> done;
  auto emit = [&](const std::string& key) {
    YAML::Node value;
    bool found = false;
    for (auto it = resolved.begin(); it != resolved.end(); ++it) {
      if (it->first.IsScalar() && it->first.Scalar() == key) {
        value = it->second;
        found = true;
        break;
      }
    }
    if (!found || done.count(key)) return;
    done.insert(key);
    out << YAML::Key << key << YAML::Value << value;
  };
  if (resolved.IsDefined() && resolved.IsMap()) {
    for (const std::string& key : kCoreSections) emit(key);
    std::vector<std::string> rest;
    for (auto it = resolved.begin(); it != resolved.end(); ++it)
      if (it->first.IsScalar() && !done.count(it->first.Scalar()))
        rest.push_back(it->first.Scalar());
    std::sort(rest.begin(), rest.end());
    for (const std::string& key : rest) emit(key);
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace tetra::core

namespace tetra::core {

nlohmann::json job_schema(const SectionRegistry& plugins) {
  SchemaRecorder recorder;
  std::set<std::string> tried;  // "path=word" overrides parsed so far
  std::vector<std::vector<std::string>> todo = {{}};
  while (!todo.empty()) {
    const std::vector<std::string> sets = todo.back();
    todo.pop_back();
    try {
      parse_job_string("{}", "job", sets, plugins);
    } catch (const std::exception&) {
      // A variant's cross-field errors do not matter: its keys were read.
    }
    for (const auto& [path, schemas] : recorder.notes())
      for (const nlohmann::json& sc : schemas)
        if (sc.contains("$list") && tried.insert(path + "=[1]").second)
          todo.push_back({path + "=[1]"});
        else if (sc.contains("enum"))
          for (const auto& word : sc["enum"])
            if (tried.insert(path + "=" + word.get<std::string>()).second)
              todo.push_back({path + "=" + word.get<std::string>()});
  }
  nlohmann::json schema = {{"$schema", "http://json-schema.org/draft-07/schema#"},
                           {"title", "tetra job file"},
                           {"description", "Generated by `train --schema` from the job parsers (Note [Schema])."},
                           {"type", "object"},
                           {"additionalProperties", false},
                           {"properties", nlohmann::json::object()}};
  auto object = [](nlohmann::json& node) {
    if (!node.contains("properties")) {
      node["type"] = "object";
      node["additionalProperties"] = false;
      node["properties"] = nlohmann::json::object();
    }
  };
  for (const auto& [path, schemas] : recorder.notes()) {  // map order: a section before its keys
    nlohmann::json* node = &schema;
    std::stringstream parts(path);
    std::vector<std::string> names;
    for (std::string part; std::getline(parts, part, '.');) names.push_back(part);
    for (size_t i = 0; i + 1 < names.size(); ++i) {
      node = &(*node)["properties"][names[i]];
      object(*node);
    }
    nlohmann::json& leaf = (*node)["properties"][names.back()];
    // Read alike under different choices but for the default (model.hidden: mlp's
    // [1024, 1024], cnn's [128]): one schema, without a default.
    std::vector<nlohmann::json> kinds;
    for (nlohmann::json sc : schemas) {
      if (sc.contains("$list")) continue;  // the explorer's hint, not a schema
      nlohmann::json bare = sc;
      bare.erase("default");
      auto same = std::find_if(kinds.begin(), kinds.end(), [&](nlohmann::json k) {
        k.erase("default");
        return k == bare;
      });
      if (same == kinds.end())
        kinds.push_back(sc);
      else if (same->contains("default") && (!sc.contains("default") || (*same)["default"] != sc["default"]))
        same->erase("default");
    }
    const bool mapping = kinds.size() == 1 && kinds[0] == nlohmann::json{{"type", "object"}};
    if (mapping)
      object(leaf);
    else
      leaf = kinds.size() == 1 ? kinds[0] : nlohmann::json{{"anyOf", kinds}};
  }
  // Every getter reads `key: ~` (YAML null) as the key left out, its default, and a null
  // section as an empty one: the schema says so, or editors would flag what runs.
  std::function<void(nlohmann::json&)> nullable = [&](nlohmann::json& node) {
    if (node.contains("anyOf")) {
      node["anyOf"].push_back({{"type", "null"}});
      return;
    }
    if (node.contains("enum")) node["enum"].push_back(nullptr);
    if (node.contains("type") && node["type"].is_string()) node["type"] = {node["type"], "null"};
    if (node.contains("properties"))
      for (auto& [k, child] : node["properties"].items()) nullable(child);
  };
  for (auto& [k, section] : schema["properties"].items()) nullable(section);
  return schema;
}

}  // namespace tetra::core
