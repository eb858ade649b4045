// One draw by inverse CDF, shared by the cycle kernels (btree_draft.cpp, accept.cpp).
#pragma once

#include <cstdint>

// The first index whose running sum of the (non-negative, any scale) weights w exceeds u * total,
// as torch.searchsorted(cdf, u * total, right=True): an index of zero weight is never chosen.
inline int64_t inverse_cdf(const double* w, int64_t count, double u) {
  double total = 0;
  for (int64_t i = 0; i < count; ++i) total += w[i];
  const double target = u * total;
  double run = 0;
  for (int64_t i = 0; i < count; ++i) {
    run += w[i];
    if (run > target) return i;
  }
  return count - 1;
}
