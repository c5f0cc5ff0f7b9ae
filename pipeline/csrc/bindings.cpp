// The Python module of lowbit's CPU kernels (pipeline/cpu_ext.py builds it).
#include <torch/extension.h>

#include <optional>
#include <string>

torch::Tensor w4a8_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                      torch::Tensor zero, int64_t group_len, const std::string& isa);
torch::Tensor lut16_mm(torch::Tensor x, torch::Tensor packed, torch::Tensor base,
                       torch::Tensor ridx, torch::Tensor tables, int64_t group_len,
                       const std::string& isa);
torch::Tensor f32_rows_mm(torch::Tensor x, torch::Tensor weight, const std::string& isa);
torch::Tensor add_rms_norm(torch::Tensor x, std::optional<torch::Tensor> delta,
                           torch::Tensor weight, double eps, const std::string& isa);
torch::Tensor rope_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                             torch::Tensor k_cache, torch::Tensor v_cache, int64_t past,
                             int64_t heads, double scaling, const std::string& isa);
torch::Tensor silu_mul(torch::Tensor gate_up, const std::string& isa);

// The kernels' index of an ISA: 0 "avx2", 1 "avx512", 2 "avx512gfni" (the avx512 kernels, with
// GFNI where a kernel has a use for it). A CPU that lacks the ISA gets an error here rather than
// an illegal instruction inside the kernel (cpu_ext.isa() picks one it runs).
int isa_index(const std::string& isa) {
  if (isa == "avx2") {
    TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
                "this CPU lacks AVX2/FMA: lowbit's avx2 kernels cannot run here");
    return 0;
  }
  if (isa == "avx512" || isa == "avx512gfni") {
    TORCH_CHECK(__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                    __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"),
                "this CPU lacks AVX-512 VNNI: lowbit's ", isa, " kernels cannot run here");
    if (isa == "avx512") return 1;
    TORCH_CHECK(__builtin_cpu_supports("gfni"),
                "this CPU lacks GFNI: lowbit's avx512gfni kernels cannot run here");
    return 2;
  }
  TORCH_CHECK(false, "unknown ISA '", isa,
              "': lowbit's CPU kernels are built for avx512gfni, avx512, avx2");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w4a8_mm", &w4a8_mm, "W4A8 matmul, few rows (w4a8.cpp)", py::arg("x"),
        py::arg("packed"), py::arg("scale"), py::arg("zero"), py::arg("group_len"),
        py::arg("isa"));
  m.def("lut16_mm", &lut16_mm, "4-bit LUT codes x float32, few rows (lut16.cpp)", py::arg("x"),
        py::arg("packed"), py::arg("base"), py::arg("ridx"), py::arg("tables"),
        py::arg("group_len"), py::arg("isa"));
  m.def("f32_rows_mm", &f32_rows_mm, "float32 matmul, few rows, weight read once (f32_rows.cpp)",
        py::arg("x"), py::arg("weight"), py::arg("isa"));
  m.def("add_rms_norm", &add_rms_norm, "x += delta in place, then RMSNorm(x) * weight (decode_ops.cpp)",
        py::arg("x"), py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("isa"));
  m.def("rope_attention", &rope_attention,
        "rotary embedding, KV-cache write and attention for a few rows (decode_ops.cpp)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("past"), py::arg("heads"),
        py::arg("scaling"), py::arg("isa"));
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of [gate | up] rows (decode_ops.cpp)",
        py::arg("gate_up"), py::arg("isa"));
}
