// w4a8.cpp's kernels on AVX2: no vpdpbusd. vpmaddubsw multiplies u8 by s8 into int16 pairs,
// vpmaddwd by ones sums the pairs into int32. A tile is two halves of 8 output rows (the 8 int32
// lanes of a ymm): bytes 0-31 and 32-63 of each 64-byte line of the layout.
#include <immintrin.h>

#include "w4a8.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace avx2 {

using namespace w4a8;

constexpr int kMaxRows = 5;  // activation rows per pass
// 8-bit: blocks per pass over one half of a tile: the halves alternate every chunk, so the
// second reads the chunk's lines from L1. A divisor of the group (the scale applies per pass).
constexpr int kChunk = 4;

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// The AVX-512 quantization's arithmetic, 8 lanes at a time: the same codes and scales.
void quantize_row(const float* x, int64_t k, int64_t blocks_per_group, int8_t* xq, float* dx,
                  int32_t* bs, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' lane split
  float group_sum = 0.f;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float a = hmax(amax);
    const float d = a / 127.f, inv = a > 0.f ? 127.f / a : 0.f;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    const __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                          _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock),
                        _mm256_permutevar8x32_epi32(q8, order));
    const int32_t sum =
        hsum(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    close_block(b, blocks_per_group, d, sum, dx, bs, sx, group_sum);
  }
}

inline __m256 load_half(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i bcast(const int8_t* p) {  // four int8 activations to every lane
  return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p));
}

inline __m256i load(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Lines 2p and 2p + 1 of a 2/3/4-bit block (columns 8p..8p+7) for the tile's half h: each
// 32-bit lane r holds four codes of row 8h + r.
template <int BITS>
inline void line_pair(const uint8_t* wb, int p, int h, __m256i& a, __m256i& b) {
  if constexpr (BITS == 4) {
    const __m256i v = load(wb + 64 * p + 32 * h), low = _mm256_set1_epi8(0x0F);
    a = _mm256_and_si256(v, low);
    b = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  } else {  // line j = 4c + s at bits 2s of line c; the 16-bit shifts stay inside each byte
    const __m256i v = load(wb + 64 * (p / 2) + 32 * h), three = _mm256_set1_epi8(3);
    const int s = 4 * (p % 2);
    a = _mm256_and_si256(_mm256_srli_epi16(v, s), three);
    b = _mm256_and_si256(_mm256_srli_epi16(v, s + 2), three);
    if constexpr (BITS == 3) {  // bit j of each byte of the 1-bit plane: line j's bit 2
      const __m256i hi = load(wb + 128 + 32 * h), one = _mm256_set1_epi8(1);
      const __m256i ba = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * p), one);
      const __m256i bb = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * p + 1), one);
      a = _mm256_or_si256(a, _mm256_slli_epi16(ba, 2));
      b = _mm256_or_si256(b, _mm256_slli_epi16(bb, 2));
    }
  }
}

// 2- and 3-bit: 64-byte line c of the low two bits holds lines 4c..4c+3, line 4c + s at bits 2s
// (3-bit: line j's third bit at bit j of the 1-bit plane). Each line is masked where it lies
// shifted to bits 2-3 (2-bit: 4u) or 1-3 (3-bit: 2u): one load and constant shifts for four
// lines, no shift back (1.16x / 1.2x the codes per second at one row, one thread); pairs stay
// <= 2 * 14 * 127 and a block's eight per lane sum to <= 28448. kScaled undoes the factor (exact).
template <int BITS>
constexpr float kScaled = BITS == 2 ? 0.25f : 0.5f;
// One row only: from two rows on, the pairs below (which reload and shift the same line again)
// measured as fast or faster (quad's eight lines and 2R accumulators spill registers).
template <int BITS, int R>
constexpr bool kQuad = BITS < 4 && R == 1;

