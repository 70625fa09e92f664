#include "pipeline/split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace tetra::pipeline {

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;

enum class Kind : char { kActivation, kDerived, kParameter, kInput };

bool weight_side(Kind k) { return k == Kind::kParameter || k == Kind::kDerived; }

// Every node under `root`, classified (Note [B and W on the autograd graph]). Iterative:
// a transformer stage's graph is thousands of nodes deep.
std::unordered_map<Node*, Kind> classify(Node* root, Node* input) {
  std::unordered_map<Node*, Kind> kind;
  std::vector<std::pair<Node*, size_t>> stack{{root, 0}};
  std::unordered_set<Node*> open{root};
  while (!stack.empty()) {
    auto& [node, next] = stack.back();
    if (next < node->num_outputs()) {
      const Edge& e = node->next_edge(next++);
      Node* child = e.function.get();
      if (child && !kind.count(child) && open.insert(child).second) stack.push_back({child, 0});
      continue;
    }
    Kind k;
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      k = node == input ? Kind::kInput : Kind::kParameter;
    } else {
      bool derived = node->num_outputs() > 0;
      for (const Edge& e : node->next_edges())
        derived = derived && e.is_valid() && weight_side(kind.at(e.function.get()));
      k = derived ? Kind::kDerived : Kind::kActivation;
    }
    kind[node] = k;
    stack.pop_back();
  }
  return kind;
}

// The parameters' gradient edges under a weight-side node.
void collect_parameters(Node* node, const std::unordered_map<Node*, Kind>& kind,
                        std::unordered_set<Node*>& seen, std::vector<Edge>& out) {
  if (!seen.insert(node).second) return;  // `seen`: the weight-side nodes met
  if (kind.at(node) == Kind::kParameter) {
    out.emplace_back(node->shared_from_this(), 0);
    return;
  }
  for (const Edge& e : node->next_edges()) collect_parameters(e.function.get(), kind, seen, out);
}

// W's stand-in for a boundary: the boundary's weight edges only, so the one autograd pass
// W makes from every boundary at once cannot walk down an activation edge to another
// boundary (and compute its weights twice). It calls the boundary itself, inside that
// pass: the boundary's Node::task_should_compute_output then finds its activation edges
// outside the pass and computes only its weights' gradients.
struct WeightProxy final : Node {
  WeightProxy(std::shared_ptr<Node> boundary, std::vector<uint32_t> inputs, std::vector<uint32_t> outputs,
              torch::autograd::edge_list&& edges)
      : Node(boundary->sequence_nr(), std::move(edges)),  // the fused backward's order
        boundary_(std::move(boundary)),
        inputs_(std::move(inputs)),
        outputs_(std::move(outputs)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list all(boundary_->num_inputs());
    for (size_t j = 0; j < inputs_.size(); ++j) all[inputs_[j]] = std::move(grads[j]);
    torch::autograd::variable_list out = (*boundary_)(std::move(all));
    torch::autograd::variable_list mine;
    for (uint32_t o : outputs_) mine.push_back(std::move(out[o]));
    return mine;
  }
  std::string name() const override { return "tetra::WeightProxy(" + boundary_->name() + ")"; }
  void release_variables() override { boundary_.reset(); }

 private:
  std::shared_ptr<Node> boundary_;
  std::vector<uint32_t> inputs_;   // the boundary's inputs, for the proxy's
  std::vector<uint32_t> outputs_;  // the boundary's weight edges, for the proxy's
};

}  // namespace

