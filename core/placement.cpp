#include "core/placement.h"

#include <algorithm>

#include "collectives/error.h"

namespace tetra::core {

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t product(const std::vector<int64_t>& shape, size_t from, size_t to) {
  int64_t n = 1;
  for (size_t i = from; i < to; ++i) n *= shape[i];
  return n;
}

}  // namespace

Placement Placement::split(std::vector<int64_t> view, int dim, int parts, int index) {
  TETRA_CHECK(dim >= 0 && static_cast<size_t>(dim) < view.size(), "placement: dimension ", dim,
              " is outside the shape ", shape_text(view));
  TETRA_CHECK(parts >= 1 && index >= 0 && index < parts, "placement: part ", index, " of ", parts,
              " does not exist");
  TETRA_CHECK(view[static_cast<size_t>(dim)] % parts == 0, "placement: ", parts,
              " parts do not divide dimension ", dim, " of ", shape_text(view));
  return Placement{std::move(view), dim, parts, index};
}

Placement Placement::whole(std::vector<int64_t> shape) { return Placement{std::move(shape), -1, 1, 0}; }

Placement Placement::of_shape(std::vector<int64_t> whole) const {
  Placement p = *this;
  TETRA_CHECK(product(whole, 0, whole.size()) == whole_numel(), "placement: the shape ", shape_text(whole),
              " does not hold the elements of ", shape_text(view));
  p.shape = std::move(whole);
  return p;
}

std::vector<int64_t> Placement::local() const {
  std::vector<int64_t> shape = view;
  if (is_split()) shape[static_cast<size_t>(dim)] /= parts;
  return shape;
}

int64_t Placement::whole_numel() const { return product(view, 0, view.size()); }

int64_t Placement::local_numel() const { return whole_numel() / (is_split() ? parts : 1); }

std::vector<Placement::Run> Placement::runs(int64_t local_begin, int64_t count) const {
  TETRA_CHECK(local_begin >= 0 && count >= 0 && local_begin + count <= local_numel(), "placement ",
              str(), ": elements [", local_begin, ", ", local_begin + count, ") are outside its ",
              local_numel());
  std::vector<Run> out;
  if (count == 0) return out;
  if (!is_split()) {
    out.push_back(Run{local_begin, local_begin, count});
    return out;
  }
  // A row of the part: its block along `dim` with everything inside, contiguous in the
  // whole; rows follow each other every view[dim] x inner elements of the whole.
  const size_t d = static_cast<size_t>(dim);
  const int64_t inner = product(view, d + 1, view.size());
  const int64_t row = view[d] / parts * inner;
  const int64_t stride = view[d] * inner;
  const int64_t offset = index * row;
  for (int64_t i = local_begin, end = local_begin + count; i < end;) {
    const int64_t outer = i / row, within = i % row;
    const int64_t length = std::min(row - within, end - i);
    out.push_back(Run{outer * stride + offset + within, i, length});
    i += length;
  }
  return out;
}

std::string Placement::str() const {
  if (!is_split()) return shape_text(view) + " whole";
  return shape_text(view) + " split along " + std::to_string(dim) + " into " + std::to_string(parts) +
         ", part " + std::to_string(index);
}

}  // namespace tetra::core
