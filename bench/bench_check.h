// Correctness guards shared by the benchmarks: a fast result that is wrong is never reported
// silently.
#pragma once

#include <cmath>
#include <vector>

namespace epflow::bench {

// |a - b| / |b| over whole vectors; infinite when anything is non-finite (a NaN row is one never
// written), when the sizes differ, or when b is zero while a is not.
inline double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * b[i];
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

}  // namespace epflow::bench
