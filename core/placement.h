// Where a rank's part of a tensor lies in the whole tensor.
//
// Note [Placements]
// ~~~~~~~~~~~~~~~~~
// A tensor-parallel rank holds one part of a split tensor: Megatron's column-parallel
// Linear holds a block of the weight's rows, its row-parallel Linear a block of columns,
// the vocabulary-parallel embedding a block of the vocabulary. A Placement says which:
// the whole tensor's shape as it is split (`view`), the dimension it is split along, into
// how many equal parts, and which part this rank holds. The view may regroup the whole
// tensor without moving an element: a fused query/key/value weight [3d, d] split by heads
// is the view [3, d, d] split along dimension 1, so that each part holds its heads' rows
// of all three.
//
// The part is a box of the view (every index along the other dimensions, one block along
// `dim`), held contiguously, row-major, in the part's own shape. runs() maps a range of
// the part's flat elements to the ranges of the whole tensor's flat elements they are:
// each "row" of the part — everything from `dim` inwards, local()[dim] x the inner
// extent — is one contiguous range of the whole. Everything keyed by an element's index
// in the whole tensor reads through it: the initial values (Note [Layout-invariant
// initialisation], core/init.h), so a part holds exactly the bytes one process holds
// there; and, with it, checkpoints' slices and exports.
//
// A tensor that is not split (dim < 0: replicated, the norms of a tensor-parallel block)
// is its whole self on every rank: one run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tetra::core {

struct Placement {
  std::vector<int64_t> view;  // the whole tensor's shape as split (same numel as the whole)
  int dim = -1;               // split along this dimension of `view`; < 0: not split
  int parts = 1;              // into this many equal parts
  int index = 0;              // of which this rank holds this one
  std::vector<int64_t> shape;  // the whole tensor's own shape when `view` regroups it; empty: view

  const std::vector<int64_t>& whole_shape() const { return shape.empty() ? view : shape; }
  // The same split with the whole tensor's own shape `whole` (its view regroups it).
  Placement of_shape(std::vector<int64_t> whole) const;

  // Part `index` of `parts` along `dim` of `view`. Throws when `parts` does not divide it.
  static Placement split(std::vector<int64_t> view, int dim, int parts, int index);
  // The whole tensor of this shape, on every rank.
  static Placement whole(std::vector<int64_t> shape);

  bool is_split() const { return dim >= 0 && parts > 1; }
  std::vector<int64_t> local() const;  // the part's shape: `view` with dim divided by parts
  int64_t whole_numel() const;
  int64_t local_numel() const;

  // [local_begin, local_begin + length) of the part's flat elements are
  // [whole_begin, whole_begin + length) of the whole tensor's.
  struct Run {
    int64_t whole_begin = 0, local_begin = 0, length = 0;
  };
  // The runs that cover the part's flat elements [local_begin, local_begin + count), in
  // order. Throws when the range is outside the part.
  std::vector<Run> runs(int64_t local_begin, int64_t count) const;

  std::string str() const;  // "[3, 32, 32] split along 1 into 2, part 0" or "[32] whole"
};

}  // namespace tetra::core
