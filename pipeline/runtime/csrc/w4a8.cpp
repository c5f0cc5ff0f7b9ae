// W4A8 / W8A8 matmul for a few rows: y = x @ W.T, W = (u - base - offset) * scale per group,
// u the unsigned code (base 8 for 2/3/4-bit codes, 128 for 8-bit ones). One build holds an
// AVX-512 VNNI and an AVX2 version, each compiled for its ISA alone (the pragmas below), so a
// CPU runs only the one Python chose (cpu_ext.isa()).
//
// Weights: packed by pipeline/runtime/cpu_w4a8.py in tiles of 16 output rows and blocks of 32
// columns. 4-bit codes take 256 bytes per (tile, block): byte 64c + 4r + i holds u[r, 8c + i] in
// its low nibble and u[r, 8c + 4 + i] in its high nibble. 8-bit codes take 512 bytes: byte
// 64j + 4r + i holds u[r, 4j + i]. Either way a 64-byte line holds four consecutive codes of
// each of the 16 output rows in its 32-bit lane r: what vpdpbusd (AVX-512) multiplies with four
// int8 activations broadcast to every lane, so 16 output rows accumulate in one register and no
// horizontal sum is ever needed. AVX2 reads the same line as two halves, rows 0-7 and 8-15.
//
// Each ISA's code sits between its target pragmas, and only kernel code does: the ATen and std
// headers are included above them, so no inline header function is emitted (and shared with
// other objects) carrying AVX-512 or AVX2 instructions; and the driver at the bottom, compiled
// for the baseline, calls the chosen ISA's functions through a table.
//
// Activations: each row is quantized per 32 columns to int8, symmetric (Q8_0: d = max|x| / 127),
// the same way on both ISAs. The zero term (base + offset) * scale * sum(x) uses the sum of the
// *quantized* x, so the result is exactly W . x_hat: the error is that of x_hat alone (~0.5%
// relative), not of u . dx. Both ISAs compute the same integer dot products per block.
//
// The point is the loop order: a block of weights is loaded (and unpacked) once, then applied to
// up to kMaxRows activation rows held in registers, so the weights are read from memory once
// whatever M; the rows then cost multiply throughput, not bandwidth.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>

int isa_index(const std::string& isa);  // bindings.cpp: 0 avx2, 1 avx512, or an error

