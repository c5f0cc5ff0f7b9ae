// A decoder layer's work between its matmuls, for the few rows of one sequence that decoding
// and verification run (pipeline/models/lean.py calls them): the residual add with RMSNorm, the
// rotary embedding with the KV-cache write and attention, and SiLU(gate) * up.
//
// Why: on a 1 B model a decode step spent 7-9 ms outside the matmuls (~50 torch calls a layer,
// each a dispatch and an allocation), a quarter of a W4 step; three calls a layer do that work.
// AVX2 + FMA code serves both ISAs (the work is small; AVX-512 CPUs run it too). exp is
// Cephes' polynomial (~1e-7 relative), so results match torch's to float32 rounding, not bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

int isa_index(const std::string& isa);  // bindings.cpp: 0 avx2, 1 avx512, 2 avx512gfni

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// e^x, Cephes' expf: x = n ln2 + r, e^r by a degree-5 polynomial, 2^n by the exponent bits
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  const __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float p : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(p));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

// scores[j] = q . keys[j] * scale for j < len, four keys at a time (independent FMA chains)
void scores(const float* q, const float* keys, int64_t len, int64_t d, float scale,
            float* out) {
  int64_t j = 0;
  for (; j + 4 <= len; j += 4) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float* k = keys + j * d;
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 qv = _mm256_loadu_ps(q + c);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + c), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d + c), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * d + c), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * d + c), a3);
    }
    out[j] = hsum(a0) * scale;
    out[j + 1] = hsum(a1) * scale;
    out[j + 2] = hsum(a2) * scale;
    out[j + 3] = hsum(a3) * scale;
  }
  for (; j < len; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8)
      a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(keys + j * d + c), a);
    out[j] = hsum(a) * scale;
  }
}

// out = t * cos + roll(t, d / 2) * sin, the rotate-half embedding with sin's first half negated
inline void rope(const float* t, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t c = 0; c < d; c += 8) {
    const int64_t from = c < half ? c + half : c - half;  // half % 8 == 0: no block straddles
    const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(t + from), _mm256_loadu_ps(sin + c));
    _mm256_storeu_ps(out + c, _mm256_fmadd_ps(_mm256_loadu_ps(t + c), _mm256_loadu_ps(cos + c), r));
  }
}

void rms_rows(float* x, const float* delta, const float* w, float eps, int64_t rows,
              int64_t hidden, float* h) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * hidden;
    __m256 ss = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= hidden; c += 8) {
      __m256 v = _mm256_loadu_ps(xr + c);
      if (delta) {
        v = _mm256_add_ps(v, _mm256_loadu_ps(delta + r * hidden + c));
        _mm256_storeu_ps(xr + c, v);
      }
      ss = _mm256_fmadd_ps(v, v, ss);
    }
    float sum = hsum(ss);
    for (; c < hidden; ++c) {
      if (delta) xr[c] += delta[r * hidden + c];
      sum += xr[c] * xr[c];
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    float* hr = h + r * hidden;
    for (c = 0; c + 8 <= hidden; c += 8)
      _mm256_storeu_ps(hr + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + c), iv),
                                             _mm256_loadu_ps(w + c)));
    for (; c < hidden; ++c) hr[c] = xr[c] * inv * w[c];
  }
}

// One head's attention for one row: softmax(q . K[0..len) * scale) V into out (d floats)
void attend(const float* q, const float* kc, const float* vc, int64_t len, int64_t d, float scale,
            std::vector<float>& p, float* out) {
  p.resize(len);
  scores(q, kc, len, d, scale, p.data());
  const float m = *std::max_element(p.begin(), p.end());
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.data() + j), mv));
    _mm256_storeu_ps(p.data() + j, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum(sv);
  for (; j < len; ++j) sum += (p[j] = exp1(p[j] - m));
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  // 64 output columns at a time in eight accumulators, so successive FMAs are independent
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    const int blocks = static_cast<int>(std::min<int64_t>(64, d - c0) / 8);
    __m256 acc[8];
    for (int b = 0; b < 8; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t]);
      const float* v = vc + t * d + c0;
      for (int b = 0; b < blocks; ++b)
        acc[b] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * b), acc[b]);
    }
    for (int b = 0; b < blocks; ++b) _mm256_storeu_ps(out + c0 + 8 * b, _mm256_mul_ps(acc[b], inv));
  }
}

