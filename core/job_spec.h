// The job spec: one YAML file parsed into typed, validated structs.
//
// Core owns the sections every job has (model, data, optimizer, schedule, train,
// checkpoint, log). Strategy plugins register their own sections with the
// SectionRegistry; core names none of them. Each field's default and meaning are
// written beside it; tools/train --print-config prints the resolved values.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/mesh.h"

namespace tetra::core {

struct ModelSpec {
  std::string type = "mlp";  // mlp | cnn | gpt
  // mlp: widths of the hidden layers; cnn: widths of the dense layers after the convs.
  std::vector<int64_t> hidden = {1024, 1024};
  std::string activation = "relu";  // relu | gelu | tanh (mlp, cnn)
  double dropout = 0.0;             // in [0, 1)
  // cnn: output channels of each 3x3 conv block (conv, activation, 2x2 max-pool).
  std::vector<int64_t> channels = {32, 64};
  // gpt: a byte-level causal transformer; its context is data.seq_len.
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t d_model = 128;
  int64_t d_ff = 0;  // 0 = 4 * d_model
  // gpt: a bias on the output layer. GPT-2 has none (its lm_head is the token table,
  // tied): false builds what `ckpt export --format hf` writes as GPT-2 (Note [GPT-2 export]).
  bool head_bias = true;
};

struct DataSpec {
  std::string type = "fashion-mnist";  // fashion-mnist | text | synthetic
  // fashion-mnist: folder with the four gzipped IDX files; text: the text file.
  std::string path = "/usr/share/datasets/fashion-mnist";
  int64_t batch_size = 256;       // the global batch: all ranks and micro-batches together
  int64_t eval_batch_size = 1000; // per evaluation forward
  int64_t eval_samples = 0;       // 0 = the whole test split
  bool shuffle = true;            // deterministic in (seed, epoch)
  // text: a sample is seq_len + 1 consecutive bytes; the last test_fraction of the file
  // is the test split.
  int64_t seq_len = 128;
  double test_fraction = 0.1;
  // synthetic: seeded classification data, inputs of `shape`, `classes` labels.
  std::vector<int64_t> shape = {784};
  int64_t classes = 10;
  int64_t train_samples = 8192;
  int64_t test_samples = 1024;
};

struct OptimizerSpec {
  std::string type = "adamw";  // sgd | adam | adamw
  double lr = 1e-3;            // peak learning rate (after warmup)
  double momentum = 0.0;       // sgd
  bool nesterov = false;       // sgd; needs momentum > 0
  double beta1 = 0.9;          // adam, adamw: `betas: [b1, b2]`
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;   // sgd/adam: L2 added to the gradient; adamw: decoupled
  double clip_grad_norm = 0.0; // clip by global L2 norm; 0 = off
};

struct ScheduleSpec {
  std::string type = "constant";  // constant | cosine | linear
  int64_t warmup_steps = 0;       // linear ramp from 0 to optimizer.lr
  double min_lr = 0.0;            // where cosine/linear decay ends
  int64_t decay_steps = 0;        // steps of decay after warmup; 0 = until the last step
};

// train.precision: fp32, or bf16 under autocast (on the job's device).
enum class Precision { kFp32, kBf16 };
const std::vector<std::string>& precision_names();  // fp32 bf16
const std::string& to_string(Precision precision);

// train.device: where every tensor the framework creates lives (Note [One device],
// core/device.h): cpu, or cuda (a rank's GPU from its local rank).
enum class DeviceKind { kCpu, kCuda };
const std::vector<std::string>& device_names();  // cpu cuda
const std::string& to_string(DeviceKind device);

// train.on_nonfinite: what a step whose loss or gradients hold a NaN or an infinity does.
// stop: the run fails naming the step, the micro-batch and the first such parameter;
// skip: that step updates nothing (counted as skipped_steps). All ranks decide alike.
// train.recompute (Note [Recompute], core/models.cpp): what a gpt's blocks keep for
// backward. none keeps everything; blocks keeps each transformer block's input and runs the
// block again in backward (Megatron's full recompute); selective keeps all but attention's
// seq x seq tensors and recomputes those (Megatron's selective recompute).
enum class Recompute { kNone, kBlocks, kSelective };
const std::vector<std::string>& recompute_names();  // none blocks selective
const std::string& to_string(Recompute recompute);

enum class OnNonfinite { kStop, kSkip };
const std::vector<std::string>& on_nonfinite_names();  // stop skip
const std::string& to_string(OnNonfinite action);

struct TrainSpec {
  int64_t epochs = 1;
  std::optional<int64_t> max_steps;  // when set, training stops after this many steps
  int64_t eval_every = 0;            // steps between evaluations; 0 = at each epoch's end
  int64_t seed = 1;
  int threads = 0;                   // intra-op threads per process; 0 = cores / local ranks
  Precision precision = Precision::kFp32;
  DeviceKind device = DeviceKind::kCpu;
  int64_t accumulation_steps = 1;    // micro-batches per optimizer step; divides batch_size
  OnNonfinite on_nonfinite = OnNonfinite::kStop;
  Recompute recompute = Recompute::kNone;  // gpt only
};

// What a failed checkpoint save (full disk, read-only folder) does to the run.
enum class OnCheckpointError { kStop, kWarn };
const std::vector<std::string>& on_checkpoint_error_names();  // stop warn
const std::string& to_string(OnCheckpointError on_error);

struct CheckpointSpec {
  std::string dir;            // default ckpt (in the run folder); "" = no checkpoints
  int64_t every_steps = 0;    // 0 = only at the end
  int64_t keep = 3;           // newest K kept; >= 1
  std::string resume = "auto"; // auto (newest in dir, if any) | never | a checkpoint path
  std::string safetensors;    // when set (model.safetensors), the final weights are exported there
  // Note [Weights from elsewhere] (core/trainer.cpp): a checkpoint folder of any job and
  // layout, or a safetensors export, whose model weights (and nothing else: no optimizer
  // state, no step, no data position) this run starts from; "" = the seeded initialisation.
  // Read from the current directory. A run that resumes its own checkpoint ignores it.
  std::string init_from;
  // false: tensors of the model that init_from lacks keep their initialisation, and its
  // tensors the model lacks are left; both listed. true: either is an error listing them.
  bool init_strict = true;
  // A failed save: stop ends the run with its error; warn prints it on rank 0, counts it
  // (metrics' checkpoint_failures) and trains on. The previous checkpoint stays intact.
  OnCheckpointError on_error = OnCheckpointError::kStop;
};

// Note [One run folder]
// Everything a run writes lives in one folder, log.dir, which defaults to runs/<name>:
// job.yaml, summary.json and flight/ always, and checkpoint.dir (ckpt), log.metrics
// (metrics.jsonl), log.trace, log.tensorboard and checkpoint.safetensors, whose relative
// paths are taken inside it (torchtitan's dump_folder does the same). So a new `name`,
// or a new log.dir, moves the whole run and leaves every other run's files alone; an
// absolute path still goes where it says. The job file and job.yaml keep the paths as
// written (relative); the parsed spec holds them resolved (runs/<name>/ckpt), which is
// what every reader of the spec uses. With log.dir "" (no run folder) relative paths are
// taken from the current directory. checkpoint.resume and data.path, which the job reads,
// are taken from the current directory.
struct LogSpec {
  std::string metrics;  // JSONL path; default metrics.jsonl (in the run folder); "" = off
  int64_t every = 50;   // steps between train records / plain progress lines
  std::string trace;    // Chrome trace JSON path (per rank), e.g. trace.json; "" = off
  std::string progress = "auto";  // auto (live line on a terminal) | line | plain | off
  std::string dir;  // default runs/<name>: job.yaml, summary.json (Note [Run folder]), flight/
  std::string tensorboard;  // TensorBoard event files go to this folder (rank 0's), e.g. tb; "" = off
};

struct CollectivesSpec {
  // auto | mpi | gloo | nccl (a build without one rejects it): the data plane's backend
  // (Note [Two planes], collectives/backends.h); host tensors go over a host backend beside
  // one that carries none (nccl: mpi under mpirun and srun with PMI, gloo under torchrun).
  // auto: nccl when train.device is cuda, else mpi (backend_of).
  std::string backend = "auto";
  double timeout_s = 300;       // set-up and default op timeout: a lost peer is an error, not a hang
  // Every op's (op, dtype, shape, sequence number) agreed by the group before it runs
  // (Note [Health checks]). Unset: the environment's TETRA_COLLECTIVES_CHECK, else off.
  std::optional<bool> check;
  // An op waiting this long is reported with the ranks that have not joined it, again at
  // twice the interval until timeout_s (Note [Stall warnings]). 0 = no warnings.
  double stall_warning_s = 60;
  // A process not heard from for this long (its host stopped, or the network to it) is
  // lost: every rank ends naming it (Note [Silence] in collectives/monitor.h). Raise it
  // where machines pause for longer (live migration).
  double peer_silence_s = 20;
};

// A rule the job breaks: `key` is the setting to change, as a job-file key
// ("data.batch_size", "pipeline.micro_batches"), so the YAML path can point at its line
// and the C++ builder at its call.
struct PlanIssue {
  std::string key;
  std::string message;
};

// What a plugin's section parses into. Plugins subclass it with their typed options.
struct PluginConfig {
  virtual ~PluginConfig() = default;
};

struct JobSpec;

// Parses and validates one plugin section. Called with the section (empty when the job
// does not have it) and the core part of the spec, already parsed, for cross-field
// rules. Returns nullptr when the section is absent and the plugin is therefore off.
using SectionParser =
    std::function<std::shared_ptr<const PluginConfig>(Section& section, const JobSpec& job)>;

// Section names -> parsers. Duplicate names are rejected; a missing name lists the known.
// A plugin adds its section through core::register_section (core/fields.h), which writes
// the parser around the plugin's keys and rules.
class SectionRegistry {
 public:
  // `axis`: the mesh axis the plugin's strategy owns ("" for none).
  void add(const std::string& name, SectionParser parser, const std::string& axis = "");
  bool contains(const std::string& name) const;
  const SectionParser& at(const std::string& name) const;
  std::vector<std::string> names() const;
  // The section whose strategy owns `axis`, or "" when no plugin does.
  std::string owner_of_axis(const std::string& axis) const;

