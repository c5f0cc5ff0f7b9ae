// float32 matmul for a few rows on AVX-512: y = x @ W.T, W the (n, k) weight of an nn.Linear as
// it is (no repacking, no second copy).
//
// Why: MKL's sgemm streams a 32000 x 2048 lm_head at ~17 ms for one row on this kind of CPU but
// takes ~50 ms for three to five (and does not split one row over two threads): past one row it
// packs and re-reads the weight instead of streaming it once. Speculative decoding verifies
// gamma + 1 rows per step, so a float32 head cost ~3.5 single steps per verification. Here each
// block of weight rows is streamed from memory once and applied to up to kMaxRows activation
// rows held in L1, so the weight bytes are read once whatever M; what the rows add is FMA work.
//
// One row: weight rows one at a time (a single sequential stream, what the hardware prefetcher
// follows best: 13.4 against 15.5 ms for blocks of 4). More rows: blocks of kRowsN weight rows,
// kRowsN x R accumulators of 16 lanes (24 zmm at R = 6), one register per weight row and one
// for the activation; the k tail is a masked load, and each weight row is prefetched kPrefetch
// bytes ahead into L2 (into L1 it measured slower than none; into L2, 10-20% faster at 3-5
// rows). Each output is one horizontal sum at the end, so the summation order differs from
// sgemm's (~1e-7 relative).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>

#include <cstdint>

namespace {

constexpr int kRowsN = 4;    // weight rows per block when M > 1
constexpr int kMaxRows = 5;  // activation rows per pass: 4 x 5 accumulators + 5 operands
constexpr int kPrefetch = 2048;  // bytes ahead in each weight row (blocks of kRowsN rows only)

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

using BlockFn = void (*)(const float*, int64_t, const float*, float*, int64_t);

template <int NR>
constexpr BlockFn kBlockFns[kMaxRows + 1] = {nullptr,           block_rows<NR, 1>,
                                             block_rows<NR, 2>, block_rows<NR, 3>,
                                             block_rows<NR, 4>, block_rows<NR, 5>};

}  // namespace

// x (M, k) float32 contiguous; weight (n, k) float32 contiguous -> (M, n) float32.
at::Tensor f32_rows_mm(at::Tensor x, at::Tensor weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous() && weight.size(1) == x.size(1));
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  auto out = at::empty({rows, n}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (rows == 1) {
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) kBlockFns<1>[1](wp + i * k, k, xp, op + i, n);
    });
    return out;
  }
  const int64_t blocks = (n + kRowsN - 1) / kRowsN;
  // Blocks split across threads; a block's kRowsN * k floats stay in L2 for the passes after
  // the first when M > kMaxRows.
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r0 = b * kRowsN, nr = std::min<int64_t>(kRowsN, n - r0);
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        const int r = static_cast<int>(std::min<int64_t>(kMaxRows, rows - m0));
        const float* xb = xp + m0 * k;
        float* ob = op + m0 * n + r0;
        if (nr == kRowsN) {
          kBlockFns<kRowsN>[r](wp + r0 * k, k, xb, ob, n);
        } else {  // the last rows of an n that kRowsN does not divide, one at a time
          for (int64_t i = 0; i < nr; ++i) kBlockFns<1>[r](wp + (r0 + i) * k, k, xb, ob + i, n);
        }
      }
    }
  });
  return out;
}
