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
