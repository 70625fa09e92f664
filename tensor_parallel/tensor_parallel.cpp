#include "tensor_parallel/tensor_parallel.h"

#include <torch/torch.h>

#include <iomanip>
#include <sstream>

#include "core/fields.h"
#include "core/layers.h"
#include "core/tensor_group.h"
#include "tensor_parallel/mappings.h"

namespace tetra::tensor_parallel {

namespace {

std::string text(int64_t v) { return std::to_string(v); }

class TensorParallel final : public core::Strategy, public core::StateGatherer {
 public:
  TensorParallel(bool sequence, bool overlap) : sequence_(sequence), overlap_(overlap) {}
  std::string name() const override { return "tensor_parallel"; }

  void attach(core::TrainState& state) override {
    TETRA_CHECK(state.mesh, "tensor_parallel: attached without a mesh");
    comm_ = state.mesh->axis("tensor");
    timeout_ = collectives::Duration(static_cast<int64_t>(state.spec.collectives.timeout_s * 1000));
    parts_ = state.weights;
    device_ = state.device;
    host_ = state.mesh->host("tensor");  // Note [Two planes]: the norm's partial sums
    core::check_same_job(*host_, state, "tensor_parallel");
    // Note [Tensor traffic]: four activation sums per block per micro-batch; across hosts
    // they run at the slower link. Said, not refused (a test cluster may have to).
    const collectives::HostMap hosts = state.mesh->hosts("tensor");
    if (hosts.hosts.size() > 1)
      decision_ = "warning: the tensor group spans " + std::to_string(hosts.hosts.size()) + " hosts (" +
                  hosts.describe() + "): every block's activation sums cross the hosts' link; use a tensor degree "
                  "of at most the ranks per host";
    group_ = tensor_group(comm_, timeout_, overlap_);
    for (const auto& m : state.model->modules(/*include_self=*/false))
      if (auto* layer = dynamic_cast<core::TensorParallelLayer*>(m.get())) layer->bind(group_);
    if (sequence_) {
      // A replicated parameter met only this rank's block of the sequence: its gradient is
      // a part of the sum, completed over the group as autograd hands it over (before it
      // is accumulated, so whatever holds the gradients next — ZeRO's buckets, the data
      // axis' allreduce, the pipeline's micro-batches — sees one process's).
      for (const auto& p : state.params) {
        const core::Placement* at = parts_ ? parts_->placement(p.name) : nullptr;
        if ((at && at->is_split()) || !p.tensor.requires_grad()) continue;
        auto group = group_;
        p.tensor.register_hook([group](const at::Tensor& grad) {
          at::Tensor sum = grad.contiguous().clone();
          group->allreduce(sum, collectives::ReduceOp::kSum);
          return sum;
        });
      }
    }
    // Note [Vocabulary-parallel loss]: the head leaves this rank's block of the logits.
    const int64_t vocab = state.data->info().num_classes;
    const int64_t begin = vocab / comm_->size() * comm_->rank();
    auto group = group_;
    state.loss.loss = [group, begin](const torch::Tensor& output, const torch::Tensor& targets) {
      return core::vocab_cross_entropy(*group, output.reshape({-1, output.size(-1)}), targets.reshape({-1}), begin)
          .mean();
    };
    state.loss.correct = [group, begin](const torch::Tensor& output, const torch::Tensor& targets) {
      return core::vocab_argmax(*group, output.reshape({-1, output.size(-1)}), begin)
          .eq(targets.reshape({-1}))
          .sum()
          .item<int64_t>();
    };
  }

  std::string decision() const override { return decision_; }

  // The owner counted each split parameter's part and each whole one on tensor rank 0
  // only: their sum over the group is the model's.
  double reduce_grad_norm_sq(double local) override {
    at::Tensor t = at::tensor({local}, at::kDouble);
    collectives::AllreduceOptions o;
    o.timeout = timeout_;
    host_->allreduce(t, o)->wait();
    return t.item<double>();
  }

  // Every part becomes the whole tensor (its single-process name, shape and values) on
  // every rank of the group, so the writer holds the model as one process does. A part a
  // pipeline already gathered to this rank arrived in host memory (its stages' bytes come
  // over the host plane): it goes back on this rank's device to cross the tensor group.
  void gather_state(core::TensorMap& tensors) override {
    for (auto& [key, t] : tensors) {
      const core::Placement* part = parts_ ? parts_->placement(core::parameter_of_key(key)) : nullptr;
      if (!part || !part->is_split() || !t.defined() || t.numel() != part->local_numel()) continue;
      t = core::gather_whole(*comm_, *part, t.to(device_), timeout_);
    }
  }

