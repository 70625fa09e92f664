// The shapes of the zoo's data, for tests that build models without reading any: 28 x 28
// images of 10 classes (Fashion-MNIST's) and byte-level text of a given context length.
#pragma once

#include <cstdint>

#include "core/data.h"

namespace tetra::testing_data {

inline core::DataInfo image_info() {
  core::DataInfo d;
  d.input_shape = {1, 28, 28};
  d.num_classes = 10;
  d.description = "Fashion-MNIST (60000 train, 10000 test)";
  return d;
}

inline core::DataInfo text_info(int64_t seq_len) {
  core::DataInfo d;
  d.input_shape = {seq_len};
  d.num_classes = 256;
  d.language_model = true;
  d.seq_len = seq_len;
  d.description = "text corpus.txt";
  return d;
}

}  // namespace tetra::testing_data
