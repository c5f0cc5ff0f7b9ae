// 4-bit LUT codes (exponential codes) times float32 activations for a few rows: y = x @ W.T,
// W[r, c] = base[r, g] * table[ridx[r, g]][u[r, c]], g = c / group_len. The codes stay 4 bits a
// weight in memory and are decoded in registers by a 16-entry table lookup on an int16 copy of
// the table, times activations rounded to int16 per group (AVX-512: vpermw and vpdpwssd, 128
// weights a step where groups hold them, else 64; AVX2: two vpshufb and vpmaddwd, see there),
// instead of a bf16 copy of W that reads four times the bytes. AVX-512 groups of 32 columns, too
// short for a 64-weight step, take vpermps on the float table. One build holds an AVX-512 and an
// AVX2 version (see w4a8.cpp for why each sits between its target pragmas).
//
// Layout (pipeline/runtime/cpu_lut16.py): each weight row's codes in order, 16 bytes per 32
// columns; byte i of a block holds column i in its low nibble and column 16 + i in its high
// nibble. The tables are a layer's distinct normalised LUTs (an exponential group's levels
// divided by its base: one per ratio), so a group's table is one load and its base one multiply
// at the end.
//
// int16 products: a group's int32 sum must not overflow. A lane adds group_len / 8 products
// (AVX2; AVX-512 adds group_len / 16) of |entry| <= 32767 and |x| < 2^19 / group_len (12 bits at
// 128, 14 at 32), which costs <= 2.1e-4 relative error against float products (bf16
// activations: 4e-3).
//
// Lanes are columns, so a row's dot product ends in one horizontal sum; each row of codes is
// read once per kMaxRows activation rows (a row of codes is k / 2 bytes: later passes hit L1).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

int isa_index(const std::string& isa);  // bindings.cpp: 0 avx2, 1 avx512, 2 avx512gfni

namespace {

constexpr int kBlock = 32;  // columns per 16 packed bytes
// Bytes ahead in a thread's stream of codes, prefetched into L2 (as w4a8.h's kPrefetch): rows
// of codes are short (k / 2 bytes), so without it each row's first lines wait on memory.
constexpr int64_t kPrefetch = 8192;

// The most |x| rounds to in a group of group_len columns (see the top): a group's sum in int32
float x_max(int64_t group_len) { return static_cast<float>((int64_t{1} << 19) / group_len - 1); }

// A layer's tables as int16 (32767 at each table's largest |entry|) and each one's scale
void int16_tables(const float* tables, int64_t count, int16_t* entries, float* scale) {
  for (int64_t t = 0; t < count; ++t) {
    float top = 0.0f;
    for (int j = 0; j < 16; ++j) top = std::max(top, std::fabs(tables[16 * t + j]));
    scale[t] = top / 32767.0f;
    for (int j = 0; j < 16; ++j) {
      const float v = top > 0.0f ? tables[16 * t + j] * 32767.0f / top : 0.0f;
      entries[16 * t + j] = static_cast<int16_t>(std::lrint(v));
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace {
namespace avx512 {

constexpr int kMaxRows = 8;  // 2 accumulators and a total per row, beside the table and codes
// Columns per int16 step: 64 (two blocks: 32 bytes of codes widened to words), or 128 where the
// groups hold whole steps (four blocks: 64 bytes read as 32 words of four codes, no widening).
constexpr int kStep = 64, kWideStep = 128;

// The column of a step's activation word 32 t + j: the kernel's lookup t takes code t of each
// word j (STEP / 32 codes a word), i.e. byte j * STEP / 64 + t / 2 of the step's codes, nibble
// t % 2; byte i of a 32-column block holds columns i (low nibble) and 16 + i (high).
constexpr int step_column(int step, int j, int t) {
  const int b = j * (step / 64) + t / 2;
  return b / 16 * 32 + t % 2 * 16 + b % 16;
}

// One row of x to int16, a scale per group (xs[g]), each step's columns in the order of the
// kernel's lookups (step_column), gathered 16 at a time.
template <int STEP>
void quantize_row16(const float* x, int64_t k, int64_t group_len, int16_t* xq, float* xs) {
  alignas(64) int32_t index[STEP / 16][16];
  for (int p = 0; p < STEP / 16; ++p)
    for (int i = 0; i < 16; ++i) index[p][i] = step_column(STEP, p % 2 * 16 + i, p / 2);
  for (int64_t g = 0; g < k / group_len; ++g) {
    const float* p = x + g * group_len;
    __m512 m = _mm512_setzero_ps();
    for (int64_t c = 0; c < group_len; c += 16)
      m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(p + c)));
    const float top = _mm512_reduce_max_ps(m), most = x_max(group_len);
    xs[g] = top / most;
    const __m512 inv = _mm512_set1_ps(top > 0.0f ? most / top : 0.0f);
    for (int64_t c = 0; c < group_len; c += STEP) {
      for (int part = 0; part < STEP / 16; ++part) {  // words 16 part ..: lookup part / 2
        const __m512 v = _mm512_i32gather_ps(_mm512_load_si512(index[part]), p + c, 4);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * group_len + c + 16 * part),
                            _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv))));
      }
    }
  }
}