at::Tensor SplitBackward::input_pass(const at::Tensor& root, const at::Tensor& grad, const at::Tensor& input) {
  proxies_.clear();
  grads_.clear();
  params_.clear();
  fused_ = false;
  const at::Tensor g = grad.defined() ? grad : (root.defined() ? at::ones_like(root) : at::Tensor());
  const bool wants_input = input.defined() && input.requires_grad();
  auto whole = [&] {  // the fused backward: nothing to split
    fused_ = true;
    if (root.requires_grad()) torch::autograd::backward({root}, {g});
    return wants_input ? input.grad() : at::Tensor();
  };
  if (!root.requires_grad()) return whole();  // nothing to differentiate (a lone Flatten on the data)
  const Edge root_edge = torch::autograd::impl::gradient_edge(root);
  const Edge input_edge = wants_input ? torch::autograd::impl::gradient_edge(input) : Edge();
  const auto kind = classify(root_edge.function.get(), input_edge.function.get());
  if (weight_side(kind.at(root_edge.function.get()))) return whole();

  // The boundaries, in the order a fused backward reaches them (latest forward first).
  std::vector<Node*> boundaries;
  for (const auto& [node, k] : kind)
    if (k == Kind::kActivation &&
        std::any_of(node->next_edges().begin(), node->next_edges().end(),
                    [&](const Edge& e) { return e.is_valid() && weight_side(kind.at(e.function.get())); }))
      boundaries.push_back(node);
  if (boundaries.empty()) return whole();
  std::sort(boundaries.begin(), boundaries.end(), [](Node* a, Node* b) { return a->sequence_nr() > b->sequence_nr(); });

  // B: capture the gradient reaching every boundary (and the input's).
  torch::autograd::edge_list targets;
  if (wants_input) targets.push_back(input_edge);
  for (Node* b : boundaries)
    for (uint32_t i = 0; i < b->num_inputs(); ++i) targets.emplace_back(b->shared_from_this(), i);
  torch::autograd::variable_list captured = torch::autograd::Engine::get_default_engine().execute(
      {root_edge}, {g}, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false, targets);
  size_t at = 0;
  at::Tensor input_grad = wants_input ? captured[at++] : at::Tensor();

  // What W needs: a proxy per boundary (its weight edges, fed its captured gradients), and
  // the weights as the pass's outputs.
  std::unordered_set<Node*> seen;
  for (Node* b : boundaries) {
    std::vector<uint32_t> inputs, outputs;
    for (uint32_t i = 0; i < b->num_inputs(); ++i, ++at)
      if (captured[at].defined()) inputs.push_back(i);
    torch::autograd::edge_list edges;
    for (uint32_t o = 0; o < b->num_outputs(); ++o) {
      const Edge& e = b->next_edge(o);
      if (!e.is_valid() || !weight_side(kind.at(e.function.get()))) continue;
      outputs.push_back(o);
      edges.push_back(e);
      collect_parameters(e.function.get(), kind, seen, params_);
    }
    if (inputs.empty()) continue;  // no gradient reached it: its weights get none
    auto proxy = std::make_shared<WeightProxy>(b->shared_from_this(), inputs, std::move(outputs), std::move(edges));
    const size_t first = at - b->num_inputs();
    for (uint32_t i : inputs) {
      proxy->add_input_metadata(captured[first + i]);
      grads_.push_back(std::move(captured[first + i]));
    }
    proxies_.push_back(std::move(proxy));
  }

  // B kept the graph for W, which needs only the boundaries and what is under their
  // weights: the other activation nodes let go of what they saved now (as a fused
  // backward's nodes do once they have run).
  std::unordered_set<Node*> kept(boundaries.begin(), boundaries.end());
  for (const auto& [node, k] : kind)
    if (k == Kind::kActivation && !kept.count(node)) node->release_variables();
  return input_grad;
}

void SplitBackward::weight_pass() {
  // One autograd pass from every boundary's proxy to the weights: a weight two boundaries
  // reach (tied) gets both contributions summed before it accumulates, as in the fused
  // backward, and the gradient hooks fire in the fused backward's order.
  if (!proxies_.empty() && !params_.empty()) {
    torch::autograd::edge_list roots;
    for (const auto& p : proxies_)
      for (uint32_t j = 0; j < p->num_inputs(); ++j) roots.emplace_back(p, j);
    torch::autograd::Engine::get_default_engine().execute(roots, grads_, /*keep_graph=*/false, /*create_graph=*/false,
                                                          /*accumulate_grad=*/true, params_);
  }
  proxies_.clear();
  grads_.clear();
  params_.clear();
}

}  // namespace tetra::pipeline