void silu_rows(const float* g, int64_t gs, const float* u, int64_t us, int64_t rows,
               int64_t inter, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = g + r * gs;
    const float* ur = u + r * us;
    float* o = out + r * inter;
    int64_t c = 0;
    for (; c + 8 <= inter; c += 8) {
      const __m256 gv = _mm256_loadu_ps(gr + c);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));  // silu = g / (1 + e^-g)
      _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                            _mm256_loadu_ps(ur + c)));
    }
    for (; c < inter; ++c) o[c] = gr[c] / (1.0f + exp1(-gr[c])) * ur[c];
  }
}

}  // namespace
#pragma GCC pop_options

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.device().is_cpu(), name,
              " must be float32 on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be (rows, width) with unit stride");
}

void check_isa(const std::string& isa) {
  isa_index(isa);  // an error where the CPU lacks the ISA; the code below is AVX2 + FMA
}

}  // namespace

at::Tensor add_rms_norm(at::Tensor x, std::optional<at::Tensor> delta,
                           at::Tensor weight, double eps, const std::string& isa) {
  check_isa(isa);
  check_rows(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous (it is updated in place)");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const float* d = nullptr;
  at::Tensor dc;
  if (delta.has_value()) {
    dc = delta->reshape({rows, hidden}).contiguous();
    check_rows(dc, "delta");
    d = dc.data_ptr<float>();
  }
  auto w = weight.contiguous();
  check_rows(w.view({1, hidden}), "weight");
  auto h = at::empty_like(x);
  rms_rows(x.data_ptr<float>(), d, w.data_ptr<float>(), static_cast<float>(eps), rows, hidden,
           h.data_ptr<float>());
  return h;
}

at::Tensor rope_attention(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                          at::Tensor v_cache, int64_t past, int64_t heads, double scaling,
                          const std::string& isa) {
  check_isa(isa);
  for (auto* t : {&qkv, &cos, &sin}) check_rows(*t, "qkv, cos and sin");
  const int64_t n = qkv.size(0), d = cos.size(1), kv = k_cache.size(0), cap = k_cache.size(1);
  TORCH_CHECK(d % 16 == 0, "head_dim must be a multiple of 16, got ", d);
  TORCH_CHECK(heads % kv == 0 && qkv.size(1) == (heads + 2 * kv) * d,
              "qkv must be (rows, (heads + 2 kv_heads) head_dim): q, k, v side by side");
  TORCH_CHECK(cos.size(0) == n && sin.size(0) == n && sin.size(1) == d, "cos, sin: (rows, d)");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 3 && k_cache.size(2) == d &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "caches must be contiguous float32 (kv_heads, capacity, head_dim)");
  TORCH_CHECK(past >= 0 && past + n <= cap, "the cache holds ", cap, " positions, need ",
              past + n);
  const float* qp = qkv.data_ptr<float>();
  const float *kp = qp + heads * d, *vp = kp + kv * d;
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t rs = qkv.stride(0);
  for (int64_t i = 0; i < n; ++i)  // the new rows' keys (rotated) and values into the cache
    for (int64_t g = 0; g < kv; ++g) {
      rope(kp + i * rs + g * d, cp + i * d, sp + i * d, d, kc + (g * cap + past + i) * d);
      std::copy_n(vp + i * rs + g * d, d, vc + (g * cap + past + i) * d);
    }
  auto out = at::empty({n, heads * d}, qkv.options().memory_format(at::MemoryFormat::Contiguous));
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv;
  const float scale = static_cast<float>(scaling);
  // one task per (head, row); a row sees the cache and the rows before it
  at::parallel_for(0, heads * n, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> p, qr(d);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / n, i = t % n, g = h / group;
      rope(qp + i * rs + h * d, cp + i * d, sp + i * d, d, qr.data());
      attend(qr.data(), kc + g * cap * d, vc + g * cap * d, past + i + 1, d, scale, p,
             op + i * heads * d + h * d);
    }
  });
  return out;
}

at::Tensor silu_mul(at::Tensor gate_up, const std::string& isa) {
  check_isa(isa);
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must be (rows, 2 intermediate): gate, up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  const float* g = gate_up.data_ptr<float>();
  silu_rows(g, gate_up.stride(0), g + inter, gate_up.stride(0), rows, inter, out.data_ptr<float>());
  return out;
}
