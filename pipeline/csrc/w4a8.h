// What w4a8.cpp's driver and its two ISA files (w4a8_avx512.cpp, w4a8_avx2.cpp) share: the
// tiling, the per-ISA function table and the activation quantizer's bookkeeping. The layouts
// and the reasons: w4a8.cpp. Included above the ISA files' target pragmas, so close_block is
// baseline code that each ISA's functions inline.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace w4a8 {

constexpr int kTile = 16;   // output rows per tile: the 16 int32 lanes of a zmm
constexpr int kBlock = 32;  // columns per activation scale and per packed block
// Bytes ahead in the weight stream (32 4-bit blocks), prefetched into L2, not L1: with L1 as the
// target the few L1 miss buffers capped the loads in flight once the rows' multiplies filled the
// time between them.
constexpr int kPrefetch = 8192;
constexpr int kLayouts = 4;
constexpr int kLayoutBits[kLayouts] = {2, 3, 4, 8};  // the code width of each layout

// One row of x (k floats) -> int8 codes xq, a scale dx and the code sum bs per block, the
// dequantized sum sx per group.
using QuantizeFn = void (*)(const float* x, int64_t k, int64_t blocks_per_group, int8_t* xq,
                            float* dx, int32_t* bs, float* sx);
// One tile of 16 outputs for R activation rows: out[m, 0:16] for m < R.
using TileFn = void (*)(const uint8_t* w, const at::Half* scale, const at::Half* zero,
                        const int8_t* xq, const float* dx, const int32_t* bs, const float* sx,
                        int64_t k, int64_t blocks_per_group, float* out, int64_t n);

struct Kernels {
  QuantizeFn quantize;
  int max_rows;                   // activation rows per pass
  const TileFn* tiles[kLayouts];  // [layout][R], R = 1..max_rows
};

extern const Kernels kAvx2, kAvx512, kAvx512Gfni;  // by isa_index: 0, 1, 2

// Stores a block's scale d and code sum, adds d * sum(q) to its group's and closes the group
// every blocks_per_group blocks.
inline void close_block(int64_t b, int64_t blocks_per_group, float d, int32_t sum, float* dx,
                        int32_t* bs, float* sx, float& group_sum) {
  dx[b] = d;
  bs[b] = sum;
  group_sum += d * static_cast<float>(sum);
  if ((b + 1) % blocks_per_group == 0) {
    sx[b / blocks_per_group] = group_sum;
    group_sum = 0.f;
  }
}

}  // namespace w4a8
