#include "core/optim.h"

#include <cmath>

#include "collectives/error.h"

namespace tetra::core {

Optimizer::Optimizer(const OptimizerSpec& spec, std::vector<NamedParam> params)
    : spec_(spec), params_(std::move(params)), state_(params_.size()) {
  TETRA_CHECK(spec_.type == "sgd" || spec_.type == "adam" || spec_.type == "adamw",
              "unknown optimizer type \"", spec_.type, "\"");
}

void Optimizer::zero_grad() {
  for (auto& p : params_) {
    auto& g = p.tensor.mutable_grad();
    if (g.defined()) g.zero_();
  }
}

void Optimizer::step(double lr) {
  torch::NoGradGuard no_grad;
  ++steps_;
  const double wd = spec_.weight_decay;
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor& p = params_[i].tensor;
    if (!p.grad().defined()) continue;
    torch::Tensor grad = p.grad();
    State& st = state_[i];
    if (spec_.type == "sgd") {
      // torch::optim::SGD: d = g + wd p; buf = m buf + d; d = nesterov ? d + m buf : buf.
      if (wd != 0) grad = grad.add(p, wd);
      if (spec_.momentum != 0) {
        if (!st.momentum.defined()) {
          st.momentum = grad.clone();
        } else {
          st.momentum.mul_(spec_.momentum).add_(grad);
        }
        grad = spec_.nesterov ? grad.add(st.momentum, spec_.momentum) : st.momentum;
      }
      p.add_(grad, -lr);
      continue;
    }
    // Adam / AdamW, as torch::optim::Adam(W).
    if (spec_.type == "adamw") {
      if (wd != 0) p.mul_(1 - lr * wd);
    } else if (wd != 0) {
      grad = grad.add(p, wd);
    }
    if (!st.exp_avg.defined()) {
      st.exp_avg = torch::zeros_like(p, torch::MemoryFormat::Preserve);
      st.exp_avg_sq = torch::zeros_like(p, torch::MemoryFormat::Preserve);
    }
    const double b1 = spec_.beta1, b2 = spec_.beta2;
    const double bc1 = 1 - std::pow(b1, static_cast<double>(steps_));
    const double bc2 = 1 - std::pow(b2, static_cast<double>(steps_));
    st.exp_avg.mul_(b1).add_(grad, 1 - b1);
    st.exp_avg_sq.mul_(b2).addcmul_(grad, grad, 1 - b2);
    torch::Tensor denom = (st.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(spec_.eps);
    p.addcdiv_(st.exp_avg, denom, -lr / bc1);
  }
}

std::map<std::string, torch::Tensor> Optimizer::state_dict() const {
  std::map<std::string, torch::Tensor> out;
  out["__step__"] = torch::tensor(steps_, torch::kInt64);
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& n = params_[i].name;
    const State& st = state_[i];
    if (st.exp_avg.defined()) out[n + ".exp_avg"] = st.exp_avg;
    if (st.exp_avg_sq.defined()) out[n + ".exp_avg_sq"] = st.exp_avg_sq;
    if (st.momentum.defined()) out[n + ".momentum"] = st.momentum;
  }
  return out;
}

void Optimizer::load_state_dict(const std::map<std::string, torch::Tensor>& state) {
  auto step = state.find("__step__");
  if (step == state.end()) throw Error("optimizer state has no step count");
  steps_ = step->second.item<int64_t>();
  torch::NoGradGuard no_grad;
  auto take = [&](const std::string& key, const torch::Tensor& like) -> torch::Tensor {
    auto it = state.find(key);
    if (it == state.end()) return {};
    if (!it->second.sizes().equals(like.sizes()))
      throw Error("optimizer state " + key + " has shape " + c10::str(it->second.sizes()) +
                  ", the parameter has " + c10::str(like.sizes()));
    return it->second.to(like.options()).clone();
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& n = params_[i].name;
    const auto& p = params_[i].tensor;
    state_[i].exp_avg = take(n + ".exp_avg", p);
    state_[i].exp_avg_sq = take(n + ".exp_avg_sq", p);
    state_[i].momentum = take(n + ".momentum", p);
    bool adam = spec_.type != "sgd";
    if (adam && steps_ > 0 && !state_[i].exp_avg.defined() && p.requires_grad())
      throw Error("optimizer state for " + n + " is missing (was it saved by " + spec_.type + "?)");
  }
}

namespace {
double grad_norm_sq(const std::vector<NamedParam>& params) {
  torch::NoGradGuard no_grad;
  double total = 0;
  for (const auto& p : params) {
    if (!p.tensor.grad().defined()) continue;
    double n = p.tensor.grad().norm().item<double>();
    total += n * n;
  }
  return total;
}
}  // namespace

double grad_norm(const std::vector<NamedParam>& params) { return std::sqrt(grad_norm_sq(params)); }

double clip_grad_norm(const std::vector<NamedParam>& params, double max_norm) {
  return clip_grad_norm(params, max_norm, [](double sq) { return sq; });
}

double clip_grad_norm(const std::vector<NamedParam>& params, double max_norm,
                      const std::function<double(double)>& reduce_sq) {
  double norm = std::sqrt(reduce_sq(grad_norm_sq(params)));
  if (max_norm > 0 && norm > max_norm) {
    torch::NoGradGuard no_grad;
    double scale = max_norm / (norm + 1e-6);  // torch.nn.utils.clip_grad_norm_'s epsilon
    for (const auto& p : params)
      if (p.tensor.grad().defined()) p.tensor.mutable_grad().mul_(scale);
  }
  return norm;
}

LrSchedule::LrSchedule(const ScheduleSpec& spec, double peak_lr, int64_t total_steps)
    : spec_(spec), peak_(peak_lr), total_(total_steps) {}

double LrSchedule::at(int64_t step) const {
  const int64_t warm = spec_.warmup_steps;
  if (warm > 0 && step < warm) return peak_ * static_cast<double>(step + 1) / static_cast<double>(warm);
  if (spec_.type == "constant") return peak_;
  int64_t decay = spec_.decay_steps > 0 ? spec_.decay_steps : std::max<int64_t>(1, total_ - warm);
  double t = std::min(1.0, static_cast<double>(step - warm) / static_cast<double>(decay));
  if (t < 0) t = 0;
  if (spec_.type == "linear") return spec_.min_lr + (peak_ - spec_.min_lr) * (1 - t);
  // cosine
  return spec_.min_lr + 0.5 * (peak_ - spec_.min_lr) * (1 + std::cos(M_PI * t));
}

}  // namespace tetra::core
