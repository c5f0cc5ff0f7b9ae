// 4-bit LUT codes (exponential codes) times float32 activations for a few rows: y = x @ W.T,
// W[r, c] = base[r, g] * table[ridx[r, g]][u[r, c]], g = c / group_len. The codes stay 4 bits a
// weight in memory and are decoded in registers by a 16-entry table lookup (vpermps), instead
// of a bf16 copy of W that reads four times the bytes. One build holds an AVX-512 and an AVX2
// version (see w4a8.cpp for why each sits between its target pragmas).
//
// Layout (pipeline/runtime/cpu_lut16.py): each weight row's codes in order, 16 bytes per 32
// columns; byte i of a block holds column i in its low nibble and column 16 + i in its high
// nibble, so one vpmovzxbd of 16 bytes gives the indices of 16 consecutive columns in its low
// nibbles and of the next 16 above them (vpermps reads only an index's low bits). The tables
// are a layer's distinct normalised LUTs (an exponential group's levels divided by its base:
// one per ratio), so a group's table is one 64-byte load and its base one multiply at the end.
//
// Lanes are columns, so a row's dot product ends in one horizontal sum; each row of codes is
// read once per kMaxRows activation rows (a row of codes is k / 2 bytes: later passes hit L1).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>

int isa_index(const std::string& isa);  // bindings.cpp: 0 avx2, 1 avx512, or an error

namespace {

constexpr int kBlock = 32;  // columns per 16 packed bytes

// One weight row (its k / 2 code bytes, groups bases and table indices) times R activation
// rows x (stride k): out[m * n] for m < R.
using RowFn = void (*)(const uint8_t* w, const uint16_t* base, const uint8_t* ridx,
                       const float* tables, const float* x, int64_t k, int64_t group_len,
                       float* out, int64_t n);

struct Kernels {
  int max_rows;       // activation rows per pass
  const RowFn* rows;  // [R], R = 1..max_rows
};

}  // namespace

// ---------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace {
namespace avx512 {

constexpr int kMaxRows = 8;  // 2 accumulators and a total per row, beside the table and codes

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

constexpr RowFn kRowFns[kMaxRows + 1] = {nullptr,     row_lut<1>, row_lut<2>, row_lut<3>, row_lut<4>,
                                         row_lut<5>, row_lut<6>, row_lut<7>, row_lut<8>};

}  // namespace avx512
}  // namespace
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------
// AVX2: vpermps looks up 8 entries; the 16-entry table is two halves blended on index bit 3.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace avx2 {

constexpr int kMaxRows = 4;  // an accumulator and a total per row in 16 ymm

inline __m256 lookup(__m256i idx, __m256 low, __m256 high) {
  const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // to the sign bit
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, idx),
                          _mm256_permutevar8x32_ps(high, idx), bit3);
}

template <int R>
void row_lut(const uint8_t* w, const uint16_t* base, const uint8_t* ridx, const float* tables,
             const float* x, int64_t k, int64_t group_len, float* out, int64_t n) {
  __m256 total[R];
  for (int m = 0; m < R; ++m) total[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < k / group_len; ++g) {
    const float* t = tables + 16 * ridx[g];
    const __m256 low = _mm256_loadu_ps(t), high = _mm256_loadu_ps(t + 8);
    __m256 part[R];
    for (int m = 0; m < R; ++m) part[m] = _mm256_setzero_ps();
    for (int64_t c = g * group_len; c < (g + 1) * group_len; c += kBlock) {
      for (int h = 0; h < 2; ++h) {  // bytes 8h..8h+7: columns 8h.. (low), 16 + 8h.. (high)
        const __m256i v = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + c / 2 + 8 * h)));
        const __m256 w0 = lookup(v, low, high), w1 = lookup(_mm256_srli_epi32(v, 4), low, high);
        for (int m = 0; m < R; ++m) {
          part[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * k + c + 8 * h), part[m]);
          part[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * k + c + 16 + 8 * h), part[m]);
        }
      }
    }
    const __m256 b = _mm256_set1_ps(_cvtsh_ss(base[g]));
    for (int m = 0; m < R; ++m) total[m] = _mm256_fmadd_ps(part[m], b, total[m]);
  }
  for (int m = 0; m < R; ++m) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(total[m]), _mm256_extractf128_ps(total[m], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    out[m * n] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
}

constexpr RowFn kRowFns[kMaxRows + 1] = {nullptr, row_lut<1>, row_lut<2>, row_lut<3>, row_lut<4>};

}  // namespace avx2
}  // namespace
#pragma GCC pop_options

namespace {
const Kernels kKernels[2] = {{avx2::kMaxRows, avx2::kRowFns}, {avx512::kMaxRows, avx512::kRowFns}};
}  // namespace

// x (M, k) float32; packed (n, k / 2) uint8; base (n, groups) float16; ridx (n, groups) uint8;
// tables (T, 16) float32 -> (M, n) float32.
at::Tensor lut16_mm(at::Tensor x, at::Tensor packed, at::Tensor base, at::Tensor ridx,
                    at::Tensor tables, int64_t group_len, const std::string& isa) {
  const Kernels& kern = kKernels[isa_index(isa)];
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
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t m0 = 0; m0 < rows; m0 += kern.max_rows) {
        const int r = static_cast<int>(std::min<int64_t>(kern.max_rows, rows - m0));
        kern.rows[r](wp + i * (k / 2), bp + i * groups, rp + i * groups, tp, xp + m0 * k, k,
                     group_len, op + m0 * n + i, n);
      }
    }
  });
  return out;
}
