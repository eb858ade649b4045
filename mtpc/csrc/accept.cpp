// The cycle's acceptance for one window on the CPU, in one call. Sampling: what
// acceptance.sample_verify computes with ~25 small tensor ops, from two uniforms instead of two
// torch.multinomial draws (the same distribution; a different stream of random numbers).
//
//   a_j = min(1, p_j(d_j) / q_j(d_j)) for the first `count` drafts (the testable ones), else 0
//   s   ~ P(s = j) = a_0 ... a_{j-1} (1 - a_j)  (a_m = 0), by inverse CDF from u0
//   extra ~ normalise(max(0, p_s - q_s)) after a rejection (s < count; p_s where that is all 0),
//           p_s after accepting every testable draft, by inverse CDF from u1
// p (m + 1, v) and q (m, v) are probabilities (float32), d (m,) the draft; the testable drafts are
// the first `budget`, up to and including the first stop id (acceptance.testable_drafts). Returns
// [s, extra, testable count, *d] (int64), what the cycle reads back in its one host read.

#include <torch/extension.h>

#include "inverse_cdf.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor sample_accept(torch::Tensor p, torch::Tensor q, torch::Tensor draft, int64_t budget,
                            std::vector<int64_t> stop_ids, torch::Tensor uniforms) {
  TORCH_CHECK(p.dtype() == torch::kFloat32 && q.dtype() == torch::kFloat32 && draft.dtype() == torch::kInt64 &&
                  uniforms.dtype() == torch::kFloat64,
              "sample_accept: float32 p and q, int64 draft, float64 uniforms");
  TORCH_CHECK(p.dim() == 2 && q.dim() == 2 && draft.dim() == 1 && p.is_contiguous() && q.is_contiguous() &&
                  draft.is_contiguous() && uniforms.is_contiguous() && uniforms.numel() == 2,
              "sample_accept: contiguous p (m + 1, v), q (m, v), draft (m,), two uniforms");
  const int64_t m = draft.size(0), v = p.size(1);
  TORCH_CHECK(p.size(0) == m + 1 && q.size(0) == m && q.size(1) == v,
              "sample_accept: p must be (m + 1, v) and q (m, v) for a draft of m");
  const float* P = p.data_ptr<float>();
  const float* Q = q.data_ptr<float>();
  const int64_t* d = draft.data_ptr<int64_t>();
  const double* u = uniforms.data_ptr<double>();
  // testable: the first `budget` drafts, up to and including the first stop id (testable_drafts)
  int64_t count = 0;
  for (int64_t j = 0; j < std::min(m, budget); ++j) {
    ++count;
    if (std::find(stop_ids.begin(), stop_ids.end(), d[j]) != stop_ids.end()) break;
  }
  std::vector<double> dist(m + 1), row(v);
  double survive = 1.0;
  for (int64_t j = 0; j <= m; ++j) {
    double a = 0.0;
    if (j < count) {
      TORCH_CHECK(d[j] >= 0 && d[j] < v, "sample_accept: draft id out of range");
      const double qd = std::max<double>(Q[j * v + d[j]], std::numeric_limits<float>::min());
      a = std::min(1.0, P[j * v + d[j]] / qd);
    }
    dist[j] = survive * (1.0 - a);
    survive *= a;
  }
  const int64_t s = inverse_cdf(dist.data(), m + 1, u[0]);
  const float* ps = P + s * v;
  double mass = 0;
  if (s < count) {
    const float* qs = Q + s * v;
    for (int64_t t = 0; t < v; ++t) mass += (row[t] = std::max(0.0, static_cast<double>(ps[t]) - qs[t]));
  }
  if (!(mass > 0))
    for (int64_t t = 0; t < v; ++t) row[t] = ps[t];
  auto out = torch::empty({3 + m}, torch::dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  o[0] = s;
  o[1] = inverse_cdf(row.data(), v, u[1]);
  o[2] = count;
  std::copy(d, d + m, o + 3);
  return out;
}

// The greedy cycle's acceptance in one call: the verifier's choice per row (argmax of p_logits
// (m + 1, v) with the banned ids at -inf: acceptance.greedy_target, the first maximum), the
// testable drafts (as sample_accept), s = the leading drafts equal to the choices, the extra token =
// the choice at s. Returns [s, extra, testable count, *d] (int64), the cycle's one host read.
torch::Tensor greedy_accept_native(torch::Tensor logits, torch::Tensor draft, int64_t budget,
                                   std::vector<int64_t> stop_ids, std::vector<int64_t> banned) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && draft.dtype() == torch::kInt64,
              "greedy_accept: float32 logits, int64 draft");
  TORCH_CHECK(logits.dim() == 2 && draft.dim() == 1 && logits.is_contiguous() && draft.is_contiguous(),
              "greedy_accept: contiguous logits (m + 1, v), draft (m,)");
  const int64_t m = draft.size(0), v = logits.size(1);
  TORCH_CHECK(logits.size(0) == m + 1, "greedy_accept: logits must be (m + 1, v) for a draft of m");
  const float* L = logits.data_ptr<float>();
  const int64_t* d = draft.data_ptr<int64_t>();
  std::vector<char> ban(v, 0);
  for (int64_t b : banned)
    if (b >= 0 && b < v) ban[b] = 1;
  auto choice = [&](int64_t row) {  // argmax, first maximum, banned ids excluded (-inf); NaN wins as in torch
    const float* x = L + row * v;
    int64_t arg = -1;
    float best = 0;
    for (int64_t t = 0; t < v; ++t) {
      const float val = ban[t] ? -std::numeric_limits<float>::infinity() : x[t];
      if (arg < 0 || val > best || (std::isnan(val) && !std::isnan(best))) best = val, arg = t;
    }
    return arg;
  };
  int64_t count = 0;
  for (int64_t j = 0; j < std::min(m, budget); ++j) {
    ++count;
    if (std::find(stop_ids.begin(), stop_ids.end(), d[j]) != stop_ids.end()) break;
  }
  int64_t s = 0, extra = choice(0);
  while (s < count && d[s] == extra) extra = choice(++s);
  auto out = torch::empty({3 + m}, torch::dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  o[0] = s;
  o[1] = extra;
  o[2] = count;
  std::copy(d, d + m, o + 3);
  return out;
}
