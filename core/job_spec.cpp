// The job spec's schema: each section's keys declared once (Note [Fields declared once],
// core/fields.h), read through Section getters (Note [Config diagnostics] in config.h)
// and written by the same declaration, then the cross-field rules.
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
#include "collectives/launch.h"
#include "core/fields.h"
#include "core/text.h"

namespace tetra::core {

namespace {

const std::vector<std::string> kCoreSections = {
    "name", "model", "data", "optimizer", "schedule", "train", "checkpoint", "log", "mesh",
    "collectives"};


std::string shortest(double x) {
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

double fraction(Section& s, const std::string& key, double def, bool open_low) {
  double v = s.number(key, def, 0.0, 1.0);
  if ((open_low && v <= 0.0) || v >= 1.0) {
    s.error(key, std::string("must be in ") + (open_low ? "(" : "[") + "0, 1), got " + shortest(v));
    return def;
  }
  return v;
}

// ---- the sections' keys, each declared once (Note [Fields declared once]) -----------------

// fraction() for a visitor: a number in [0, 1) (or (0, 1)), read with its own message.
template <class V>
void fraction_field(V& v, const std::string& key, double& f, bool open_low) {
  if constexpr (V::kReads)
    f = fraction(v.section(), key, f, open_low);
  else
    v.number(key, f, 0.0, 1.0);
}

template <class V>
void model_fields(V& v, ModelSpec& m) {
  v.choice("type", m.type, {"mlp", "cnn", "gpt"}, fields::kAlways);
  const std::vector<std::string> activations = {"relu", "gelu", "tanh"};
  if (m.type == "mlp") {
    v.integers("hidden", m.hidden, 1);
    v.choice("activation", m.activation, activations);
    fraction_field(v, "dropout", m.dropout, false);
  } else if (m.type == "cnn") {
    v.integers("channels", m.channels, 1);
    if constexpr (V::kReads) {
      if (m.channels.empty()) {
        v.section().error("channels", "must not be empty (a cnn needs at least one conv block)");
        m.channels = ModelSpec().channels;
      }
      m.hidden = {128};  // a cnn's dense layers, unless given
    }
    v.integers("hidden", m.hidden, 1);
    v.choice("activation", m.activation, activations);
    fraction_field(v, "dropout", m.dropout, false);
  } else {  // gpt
    v.integer("layers", m.layers, 1);
    v.integer("heads", m.heads, 1);
    v.integer("d_model", m.d_model, 1);
    v.integer("d_ff", m.d_ff, 0);
    v.boolean("head_bias", m.head_bias);
    fraction_field(v, "dropout", m.dropout, false);
    if constexpr (V::kReads) {
      if (m.d_ff == 0) m.d_ff = 4 * m.d_model;
      if (m.d_model % m.heads != 0)
        v.section().error("heads", std::to_string(m.heads) + " heads do not divide model.d_model " +
                                       std::to_string(m.d_model) + " (d_model must be a multiple of heads)");
    }
  }
}

template <class V>
void data_fields(V& v, DataSpec& d) {
  v.choice("type", d.type, {"fashion-mnist", "text", "synthetic"}, fields::kAlways);
  v.integer("batch_size", d.batch_size, 1);
  v.integer("eval_batch_size", d.eval_batch_size, 1);
  v.integer("eval_samples", d.eval_samples, 0);
  v.boolean("shuffle", d.shuffle);
  if (d.type == "fashion-mnist") {
    v.string("path", d.path);
    if constexpr (V::kReads) {
      if (d.path.empty()) {
        v.section().error("path", "must not be empty (the folder with the Fashion-MNIST IDX files)");
        d.path = DataSpec().path;
      }
    }
  } else if (d.type == "text") {
    bool given = true;
    if constexpr (V::kReads) {
      given = v.section().has("path");
      d.path = "";
    }
    v.string("path", d.path, fields::kAlways);
    if constexpr (V::kReads) {
      if (!given)
        v.section().error("path", "required for data type text (the text file to train on)");
      else if (d.path.empty())
        v.section().error("path", "must not be empty");
    }
    v.integer("seq_len", d.seq_len, 1);
    fraction_field(v, "test_fraction", d.test_fraction, true);
  } else {  // synthetic
    v.integers("shape", d.shape, 1);
    if constexpr (V::kReads) {
      if (d.shape.empty()) {
        v.section().error("shape", "must not be empty (the shape of one input, e.g. [784] or [1, 28, 28])");
        d.shape = DataSpec().shape;
      }
    }
    v.integer("classes", d.classes, 2);
    v.integer("train_samples", d.train_samples, 1);
    v.integer("test_samples", d.test_samples, 1);
  }
}

template <class V>
void optimizer_fields(V& v, OptimizerSpec& o) {
  v.choice("type", o.type, {"sgd", "adam", "adamw"}, fields::kAlways);
  v.positive("lr", o.lr);
  v.number("weight_decay", o.weight_decay, 0.0);
  v.number("clip_grad_norm", o.clip_grad_norm, 0.0);
  if (o.type == "sgd") {
    fraction_field(v, "momentum", o.momentum, false);
    v.boolean("nesterov", o.nesterov);
    if constexpr (V::kReads)
      if (o.nesterov && o.momentum <= 0.0)
        v.section().error("nesterov", "requires optimizer.momentum > 0, got momentum " + shortest(o.momentum));
  } else {
    std::vector<double> betas = {o.beta1, o.beta2};
    v.numbers("betas", betas);
    if constexpr (V::kReads) {
      if (betas.size() != 2) {
        v.section().error("betas", "expected a list of 2 numbers [beta1, beta2], got " + std::to_string(betas.size()) +
                                       (betas.size() == 1 ? " number" : " numbers"));
      } else {
        bool ok = true;
        for (size_t i = 0; i < 2; ++i) {
          if (betas[i] < 0.0 || betas[i] >= 1.0) {
            v.section().error("betas", "beta" + std::to_string(i + 1) + " must be in [0, 1), got " + shortest(betas[i]));
            ok = false;
          }
        }
        if (ok) {
          o.beta1 = betas[0];
          o.beta2 = betas[1];
        }
      }
    }
    v.positive("eps", o.eps);
  }
}

// `lr`: the optimizer's, which min_lr may not exceed (the reader's rule).
template <class V>
void schedule_fields(V& v, ScheduleSpec& s, double lr) {
  v.choice("type", s.type, {"constant", "cosine", "linear"}, fields::kAlways);
  v.integer("warmup_steps", s.warmup_steps, 0);
  if (s.type != "constant") {
    v.number("min_lr", s.min_lr, 0.0);
    if constexpr (V::kReads)
      if (s.min_lr > lr)
        v.section().error("min_lr", shortest(s.min_lr) + " is above optimizer.lr " + shortest(lr) +
                                        " (the decay ends at min_lr, so it must be <= lr)");
    v.integer("decay_steps", s.decay_steps, 0);
  }
}

template <class V>
void train_fields(V& v, TrainSpec& t) {
  v.integer("epochs", t.epochs, 1);
  v.optional_integer("max_steps", t.max_steps, 1);
  v.integer("eval_every", t.eval_every, 0);
  v.integer("seed", t.seed);
  v.integer("threads", t.threads, 0, std::numeric_limits<int>::max());
  v.word("precision", t.precision, precision_names());
  v.word("device", t.device, device_names());
  // Bounded like pipeline.micro_batches: the plan multiplies it by the data ranks, and an
  // unbounded value overflowed that product (a division by zero in `train --check`).
  v.integer("accumulation_steps", t.accumulation_steps, 1, 1 << 20);
  v.word("on_nonfinite", t.on_nonfinite, on_nonfinite_names());
  v.word("recompute", t.recompute, recompute_names());
}

// The paths are written even when empty: "" turns checkpoints off, while an absent key
// means the default in the run folder.
template <class V>
void checkpoint_fields(V& v, CheckpointSpec& c) {
  v.string("dir", c.dir, fields::kAlways);  // in the run folder (Note [One run folder]); "" = off
  v.integer("every_steps", c.every_steps, 0);
  v.integer("keep", c.keep, 1);
  v.string("resume", c.resume);
  if constexpr (V::kReads) {
    if (c.resume.empty()) {
      v.section().error("resume", "must be auto, never or the path of a checkpoint, got \"\"");
      c.resume = "auto";
    }
  }
  v.string("safetensors", c.safetensors);
  v.word("on_error", c.on_error, on_checkpoint_error_names());
  v.string("init_from", c.init_from);
  v.boolean("init_strict", c.init_strict);
}

template <class V>
void log_fields(V& v, LogSpec& l) {
  v.string("metrics", l.metrics, fields::kAlways);  // in the run folder; "" = off
  v.integer("every", l.every, 1);
  v.string("trace", l.trace);
  v.choice("progress", l.progress, {"auto", "line", "plain", "off"});
  v.string("dir", l.dir, fields::kAlways);
  v.string("tensorboard", l.tensorboard);
}

template <class V>
void collectives_fields(V& v, CollectivesSpec& c) {
  v.choice("backend", c.backend, {"auto", "mpi", "gloo", "nccl"});
  v.number("timeout_s", c.timeout_s, 0.001);
  v.optional_boolean("check", c.check);
  v.number("stall_warning_s", c.stall_warning_s, 0);
  v.number("peer_silence_s", c.peer_silence_s, 1);
}

// A typed section read by its declaration: then the keys of the other variants are
// errors that name the variant they belong to (finish_typed), listed by the same
// declaration.
template <typename S, typename Declare>
S read_typed(Section& s, const std::string& kind, const std::vector<std::string>& types, Declare&& declare) {
  S spec;
  fields::Reader r(s);
  declare(r, spec);
  Variants variants;
  for (const std::string& t : types) {
    S variant;
    variant.type = t;
    variants.push_back({t, fields::keys(variant, declare)});
  }
  finish_typed(s, kind, spec.type, !r.failed("type"), variants);
  return spec;
}

template <typename S, typename Declare>
S read_section(Section& s, S spec, Declare&& declare) {
  fields::Reader r(s);
  declare(r, spec);
  s.finish();
  return spec;
}

const auto kModel = [](auto& v, ModelSpec& m) { model_fields(v, m); };
const auto kData = [](auto& v, DataSpec& d) { data_fields(v, d); };
const auto kOptimizer = [](auto& v, OptimizerSpec& o) { optimizer_fields(v, o); };
const auto kTrain = [](auto& v, TrainSpec& t) { train_fields(v, t); };
const auto kCheckpoint = [](auto& v, CheckpointSpec& c) { checkpoint_fields(v, c); };
const auto kLog = [](auto& v, LogSpec& l) { log_fields(v, l); };
const auto kCollectives = [](auto& v, CollectivesSpec& c) { collectives_fields(v, c); };

ModelSpec parse_model(Section& m) { return read_typed<ModelSpec>(m, "model type", {"mlp", "cnn", "gpt"}, kModel); }
DataSpec parse_data(Section& d) {
  return read_typed<DataSpec>(d, "data type", {"fashion-mnist", "text", "synthetic"}, kData);
}
OptimizerSpec parse_optimizer(Section& o) {
  return read_typed<OptimizerSpec>(o, "optimizer type", {"sgd", "adam", "adamw"}, kOptimizer);
}
ScheduleSpec parse_schedule(Section& s, const OptimizerSpec& opt) {
  return read_typed<ScheduleSpec>(s, "schedule type", {"constant", "cosine", "linear"},
                                  [&](auto& v, ScheduleSpec& x) { schedule_fields(v, x, opt.lr); });
}
TrainSpec parse_train(Section& t) { return read_section(t, TrainSpec{}, kTrain); }
// The paths' defaults when the key is absent (the structs' "" means off, as a program
// that builds its spec in C++ leaves them).
CheckpointSpec parse_checkpoint(Section& c) {
  CheckpointSpec spec;
  spec.dir = "ckpt";
  return read_section(c, spec, kCheckpoint);
}
LogSpec parse_log(Section& l, const std::string& name) {
  LogSpec spec;
  spec.metrics = "metrics.jsonl";
  spec.dir = "runs/" + name;
  return read_section(l, spec, kLog);
}

// Note [Auto axis]
// mesh: {axis: size, ...}, axis names from kAxisOrder in any order, each a number of
// ranks or `auto`; data is auto unless given (torchrun, DeepSpeed and Megatron all infer
// the data-parallel size from the world). At most one axis is auto; it is the world's size
// over the product of the others, sized here, when the job is read, so that every rule
// after it (the batch over the data ranks, the plan's) sees a number. The world is the
// launch's (JobWorld): `mpirun -np 4 train configs/dp.yaml` trains on 4 data ranks, and
// `--dry-run --np 8` plans for 8. With no world to fit (one process, a dry run without
// --np) the auto axis is 1 and the mesh is what the other axes make. The job file, and the
// run folder's job.yaml, keep the word, so the job runs again on any world it divides.
MeshSpec parse_mesh(Section& m, const JobWorld& world) {
  std::vector<MeshAxis> axes;
  std::vector<std::string> autos;   // given as auto
  bool data_default = false;        // data left out: auto unless another axis is
  for (const std::string& name : kAxisOrder) {
    const bool given = m.has(name);  // every axis is read, so a misspelt one gets a suggestion
    const std::optional<int64_t> size =
        m.integer_or(name, "auto", name == "data" ? std::nullopt : std::optional<int64_t>(1), 1, 1 << 20);
    if (size) {
      if (given) axes.push_back({name, static_cast<int>(*size)});
    } else if (given) {
      autos.push_back(name);
    } else {
      data_default = true;
    }
  }
  m.finish();
  if (autos.size() > 1) {
    std::string list;
    for (const std::string& a : autos) list += (list.empty() ? "" : " and ") + a;
    m.error(autos[1], "only one axis may be auto, and " + list +
                          " are: the world fills one axis; give the other a number of ranks");
    autos.resize(1);
  }
  MeshSpec spec = make_mesh_spec(axes);
  const std::string axis = !autos.empty() ? autos[0] : data_default ? "data" : "";
  if (axis.empty()) return spec;
  const int others = spec.world_size();
  int size = 1;
  if (world.size > 0) {
    if (world.size % others != 0) {  // others > 1 here: spec has an axis, and str() its equation
      const std::string origin = world.origin.empty() ? "" : " (" + world.origin + ")";
      m.error(axis, "auto: " + axis + " = world / (" + spec.str() + ") = " + std::to_string(world.size) + " / " +
                        std::to_string(others) + ", which is not a whole number of ranks: the world has " +
                        std::to_string(world.size) + origin + ". Launch a multiple of " + std::to_string(others) +
                        " processes, or make the other axes' product divide " + std::to_string(world.size));
      return spec;
    }
    size = world.size / others;
  }
  if (size > 1 || !autos.empty()) axes.push_back({axis, size});  // a data axis of 1 left out stays out
  MeshSpec sized = make_mesh_spec(axes);
  sized.auto_axis = axis;
  return sized;
}

CollectivesSpec parse_collectives(Section& c) { return read_section(c, CollectivesSpec{}, kCollectives); }

// The rules that tie sections together. Each error points at the key to change.
// The rules within core's sections; the rules across the composition (how the batch
// splits over ranks and micro-batches, ...) are the plan's (core/plan.h).
void check_cross_fields(const JobSpec& spec, Section& model, Section& data, Section& train) {
  const ModelSpec& m = spec.model;
  const DataSpec& d = spec.data;
  if (spec.train.recompute != Recompute::kNone && m.type != "gpt")
    train.error("recompute", to_string(spec.train.recompute) + " recomputes a gpt's transformer blocks, and model type " +
                                 m.type + " has none (its layers keep little more than their outputs): use none");
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
                         const SectionRegistry& plugins, const JobWorld& world, const JobRules& rules,
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
  spec.mesh = parse_mesh(mesh, world);
  Section collectives = root.section("collectives");
  spec.collectives = parse_collectives(collectives);
  check_cross_fields(spec, model, data, train);
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
  if (diag.ok() && rules)
    for (const PlanIssue& issue : rules(spec)) {
      const size_t dot = issue.key.find('.');
      Section at = dot == std::string::npos ? root : root.section(issue.key.substr(0, dot));
      at.error(dot == std::string::npos ? issue.key : issue.key.substr(dot + 1), issue.message);
    }
  root.finish();
  if (origin_of_line) diag.relocate(origin_of_line);
  diag.throw_if_errors();
  out.resolved = doc.resolved();
  // log.dir left unset follows the name (Note [One run folder]): the job as written out
  // (the run folder's job.yaml, a tuned job, --print-config) keeps it unset (`dir: ~`), so
  // that the job run again under another name gets a folder of its own.
  if (!log.has("dir")) out.resolved["log"]["dir"] = YAML::Node(YAML::NodeType::Null);
  // A strategy's section left out of the job is not written out with its defaults: read
  // back (the run folder's job.yaml), a present section turns its strategy on, and
  // `pipeline: {micro_batches: 4}` made a one-stage pipeline of four micro-batches.
  out.left_out = YAML::Node(YAML::NodeType::Map);
  for (const std::string& name : absent)
    if (!spec.plugins.count(name)) {
      if (out.resolved[name]) out.left_out[name] = YAML::Clone(out.resolved[name]);
      out.resolved.remove(name);
    }
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

std::string backend_of(const JobSpec& spec) {
  if (spec.collectives.backend != "auto") return spec.collectives.backend;
  return spec.train.device == DeviceKind::kCuda ? "nccl" : "mpi";
}

const std::vector<std::string>& on_nonfinite_names() {
  static const std::vector<std::string> names = {"stop", "skip"};
  return names;
}
const std::string& to_string(OnNonfinite action) { return on_nonfinite_names().at(static_cast<size_t>(action)); }
const std::vector<std::string>& recompute_names() {
  static const std::vector<std::string> names = {"none", "blocks", "selective"};
  return names;
}
const std::string& to_string(Recompute recompute) { return recompute_names().at(static_cast<size_t>(recompute)); }
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

// The default of a typed section's variant, as the parser reads `{type: T}` (a cnn's
// hidden layers differ from an mlp's): a key that reads back the same when absent is
// left out of the YAML.
template <typename S, typename Parse>
S variant_default(const std::string& section, const std::string& type, Parse&& parse) {
  Diagnostics diag;  // a text variant's missing path: not this purpose's concern
  ConfigDocument doc = ConfigDocument::from_string(section + ": {type: " + type + "}", "defaults", diag);
  Section root = doc.root(diag);
  Section s = root.section(section);
  return parse(s);
}

}  // namespace

YAML::Node to_yaml(const ModelSpec& m) { return fields::write(m, variant_default<ModelSpec>("model", m.type, parse_model), kModel); }
YAML::Node to_yaml(const DataSpec& d) { return fields::write(d, variant_default<DataSpec>("data", d.type, parse_data), kData); }
YAML::Node to_yaml(const OptimizerSpec& o) {
  return fields::write(o, variant_default<OptimizerSpec>("optimizer", o.type, parse_optimizer), kOptimizer);
}
YAML::Node to_yaml(const ScheduleSpec& s) {
  const auto parse = [](Section& x) { return parse_schedule(x, OptimizerSpec{}); };
  return fields::write(s, variant_default<ScheduleSpec>("schedule", s.type, parse),
                       [](auto& v, ScheduleSpec& x) { schedule_fields(v, x, 0.0); });
}
YAML::Node to_yaml(const TrainSpec& t) { return fields::write(t, TrainSpec{}, kTrain); }
YAML::Node to_yaml(const CheckpointSpec& c) { return fields::write(c, CheckpointSpec{}, kCheckpoint); }
YAML::Node to_yaml(const LogSpec& l) { return fields::write(l, LogSpec{}, kLog); }
YAML::Node to_yaml(const CollectivesSpec& c) { return fields::write(c, CollectivesSpec{}, kCollectives); }

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

JobWorld launch_world() {
  const collectives::LaunchInfo launch = collectives::detect_launch();
  if (!launch.multi_process() || launch.world_size <= 0) return {};  // PMIx alone does not say
  return {launch.world_size, launch.launcher + ": " + launch.evidence};
}

ParsedJob read_job(const JobText& text, const std::vector<std::string>& overrides, const SectionRegistry& plugins,
                   const JobRules& rules, const JobWorld& world) {
  if (!text.path.empty())
    return guarded(text.path, [&] {
      Diagnostics diag;
      ConfigDocument doc = ConfigDocument::load_file(text.path, diag);
      return parse_document(doc, diag, text.path, overrides, plugins, world, rules);
    });
  return guarded(text.name, [&] {
    Diagnostics diag;
    ConfigDocument doc = ConfigDocument::from_string(text.yaml, text.name, diag);
    return parse_document(doc, diag, "", overrides, plugins, world, rules, text.origin_of_line);
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
