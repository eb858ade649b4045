// The btree circuit's greedy (max-product) draft for one context, in one call: what
// BTreeCircuit._greedy_window + with_prefix compute with ~40 small torch ops, for the batch-1
// decoding cycle on the CPU, where each op's dispatch costs more than its arithmetic.
//
// The same float32 operations in the same order as the torch path, so the same bits and the same
// draft, ties included (argmax takes the first maximum, as torch's does):
//   leaf message  L_i(b) = leaves[i, b, x_i] (a prefix position) or max_x leaves[i, b, x] (free)
//   upward        U_k(b) = msg(left) + msg(right);  msg_k(a) = max_b internal[k, a, b] + U_k(b)
//   root          z_0 = argmax_a root[a] + U_root(a)
//   top-down      z_k = argmax_b internal[k, z_parent, b] + U_k(b)
//   window        x_i = prefix[i] for i < k, else argmax_x leaves[i, z_parent(i), x]
//
// The tree comes as a plan (int64), built once per circuit by mtpc/circuits/btree.py
// (`_Schedule.native_plan`):
//   [m, n, then per non-root node in upward order (height, then id): its internal row, the message
//    buffer slots of its two children (0 = a zero message, 1 + i = leaf i, 1 + n + j = the j-th node
//    of the upward order), then the root's two children's slots, then per non-root node
//    breadth-first (internal row k = node k + 1) its parent's node id, then each position's parent
//    node id]

#include <torch/extension.h>

#include "inverse_cdf.h"

#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor btree_greedy_draft(torch::Tensor root, torch::Tensor internal, torch::Tensor leaves,
                                 torch::Tensor prefix, torch::Tensor plan) {
  TORCH_CHECK(root.dtype() == torch::kFloat32 && internal.dtype() == torch::kFloat32 &&
                  leaves.dtype() == torch::kFloat32,
              "btree_greedy_draft: float32 parameters only");
  TORCH_CHECK(root.dim() == 1 && internal.dim() == 3 && leaves.dim() == 3,
              "btree_greedy_draft: one context (root (r,), internal (m, r, r), leaves (n, r, v))");
  TORCH_CHECK(root.is_contiguous() && internal.is_contiguous() && leaves.is_contiguous() &&
                  prefix.is_contiguous() && plan.is_contiguous(),
              "btree_greedy_draft: contiguous inputs only");
  TORCH_CHECK(prefix.dtype() == torch::kInt64 && plan.dtype() == torch::kInt64,
              "btree_greedy_draft: int64 prefix and plan");
  const int64_t* p = plan.data_ptr<int64_t>();
  const int64_t m = p[0], n = p[1], r = root.size(0), v = leaves.size(2), k = prefix.numel();
  TORCH_CHECK(internal.size(0) == m && leaves.size(0) == n && leaves.size(1) == r &&
                  (m == 0 || (internal.size(1) == r && internal.size(2) == r)),
              "btree_greedy_draft: parameter shapes do not match the plan");
  TORCH_CHECK(k <= n, "btree_greedy_draft: prefix longer than the window");
  const int64_t* up = p + 2;           // m x (row, left slot, right slot)
  const int64_t* root_kids = up + 3 * m;
  const int64_t* parent = root_kids + 2;  // m: parent node of node 1..m
  const int64_t* leaf_parent = parent + m;  // n
  const float* R = root.data_ptr<float>();
  const float* T = internal.data_ptr<float>();
  const float* L = leaves.data_ptr<float>();
  const int64_t* x_pre = prefix.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i)
    TORCH_CHECK(x_pre[i] >= 0 && x_pre[i] < v, "btree_greedy_draft: prefix id out of range");

  // message buffer: slot 0 zeros, 1..n leaves, then the non-root nodes in upward order
  std::vector<float> buf((1 + n + m) * r, 0.0f), U(m * r), top(r);
  for (int64_t i = 0; i < n; ++i) {
    float* out = buf.data() + (1 + i) * r;
    for (int64_t b = 0; b < r; ++b) {
      const float* row = L + (i * r + b) * v;
      if (i < k) {
        out[b] = row[x_pre[i]];
      } else {
        float best = row[0];
        for (int64_t x = 1; x < v; ++x) best = row[x] > best ? row[x] : best;
        out[b] = best;
      }
    }
  }
  for (int64_t j = 0; j < m; ++j) {
    const int64_t row = up[3 * j];
    const float *lm = buf.data() + up[3 * j + 1] * r, *rm = buf.data() + up[3 * j + 2] * r;
    float* u = U.data() + row * r;
    for (int64_t b = 0; b < r; ++b) u[b] = lm[b] + rm[b];
    float* msg = buf.data() + (1 + n + j) * r;
    const float* t = T + row * r * r;
    for (int64_t a = 0; a < r; ++a) {
      float best = t[a * r] + u[0];
      for (int64_t b = 1; b < r; ++b) {
        const float s = t[a * r + b] + u[b];
        best = s > best ? s : best;
      }
      msg[a] = best;
    }
  }
  // the states top-down, by node id (breadth-first: a parent before its children)
  std::vector<int64_t> z(1 + m);
  {
    const float *lm = buf.data() + root_kids[0] * r, *rm = buf.data() + root_kids[1] * r;
    int64_t arg = 0;
    float best = R[0] + (lm[0] + rm[0]);
    for (int64_t a = 1; a < r; ++a) {
      const float s = R[a] + (lm[a] + rm[a]);
      if (s > best) best = s, arg = a;
    }
    z[0] = arg;
  }
  for (int64_t node = 1; node <= m; ++node) {
    const int64_t row = node - 1;
    const float* t = T + (row * r + z[parent[row]]) * r;
    const float* u = U.data() + row * r;
    int64_t arg = 0;
    float best = t[0] + u[0];
    for (int64_t b = 1; b < r; ++b) {
      const float s = t[b] + u[b];
      if (s > best) best = s, arg = b;
    }
    z[node] = arg;
  }
  auto x = torch::empty({n}, torch::dtype(torch::kInt64));
  int64_t* xo = x.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (i < k) {
      xo[i] = x_pre[i];
      continue;
    }
    const float* row = L + (i * r + z[leaf_parent[i]]) * v;
    int64_t arg = 0;
    float best = row[0];
    for (int64_t t = 1; t < v; ++t)
      if (row[t] > best) best = row[t], arg = t;
    xo[i] = arg;
  }
  return x;
}

