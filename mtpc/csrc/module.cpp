// The Python module of mtpc's CPU kernels (built by mtpc/kernels.py): the row-dot product
// (rowdot.cpp), the btree drafts, greedy and sampled (btree_draft.cpp), and the sampling cycle's
// acceptance (accept.cpp).

#include <torch/extension.h>

#include <vector>

torch::Tensor rowdot_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor rowdot_batched(torch::Tensor x, torch::Tensor wt, torch::Tensor bias);
std::vector<torch::Tensor> head_params(torch::Tensor e, torch::Tensor c, torch::Tensor known, torch::Tensor w,
                                       torch::Tensor bias, torch::Tensor bt, int64_t n, int64_t r, int64_t v);
torch::Tensor btree_greedy_draft(torch::Tensor root, torch::Tensor internal, torch::Tensor leaves,
                                 torch::Tensor prefix, torch::Tensor plan);
std::vector<torch::Tensor> btree_sample_draft(torch::Tensor root, torch::Tensor internal,
                                              torch::Tensor leaf_p, torch::Tensor prefix,
                                              torch::Tensor uniforms, torch::Tensor plan);
torch::Tensor sample_accept(torch::Tensor p, torch::Tensor q, torch::Tensor draft, int64_t budget,
                            std::vector<int64_t> stop_ids, torch::Tensor uniforms);
torch::Tensor greedy_accept_native(torch::Tensor logits, torch::Tensor draft, int64_t budget,
                                   std::vector<int64_t> stop_ids, std::vector<int64_t> banned);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rowdot_linear", &rowdot_linear, "x (..., in), W (out, in), bias (out,) or None -> x W^T + bias");
  m.def("rowdot_batched", &rowdot_batched,
        "x (J, K), WT (J, K, N), bias (G, N) -> y (J, N), y[j] = x[j] WT[j] + bias[j / (J / G)]");
  m.def("head_params", &head_params,
        "e (d,), c (1,) or empty, E (V, d) or empty, W (N, d), bias (N,), B^T (n r, k, v) or empty, n, r, v "
        "-> [leaves (n, r, v) log-probs, sum units' log-weights (flat)]");
  m.def("btree_greedy_draft", &btree_greedy_draft,
        "root (r,), internal (m, r, r), leaves (n, r, v), prefix (k,), plan -> the greedy window (n,)");
  m.def("btree_sample_draft", &btree_sample_draft,
        "root (r,), internal (m, r, r), leaf probabilities (n, r, v), prefix (k,), uniforms (1 + m + n,), plan "
        "-> [the drawn window (n,), its conditionals q (n, v)]");
  m.def("greedy_accept", &greedy_accept_native,
        "logits (m + 1, v), draft (m,), budget, stop ids, banned ids -> [s, extra, count, *draft]");
  m.def("sample_accept", &sample_accept,
        "p (m + 1, v), q (m, v) probabilities, draft (m,), budget, stop ids, 2 uniforms -> [s, extra, count, *draft]");
}