// One line c of the low bits: its four lines of each half, scaled, times the activations of
// columns 16c..16c+15 of one row (x: this block's), added to the halves' s[0], s[1].
template <int BITS>
inline void quad(const uint8_t* wb, int c, const int8_t* x, __m256i (&s)[2]) {
  __m256i q[2][4];
  for (int h = 0; h < 2; ++h) {
    const __m256i v = load(wb + 64 * c + 32 * h);
    if constexpr (BITS == 2) {
      const __m256i twelve = _mm256_set1_epi8(12);
      q[h][0] = _mm256_and_si256(_mm256_slli_epi16(v, 2), twelve);
      q[h][1] = _mm256_and_si256(v, twelve);
      q[h][2] = _mm256_and_si256(_mm256_srli_epi16(v, 2), twelve);
      q[h][3] = _mm256_and_si256(_mm256_srli_epi16(v, 4), twelve);
    } else {
      const __m256i six = _mm256_set1_epi8(6), eight = _mm256_set1_epi8(8);
      const __m256i hi = _mm256_srli_epi16(load(wb + 128 + 32 * h), 4 * c);  // bits 4c.. at 0..
      q[h][0] = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(v, 1), six),
                                _mm256_and_si256(_mm256_slli_epi16(hi, 3), eight));
      q[h][1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 1), six),
                                _mm256_and_si256(_mm256_slli_epi16(hi, 2), eight));
      q[h][2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 3), six),
                                _mm256_and_si256(_mm256_slli_epi16(hi, 1), eight));
      q[h][3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 5), six),
                                _mm256_and_si256(hi, eight));
    }
  }
  const int8_t* xc = x + 16 * c;
  const __m256i xs[4] = {bcast(xc), bcast(xc + 4), bcast(xc + 8), bcast(xc + 12)};
  for (int h = 0; h < 2; ++h)
    s[h] = _mm256_add_epi16(
        s[h], _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(q[h][0], xs[0]),
                                                _mm256_maddubs_epi16(q[h][1], xs[1])),
                               _mm256_add_epi16(_mm256_maddubs_epi16(q[h][2], xs[2]),
                                                _mm256_maddubs_epi16(q[h][3], xs[3]))));
}

// 2/3/4-bit: a vpmaddubsw pair is at most 2 * 15 * 127 = 3810, so a row's eight products per
// block sum in int16 (30480) before one vpmaddwd. Both halves of the tile go through the block
// at once, so each activation broadcast serves 16 output rows: with several rows the broadcasts
// and loop overhead, not the multiplies, bound the time (docs/portability.md).
template <int BITS, int R>
void tile_rows_low(const uint8_t* w, const at::Half* scale, const at::Half* zero,
                   const int8_t* xq, const float* dx, const int32_t*, const float* sx, int64_t k,
                   int64_t blocks_per_group, float* out, int64_t n) {
  constexpr int kBlockBytes = kTile * kBlock * BITS / 8;  // 128, 192 or 256
  const int64_t nb = k / kBlock, groups = nb / blocks_per_group;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][R];  // the output, halves 0 and 1
  for (int m = 0; m < R; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 part[2][R];  // the current group's sum of dx * (u . xq)
    for (int m = 0; m < R; ++m) part[0][m] = part[1][m] = _mm256_setzero_ps();
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      const uint8_t* wb = w + b * kBlockBytes;
      for (int line = 0; line < kBlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + line), _MM_HINT_T1);
      __m256i s0[R], s1[R];
      for (int m = 0; m < R; ++m) s0[m] = s1[m] = _mm256_setzero_si256();
      if constexpr (kQuad<BITS, R>) {
        __m256i s[2] = {s0[0], s1[0]};
#pragma GCC unroll 1
        for (int c = 0; c < 2; ++c) quad<BITS>(wb, c, xq + b * kBlock, s);
        s0[0] = s[0];
        s1[0] = s[1];
      } else {
#pragma GCC unroll 1  // unrolled (with the rows' loop), GCC computes every product first
        for (int p = 0; p < 4; ++p) {
          __m256i a0, b0, a1, b1;
          line_pair<BITS>(wb, p, 0, a0, b0);
          line_pair<BITS>(wb, p, 1, a1, b1);
          for (int m = 0; m < R; ++m) {
            const int8_t* xm = xq + m * k + b * kBlock + 8 * p;
            const __m256i x0 = bcast(xm), x4 = bcast(xm + 4);
            s0[m] = _mm256_add_epi16(s0[m], _mm256_add_epi16(_mm256_maddubs_epi16(a0, x0),
                                                             _mm256_maddubs_epi16(b0, x4)));
            s1[m] = _mm256_add_epi16(s1[m], _mm256_add_epi16(_mm256_maddubs_epi16(a1, x0),
                                                             _mm256_maddubs_epi16(b1, x4)));
          }
        }
      }
      for (int m = 0; m < R; ++m) {
        const __m256 d = _mm256_set1_ps((kQuad<BITS, R> ? kScaled<BITS> : 1.f) * dx[m * nb + b]);
        part[0][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s0[m], ones)), d,
                                     part[0][m]);
        part[1][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s1[m], ones)), d,
                                     part[1][m]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load_half(scale + g * kTile + 8 * h), z = load_half(zero + g * kTile + 8 * h);
      for (int m = 0; m < R; ++m) {
        acc[h][m] = _mm256_fmadd_ps(part[h][m], s, acc[h][m]);
        acc[h][m] = _mm256_fnmadd_ps(z, _mm256_set1_ps(sx[m * groups + g]), acc[h][m]);
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < R; ++m) _mm256_storeu_ps(out + m * n + 8 * h, acc[h][m]);
}

