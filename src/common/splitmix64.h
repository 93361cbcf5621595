// splitmix64's output function: a cheap, well-mixed 64-bit hash. Counter-based random numbers
// (hash of key + index) make parallel fills reproducible on host and device alike.
#pragma once

#include <cstdint>

#include "common/hd.h"

namespace epflow {

EPFLOW_HD uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace epflow
