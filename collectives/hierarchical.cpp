// The hierarchical communicator (Note [Hierarchical composition] in hierarchical.h).
#include "collectives/hierarchical.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: ATen.h stopped bringing it in LibTorch 2.x

#include <algorithm>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "collectives/health.h"

namespace tetra::collectives {
namespace {

// The time left until `deadline`, rounded up to whole milliseconds (0 once it passed):
// the timeout of each stage's op, so that the stages together end by the deadline.
Duration time_left(Deadline deadline) {
  return std::max(std::chrono::ceil<Duration>(deadline - Clock::now()), Duration(0));
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// A split color's members as processes x replica indices: member i of the flat order is
// (processes[i / replicas.size()], replicas[i % replicas.size()]).
struct Rectangle {
  std::vector<int> processes, replicas;
};

// `members` are (key, group rank) in the order a flat split ranks them; nullopt when that
// order is not a rectangle taken process by process.
std::optional<Rectangle> as_rectangle(const std::vector<std::pair<int64_t, int>>& members, int R) {
  Rectangle rect;
  const int first = members.front().second / R;
  for (const auto& m : members) {
    if (m.second / R != first) break;
    rect.replicas.push_back(m.second % R);
  }
  const size_t q = rect.replicas.size();
  if (members.size() % q != 0) return std::nullopt;
  for (size_t i = 0; i < members.size(); ++i) {
    const int g = members[i].second;
    if (i % q == 0) rect.processes.push_back(g / R);
    // Members are distinct ranks, so matching every position also makes the processes
    // (and the replicas) distinct: a repeated process would repeat a whole block.
    if (g / R != rect.processes.back() || g % R != rect.replicas[i % q]) return std::nullopt;
  }
  return rect;
}

int index_of(const std::vector<int>& v, int x) {
  return static_cast<int>(std::find(v.begin(), v.end(), x) - v.begin());
}

class HierarchicalCommunicator final : public Communicator {
 public:
  HierarchicalCommunicator(CommunicatorPtr inner, CommunicatorPtr outer, std::string name,
                           const HierarchicalOptions& options)
      : Communicator(outer->rank() * inner->size() + inner->rank(), outer->size() * inner->size(),
                     std::move(name)),
        inner_(std::move(inner)),
        outer_(std::move(outer)),
        options_(options),
        R_(inner_->size()),
        D_(outer_->size()),
        r_(inner_->rank()),
        d_(outer_->rank()) {
    // It records with the rank it serves across processes; its stalls are its inner and
    // outer groups' (watched there, with peers this process cannot see from here).
    share_recorder(outer_->recorder());
  }
  // Ops still queued use inner_ and outer_: drain them before the members go.
  ~HierarchicalCommunicator() override { stop_progress_thread(); }

  std::string backend() const override { return "hierarchical"; }
  // Its bookkeeping crosses the processes over outer (Note [Two planes]).
  at::Device device() const override { return outer_->device(); }

 protected:
  void backend_allreduce(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                         Deadline deadline) override {
    at::NoGradGuard no_grad;  // in-place ops on parameters that require grad
    const ReduceOp sum_or_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    const bool is_sum = op == ReduceOp::kSum || op == ReduceOp::kAvg;
    if (R_ > 1 && D_ > 1 && is_sum && input.numel() * input.element_size() >= options_.split_min_bytes) {
      allreduce_by_chunks(input, output, op, deadline);
      return;
    }
    bool done = false;  // output holds the result so far
    if (R_ > 1) {
      stage(kInner, deadline, [&](Duration t) { return inner_->allreduce(input, output, {sum_or_op, t}); });
      done = true;
    }
    if (D_ > 1) {
      const at::Tensor& from = done ? output : input;
      stage(kOuter, deadline, [&](Duration t) { return outer_->allreduce(from, output, {sum_or_op, t}); });
      done = true;
    }
    if (!done && input.data_ptr() != output.data_ptr()) output.view({-1}).copy_(input.view({-1}));
    finish_average(output, op, size());
  }

  // Sums: each replica takes 1/R of the tensor across processes (padded to R equal chunks).
  void allreduce_by_chunks(const at::Tensor& input, const at::Tensor& output, ReduceOp op, Deadline deadline) {
    const int64_t n = input.numel(), m = (n + R_ - 1) / R_, padded = m * R_;
    at::Tensor whole = input.view({-1});
    if (padded != n) {
      whole = scratch(kWhole, padded, input);
      whole.narrow(0, 0, n).copy_(input.view({-1}));
      whole.narrow(0, n, padded - n).zero_();
    }
    at::Tensor chunk = scratch(kPart, m, input);
    stage(kInner, deadline, [&](Duration t) { return inner_->reduce_scatter(whole, chunk, {ReduceOp::kSum, t}); });
    stage(kOuter, deadline, [&](Duration t) { return outer_->allreduce(chunk, {ReduceOp::kSum, t}); });
    finish_average(chunk, op, size());  // on 1/R of the elements, before the gather
    if (padded == n) {
      stage(kInner, deadline, [&](Duration t) { return inner_->allgather(chunk, output.view({-1}), {t}); });
    } else {
      // The padded input's scratch is free again: every replica's reduce_scatter is done.
      stage(kInner, deadline, [&](Duration t) { return inner_->allgather(chunk, whole, {t}); });
      output.view({-1}).copy_(whole.narrow(0, 0, n));
    }
  }

  void backend_reduce_scatter(const at::Tensor& input, const at::Tensor& output, ReduceOp op,
                              Deadline deadline) override {
    at::NoGradGuard no_grad;
    const ReduceOp sum_or_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    const int64_t n = output.numel();
    at::Tensor in = input.view({-1});
    if (R_ > 1 && D_ > 1) {
      // [D][R][n] -> [R][D][n]: replica r's inner chunk is then the blocks (., r).
      at::Tensor t = scratch(kWhole, input.numel(), input);
      t.view({R_, D_, n}).copy_(in.view({D_, R_, n}).transpose(0, 1));
      in = t;
    }
    bool done = false;
    if (R_ > 1) {
      // Replica r's [D][n]: block (d', r) summed over this process, for every d'.
      at::Tensor mid = D_ > 1 ? scratch(kPart, int64_t{D_} * n, input) : output;
      stage(kInner, deadline, [&](Duration t) { return inner_->reduce_scatter(in, mid, {sum_or_op, t}); });
      in = mid;
      done = true;
    }
    if (D_ > 1) {
      stage(kOuter, deadline, [&](Duration t) { return outer_->reduce_scatter(in, output, {sum_or_op, t}); });
      done = true;
    }
    if (!done && input.data_ptr() != output.data_ptr()) output.view({-1}).copy_(in);
    finish_average(output, op, size());
  }

  void backend_allgather(const at::Tensor& input, const at::Tensor& output, Deadline deadline) override {
    at::NoGradGuard no_grad;
    const int64_t n = input.numel();
    if (R_ > 1 && D_ > 1) {
      // The inputs of (., r), then of (., every r') as [R][D][n], transposed into [D][R][n].
      at::Tensor across = scratch(kPart, int64_t{D_} * n, input);
      stage(kOuter, deadline, [&](Duration t) { return outer_->allgather(input, across, {t}); });
      at::Tensor all = scratch(kWhole, output.numel(), input);
      stage(kInner, deadline, [&](Duration t) { return inner_->allgather(across, all, {t}); });
      output.view({D_, R_, n}).copy_(all.view({R_, D_, n}).transpose(0, 1));
    } else if (R_ > 1) {
      stage(kInner, deadline, [&](Duration t) { return inner_->allgather(input, output, {t}); });
    } else if (D_ > 1) {
      stage(kOuter, deadline, [&](Duration t) { return outer_->allgather(input, output, {t}); });
    } else if (input.data_ptr() != output.data_ptr()) {
      output.view({-1}).copy_(input.view({-1}));
    }
  }

  void backend_broadcast(const at::Tensor& tensor, int root, Deadline deadline) override {
    const int d0 = root / R_, r0 = root % R_;
    if (D_ > 1 && r_ == r0)
      stage(kOuter, deadline, [&](Duration t) { return outer_->broadcast(tensor, {d0, t}); });
    if (R_ > 1) stage(kInner, deadline, [&](Duration t) { return inner_->broadcast(tensor, {r0, t}); });
  }

  void backend_send(const at::Tensor& tensor, int dst, int tag, Deadline deadline) override {
    if (dst / R_ == d_)
      stage(kInner, deadline, [&](Duration t) { return inner_->send(tensor, dst % R_, {tag, t}); });
    else if (dst % R_ == r_)
      stage(kOuter, deadline, [&](Duration t) { return outer_->send(tensor, dst / R_, {tag, t}); });
    else
      throw CommError(unreachable("send to", dst));
  }

  void backend_recv(const at::Tensor& tensor, int src, int tag, Deadline deadline) override {
    if (src / R_ == d_)
      stage(kInner, deadline, [&](Duration t) { return inner_->recv(tensor, src % R_, {tag, t}); });
    else if (src % R_ == r_)
      stage(kOuter, deadline, [&](Duration t) { return outer_->recv(tensor, src / R_, {tag, t}); });
    else
      throw CommError(unreachable("receive from", src));
  }

  void backend_barrier(Deadline deadline) override {
    if (R_ > 1) stage(kInner, deadline, [&](Duration t) { return inner_->barrier({t}); });
    if (D_ > 1) stage(kOuter, deadline, [&](Duration t) { return outer_->barrier({t}); });
  }

  std::shared_ptr<Communicator> backend_split(int color, int key, const std::string& name,
                                              Deadline deadline) override {
    const int s = size();
    if (color < 0) color = -1;
    // Every rank's (color, key), by group rank: each rank checks every color, so that all
    // agree on whether to go on to the inner and outer splits.
    // Made where the group carries tensors (Note [Two planes]), read on the host.
    const at::Tensor mine = at::tensor({int64_t{color}, int64_t{key}}, at::kLong).to(device());
    at::Tensor all = at::empty({2 * int64_t{s}}, at::TensorOptions(at::kLong).device(device()));
    backend_allgather(mine, all, deadline);
    all = all.cpu();
    const int64_t* v = all.data_ptr<int64_t>();
    std::map<int64_t, std::vector<std::pair<int64_t, int>>> colors;  // color -> (key, rank)
    for (int g = 0; g < s; ++g)
      if (v[2 * g] >= 0) colors[v[2 * g]].emplace_back(v[2 * g + 1], g);
    Rectangle me;
    for (auto& [c, members] : colors) {
      std::sort(members.begin(), members.end());  // a flat split's order: (key, rank)
      std::optional<Rectangle> rect = as_rectangle(members, R_);
      if (!rect) throw CommError(not_a_rectangle(c, members));
      if (c == color) me = std::move(*rect);
    }
    // Inner then outer on every rank, in that order, color -1 included (both collective).
    const int qi = color < 0 ? 0 : index_of(me.replicas, r_), pi = color < 0 ? 0 : index_of(me.processes, d_);
    CommunicatorPtr in = stage_split(kInner, deadline, [&](Duration t) {
      return inner_->split(color, qi, name + " (inner)", t);
    });
    CommunicatorPtr out = stage_split(kOuter, deadline, [&](Duration t) {
      return outer_->split(color, pi, name + " (outer)", t);
    });
    if (color < 0) return nullptr;
    TETRA_CHECK(in && out && in->size() == static_cast<int>(me.replicas.size()) && in->rank() == qi &&
                    out->size() == static_cast<int>(me.processes.size()) && out->rank() == pi,
                "hierarchical split of ", this->name(), ": the inner or outer split does not match color ",
                color, "'s rectangle");
    return std::make_shared<HierarchicalCommunicator>(std::move(in), std::move(out), name, options_);
  }

 private:
  enum Stage { kInner, kOuter };
  enum Scratch { kWhole, kPart };

  std::string where(Stage s) const {
    return s == kInner ? "inner stage (replica " + std::to_string(r_) + " of " + std::to_string(R_) +
                             " in process " + std::to_string(d_) + ")"
                       : "outer stage (process " + std::to_string(d_) + " of " + std::to_string(D_) +
                             ", replica index " + std::to_string(r_) + ")";
  }

  // Issues one stage's op with the time left and waits for it until the deadline; its
  // failure is this op's, naming the stage (the base adds this group's name and op).
  template <typename Issue>
  void stage(Stage s, Deadline deadline, Issue&& issue) {
    try {
      WorkPtr w = issue(time_left(deadline));
      w->wait(time_left(deadline));
    } catch (const TimeoutError& e) {
      throw TimeoutError(where(s) + ": " + e.what());
    } catch (const std::exception& e) {
      throw CommError(where(s) + ": " + e.what());
    }
  }

  // As stage(), for a split (which blocks until it is done, by its own timeout).
  template <typename Split>
  CommunicatorPtr stage_split(Stage s, Deadline deadline, Split&& split) {
    try {
      return split(time_left(deadline));
    } catch (const TimeoutError& e) {
      throw TimeoutError(where(s) + ": " + e.what());
    } catch (const std::exception& e) {
      throw CommError(where(s) + ": " + e.what());
    }
  }

  std::string unreachable(const char* verb, int peer) const {
    std::vector<int> same_index;
    for (int d = 0; d < D_; ++d) same_index.push_back(d * R_ + r_);
    const int first = d_ * R_;
    return "rank " + std::to_string(rank()) + " (process " + std::to_string(d_) + ", replica " +
           std::to_string(r_) + ") cannot " + verb + " rank " + std::to_string(peer) + " (process " +
           std::to_string(peer / R_) + ", replica " + std::to_string(peer % R_) + "): a hierarchical group of " +
           std::to_string(D_) + " processes x " + std::to_string(R_) +
           " replicas connects a rank only to the ranks of its own process (" + std::to_string(first) + ".." +
           std::to_string(first + R_ - 1) + ") and to those with its replica index (" + rank_list(same_index) +
           ")";
  }

  std::string not_a_rectangle(int64_t color, const std::vector<std::pair<int64_t, int>>& members) const {
    std::string ranks, cells;
    for (size_t i = 0; i < members.size(); ++i) {
      const int g = members[i].second;
      ranks += (i ? ", " : "") + std::to_string(g);
      cells += (i ? " " : "") + std::string("(") + std::to_string(g / R_) + "," + std::to_string(g % R_) + ")";
    }
    return "split: color " + std::to_string(color) + " has ranks " + ranks +
           " in key order, as (process,replica) " + cells + "; a hierarchical group of " + std::to_string(D_) +
           " processes x " + std::to_string(R_) +
           " replicas splits only into rectangles: the same replica indices in each of its processes, "
           "ordered process by process with the replica order the same in each";
  }

  // A 1-d tensor of `numel` elements of like's dtype in kept scratch memory, beside `like`
  // (its device: Note [Two planes]) (the transposes' and chunks' buffers, reused across
  // ops; only the progress thread touches them). Bytes, so that buckets of different dtypes
  // share one buffer instead of reallocating.
  at::Tensor scratch(Scratch which, int64_t numel, const at::Tensor& like) {
    at::Tensor& buf = scratch_[which];
    const int64_t bytes = numel * static_cast<int64_t>(like.element_size());
    if (!buf.defined() || buf.numel() < bytes || buf.device() != like.device()) buf = like.new_empty({bytes}, at::kByte);
    return buf.narrow(0, 0, bytes).view(like.scalar_type());
  }

  CommunicatorPtr inner_, outer_;
  HierarchicalOptions options_;
  const int R_, D_, r_, d_;  // replicas per process, processes; this replica's index, its process
  at::Tensor scratch_[2];
};

}  // namespace

CommunicatorPtr make_hierarchical(CommunicatorPtr inner, CommunicatorPtr outer, std::string name,
                                  const HierarchicalOptions& options) {
  const std::string what = "make_hierarchical(" + name + ")";
  if (!inner || !outer)
    throw CommError(what + ": the " + (inner ? "outer" : "inner") + " communicator is null");
  if (inner == outer)
    throw CommError(what + ": inner and outer are the same communicator (" + inner->name() +
                    "); give it the in-process group and the cross-process group");
  if (options.split_min_bytes < 0)
    throw CommError(what + ": split_min_bytes must be >= 0, got " + std::to_string(options.split_min_bytes));
  const int R = inner->size(), r = inner->rank(), D = outer->size(), d = outer->rank();
  // Each member's view, {D, d, R, r}, to every replica of its process and to every member
  // of its outer group: a mix-up there would otherwise be a wrong result or a hang later.
  // Each over its own group, where that group carries tensors (Note [Two planes]).
  const at::Tensor mine = at::tensor({int64_t{D}, int64_t{d}, int64_t{R}, int64_t{r}}, at::kLong);
  at::Tensor in_all = at::empty({4 * int64_t{R}}, at::TensorOptions(at::kLong).device(inner->device()));
  at::Tensor out_all = at::empty({4 * int64_t{D}}, at::TensorOptions(at::kLong).device(outer->device()));
  try {
    inner->allgather(mine.to(inner->device()), in_all, {options.timeout})->wait();
    outer->allgather(mine.to(outer->device()), out_all, {options.timeout})->wait();
    in_all = in_all.cpu();
    out_all = out_all.cpu();
  } catch (const TimeoutError& e) {
    throw TimeoutError(what + ": checking the shape over inner and outer: " + e.what());
  } catch (const std::exception& e) {
    throw CommError(what + ": checking the shape over inner and outer: " + e.what());
  }
  const int64_t* in = in_all.data_ptr<int64_t>();
  for (int k = 0; k < R; ++k)
    if (in[4 * k] != D || in[4 * k + 1] != d)
      throw CommError(what + ": replica " + std::to_string(k) + " of this process (inner group " + inner->name() +
                      ") is rank " + std::to_string(in[4 * k + 1]) + " of " + std::to_string(in[4 * k]) +
                      " in its outer group, replica " + std::to_string(r) + " rank " + std::to_string(d) + " of " +
                      std::to_string(D) + ": every replica of a process must have the process's index "
                      "in the same number of processes");
  const int64_t* out = out_all.data_ptr<int64_t>();
  for (int k = 0; k < D; ++k)
    if (out[4 * k + 2] != R || out[4 * k + 3] != r)
      throw CommError(what + ": the outer group " + outer->name() + " joins replica " +
                      std::to_string(out[4 * k + 3]) + " of " + std::to_string(out[4 * k + 2]) + " (process " +
                      std::to_string(k) + ") with replica " + std::to_string(r) + " of " + std::to_string(R) +
                      " (process " + std::to_string(d) +
                      "): an outer group must join the replicas with one index, and every process must "
                      "have the same number of replicas");
  // The check alone around it (Note [Health wrapper]): its stalls are its members'.
  return with_health(std::make_shared<HierarchicalCommunicator>(std::move(inner), std::move(outer), std::move(name), options),
                     health_options(), /*watched=*/false);
}

}  // namespace tetra::collectives
