// W4A8 / W8A8 matmul for a few rows on AVX-512 VNNI: y = x @ W.T, W = (u - base - offset) * scale
// per group, u the unsigned code (base 8 for 2/3/4-bit codes, 128 for 8-bit ones).
//
// Weights: packed by pipeline/runtime/cpu_w4a8.py in tiles of 16 output rows and blocks of 32
// columns. 4-bit codes take 256 bytes per (tile, block): byte 64c + 4r + i holds u[r, 8c + i] in
// its low nibble and u[r, 8c + 4 + i] in its high nibble. 8-bit codes take 512 bytes: byte
// 64j + 4r + i holds u[r, 4j + i]. Either way the block yields eight registers whose 32-bit lane
// r holds four consecutive codes of output row r, which is what vpdpbusd multiplies with four
// int8 activations broadcast to every lane: 16 output rows accumulate in one register and no
// horizontal sum is ever needed.
//
// Activations: each row is quantized per 32 columns to int8, symmetric (Q8_0: d = max|x| / 127).
// The zero term (base + offset) * scale * sum(x) uses the sum of the *quantized* x, so the result
// is exactly W . x_hat: the error is that of x_hat alone (~0.5% relative), not of u . dx.
//
// The point is the loop order: a block of weights is loaded (and unpacked) once, then applied to
// up to kMaxRows activation rows held in registers, so the weights are read from memory once
// whatever M; the rows then cost vpdpbusd throughput (M = 5: ~1.7x M = 1, int4pack: 2.7x).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>

#include <cstdint>

namespace {

constexpr int kTile = 16;    // output rows per tile: the 16 int32 lanes of a zmm
constexpr int kBlock = 32;   // columns per activation scale and per packed block
constexpr int kMaxRows = 6;  // activation rows per pass: 3 zmm each, beside 8 weight zmm
// Bytes ahead in the weight stream (32 4-bit blocks), prefetched into L2, not L1: with L1 as the
// target, the few L1 miss buffers capped the loads in flight once the rows' vpdpbusd work filled
// the time between them, and 5 rows cost 1.6 single rows on a 1B model; into L2, 1.1-1.3.
constexpr int kPrefetch = 8192;

// One row of x (k floats) -> int8 codes, a scale per block, the dequantized sum per group.
void quantize_row(const float* x, int64_t k, int64_t blocks_per_group, int8_t* xq, float* dx,
                  float* sx) {
  const int64_t nb = k / kBlock;
  float group_sum = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * kBlock), hi = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    // cvtps rounds to nearest even (the default MXCSR mode); |values| <= 127 so vpmovdb is exact
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 16), _mm512_cvtepi32_epi8(qhi));
    dx[b] = d;
    group_sum += d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
    if ((b + 1) % blocks_per_group == 0) {
      sx[b / blocks_per_group] = group_sum;
      group_sum = 0.f;
    }
  }
}