// A step's codes as 32 words: STEP / 32 codes each (see kStep)
template <int STEP>
inline __m512i step_codes(const uint8_t* p) {
  if constexpr (STEP == kWideStep) return _mm512_loadu_si512(p);
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One weight row times R int16 activation rows (xq stride k, xs stride k / group_len); words
// holds each table twice (32 int16), so vpermw's 5-bit index needs no mask: a word's low five
// bits are its code plus 16 times a bit of the next code, which the copy ignores. Two vpdpwssd
// chains per row; the groups' factors (base x table scale x activation scale) are computed 16
// groups at a time.
template <int R, int STEP>
void row_lut16(const uint8_t* w, const uint16_t* base, const uint8_t* ridx, const int16_t* words,
               const float* tscale, const int16_t* xq, const float* xs, int64_t k,
               int64_t group_len, float* out, int64_t n) {
  const int64_t groups = k / group_len;
  __m512 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, groups - g0));
    const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);
    const __m512i which = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, ridx + g0));
    const __m512 f = _mm512_mul_ps(
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, base + g0)),
        _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, which, tscale, 4));
    alignas(64) float factor[R][16];
    for (int m = 0; m < R; ++m) {
      const __m512 x = _mm512_maskz_loadu_ps(live, xs + m * groups + g0);
      _mm512_store_ps(factor[m], _mm512_mul_ps(f, x));
    }
    for (int64_t g = g0; g < g0 + count; ++g) {
      const int64_t first = g * group_len;
      for (int64_t line = 0; line < group_len / 2; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + first / 2 + kPrefetch + line), _MM_HINT_T1);
      const __m512i table = _mm512_loadu_si512(words + 32 * ridx[g]);
      __m512i acc[2][R];
      for (int m = 0; m < R; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_si512();
      for (int64_t c = first; c < first + group_len; c += STEP) {
        const __m512i v = step_codes<STEP>(w + c / 2);
        for (int t = 0; t < STEP / 32; ++t) {  // lookup t: each word's code t
          const __m512i wt = _mm512_permutexvar_epi16(t ? _mm512_srli_epi16(v, 4 * t) : v, table);
          for (int m = 0; m < R; ++m) {
            const __m512i xt = _mm512_loadu_si512(xq + m * k + c + 32 * t);
            acc[t % 2][m] = _mm512_dpwssd_epi32(acc[t % 2][m], wt, xt);
          }
        }
      }
      for (int m = 0; m < R; ++m) {
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[0][m], acc[1][m]));
        total[m] = _mm512_fmadd_ps(sum, _mm512_set1_ps(factor[m][g - g0]), total[m]);
      }
    }
  }
  for (int m = 0; m < R; ++m) out[m * n] = _mm512_reduce_add_ps(total[m]);
}

