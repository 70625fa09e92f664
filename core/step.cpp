#include "core/step.h"

#include <cmath>
#include <limits>
#include <string>

#include "core/models.h"
#include "core/text.h"
#include "core/torch_compat.h"

namespace tetra::core {

MicroBatches::MicroBatches(const StepInput& step, int64_t count) : step_(step), n_(step.indices.size(0)) {
  for (int64_t i = 0; i < count; ++i)
    indices_.push_back(count == 1 ? step.indices : BatchPlan::slice(step.indices, i, count));
}

Batch MicroBatches::load(int64_t i) {
  Stopwatch t;
  Batch b = step_.load(indices(i));
  out_.data_s += t.lap();
  return b;
}

RandomContext MicroBatches::random(int64_t i) const {
  return step_.random.offset(BatchPlan::slice_begin(n_, i, count()));
}

torch::Tensor MicroBatches::weighted(int64_t i, const torch::Tensor& loss) const {
  const double w = weight(i);
  return w == 1.0 ? loss : loss * w;
}

void MicroBatches::add_loss(int64_t i, double loss) {
  out_.loss += loss * weight(i);
  if (!std::isfinite(loss) && (out_.nonfinite_micro_batch < 0 || i < out_.nonfinite_micro_batch)) {
    out_.nonfinite_micro_batch = i;
    out_.nonfinite_loss = loss;
  }
}

ModelLoss cross_entropy_loss() { return {model_loss, count_correct}; }

StepOutput LocalRunner::run(const StepInput& step) {
  MicroBatches micro(step, micro_);
  StepOutput& out = micro.out();
  for (int64_t m = 0; m < micro.count(); ++m) {
    RandomContext::Scope random_scope(micro.random(m));
    Batch batch;
    {
      Trace::Scope s(trace_, "data", "batch");
      batch = micro.load(m);
    }
    Stopwatch t;
    torch::Tensor loss;
    {
      Trace::Scope s(trace_, "compute", "forward");
      compat::Autocast autocast(step.bf16, step.device.type());
      loss = loss_.loss(model_->forward(batch.inputs), batch.targets);
    }
    out.forward_s += t.lap();
    if (step.before_backward) step.before_backward(m == micro.count() - 1);
    {
      Trace::Scope s(trace_, "compute", "backward");
      micro.weighted(m, loss).backward();
    }
    micro.add_loss(m, loss.item<double>());
    out.backward_s += t.lap();
  }
  return out;
}

EvalSums LocalRunner::evaluate(const Batch& batch, bool bf16) {
  torch::Tensor out;
  {
    compat::Autocast autocast(bf16, batch.inputs.device().type());
    out = model_->forward(batch.inputs);
  }
  out = out.to(torch::kFloat32);
  EvalSums s;
  s.loss_sum = loss_.loss(out, batch.targets).item<double>() * static_cast<double>(batch.size());
  s.correct = loss_.correct(out, batch.targets);
  s.predictions = batch.targets.numel();
  return s;
}

namespace {

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

}  // namespace

StepVerdict agree_on_step(const StepSeen& seen, const StepPlace& place, collectives::Communicator* ranks) {
  const int64_t D = place.data_size;
  at::Tensor flags = at::empty({kFlags}, at::kLong);
  int64_t* f = flags.data_ptr<int64_t>();
  f[kLossBad] = std::isfinite(seen.loss) ? 0 : -1;
  f[kMicro] = seen.nonfinite_micro_batch < 0 ? kNone
                                             : (seen.nonfinite_micro_batch * D + place.data_rank) * 4 + loss_kind(seen.nonfinite_loss);
  f[kParam] = seen.nonfinite_param < 0 ? kNone : seen.nonfinite_param;
  f[kStop] = -static_cast<int64_t>(seen.stop);
  if (ranks && ranks->size() > 1) {
    collectives::AllreduceOptions o;
    o.op = collectives::ReduceOp::kMin;
    ranks->allreduce(flags, o)->wait();
  }
  StepVerdict v;
  v.stop = static_cast<int>(-f[kStop]);
  if (f[kLossBad] == 0 && f[kMicro] == kNone && f[kParam] == kNone) return v;
  // What was not finite, and where: the same words on every rank.
  v.nonfinite = true;
  std::string where = "step " + std::to_string(place.step + 1) + " (epoch " + std::to_string(place.epoch + 1) + ")";
  std::string what;
  if (f[kMicro] != kNone) {
    const int64_t m = f[kMicro] / 4 / D, rank = f[kMicro] / 4 % D;
    const int64_t of = place.micro_batches;
    if (of > 1) where += ", micro-batch " + std::to_string(m + 1) + " of " + std::to_string(of);
    if (D > 1) where += (of > 1 ? " on data rank " : ", data rank ") + std::to_string(rank);
    what = std::string("the loss is ") + kind_name(f[kMicro] % 4);
  } else if (f[kLossBad] != 0) {
    what = std::string("the loss is ") + kind_name(loss_kind(seen.loss));
  } else {
    what = "the loss is " + fmt("%.6g", seen.loss) + " but a gradient is not finite";
  }
  what += f[kParam] != kNone ? "; first parameter whose gradient is not finite: " +
                                   place.param_names->at(static_cast<size_t>(f[kParam]))
                             : "; every gradient is finite";
  v.why = where + ": " + what;
  return v;
}

}  // namespace tetra::core