// ---------------------------------------------------------------------------------------------
// The sampled draft for one context with its conditionals: what BTreeCircuit._draft(greedy=False)
// computes (a draw of the window given the prefix, and q(x_i = . | x_<i) for every position), for
// the sampling cycle. Not the torch path's bits (its own float order, its own uniforms): the window
// is an exact draw from this circuit and the conditionals are this circuit's, which is all the
// acceptance rule needs. Probability domain, every message rescaled to a maximum of 1 (r states
// and a few levels: no underflow), accumulation in double.
//   upward (prefix evidence)  lam_leaf(b) = P(x_i | b) for i < k, else 1;  U_k = lam_left lam_right;
//                             msg_k(a) = sum_b T[a, b] U_k(b)
//   draw                      root ~ prior(a) U_root(a); node ~ T[z_parent, b] U_k(b); free leaf
//                             x_i ~ P(. | z_parent(i)), each by inverse CDF from one uniform
//   conditionals (evidence x) the upward pass again with every position's evidence, then downward
//                             A_child(b) = sum_a A_parent(a) sib(a) T[a, b] (sib: the left sibling's
//                             message when the child is a right child, else 1); leaf i:
//                             pi_i ~ A_parent(a) sib(a), q_i(x) = sum_a pi_i(a) P(x | a)
// Plan: the greedy plan followed by, per non-root node breadth-first, its left sibling's slot (0 for
// a left child) and, per position, its left sibling's slot (0 for a left child).

static void rescale(double* v, int64_t r) {
  double mx = 0;
  for (int64_t i = 0; i < r; ++i) mx = v[i] > mx ? v[i] : mx;
  if (mx > 0)
    for (int64_t i = 0; i < r; ++i) v[i] /= mx;
}

