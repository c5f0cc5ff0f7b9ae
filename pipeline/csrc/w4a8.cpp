// W2/W3/W4/W8 x A8 matmul for a few rows: y = x @ W.T, W = (u - base - offset) * scale per group,
// u the unsigned code, base = 2**(bits - 1) (2, 4, 8 or 128). One build holds an AVX-512 VNNI
// version (w4a8_avx512.cpp; w4a8_avx512_gfni.cpp: the same with GFNI) and an AVX2 one
// (w4a8_avx2.cpp), each compiled for its ISA alone, so a CPU runs only the one Python chose
// (cpu_ext.isa()); this driver calls it through a table.
//
// Weights: packed by pipeline/runtime/cpu_w4a8.py in tiles of 16 output rows and blocks of 32
// columns, each (tile, block) read as eight "lines" j = 0..7: line j holds u[r, 4j + i] (i < 4)
// in byte 4r + i, i.e. four consecutive codes of each of the 16 output rows in its 32-bit lane r.
// That is what vpdpbusd (AVX-512) multiplies with four int8 activations broadcast to every lane,
// so 16 output rows accumulate in one register and no horizontal sum is ever needed; AVX2 reads
// each line as two halves, rows 0-7 and 8-15. The layouts store only each code's bits, and the
// kernels rebuild the lines in registers with shifts and masks:
//   8-bit: 512 bytes per (tile, block); byte 64j + 4r + i holds line j's code.
//   4-bit: 256 bytes; byte 64c + 4r + i (c < 4) holds line 2c in its low nibble, 2c + 1 in its
//          high nibble.
//   2-bit: 128 bytes; byte 64c + 4r + i (c < 2) holds line 4c + s at bits 2s..2s+1 (s < 4).
//   3-bit: 192 bytes; the low two bits of each code as the 2-bit layout (bytes 0-127), then a
//          1-bit plane: byte 128 + 4r + i holds line j's third bit at bit j (j < 8).
// So a layer's codes take exactly bits / 8 bytes per weight, plus float16 scale and zero per
// 16 rows and group.
//
// Each ISA's code sits between its target pragmas, and only kernel code does: the ATen, std and
// w4a8.h headers are included above them, so no inline header function is emitted (and shared
// with other objects) carrying AVX-512 or AVX2 instructions.
//
// Activations: each row is quantized per 32 columns to int8, symmetric (Q8_0: d = max|x| / 127),
// the same way on both ISAs. The zero term (base + offset) * scale * sum(x) uses the sum of the
// *quantized* x, so the result is exactly W . x_hat: the error is that of x_hat alone (~0.5%
// relative), not of u . dx. Both ISAs compute the same integer dot products per block.
//
// The point is the loop order: a block of weights is loaded (and unpacked) once, then applied to
// up to max_rows activation rows held in registers, so the weights are read from memory once
// whatever M; the rows then cost multiply throughput, not bandwidth.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "w4a8.h"

int isa_index(const std::string& isa);  // bindings.cpp: 0 avx2, 1 avx512, 2 avx512gfni

namespace {

using namespace w4a8;

// The tile table's index of a block of block_bytes bytes, or -1.
int layout_index(int64_t block_bytes) {
  for (int i = 0; i < kLayouts; ++i)
    if (block_bytes == kTile * kBlock * kLayoutBits[i] / 8) return i;
  return -1;
}

}  // namespace

// x (M, k) float32; packed (n / 16, k / 32, 16 * 32 * bits / 8) uint8, bits 2, 3, 4 or 8;
// scale, zero (n / 16, groups, 16) float16; isa "avx512gfni", "avx512" or "avx2".
at::Tensor w4a8_mm(at::Tensor x, at::Tensor packed, at::Tensor scale, at::Tensor zero,
                   int64_t group_len, const std::string& isa) {
  const Kernels* by_isa[] = {&kAvx2, &kAvx512, &kAvx512Gfni};
  const Kernels& kern = *by_isa[isa_index(isa)];
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous());
  const int64_t rows = x.size(0), k = x.size(1), tiles = packed.size(0), n = tiles * kTile;
  TORCH_CHECK(k % kBlock == 0 && group_len % kBlock == 0 && k % group_len == 0);
  const int layout = layout_index(packed.size(2));
  TORCH_CHECK(packed.size(1) == k / kBlock && layout >= 0,
              "packed codes must be (n / 16, k / 32, 128|192|256|512): see cpu_w4a8.pack");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && zero.scalar_type() == at::kHalf);
  const TileFn* fns = kern.tiles[layout];
  const int64_t block_bytes = packed.size(2);
  const int64_t nb = k / kBlock, bpg = group_len / kBlock, groups = k / group_len;
  auto xq = at::empty({rows, k}, x.options().dtype(at::kChar));
  auto dx = at::empty({rows, nb}, x.options());
  auto bs = at::empty({rows, nb}, x.options().dtype(at::kInt));
  auto sx = at::empty({rows, groups}, x.options());
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  int32_t* bsp = bs.data_ptr<int32_t>();
  float *dxp = dx.data_ptr<float>(), *sxp = sx.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      kern.quantize(xp + m * k, k, bpg, xqp + m * k, dxp + m * nb, bsp + m * nb, sxp + m * groups);
  });
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::Half *sp = scale.data_ptr<at::Half>(), *zp = zero.data_ptr<at::Half>();
  // Tiles split across threads; each thread walks its tiles' weights once per max_rows rows
  // (later passes over the same tile come from L2: 16 * k * bits / 8 bytes).
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t m0 = 0; m0 < rows; m0 += kern.max_rows) {
        const int r = static_cast<int>(std::min<int64_t>(kern.max_rows, rows - m0));
        fns[r](wp + t * nb * block_bytes, sp + t * groups * kTile, zp + t * groups * kTile,
               xqp + m0 * k, dxp + m0 * nb, bsp + m0 * nb, sxp + m0 * groups, k, bpg,
               op + m0 * n + t * kTile, n);
      }
    }
  });
  return out;
}
