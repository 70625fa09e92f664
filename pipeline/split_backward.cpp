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

}  // namespace

at::Tensor SplitBackward::input_pass(const at::Tensor& root, const at::Tensor& grad, const at::Tensor& input) {
  boundaries_.clear();
  fused_ = false;
  const at::Tensor g = grad.defined() ? grad : (root.defined() ? at::ones_like(root) : at::Tensor());
  const bool wants_input = input.defined() && input.requires_grad();
  auto whole = [&] {  // the fused backward: nothing to split, or weights tied
    fused_ = true;
    boundaries_.clear();
    if (root.requires_grad()) torch::autograd::backward({root}, {g});
    return wants_input ? input.grad() : at::Tensor();
  };
  if (!root.requires_grad()) return whole();  // nothing to differentiate (a lone Flatten on the data)
  const Edge root_edge = torch::autograd::impl::gradient_edge(root);
  const Edge input_edge = wants_input ? torch::autograd::impl::gradient_edge(input) : Edge();
  const auto kind = classify(root_edge.function.get(), input_edge.function.get());
  if (weight_side(kind.at(root_edge.function.get()))) return whole();

  // The boundaries, in the order a fused backward reaches them (latest forward first), so
  // W fires the gradient hooks in the order the buckets expect; each with its weights.
  std::vector<Node*> nodes;
  for (const auto& [node, k] : kind)
    if (k == Kind::kActivation &&
        std::any_of(node->next_edges().begin(), node->next_edges().end(),
                    [&](const Edge& e) { return e.is_valid() && weight_side(kind.at(e.function.get())); }))
      nodes.push_back(node);
  if (nodes.empty()) return whole();
  std::sort(nodes.begin(), nodes.end(), [](Node* a, Node* b) { return a->sequence_nr() > b->sequence_nr(); });
  std::unordered_set<Node*> reached;  // every weight-side node under some boundary
  for (Node* n : nodes) {
    Boundary b;
    b.node = n->shared_from_this();
    std::unordered_set<Node*> mine;
    for (const Edge& e : n->next_edges())
      if (e.is_valid() && weight_side(kind.at(e.function.get()))) collect_parameters(e.function.get(), kind, mine, b.params);
    // A weight reached from two boundaries (tied): W from one would run the other.
    for (Node* w : mine)
      if (!reached.insert(w).second) return whole();
    boundaries_.push_back(std::move(b));
  }

  // B: capture the gradient reaching every boundary (and the input's).
  torch::autograd::edge_list targets;
  if (wants_input) targets.push_back(input_edge);
  for (Boundary& b : boundaries_)
    for (uint32_t i = 0; i < b.node->num_inputs(); ++i) targets.emplace_back(b.node, i);
  torch::autograd::variable_list captured = torch::autograd::Engine::get_default_engine().execute(
      {root_edge}, {g}, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false, targets);
  size_t at = 0;
  at::Tensor input_grad = wants_input ? captured[at++] : at::Tensor();
  for (Boundary& b : boundaries_)
    for (uint32_t i = 0; i < b.node->num_inputs(); ++i) b.grads.push_back(captured[at++]);

  // B kept the graph for W, which needs only the boundaries and what is under their
  // weights: the other activation nodes let go of what they saved now (as a fused
  // backward's nodes do once they have run).
  std::unordered_set<Node*> kept;
  for (const Boundary& b : boundaries_) kept.insert(b.node.get());
  for (const auto& [node, k] : kind)
    if (k == Kind::kActivation && !kept.count(node)) node->release_variables();
  return input_grad;
}

void SplitBackward::weight_pass() {
  // One autograd pass per boundary, from its captured gradient to its own weights only:
  // the engine then runs the boundary for the weights' outputs alone, and nothing under
  // its activation edges (they reach no weight of this boundary).
  for (Boundary& b : boundaries_) {
    torch::autograd::edge_list roots;
    torch::autograd::variable_list grads;
    for (uint32_t i = 0; i < b.grads.size(); ++i)
      if (b.grads[i].defined()) {
        roots.emplace_back(b.node, i);
        grads.push_back(b.grads[i]);
      }
    if (!roots.empty() && !b.params.empty())
      torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false,
                                                            /*create_graph=*/false, /*accumulate_grad=*/true, b.params);
  }
  boundaries_.clear();
}

}  // namespace tetra::pipeline