 private:
  bool sequence_, overlap_;
  std::string decision_;
  collectives::CommunicatorPtr comm_;
  collectives::CommunicatorPtr host_;  // the tensor axis' host plane (Note [Two planes])
  c10::Device device_ = c10::kCPU;      // this rank's (Note [One device])
  collectives::Duration timeout_{collectives::kDefaultTimeout};
  const core::Materializer* parts_ = nullptr;
  std::shared_ptr<core::TensorGroup> group_;
};

// The `tensor` section's keys, declared once (Note [Fields declared once]); the degree is mesh.tensor.
template <class V>
void tensor_fields(V& v, Options& o) {
  v.boolean("sequence_parallel", o.sequence_parallel);
  v.boolean("overlap", o.overlap);
}
const auto kFields = [](auto& v, Options& o) { tensor_fields(v, o); };

}  // namespace

namespace {

// Layer i's parameters (the whole model's names, "i.<key>"), each with its placement when
// this rank holds a part of it.
struct LayerParam {
  std::string name;
  int64_t numel = 0;  // this rank's
  std::optional<core::Placement> part;
};
std::vector<LayerParam> layer_params(torch::nn::Sequential& model, int i) {
  std::vector<LayerParam> out;
  const auto layer = model->ptr(static_cast<size_t>(i));
  for (const auto& m : layer->named_modules("", /*include_self=*/true)) {
    const auto* init = dynamic_cast<const core::Initialized*>(m.value().get());
    for (const auto& p : m.value()->named_parameters(/*recurse=*/false)) {
      LayerParam lp;
      lp.name = std::to_string(i) + "." + (m.key().empty() ? "" : m.key() + ".") + p.key();
      lp.numel = p.value().numel();
      if (init) lp.part = init->placement_of(p.key());
      if (lp.part && !lp.part->is_split()) lp.part.reset();
      out.push_back(std::move(lp));
    }
  }
  return out;
}

std::string range(int64_t whole, int parts, int index) {
  const int64_t n = whole / parts;
  return std::to_string(n * index) + "-" + std::to_string(n * (index + 1) - 1) + " of " + std::to_string(whole);
}

}  // namespace

// Note [Tensor traffic]: per micro-batch of m samples of S tokens (d_model D), in the
// convention of Note [Traffic counters]:
//   without sequence parallelism, [m, S, D] activations allreduced: the embedding's sum
//   forward, each block's proj and fc2 sums forward and its qkv and fc1 input gradients
//   backward (4 per block), the head's input gradient backward;
//   with it, the same tensors all-gathered and reduce-scattered instead (an allreduce's
//   two halves): the embedding reduce-scatters forward and all-gathers its gradient, each
//   block's two gathers and two reduce-scatters forward are reduce-scatters and gathers
//   backward, the head gathers forward and reduce-scatters backward; and every whole
//   parameter's gradient summed over the group (an allreduce of its bytes);
//   the loss: the rows' maximum [m S] and the packed sums [2, m S] (fp32), allreduced;
//   per step, the clipped gradient norm (a double) when optimizer.clip_grad_norm is set.
// Activations are counted in fp32 (under bf16 autocast the projections' outputs are bf16:
// a note says so).
void Options::estimate(const core::PlanInput& input, core::RankEstimate& rank) const {
  const int T = input.plan.spec().mesh.size("tensor");
  if (T <= 1) return;
  using K = collectives::Traffic;
  collectives::Traffic& t = rank.traffic["tensor"];
  const int64_t micro = input.plan.micro_batches();
  const int64_t tokens = input.plan.micro_batch_size() * input.data.info().seq_len;
  const int64_t act = tokens * input.spec.model.d_model * 4;
  const int last = static_cast<int>(input.model->size()) - 1;
  for (int64_t mb = 0; mb < micro; ++mb) {
    for (int i : rank.layers) {
      const int ops = i == 0 || i == last ? 1 : 4;  // each way
      for (int k = 0; k < ops; ++k) {
        if (!sequence_parallel) {
          t.record(K::kAllreduce, act, T);
          continue;
        }
        // Forward then backward of each join: embedding and row layers reduce-scatter
        // forward, column layers (and the head) all-gather.
        const bool scatter_first = i == 0 || k % 2 == 1;
        t.record(scatter_first ? K::kReduceScatter : K::kAllgather, act, T);
        t.record(scatter_first ? K::kAllgather : K::kReduceScatter, act, T);
      }
      if (sequence_parallel)
        for (const LayerParam& p : layer_params(input.model, i))
          if (!p.part) t.record(K::kAllreduce, p.numel * 4, T);
      if (i == last) {
        t.record(K::kAllreduce, tokens * 4, T);
        t.record(K::kAllreduce, 2 * tokens * 4, T);
      }
    }
  }
  if (input.spec.optimizer.clip_grad_norm > 0) t.record(K::kAllreduce, 8, T);
  if (input.spec.train.precision == core::Precision::kBf16)
    rank.notes.push_back("tensor: activations counted in fp32; under bf16 the projections' sums are half that");
}

std::string Options::plan(const core::PlanInput& input) const {
  const int T = input.plan.spec().mesh.size("tensor");
  if (T <= 1) return "";
  const core::ModelSpec& m = input.spec.model;
  const int64_t d_ff = m.d_ff > 0 ? m.d_ff : 4 * m.d_model;
  const int64_t vocab = input.data.info().num_classes;
  int64_t split = 0, whole = 0;
  for (int i = 0; i < static_cast<int>(input.model->size()); ++i)
    for (const LayerParam& p : layer_params(input.model, i)) (p.part ? split : whole) += p.part ? p.part->whole_numel() : p.numel;
  std::ostringstream os;
  os << "tensor: " << T << " tensor ranks per slice (the innermost axis: adjacent ranks, one host's fastest links)"
     << (sequence_parallel ? ", sequence-parallel (norms, dropouts and the residual on blocks of "
                                 + std::to_string(input.data.info().seq_len / T) + " tokens)"
                           : "")
     << "\n";
  for (int r = 0; r < T; ++r)
    os << "  tensor rank " << r << ": heads " << range(m.heads, T, r) << ", MLP hidden " << range(d_ff, T, r)
       << ", vocabulary " << range(vocab, T, r) << "\n";
  os << "  split: " << split << " of " << split + whole << " parameters (" << std::fixed << std::setprecision(1)
     << 100.0 * double(split) / double(std::max<int64_t>(1, split + whole)) << "%), 1/" << T
     << " on each rank; whole on every rank: " << whole << " (norms, positions, row layers' biases)\n";
  return os.str();
}

std::unique_ptr<core::Strategy> Options::build() const { return std::make_unique<TensorParallel>(sequence_parallel, overlap); }

void Options::shape_model(core::TensorSlot& slot) const { slot.sequence = sequence_parallel && slot.parts > 1; }

core::StrategyRole Options::role(const core::JobSpec&) const {
  core::StrategyRole r;
  r.axis = "tensor";
  r.why = std::string("splits each block's matrices over the tensor group (attention by heads, the MLP column then row, "
                      "embedding and loss by vocabulary; ") +
          (sequence_parallel ? "sequence-parallel: an all-gather and a reduce-scatter each way per block half)"
                             : "one allreduce each way per block half)");
  r.needs_group = true;
  r.needs_group_key = "mesh.tensor";
  return r;
}

std::vector<core::PlanIssue> Options::issues(const core::JobSpec& job) const {
  std::vector<core::PlanIssue> out;
  const int t = job.mesh.size("tensor");
  if (t <= 1) return out;
  const std::string T = "mesh.tensor " + text(t);
  if (job.model.type != "gpt") {
    out.push_back({"mesh.tensor", T + " splits the layers of model.type gpt, and model.type is " + job.model.type +
                                      " (its layers are not tensor-parallel); use mesh.tensor 1 or model.type gpt"});
    return out;
  }
  if (job.model.heads % t != 0)
    out.push_back({"mesh.tensor", T + " does not divide model.heads " + text(job.model.heads) +
                                      ": attention is split by heads, each rank taking the same number; use a "
                                      "tensor degree that divides the heads"});
  const int64_t d_ff = job.model.d_ff > 0 ? job.model.d_ff : 4 * job.model.d_model;
  if (d_ff % t != 0)
    out.push_back({"mesh.tensor", T + " does not divide model.d_ff " + text(d_ff) +
                                      ": the MLP's hidden layer is split into equal parts; use a tensor degree "
                                      "that divides it"});
  // The vocabulary comes with the data; a text file's is its 256 byte values.
  if (job.data.type == "text" && 256 % t != 0)
    out.push_back({"mesh.tensor", T + " does not divide the vocabulary of 256 byte values (data.type text), which the "
                                      "embedding and the output layer split; use a tensor degree that divides it"});
  if (sequence_parallel && job.data.seq_len % t != 0)
    out.push_back({"tensor.sequence_parallel",
                   "tensor.sequence_parallel with " + T + " splits each sequence into equal blocks, and " + T +
                       " does not divide data.seq_len " + text(job.data.seq_len) +
                       "; use a tensor degree that divides it, or sequence_parallel: false"});
  return out;
}

YAML::Node Options::to_yaml() const { return core::fields::write(*this, Options{}, kFields); }

void register_tensor_parallel(core::SectionRegistry& registry) {
  core::register_section<Options>(
      registry, "tensor", kFields, "tensor", [](core::Section& s, const core::JobSpec& job, const Options& o, bool) {
        if (job.mesh.size("tensor") > 1) return true;
        if (o.sequence_parallel)
          s.error("sequence_parallel", "splits the sequence over the tensor group, and "
                                       "mesh.tensor is 1 (no group); set mesh.tensor > 1 or remove the key");
        return false;  // off: every rank holds whole layers
      });
}

}  // namespace tetra::tensor_parallel