using Row16Fn = void (*)(const uint8_t*, const uint16_t*, const uint8_t*, const int16_t*,
                         const float*, const int16_t*, const float*, int64_t, int64_t, float*,
                         int64_t);
template <int STEP>
constexpr Row16Fn kRow16Fns[kMaxRows + 1] = {
    nullptr,             row_lut16<1, STEP>, row_lut16<2, STEP>, row_lut16<3, STEP>,
    row_lut16<4, STEP>,  row_lut16<5, STEP>, row_lut16<6, STEP>, row_lut16<7, STEP>,
    row_lut16<8, STEP>};

template <int R>
void row_lut(const uint8_t* w, const uint16_t* base, const uint8_t* ridx, const float* tables,
             const float* x, int64_t k, int64_t group_len, float* out, int64_t n) {
  __m512 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k / group_len; ++g) {
    const __m512 table = _mm512_loadu_ps(tables + 16 * ridx[g]);
    __m512 lo[R], hi[R];  // two chains: columns 0-15 and 16-31 of each block
    for (int m = 0; m < R; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
    for (int64_t c = g * group_len; c < (g + 1) * group_len; c += kBlock) {
      const __m512i v =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c / 2)));
      const __m512 w0 = _mm512_permutexvar_ps(v, table);
      const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
      for (int m = 0; m < R; ++m) {
        lo[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * k + c), lo[m]);
        hi[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * k + c + 16), hi[m]);
      }
    }
    const __m512 b = _mm512_set1_ps(_cvtsh_ss(base[g]));
    for (int m = 0; m < R; ++m) total[m] = _mm512_fmadd_ps(_mm512_add_ps(lo[m], hi[m]), b, total[m]);
  }
  for (int m = 0; m < R; ++m) out[m * n] = _mm512_reduce_add_ps(total[m]);
}

using RowFn = void (*)(const uint8_t*, const uint16_t*, const uint8_t*, const float*,
                       const float*, int64_t, int64_t, float*, int64_t);
constexpr RowFn kRowFns[kMaxRows + 1] = {nullptr,     row_lut<1>, row_lut<2>, row_lut<3>, row_lut<4>,
                                         row_lut<5>, row_lut<6>, row_lut<7>, row_lut<8>};

}  // namespace avx512
}  // namespace
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------
// AVX2 has no 16-entry float lookup (vpermps takes 8: two lookups and a blend per 8 weights ran
// at a seventh of the 4-bit kernel's speed). So the codes index an int16 copy of the table with
// two vpshufb (its low and its high bytes), and vpmaddwd multiplies them with the activations
// quantized to int16 per group: ~12 instructions per 32 weights, and one conversion to float per
// group (the range: see the top).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace avx2 {

constexpr int kMaxRows = 4;  // an accumulator and a total per row beside the tables and codes

// One row of x to int16, a scale per group (xs[g]), each 32-column block stored in the order
// the kernel's unpacks give its weights: columns 0-7, 16-23, then 8-15, 24-31.
void quantize_row(const float* x, int64_t k, int64_t group_len, int16_t* xq, float* xs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < k / group_len; ++g) {
    const float* p = x + g * group_len;
    __m256 m = _mm256_setzero_ps();
    for (int64_t c = 0; c < group_len; c += 8) {
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + c)));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))), most = x_max(group_len);
    xs[g] = top / most;
    const __m256 inv = _mm256_set1_ps(top > 0.0f ? most / top : 0.0f);
    // packs works within 128-bit lanes; the qword permute puts 0-3, 4-7, 16-19, 20-23 in order
    const auto q = [&](const float* v, int64_t other) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), inv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + other), inv));
      return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    };
    for (int64_t c = 0; c < group_len; c += kBlock) {
      const __m256i a = q(p + c, 16), b = q(p + c + 8, 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * group_len + c), a);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + g * group_len + c + 16), b);
    }
  }
}

