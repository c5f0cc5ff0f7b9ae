// float32 matmul for a few rows: y = x @ W.T, W the (n, k) weight of an nn.Linear as it is (no
// repacking, no second copy). One build holds an AVX-512 and an AVX2 version (see w4a8.cpp).
//
// Why: MKL's sgemm streams a 32000 x 2048 lm_head near memory speed for one row, but past one
// row it packs and re-reads the weight instead of streaming it once (and it does not split one
// row over two threads). Speculative decoding verifies gamma + 1 rows per step, so a float32
// head cost ~3.5 single steps per verification. Here each block of weight rows is streamed from
// memory once and applied to up to kMaxRows activation rows held in L1, so the weight bytes are
// read once whatever M; what the rows add is FMA work.
//
// One row: weight rows one at a time (a single sequential stream, what the hardware prefetcher
// follows best). More rows: blocks of kRowsN weight rows, kRowsN x R accumulators, one register
// per weight row and one for the activation; each weight row is prefetched kPrefetch bytes
// ahead into L2 (into L1 it measured slower than none). Each output is one horizontal sum at the
// end, so the summation order differs from sgemm's (~1e-7 relative).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>

int isa_index(const std::string& isa);  // bindings.cpp: 0 avx2, 1 avx512, 2 avx512gfni

namespace {

constexpr int kPrefetch = 2048;  // bytes ahead in each weight row (blocks of kRowsN rows only)

using BlockFn = void (*)(const float* w, int64_t k, const float* x, float* out, int64_t n);

struct Kernels {
  int rows_n;              // weight rows per block when M > 1
  int max_rows;            // activation rows per pass
  const BlockFn* one;      // [R]: one weight row
  const BlockFn* block;    // [R]: rows_n weight rows
};

}  // namespace

// ---------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace {
namespace avx512 {

constexpr int kRowsN = 4;    // weight rows per block when M > 1
constexpr int kMaxRows = 5;  // activation rows per pass: 4 x 5 accumulators + 5 operands

template <int NR, int R>
void block_rows(const float* w, int64_t k, const float* x, float* out, int64_t n) {
  __m512 acc[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int m = 0; m < R; ++m) acc[i][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) {
    const __mmask16 mask = k - c >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (k - c)) - 1);
    __m512 wr[NR];
    for (int i = 0; i < NR; ++i) {
      if constexpr (NR > 1)  // one row alone: a single stream the hardware prefetcher follows
        _mm_prefetch(reinterpret_cast<const char*>(w + i * k + c) + kPrefetch, _MM_HINT_T1);
      wr[i] = _mm512_maskz_loadu_ps(mask, w + i * k + c);
    }
    for (int m = 0; m < R; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * k + c);
      for (int i = 0; i < NR; ++i) acc[i][m] = _mm512_fmadd_ps(wr[i], xv, acc[i][m]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int i = 0; i < NR; ++i) out[m * n + i] = _mm512_reduce_add_ps(acc[i][m]);
}

template <int NR>
constexpr BlockFn kBlockFns[kMaxRows + 1] = {nullptr,           block_rows<NR, 1>,
                                             block_rows<NR, 2>, block_rows<NR, 3>,
                                             block_rows<NR, 4>, block_rows<NR, 5>};

}  // namespace avx512
}  // namespace
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {
namespace avx2 {

constexpr int kRowsN = 2;    // weight rows per block when M > 1
constexpr int kMaxRows = 5;  // activation rows per pass: 2 x 5 accumulators + 2 + 1 operands

// -1 (load) for the first `rest` of 8 lanes: a window of this table at 8 - rest
alignas(64) constexpr int32_t kTailMask[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                               0,  0,  0,  0,  0,  0,  0,  0};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <int NR, int R, bool kTail>
inline void step(const float* w, int64_t k, const float* x, int64_t c, __m256i mask,
                 __m256 (&acc)[NR][R]) {
  __m256 wr[NR];
  for (int i = 0; i < NR; ++i) {
    if constexpr (NR > 1)
      _mm_prefetch(reinterpret_cast<const char*>(w + i * k + c) + kPrefetch, _MM_HINT_T1);
    wr[i] = kTail ? _mm256_maskload_ps(w + i * k + c, mask) : _mm256_loadu_ps(w + i * k + c);
  }
  for (int m = 0; m < R; ++m) {
    const __m256 xv = kTail ? _mm256_maskload_ps(x + m * k + c, mask)
                            : _mm256_loadu_ps(x + m * k + c);
    for (int i = 0; i < NR; ++i) acc[i][m] = _mm256_fmadd_ps(wr[i], xv, acc[i][m]);
  }
}

template <int NR, int R>
void block_rows(const float* w, int64_t k, const float* x, float* out, int64_t n) {
  __m256 acc[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int m = 0; m < R; ++m) acc[i][m] = _mm256_setzero_ps();
  const __m256i all = _mm256_set1_epi32(-1);
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) step<NR, R, false>(w, k, x, c, all, acc);
  if (c < k) {
    const __m256i mask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kTailMask + 8 - (k - c)));
    step<NR, R, true>(w, k, x, c, mask, acc);
  }
  for (int m = 0; m < R; ++m)
    for (int i = 0; i < NR; ++i) out[m * n + i] = hsum(acc[i][m]);
}

template <int NR>
constexpr BlockFn kBlockFns[kMaxRows + 1] = {nullptr,           block_rows<NR, 1>,
                                             block_rows<NR, 2>, block_rows<NR, 3>,
                                             block_rows<NR, 4>, block_rows<NR, 5>};

}  // namespace avx2
}  // namespace
#pragma GCC pop_options

namespace {
const Kernels kKernels[2] = {
    {avx2::kRowsN, avx2::kMaxRows, avx2::kBlockFns<1>, avx2::kBlockFns<avx2::kRowsN>},
    {avx512::kRowsN, avx512::kMaxRows, avx512::kBlockFns<1>, avx512::kBlockFns<avx512::kRowsN>},
};
}  // namespace

// x (M, k) float32 contiguous; weight (n, k) float32 contiguous -> (M, n) float32.
at::Tensor f32_rows_mm(at::Tensor x, at::Tensor weight, const std::string& isa) {
  const Kernels& kern = kKernels[isa_index(isa) > 0];
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous() && weight.size(1) == x.size(1));
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  auto out = at::empty({rows, n}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (rows == 1) {
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) kern.one[1](wp + i * k, k, xp, op + i, n);
    });
    return out;
  }
  const int64_t rows_n = kern.rows_n, blocks = (n + rows_n - 1) / rows_n;
  // Blocks split across threads; a block's rows_n * k floats stay in L2 for the passes after
  // the first when M > max_rows.
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r0 = b * rows_n, nr = std::min<int64_t>(rows_n, n - r0);
      for (int64_t m0 = 0; m0 < rows; m0 += kern.max_rows) {
        const int r = static_cast<int>(std::min<int64_t>(kern.max_rows, rows - m0));
        const float* xb = xp + m0 * k;
        float* ob = op + m0 * n + r0;
        if (nr == rows_n) {
          kern.block[r](wp + r0 * k, k, xb, ob, n);
        } else {  // the last rows of an n that rows_n does not divide, one at a time
          for (int64_t i = 0; i < nr; ++i) kern.one[r](wp + (r0 + i) * k, k, xb, ob + i, n);
        }
      }
    }
  });
  return out;
}
