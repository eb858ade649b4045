// The Python module of mtpc's CPU kernels (built by mtpc/kernels.py): the row-dot product
// (rowdot.cpp) and the btree greedy draft (btree_greedy.cpp).

#include <torch/extension.h>

torch::Tensor rowdot_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor btree_greedy_draft(torch::Tensor root, torch::Tensor internal, torch::Tensor leaves,
                                 torch::Tensor prefix, torch::Tensor plan);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rowdot_linear", &rowdot_linear, "x (..., in), W (out, in), bias (out,) or None -> x W^T + bias");
  m.def("btree_greedy_draft", &btree_greedy_draft,
        "root (r,), internal (m, r, r), leaves (n, r, v), prefix (k,), plan -> the greedy window (n,)");
}
