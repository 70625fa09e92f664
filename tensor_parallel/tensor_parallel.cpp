#include "tensor_parallel/tensor_parallel.h"

#include <torch/torch.h>

#include "core/fields.h"
#include "core/layers.h"
#include "core/tensor_group.h"
#include "tensor_parallel/mappings.h"

namespace tetra::tensor_parallel {

namespace {

std::string text(int64_t v) { return std::to_string(v); }

class TensorParallel final : public core::Strategy, public core::StateGatherer {
 public:
  explicit TensorParallel(bool sequence) : sequence_(sequence) {}
  std::string name() const override { return "tensor_parallel"; }

  void attach(core::TrainState& state) override {
    TETRA_CHECK(state.mesh, "tensor_parallel: attached without a mesh");
    comm_ = state.mesh->axis("tensor");
    timeout_ = collectives::Duration(static_cast<int64_t>(state.spec.collectives.timeout_s * 1000));
    parts_ = state.weights;
    core::check_same_job(*comm_, state, "tensor_parallel");
    group_ = tensor_group(comm_, timeout_);
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

  // The owner counted each split parameter's part and each whole one on tensor rank 0
  // only: their sum over the group is the model's.
  double reduce_grad_norm_sq(double local) override {
    at::Tensor t = at::tensor({local}, at::kDouble);
    collectives::AllreduceOptions o;
    o.timeout = timeout_;
    comm_->allreduce(t, o)->wait();
    return t.item<double>();
  }

  // Every part becomes the whole tensor (its single-process name, shape and values) on
  // every rank of the group, so the writer holds the model as one process does.
  void gather_state(core::TensorMap& tensors) override {
    for (auto& [key, t] : tensors) {
      const core::Placement* part = parts_ ? parts_->placement(core::parameter_of_key(key)) : nullptr;
      if (!part || !part->is_split() || !t.defined() || t.numel() != part->local_numel()) continue;
      at::Tensor mine = t.detach().contiguous().view({-1});
      at::Tensor all = at::empty({mine.numel() * comm_->size()}, mine.options());
      collectives::AllgatherOptions o;
      o.timeout = timeout_;
      comm_->allgather(mine, all, o)->wait();
      t = core::whole_of(*part, all.chunk(comm_->size()));
    }
  }

 private:
  bool sequence_;
  collectives::CommunicatorPtr comm_;
  collectives::Duration timeout_{collectives::kDefaultTimeout};
  const core::Materializer* parts_ = nullptr;
  std::shared_ptr<core::TensorGroup> group_;
};

// The `tensor` section's keys, declared once (Note [Fields declared once]); the degree is mesh.tensor.
template <class V>
void tensor_fields(V& v, Options& o) {
  v.boolean("sequence_parallel", o.sequence_parallel);
}
const auto kFields = [](auto& v, Options& o) { tensor_fields(v, o); };

}  // namespace

std::unique_ptr<core::Strategy> Options::build() const { return std::make_unique<TensorParallel>(sequence_parallel); }

void Options::shape_model(core::TensorSlot& slot) const { slot.sequence = sequence_parallel && slot.parts > 1; }

core::StrategyRole Options::role(const core::JobSpec&) const {
  core::StrategyRole r;
  r.axis = "tensor";
  r.why = "splits each block's matrices over the tensor group (attention by heads, the MLP column then row, "
          "embedding and loss by vocabulary; one allreduce each way per block half)";
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
  if (sequence_parallel && job.data.seq_len % t != 0)
    out.push_back({"tensor.sequence_parallel",
                   "tensor.sequence_parallel with " + T + " splits each sequence into equal blocks, and " + T +
                       " does not divide data.seq_len " + text(job.data.seq_len) +
                       "; use a tensor degree that divides it, or sequence_parallel: false"});
  return out;
}

YAML::Node Options::to_yaml() const { return core::fields::write(*this, Options{}, kFields); }

void register_tensor_parallel(core::SectionRegistry& registry) {
  registry.add(
      "tensor",
      [](core::Section& s, const core::JobSpec& job) -> std::shared_ptr<const core::PluginConfig> {
        auto o = std::make_shared<Options>();
        core::fields::Reader r(s);
        tensor_fields(r, *o);
        s.finish();
        if (job.mesh.size("tensor") <= 1) {
          if (o->sequence_parallel)
            s.error("sequence_parallel", "splits the sequence over the tensor group, and "
                                         "mesh.tensor is 1 (no group); set mesh.tensor > 1 or remove the key");
          return nullptr;  // off: every rank holds whole layers
        }
        return o;
      },
      "tensor");
}

}  // namespace tetra::tensor_parallel