// One tile of 16 outputs for R activation rows: out[m, 0:16] for m < R.
// 16 float16 -> float32 (scale and zero are stored as float16: half the bytes of a group's
// parameters, which at 64-column groups are 1 bit per weight in float32)
inline __m512 load_half(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int BITS, int R>
void tile_rows(const uint8_t* w, const at::Half* scale, const at::Half* zero, const int8_t* xq,
               const float* dx, const float* sx, int64_t k, int64_t blocks_per_group,
               float* out, int64_t n) {
  constexpr int kBlockBytes = kTile * kBlock * BITS / 8;  // 256 (4-bit codes) or 512 (8-bit)
  const int64_t nb = k / kBlock, groups = nb / blocks_per_group;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R], part[R];  // the output; the current group's sum of dx * (u . xq)
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int m = 0; m < R; ++m) part[m] = _mm512_setzero_ps();
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      const uint8_t* wb = w + b * kBlockBytes;
      for (int line = 0; line < kBlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + line), _MM_HINT_T1);
      __m512i wr[8];
      if constexpr (BITS == 4) {
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(wb + 64 * c);
          wr[2 * c] = _mm512_and_si512(v, low);
          wr[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
      } else {
        for (int j = 0; j < 8; ++j) wr[j] = _mm512_loadu_si512(wb + 64 * j);
      }
      for (int m = 0; m < R; ++m) {
        const int32_t* xm = reinterpret_cast<const int32_t*>(xq + m * k + b * kBlock);
        // two chains, so that one row's eight dependent vpdpbusd do not serialise
        __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 2) {
          i0 = _mm512_dpbusd_epi32(i0, wr[j], _mm512_set1_epi32(xm[j]));
          i1 = _mm512_dpbusd_epi32(i1, wr[j + 1], _mm512_set1_epi32(xm[j + 1]));
        }
        const __m512 d = _mm512_set1_ps(dx[m * nb + b]);
        part[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), d, part[m]);
      }
    }
    const __m512 s = load_half(scale + g * kTile), z = load_half(zero + g * kTile);
    for (int m = 0; m < R; ++m) {
      acc[m] = _mm512_fmadd_ps(part[m], s, acc[m]);
      acc[m] = _mm512_fnmadd_ps(z, _mm512_set1_ps(sx[m * groups + g]), acc[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(out + m * n, acc[m]);
}

using TileFn = void (*)(const uint8_t*, const at::Half*, const at::Half*, const int8_t*,
                        const float*, const float*, int64_t, int64_t, float*, int64_t);
template <int BITS>
constexpr TileFn kTileFns[kMaxRows + 1] = {
    nullptr,           tile_rows<BITS, 1>, tile_rows<BITS, 2>, tile_rows<BITS, 3>,
    tile_rows<BITS, 4>, tile_rows<BITS, 5>, tile_rows<BITS, 6>};

}  // namespace

// x (M, k) float32; packed (n / 16, k / 32, 256 or 512) uint8 (4- or 8-bit codes); scale, zero
// (n / 16, groups, 16) float16.
at::Tensor w4a8_mm(at::Tensor x, at::Tensor packed, at::Tensor scale,
                      at::Tensor zero, int64_t group_len) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous());
  const int64_t rows = x.size(0), k = x.size(1), tiles = packed.size(0), n = tiles * kTile;
  TORCH_CHECK(k % kBlock == 0 && group_len % kBlock == 0 && k % group_len == 0);
  TORCH_CHECK(packed.size(1) == k / kBlock && (packed.size(2) == 256 || packed.size(2) == 512));
  const TileFn* fns = packed.size(2) == 256 ? kTileFns<4> : kTileFns<8>;
  const int64_t block_bytes = packed.size(2);
  const int64_t nb = k / kBlock, bpg = group_len / kBlock, groups = k / group_len;
  auto xq = at::empty({rows, k}, x.options().dtype(at::kChar));
  auto dx = at::empty({rows, nb}, x.options());
  auto sx = at::empty({rows, groups}, x.options());
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float *dxp = dx.data_ptr<float>(), *sxp = sx.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(xp + m * k, k, bpg, xqp + m * k, dxp + m * nb, sxp + m * groups);
  });
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  TORCH_CHECK(scale.scalar_type() == at::kHalf && zero.scalar_type() == at::kHalf);
  const at::Half *sp = scale.data_ptr<at::Half>(), *zp = zero.data_ptr<at::Half>();
  // Tiles split across threads; each thread walks its tiles' weights once per kMaxRows rows
  // (later passes over the same tile come from L2: 16 * k / 2 bytes).
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        const int r = static_cast<int>(std::min<int64_t>(kMaxRows, rows - m0));
        fns[r](wp + t * nb * block_bytes, sp + t * groups * kTile, zp + t * groups * kTile,
                    xqp + m0 * k, dxp + m0 * nb, sxp + m0 * groups, k, bpg,
                    op + m0 * n + t * kTile, n);
      }
    }
  });
  return out;
}
