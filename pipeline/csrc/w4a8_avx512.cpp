// w4a8.cpp's kernels on AVX-512 VNNI: vpdpbusd multiplies u8 codes by s8 activations, four at a
// time, into int32. Only kernel code sits between the target pragmas (see w4a8.cpp).
// w4a8_avx512_gfni.cpp compiles this file again with GFNI, for CPUs that have it: one
// vgf2p8affineqb moves a byte's 2- or 4-bit field down where a shift and a mask took two.
#include <immintrin.h>

#include "w4a8.h"

#pragma GCC push_options
#ifdef LOWBIT_W4A8_GFNI
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,gfni,avx2,fma,f16c")
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif
namespace {
namespace avx512 {

using namespace w4a8;

// Bits [from, from + width) of every byte moved to bits [0, width), the rest cleared: GFNI's
// affine transform (row i of the 8x8 bit matrix, byte 7 - i, picks input bit from + i), else a
// 16-bit shift, whose bits from the next byte the mask clears.
inline __m512i field(__m512i v, int from, int width) {
#ifdef LOWBIT_W4A8_GFNI
  uint64_t matrix = 0;
  for (int i = 0; i < width; ++i) matrix |= (uint64_t{1} << (from + i)) << (8 * (7 - i));
  return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(static_cast<int64_t>(matrix)), 0);
#else
  return _mm512_and_si512(_mm512_srli_epi16(v, from), _mm512_set1_epi8((1 << width) - 1));
#endif
}

constexpr int kMaxRows = 6;  // activation rows per pass: 3 zmm each, beside 8 weight zmm

void quantize_row(const float* x, int64_t k, int64_t blocks_per_group, int8_t* xq, float* dx,
                  int32_t* bs, float* sx) {
  float group_sum = 0.f;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * kBlock), hi = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    // cvtps rounds to nearest even (the default MXCSR mode); |values| <= 127 so vpmovdb is exact
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 16), _mm512_cvtepi32_epi8(qhi));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    close_block(b, blocks_per_group, d, sum, dx, bs, sx, group_sum);
  }
}

// 16 float16 -> float32 (scale and zero are stored as float16: half the bytes of a group's
// parameters, which at 64-column groups are 1 bit per weight in float32)
inline __m512 load_half(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i load(const uint8_t* p) { return _mm512_loadu_si512(p); }

// A block's eight vpdpbusd lines: wr[j] holds columns 4j..4j+3 of row r in its lane r.
template <int BITS>
inline void unpack(const uint8_t* wb, __m512i* wr) {
  if constexpr (BITS == 8) {
    for (int j = 0; j < 8; ++j) wr[j] = load(wb + 64 * j);
  } else if constexpr (BITS == 4) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = load(wb + 64 * c);
      wr[2 * c] = _mm512_and_si512(v, low);
      wr[2 * c + 1] = field(v, 4, 4);
    }
  } else {  // 2 bits, and the low two of 3-bit codes
    for (int c = 0; c < 2; ++c) {
      const __m512i v = load(wb + 64 * c);
      wr[4 * c] = _mm512_and_si512(v, _mm512_set1_epi8(3));
      for (int s = 1; s < 4; ++s) wr[4 * c + s] = field(v, 2 * s, 2);
    }
    if constexpr (BITS == 3) {  // bit j of each byte of the 1-bit plane: line j's bit 2
      const __m512i hi = load(wb + 128), four = _mm512_set1_epi8(4);
      for (int j = 0; j < 8; ++j) {
        // bit j shifted to bit 2, then wr | (that & 4) in one vpternlogd (0xF8: a | (b & c))
        const __m512i at2 = j < 2 ? _mm512_slli_epi16(hi, 2 - j) : _mm512_srli_epi16(hi, j - 2);
        wr[j] = _mm512_ternarylogic_epi32(wr[j], at2, four, 0xF8);
      }
    }
  }
}

template <int BITS, int R>
void tile_rows(const uint8_t* w, const at::Half* scale, const at::Half* zero, const int8_t* xq,
               const float* dx, const int32_t*, const float* sx, int64_t k,
               int64_t blocks_per_group, float* out, int64_t n) {
  constexpr int kBlockBytes = kTile * kBlock * BITS / 8;  // 128, 192, 256 or 512
  const int64_t nb = k / kBlock, groups = nb / blocks_per_group;
  __m512 acc[R], part[R];  // the output; the current group's sum of dx * (u . xq)
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int m = 0; m < R; ++m) part[m] = _mm512_setzero_ps();
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      const uint8_t* wb = w + b * kBlockBytes;
      for (int line = 0; line < kBlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + line), _MM_HINT_T1);
      __m512i wr[8];
      unpack<BITS>(wb, wr);
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

template <int BITS>
constexpr TileFn kTileFns[kMaxRows + 1] = {
    nullptr,            tile_rows<BITS, 1>, tile_rows<BITS, 2>, tile_rows<BITS, 3>,
    tile_rows<BITS, 4>, tile_rows<BITS, 5>, tile_rows<BITS, 6>};

}  // namespace avx512
}  // namespace
#pragma GCC pop_options

#ifdef LOWBIT_W4A8_GFNI
const w4a8::Kernels w4a8::kAvx512Gfni = {
#else
const w4a8::Kernels w4a8::kAvx512 = {
#endif
    avx512::quantize_row,
    avx512::kMaxRows,
    {avx512::kTileFns<2>, avx512::kTileFns<3>, avx512::kTileFns<4>, avx512::kTileFns<8>}};