// 8-bit: u would overflow vpmaddubsw's pairs; q = u ^ 0x80 is signed, |q| . (x * sign q) with
// |q| <= 128 fits (32512), and u . x = q . x + 128 * sum(x). One block's integer dot products
// for rows 8h..8h+7 of the tile and R activation rows.
template <int R>
inline void block_dots8(const uint8_t* wb, const int8_t* xq, int64_t k, const int32_t* bs,
                        __m256i* dot) {  // xq and bs: row m at m * k and m * k / kBlock
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int m = 0; m < R; ++m) dot[m] = _mm256_set1_epi32(bs[m * (k / kBlock)] * 128);
#pragma GCC unroll 1
  for (int j = 0; j < 8; ++j) {
    const __m256i q = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j)), flip);
    const __m256i aq = _mm256_abs_epi8(q);
    for (int m = 0; m < R; ++m) {
      const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(bcast(xq + m * k + 4 * j), q));
      dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(p, ones));
    }
  }
}

template <int R>
void tile_rows8(const uint8_t* w, const at::Half* scale, const at::Half* zero, const int8_t* xq,
                const float* dx, const int32_t* bs, const float* sx, int64_t k,
                int64_t blocks_per_group, float* out, int64_t n) {
  constexpr int kBlockBytes = kTile * kBlock;
  const int64_t nb = k / kBlock, groups = nb / blocks_per_group;
  int64_t chunk = kChunk;  // no std::min in here (see the top)
  while (blocks_per_group % chunk) --chunk;
  for (int m = 0; m < R; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * n + 8 * h, _mm256_setzero_ps());
  for (int64_t g = 0, b0 = 0; g < groups; b0 += chunk) {  // no division per chunk: idiv is slow
    const bool closes = b0 + chunk == (g + 1) * blocks_per_group;
    for (int h = 0; h < 2; ++h) {
      __m256 part[R];  // this chunk's sum of dx * (u . xq)
      for (int m = 0; m < R; ++m) part[m] = _mm256_setzero_ps();
      for (int64_t b = b0; b < b0 + chunk; ++b) {
        const uint8_t* wb = w + b * kBlockBytes;
        if (h == 0)
          for (int line = 0; line < kBlockBytes; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + line), _MM_HINT_T1);
        __m256i dot[R];
        block_dots8<R>(wb + 32 * h, xq + b * kBlock, k, bs + b, dot);
        for (int m = 0; m < R; ++m)
          part[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_set1_ps(dx[m * nb + b]),
                                    part[m]);
      }
      const __m256 s = load_half(scale + g * kTile + 8 * h), z = load_half(zero + g * kTile + 8 * h);
      for (int m = 0; m < R; ++m) {
        float* o = out + m * n + 8 * h;
        __m256 acc = _mm256_fmadd_ps(part[m], s, _mm256_loadu_ps(o));
        if (closes) acc = _mm256_fnmadd_ps(z, _mm256_set1_ps(sx[m * groups + g]), acc);
        _mm256_storeu_ps(o, acc);
      }
    }
    g += closes;
  }
}

template <int BITS>
constexpr TileFn kTileFnsLow[kMaxRows + 1] = {nullptr,
                                              tile_rows_low<BITS, 1>, tile_rows_low<BITS, 2>,
                                              tile_rows_low<BITS, 3>, tile_rows_low<BITS, 4>,
                                              tile_rows_low<BITS, 5>};
constexpr TileFn kTileFns8[kMaxRows + 1] = {nullptr,        tile_rows8<1>, tile_rows8<2>,
                                            tile_rows8<3>, tile_rows8<4>, tile_rows8<5>};

}  // namespace avx2
}  // namespace
#pragma GCC pop_options

const w4a8::Kernels w4a8::kAvx2 = {
    avx2::quantize_row,
    avx2::kMaxRows,
    {avx2::kTileFnsLow<2>, avx2::kTileFnsLow<3>, avx2::kTileFnsLow<4>, avx2::kTileFns8}};