std::vector<torch::Tensor> btree_sample_draft(torch::Tensor root, torch::Tensor internal,
                                              torch::Tensor leaf_p, torch::Tensor prefix,
                                              torch::Tensor uniforms, torch::Tensor plan) {
  TORCH_CHECK(root.dtype() == torch::kFloat32 && internal.dtype() == torch::kFloat32 &&
                  leaf_p.dtype() == torch::kFloat32 && uniforms.dtype() == torch::kFloat64,
              "btree_sample_draft: float32 parameters and float64 uniforms");
  TORCH_CHECK(root.dim() == 1 && internal.dim() == 3 && leaf_p.dim() == 3,
              "btree_sample_draft: one context (root (r,), internal (m, r, r), leaf probabilities (n, r, v))");
  TORCH_CHECK(root.is_contiguous() && internal.is_contiguous() && leaf_p.is_contiguous() &&
                  prefix.is_contiguous() && uniforms.is_contiguous() && plan.is_contiguous(),
              "btree_sample_draft: contiguous inputs only");
  TORCH_CHECK(prefix.dtype() == torch::kInt64 && plan.dtype() == torch::kInt64,
              "btree_sample_draft: int64 prefix and plan");
  const int64_t* p = plan.data_ptr<int64_t>();
  const int64_t m = p[0], n = p[1], r = root.size(0), v = leaf_p.size(2), k = prefix.numel();
  TORCH_CHECK(plan.numel() == 2 + 3 * m + 2 + m + n + m + n, "btree_sample_draft: a plan without siblings");
  TORCH_CHECK(internal.size(0) == m && leaf_p.size(0) == n && leaf_p.size(1) == r &&
                  (m == 0 || (internal.size(1) == r && internal.size(2) == r)),
              "btree_sample_draft: parameter shapes do not match the plan");
  TORCH_CHECK(k <= n && uniforms.numel() == 1 + m + n,
              "btree_sample_draft: prefix longer than the window or not 1 + m + n uniforms");
  const int64_t* up = p + 2;
  const int64_t* root_kids = up + 3 * m;
  const int64_t* parent = root_kids + 2;
  const int64_t* leaf_parent = parent + m;
  const int64_t* node_sib = leaf_parent + n;
  const int64_t* leaf_sib = node_sib + m;
  const float* R = root.data_ptr<float>();
  const float* T = internal.data_ptr<float>();
  const float* P = leaf_p.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  const int64_t* x_pre = prefix.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i)
    TORCH_CHECK(x_pre[i] >= 0 && x_pre[i] < v, "btree_sample_draft: prefix id out of range");

  std::vector<double> Tp(m * r * r), Rp(r), buf((1 + n + m) * r), U(m * r), w(std::max(r, v));
  for (int64_t i = 0; i < m * r * r; ++i) Tp[i] = std::exp(static_cast<double>(T[i]));
  for (int64_t a = 0; a < r; ++a) Rp[a] = std::exp(static_cast<double>(R[a]));
  std::vector<int64_t> x(n);
  for (int64_t i = 0; i < k; ++i) x[i] = x_pre[i];

  // the upward pass with evidence at positions < ev (messages as functions of the parent's state)
  auto upward = [&](int64_t ev) {
    for (int64_t b = 0; b < r; ++b) buf[b] = 1.0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t b = 0; b < r; ++b) buf[(1 + i) * r + b] = i < ev ? P[(i * r + b) * v + x[i]] : 1.0;
    for (int64_t j = 0; j < m; ++j) {
      const int64_t row = up[3 * j];
      const double *lm = buf.data() + up[3 * j + 1] * r, *rm = buf.data() + up[3 * j + 2] * r;
      double* uk = U.data() + row * r;
      for (int64_t b = 0; b < r; ++b) uk[b] = lm[b] * rm[b];
      rescale(uk, r);
      double* msg = buf.data() + (1 + n + j) * r;
      const double* t = Tp.data() + row * r * r;
      for (int64_t a = 0; a < r; ++a) {
        double s = 0;
        for (int64_t b = 0; b < r; ++b) s += t[a * r + b] * uk[b];
        msg[a] = s;
      }
      rescale(msg, r);
    }
  };

  // the draw
  upward(k);
  std::vector<int64_t> z(1 + m);
  {
    const double *lm = buf.data() + root_kids[0] * r, *rm = buf.data() + root_kids[1] * r;
    for (int64_t a = 0; a < r; ++a) w[a] = Rp[a] * lm[a] * rm[a];
    z[0] = inverse_cdf(w.data(), r, u[0]);
  }
  for (int64_t node = 1; node <= m; ++node) {
    const int64_t row = node - 1;
    const double* t = Tp.data() + (row * r + z[parent[row]]) * r;
    const double* uk = U.data() + row * r;
    for (int64_t b = 0; b < r; ++b) w[b] = t[b] * uk[b];
    z[node] = inverse_cdf(w.data(), r, u[node]);
  }
  for (int64_t i = k; i < n; ++i) {
    const float* row = P + (i * r + z[leaf_parent[i]]) * v;
    for (int64_t t = 0; t < v; ++t) w[t] = row[t];
    x[i] = inverse_cdf(w.data(), v, u[1 + m + i]);
  }

  // the conditionals given the whole window
  upward(n);
  std::vector<double> A((1 + m) * r), pi(r), vec(r);
  for (int64_t a = 0; a < r; ++a) A[a] = Rp[a];
  for (int64_t node = 1; node <= m; ++node) {
    const int64_t row = node - 1, par = parent[row];
    const double* sib = buf.data() + node_sib[row] * r;
    for (int64_t a = 0; a < r; ++a) vec[a] = A[par * r + a] * sib[a];
    double* out = A.data() + node * r;
    for (int64_t b = 0; b < r; ++b) out[b] = 0;
    const double* t = Tp.data() + row * r * r;
    for (int64_t a = 0; a < r; ++a)
      for (int64_t b = 0; b < r; ++b) out[b] += vec[a] * t[a * r + b];
    rescale(out, r);
  }
  auto q = torch::empty({n, v}, torch::dtype(torch::kFloat32));
  float* qo = q.data_ptr<float>();
  std::vector<double> acc(v);
  for (int64_t i = 0; i < n; ++i) {
    const double* sib = buf.data() + leaf_sib[i] * r;
    double total = 0;
    for (int64_t a = 0; a < r; ++a) total += (pi[a] = A[leaf_parent[i] * r + a] * sib[a]);
    for (int64_t t = 0; t < v; ++t) acc[t] = 0;
    for (int64_t a = 0; a < r; ++a) {
      const double wa = pi[a] / total;
      const float* row = P + (i * r + a) * v;
      for (int64_t t = 0; t < v; ++t) acc[t] += wa * row[t];
    }
    for (int64_t t = 0; t < v; ++t) qo[i * v + t] = static_cast<float>(acc[t]);
  }
  auto xs = torch::empty({n}, torch::dtype(torch::kInt64));
  std::copy(x.begin(), x.end(), xs.data_ptr<int64_t>());
  return {xs, q};
}