namespace {

constexpr int kTile = 16;   // output rows per tile: the 16 int32 lanes of a zmm
constexpr int kBlock = 32;  // columns per activation scale and per packed block
// Bytes ahead in the weight stream (32 4-bit blocks), prefetched into L2, not L1: with L1 as the
// target the few L1 miss buffers capped the loads in flight once the rows' multiplies filled the
// time between them.
constexpr int kPrefetch = 8192;

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
  int max_rows;            // activation rows per pass
  const TileFn* tiles[2];  // [4-bit, 8-bit][R], R = 1..max_rows
};

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

}  // namespace

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI: vpdpbusd multiplies u8 codes by s8 activations, four at a time, into int32.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace {
namespace avx512 {

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

template <int BITS, int R>
void tile_rows(const uint8_t* w, const at::Half* scale, const at::Half* zero, const int8_t* xq,
               const float* dx, const int32_t*, const float* sx, int64_t k,
               int64_t blocks_per_group, float* out, int64_t n) {
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

template <int BITS>
constexpr TileFn kTileFns[kMaxRows + 1] = {
    nullptr,            tile_rows<BITS, 1>, tile_rows<BITS, 2>, tile_rows<BITS, 3>,
    tile_rows<BITS, 4>, tile_rows<BITS, 5>, tile_rows<BITS, 6>};

}  // namespace avx512
}  // namespace
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------
// AVX2: no vpdpbusd. vpmaddubsw multiplies u8 by s8 into int16 pairs, vpmaddwd by ones sums the
// pairs into int32. A tile is two halves of 8 output rows (the 8 int32 lanes of a ymm).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace avx2 {

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

// 4-bit: a vpmaddubsw pair is at most 2 * 15 * 127 = 3810, so a row's eight products per block
// sum in int16 (30480) before one vpmaddwd. Both halves of the tile go through the block at
// once, so each activation broadcast serves 16 output rows: with several rows the broadcasts
// and loop overhead, not the multiplies, bound the time (docs/portability.md).
template <int R>
void tile_rows4(const uint8_t* w, const at::Half* scale, const at::Half* zero, const int8_t* xq,
                const float* dx, const int32_t*, const float* sx, int64_t k,
                int64_t blocks_per_group, float* out, int64_t n) {
  constexpr int kBlockBytes = kTile * kBlock / 2;
  const int64_t nb = k / kBlock, groups = nb / blocks_per_group;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
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
#pragma GCC unroll 1  // unrolled (with the rows' loop), GCC computes every product first
      for (int c = 0; c < 4; ++c) {
        const __m256i* line = reinterpret_cast<const __m256i*>(wb + 64 * c);
        const __m256i v0 = _mm256_loadu_si256(line), v1 = _mm256_loadu_si256(line + 1);
        const __m256i lo0 = _mm256_and_si256(v0, low);
        const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
        const __m256i lo1 = _mm256_and_si256(v1, low);
        const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
        for (int m = 0; m < R; ++m) {
          const int8_t* xm = xq + m * k + b * kBlock + 8 * c;
          const __m256i x0 = bcast(xm), x4 = bcast(xm + 4);
          s0[m] = _mm256_add_epi16(s0[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x0),
                                                           _mm256_maddubs_epi16(hi0, x4)));
          s1[m] = _mm256_add_epi16(s1[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, x0),
                                                           _mm256_maddubs_epi16(hi1, x4)));
        }
      }
      for (int m = 0; m < R; ++m) {
        const __m256 d = _mm256_set1_ps(dx[m * nb + b]);
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

constexpr TileFn kTileFns4[kMaxRows + 1] = {nullptr,        tile_rows4<1>, tile_rows4<2>,
                                            tile_rows4<3>, tile_rows4<4>, tile_rows4<5>};
constexpr TileFn kTileFns8[kMaxRows + 1] = {nullptr,        tile_rows8<1>, tile_rows8<2>,
                                            tile_rows8<3>, tile_rows8<4>, tile_rows8<5>};

}  // namespace avx2
}  // namespace
#pragma GCC pop_options

namespace {
const Kernels kKernels[2] = {
    {avx2::quantize_row, avx2::kMaxRows, {avx2::kTileFns4, avx2::kTileFns8}},
    {avx512::quantize_row, avx512::kMaxRows, {avx512::kTileFns<4>, avx512::kTileFns<8>}},
};
}  // namespace

// x (M, k) float32; packed (n / 16, k / 32, 256 or 512) uint8 (4- or 8-bit codes); scale, zero
// (n / 16, groups, 16) float16; isa "avx512" or "avx2".
at::Tensor w4a8_mm(at::Tensor x, at::Tensor packed, at::Tensor scale, at::Tensor zero,
                   int64_t group_len, const std::string& isa) {
  const Kernels& kern = kKernels[isa_index(isa)];
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous());
  const int64_t rows = x.size(0), k = x.size(1), tiles = packed.size(0), n = tiles * kTile;
  TORCH_CHECK(k % kBlock == 0 && group_len % kBlock == 0 && k % group_len == 0);
  TORCH_CHECK(packed.size(1) == k / kBlock && (packed.size(2) == 256 || packed.size(2) == 512));
  TORCH_CHECK(scale.scalar_type() == at::kHalf && zero.scalar_type() == at::kHalf);
  const TileFn* fns = kern.tiles[packed.size(2) == 256 ? 0 : 1];
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
  // (later passes over the same tile come from L2: 16 * k / 2 bytes).
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