 private:
  std::map<std::string, SectionParser> parsers_;
  std::map<std::string, std::string> axis_owner_;
};

struct JobSpec {
  std::string name = "job";  // used in default output paths
  std::string source;        // the job file's path ("" when built in code)
  // The job as parsed: every key with its value or default, --set applied (what
  // `train --print-config` prints; the run folder's job.yaml). "" for a spec not parsed.
  std::string resolved;
  ModelSpec model;
  DataSpec data;
  OptimizerSpec optimizer;
  ScheduleSpec schedule;
  TrainSpec train;
  CheckpointSpec checkpoint;
  LogSpec log;
  MeshSpec mesh;            // `mesh: {pipeline: P, data: D}`; absent axes have size 1
  CollectivesSpec collectives;
  // Plugin sections present in the job, by name.
  std::map<std::string, std::shared_ptr<const PluginConfig>> plugins;

  template <typename T>
  std::shared_ptr<const T> plugin(const std::string& name) const {
    auto it = plugins.find(name);
    return it == plugins.end() ? nullptr : std::dynamic_pointer_cast<const T>(it->second);
  }
};

// The backend the job's world is made over: collectives.backend, with auto resolved (nccl
// for a job on cuda, whose tensors MPI here cannot carry; mpi otherwise).
std::string backend_of(const JobSpec& spec);

struct ParsedJob {
  JobSpec spec;
  YAML::Node resolved;  // every key with its value or default
  // The strategy sections the job leaves out (so off), with their defaults: not in
  // `resolved`, where read back they would turn their strategies on.
  YAML::Node left_out;
};

// A path the run writes, as the spec holds it (Note [One run folder]): "" stays "" (off),
// an absolute path stays, a relative one is taken inside `run_dir` (unless that is "").
std::string in_run_folder(const std::string& run_dir, const std::string& path);

// The world a job is parsed for, which sizes a mesh axis given as auto (Note [Auto axis]
// in job_spec.cpp). size 0: the mesh's own (the auto axis is 1), as a dry run without --np
// plans it. launch_world(): the launch this process is in when it has several processes
// (mpirun, srun, torchrun), else size 0.
struct JobWorld {
  int size = 0;
  std::string origin;  // for messages: "--np 4", "mpirun: OMPI_COMM_WORLD_SIZE=4"
};
JobWorld launch_world();

// The rules across the sections, checked once every section is sound, each broken one
// reported at the line of its key: the plan's (Plan::issues, core/plan.h). The spec does
// not name the plan, which is built from a spec; core/job_file.h passes them.
using JobRules = std::function<std::vector<PlanIssue>(const JobSpec& spec)>;

// A job's text: a file, or a document a program wrote.
struct JobText {
  std::string path;  // the job file; "" for the document below
  std::string yaml;  // the document, named `name` in messages
  std::string name;
  // For a document a program wrote: names the call that wrote each line, which the
  // diagnostics then carry instead of name:line:col (the C++ Plan builder).
  std::function<std::string(int line)> origin_of_line;
};

// Reads a job: applies the `--set` overrides, validates every section, then `rules`.
// Throws tetra::ConfigError carrying every diagnostic at once. Programs call
// parse_job_file and parse_job_string (core/job_file.h), which pass the plan's rules.
ParsedJob read_job(const JobText& text, const std::vector<std::string>& overrides, const SectionRegistry& plugins,
                   const JobRules& rules, const JobWorld& world);

// A core section as the keys its parser reads, leaving out those at their defaults (the
// keys a type does not read are never written): what the C++ Plan builder writes before it
// parses the job like a file. Plugins write theirs with StrategyConfig::to_yaml.
// A number as the shortest text that reads back as the same double (0.05, not
// 0.050000000000000003), for the sections' to_yaml.
YAML::Node yaml_number(double value);
YAML::Node to_yaml(const ModelSpec& spec);
YAML::Node to_yaml(const DataSpec& spec);
YAML::Node to_yaml(const OptimizerSpec& spec);
YAML::Node to_yaml(const ScheduleSpec& spec);
YAML::Node to_yaml(const TrainSpec& spec);
YAML::Node to_yaml(const CheckpointSpec& spec);
YAML::Node to_yaml(const LogSpec& spec);
YAML::Node to_yaml(const CollectivesSpec& spec);

// The resolved config as YAML text, sections in a fixed order.
std::string resolved_yaml(const YAML::Node& resolved);

}  // namespace tetra::core
