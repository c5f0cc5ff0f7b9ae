// The Python module of lowbit's CPU kernels (pipeline/runtime/cpu_ext.py builds it).
#include <torch/extension.h>

torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                      torch::Tensor zero, int64_t group_len);
torch::Tensor f32_rows_mm(torch::Tensor x, torch::Tensor weight);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w4a8_mm", &w4a8_mm, "W4A8 matmul, few rows (w4a8.cpp)");
  m.def("f32_rows_mm", &f32_rows_mm, "float32 matmul, few rows, weight read once (f32_rows.cpp)");
}