inline __m256i both_lanes(const uint8_t* p) {  // 16 bytes in each 128-bit lane
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One weight row times R quantized activation rows (xq stride k, xs stride k / group_len); PB
// the blocks per group when known at compile time (an unrolled group), 0 to read group_len.
template <int R, int PB>
void row_lut(const uint8_t* w, const uint16_t* base, const uint8_t* ridx, const uint8_t* tbytes,
             const float* tscale, const int16_t* xq, const float* xs, int64_t k,
             int64_t group_len, float* out, int64_t n) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i high_lane_by_4 = _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0);
  const int64_t groups = k / group_len, per_group = PB > 0 ? PB : group_len / kBlock;
  __m256 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* t = tbytes + 32 * ridx[g];
    const __m256i low = both_lanes(t), high = both_lanes(t + 16);
    __m256i acc[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t j = 0; j < per_group; ++j, w += kBlock / 2) {
      const int64_t c = g * group_len + j * kBlock;
      // lane 0: the 16 low nibbles (columns 0-15), lane 1: the high ones (columns 16-31)
      const __m256i v = both_lanes(w);
      const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(v, high_lane_by_4), nibble);
      const __m256i lo = _mm256_shuffle_epi8(low, idx), hi = _mm256_shuffle_epi8(high, idx);
      const __m256i w0 = _mm256_unpacklo_epi8(lo, hi);  // columns 0-7, 16-23
      const __m256i w1 = _mm256_unpackhi_epi8(lo, hi);  // columns 8-15, 24-31
      for (int m = 0; m < R; ++m) {
        const __m256i* xb = reinterpret_cast<const __m256i*>(xq + m * k + c);
        const __m256i s0 = _mm256_madd_epi16(w0, _mm256_loadu_si256(xb));
        const __m256i s1 = _mm256_madd_epi16(w1, _mm256_loadu_si256(xb + 1));
        acc[m] = _mm256_add_epi32(acc[m], _mm256_add_epi32(s0, s1));
      }
    }
    const float f = _cvtsh_ss(base[g]) * tscale[ridx[g]];
    for (int m = 0; m < R; ++m) {
      const __m256 scale = _mm256_set1_ps(f * xs[m * groups + g]);
      total[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), scale, total[m]);
    }
  }
  for (int m = 0; m < R; ++m) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(total[m]), _mm256_extractf128_ps(total[m], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    out[m * n] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
}

using RowFn = void (*)(const uint8_t*, const uint16_t*, const uint8_t*, const uint8_t*,
                       const float*, const int16_t*, const float*, int64_t, int64_t, float*,
                       int64_t);
template <int PB>
constexpr RowFn kFns[kMaxRows + 1] = {nullptr, row_lut<1, PB>, row_lut<2, PB>, row_lut<3, PB>,
                                      row_lut<4, PB>};

// g32, g64 and g128 unrolled; other group lengths loop
const RowFn* row_fns(int64_t group_len) {
  switch (group_len / kBlock) {
    case 1: return kFns<1>;
    case 2: return kFns<2>;
    case 4: return kFns<4>;
    default: return kFns<0>;
  }
}

}  // namespace avx2
}  // namespace
#pragma GCC pop_options

// x (M, k) float32; packed (n, k / 2) uint8; base (n, groups) float16; ridx (n, groups) uint8;
// tables (T, 16) float32 -> (M, n) float32.
at::Tensor lut16_mm(at::Tensor x, at::Tensor packed, at::Tensor base, at::Tensor ridx,
                    at::Tensor tables, int64_t group_len, const std::string& isa) {
  const bool avx512 = isa_index(isa) > 0;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous());
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0), groups = k / group_len;
  TORCH_CHECK(k % kBlock == 0 && group_len % kBlock == 0 && k % group_len == 0);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(1) == k / 2);
  TORCH_CHECK(base.scalar_type() == at::kHalf && base.is_contiguous() &&
              base.size(0) == n && base.size(1) == groups);
  TORCH_CHECK(ridx.scalar_type() == at::kByte && ridx.is_contiguous() &&
              ridx.size(0) == n && ridx.size(1) == groups);
  // every ridx < tables.size(0): cpu_lut16.pack builds them together (no per-call scan here)
  TORCH_CHECK(tables.scalar_type() == at::kFloat && tables.is_contiguous() &&
              tables.size(1) == 16);
  auto out = at::empty({rows, n}, x.options());
  const float *xp = x.data_ptr<float>(), *tp = tables.data_ptr<float>();
  const uint8_t *wp = packed.data_ptr<uint8_t>(), *rp = ridx.data_ptr<uint8_t>();
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(base.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  // call(i, m0, r): weight row i times activation rows m0 .. m0 + r, r <= max_rows
  const auto each_row = [&](int max_rows, const auto& call) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        for (int64_t m0 = 0; m0 < rows; m0 += max_rows) {
          call(i, m0, static_cast<int>(std::min<int64_t>(max_rows, rows - m0)));
        }
      }
    });
  };
  if (avx512 && group_len % avx512::kStep != 0) {  // g32: the float lookup
    each_row(avx512::kMaxRows, [&](int64_t i, int64_t m0, int r) {
      avx512::kRowFns[r](wp + i * (k / 2), bp + i * groups, rp + i * groups, tp, xp + m0 * k, k,
                         group_len, op + m0 * n + i, n);
    });
    return out;
  }
  // a group's int32 sum leaves the activations 2^19 / group_len - 1 levels: 63 at 8192
  TORCH_CHECK(group_len <= 8192, "exp4lut takes groups of at most 8192 columns");
  const int64_t count = tables.size(0);
  std::vector<int16_t> entries(16 * count), xq(rows * k);
  std::vector<float> tscale(count), xs(rows * groups);
  int16_tables(tp, count, entries.data(), tscale.data());
  if (avx512) {
    std::vector<int16_t> words(32 * count);  // each table twice: see row_lut16
    for (int64_t j = 0; j < 16 * count; ++j) {
      words[j + j / 16 * 16] = words[j + j / 16 * 16 + 16] = entries[j];
    }
    const bool wide = group_len % avx512::kWideStep == 0;
    const auto quantize = wide ? avx512::quantize_row16<avx512::kWideStep>
                               : avx512::quantize_row16<avx512::kStep>;
    const avx512::Row16Fn* fns = wide ? avx512::kRow16Fns<avx512::kWideStep>
                                      : avx512::kRow16Fns<avx512::kStep>;
    for (int64_t m = 0; m < rows; ++m) {
      quantize(xp + m * k, k, group_len, xq.data() + m * k, xs.data() + m * groups);
    }
    each_row(avx512::kMaxRows, [&](int64_t i, int64_t m0, int r) {
      fns[r](wp + i * (k / 2), bp + i * groups, rp + i * groups, words.data(), tscale.data(),
             xq.data() + m0 * k, xs.data() + m0 * groups, k, group_len, op + m0 * n + i, n);
    });
    return out;
  }
  std::vector<uint8_t> tbytes(32 * count);  // AVX2: per table its 16 low bytes, then 16 high
  for (int64_t j = 0; j < 16 * count; ++j) {
    tbytes[j + j / 16 * 16] = static_cast<uint8_t>(entries[j] & 0xFF);
    tbytes[j + j / 16 * 16 + 16] = static_cast<uint8_t>((entries[j] >> 8) & 0xFF);
  }
  for (int64_t m = 0; m < rows; ++m) {
    avx2::quantize_row(xp + m * k, k, group_len, xq.data() + m * k, xs.data() + m * groups);
  }
  const avx2::RowFn* fns = avx2::row_fns(group_len);
  each_row(avx2::kMaxRows, [&](int64_t i, int64_t m0, int r) {
    fns[r](wp + i * (k / 2), bp + i * groups, rp + i * groups, tbytes.data(), tscale.data(),
           xq.data() + m0 * k, xs.data() + m0 * groups, k, group_len, op + m0 * n + i, n);
  });
  return out;
}
