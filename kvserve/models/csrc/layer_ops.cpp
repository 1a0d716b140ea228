// Fused element-wise steps of a decoder layer, for CPU float32 and bfloat16 (the role of vLLM's
// fused_add_rms_norm, rotary_embedding, silu_and_mul and gelu_tanh_and_mul custom ops). Each replaces 3-14 PyTorch calls; at
// decode batch sizes a layer's element-wise work is tiny and the per-call dispatch cost is what these save.
// bfloat16 tensors are read into float, computed in float and rounded once when stored (PyTorch's reference
// rounds after every op: the fused result is the closer one to float32).
//
// The vector code is chosen at compile time (utils/cpu_isa.py builds one variant per instruction set): AVX-512
// (16 lanes), AVX2 + FMA (8 lanes) or scalar, each op one template over the vector type `Vec`. A row's last
// partial vector goes through a small buffer rather than a scalar loop, so every element takes the same
// arithmetic whatever the row length.
#include <torch/extension.h>

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using bf16 = c10::BFloat16;

#if defined(__AVX512F__)
struct Vec {
  using T = __m512;
  static constexpr int kWidth = 16;
  T v;
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const bf16* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(bf16* p) const {
    // round to nearest even: add 0x7fff plus the kept part's lowest bit, keep the high half. NOTE: no NaN
    // test, as c10's conversion has none under -ffast-math either: the default NaN stays a NaN.
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec fms(Vec a, Vec b, Vec c) { return {_mm512_fmsub_ps(a.v, b.v, c.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  static Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
  static Vec round(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  // 2^n for whole n in [-126, 127]
  static Vec pow2(Vec n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using T = __m256;
  static constexpr int kWidth = 8;
  T v;
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const bf16* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(bf16* p) const {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    // 8 x 32-bit -> 8 x 16-bit: packus works within each 128-bit half, so pack, then gather the halves
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec fms(Vec a, Vec b, Vec c) { return {_mm256_fmsub_ps(a.v, b.v, c.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  static Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
  static Vec round(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  static Vec pow2(Vec n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
  }
  float sum() const {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
};
#else
struct Vec {
  using T = float;
  static constexpr int kWidth = 1;
  T v;
  static Vec set1(float x) { return {x}; }
  static Vec load(const float* p) { return {*p}; }
  static Vec load(const bf16* p) { return {static_cast<float>(*p)}; }
  void store(float* p) const { *p = v; }
  void store(bf16* p) const { *p = static_cast<bf16>(v); }
  friend Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
  friend Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
  friend Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
  friend Vec operator/(Vec a, Vec b) { return {a.v / b.v}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {a.v * b.v + c.v}; }
  static Vec fms(Vec a, Vec b, Vec c) { return {a.v * b.v - c.v}; }
  float sum() const { return v; }
};
#endif

// n < Vec::kWidth elements (a row's tail) through a buffer, so the tail takes the vector arithmetic too
template <typename T>
inline Vec load_n(const T* p, int64_t n) {
  T buf[Vec::kWidth] = {};
  std::memcpy(buf, p, n * sizeof(T));
  return Vec::load(buf);
}

template <typename T>
inline void store_n(const Vec& x, T* p, int64_t n) {
  T buf[Vec::kWidth];
  x.store(buf);
  std::memcpy(p, buf, n * sizeof(T));
}

// f(i, n) over [0, len) in whole vectors, then the tail (n < kWidth)
template <typename F>
inline void for_each_vec(int64_t len, F&& f) {
  int64_t i = 0;
  for (; i + Vec::kWidth <= len; i += Vec::kWidth) f(i, Vec::kWidth);
  if (i < len) f(i, len - i);
}

template <typename T>
inline Vec load_at(const T* p, int64_t n) { return n == Vec::kWidth ? Vec::load(p) : load_n(p, n); }

template <typename T>
inline void store_at(const Vec& x, T* p, int64_t n) {
  if (n == Vec::kWidth) x.store(p); else store_n(x, p, n);
}

// x / (1 + exp(-y)): SiLU is y = x; tanh-GELU is y = 2 sqrt(2/pi) (x + 0.044715 x^3), as
// 0.5 (1 + tanh(z)) = 1 / (1 + exp(-2z)).
// exp(x) clamped to float's normal range, exp(-87) ~ 2e-38 to exp(88) ~ 2e38: it only ever divides x here, where
// either end gives x or 0 to float precision, and an infinity would be undefined under -ffast-math.
constexpr float kExpLo = -87.0f, kExpHi = 88.0f;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Vector: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (truncation below 1e-8 on
// that range), times 2^n built in the exponent bits.
inline Vec exp(Vec x) {
  x = Vec::min(Vec::max(x, Vec::set1(kExpLo)), Vec::set1(kExpHi));
  const Vec n = Vec::round(x * Vec::set1(1.44269504088896341f));
  Vec r = Vec::fma(n, Vec::set1(-0.693145751953125f), x);  // ln2 in two parts: n * hi is exact
  r = Vec::fma(n, Vec::set1(-1.428606765330187e-06f), r);
  Vec p = Vec::set1(1.0f / 5040);
  p = Vec::fma(p, r, Vec::set1(1.0f / 720));
  p = Vec::fma(p, r, Vec::set1(1.0f / 120));
  p = Vec::fma(p, r, Vec::set1(1.0f / 24));
  p = Vec::fma(p, r, Vec::set1(1.0f / 6));
  p = Vec::fma(p, r, Vec::set1(0.5f));
  p = Vec::fma(p, r, Vec::set1(1.0f));
  p = Vec::fma(p, r, Vec::set1(1.0f));
  return p * Vec::pow2(n);
}
#else
inline Vec exp(Vec x) { return {std::exp(std::fmin(std::fmax(x.v, kExpLo), kExpHi))}; }
#endif

struct Silu {
  static Vec apply(Vec g) { return g / (Vec::set1(1.0f) + exp(Vec::set1(0.0f) - g)); }
};

struct GeluTanh {  // PyTorch's gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
  static Vec apply(Vec g) {
    constexpr float kBeta2 = 2 * 0.7978845608028654f, kKappa = 0.044715f;
    const Vec g3 = g * g * g;
    const Vec neg_y = Vec::set1(-kBeta2) * Vec::fma(Vec::set1(kKappa), g3, g);
    return g / (Vec::set1(1.0f) + exp(neg_y));
  }
};

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 &&
                  (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16),
              name, ": expected a float32 or bfloat16 [rows, cols] tensor with contiguous rows");
}

void check_same_dtype(const torch::Tensor& a, const torch::Tensor& b, const char* name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), name, ": all tensors must have one dtype");
}

template <typename T>
void add_rms_norm_impl(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, float eps) {
  const int64_t T_ = x.size(0), H = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
#pragma omp parallel for schedule(static) if (T_ > 8)
  for (int64_t t = 0; t < T_; ++t) {
    T* xr = xp + t * xs;
    T* rr = rp + t * rs;
    Vec ss = Vec::set1(0.0f);
    for_each_vec(H, [&](int64_t h, int64_t n) {
      // NOTE: the residual stream is stored in T, so the norm is taken of the stored (rounded) sum, as
      // transformers does: the sum is stored, then read back.
      store_at(load_at(rr + h, n) + load_at(xr + h, n), rr + h, n);
      const Vec v = load_at(rr + h, n);
      ss = Vec::fma(v, v, ss);
    });
    const Vec inv = Vec::set1(1.0f / std::sqrt(ss.sum() / static_cast<float>(H) + eps));
    for_each_vec(H, [&](int64_t h, int64_t n) {
      store_at(load_at(rr + h, n) * inv * load_at(wp + h, n), xr + h, n);
    });
  }
}

template <typename T>
void rope_impl(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t num_heads,
               int64_t head_dim) {
  // R: the rotated dims at the start of each head (partial RoPE: R < head_dim; the rest pass through)
  const int64_t T_ = qkv.size(0), D = head_dim, R = cos.size(1), half = R / 2, stride = qkv.stride(0);
  T* p = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
#pragma omp parallel for schedule(static) if (T_ > 8)
  for (int64_t t = 0; t < T_; ++t) {
    const T* c = cp + t * R;
    const T* s = sp + t * R;
    for (int64_t h = 0; h < num_heads; ++h) {
      T* x = p + t * stride + h * D;
      for_each_vec(half, [&](int64_t i, int64_t n) {
        const Vec x1 = load_at(x + i, n), x2 = load_at(x + i + half, n);
        // x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin
        store_at(Vec::fms(x1, load_at(c + i, n), x2 * load_at(s + i, n)), x + i, n);
        store_at(Vec::fma(x2, load_at(c + i + half, n), x1 * load_at(s + i + half, n)), x + i + half, n);
      });
    }
  }
}

template <typename T, typename Act>
void act_and_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t T_ = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
#pragma omp parallel for schedule(static) if (T_ > 8)
  for (int64_t t = 0; t < T_; ++t) {
    const T* g = gp + t * stride;
    const T* u = g + I;
    T* o = op + t * I;
    for_each_vec(I, [&](int64_t i, int64_t n) {
      store_at(Act::apply(load_at(g + i, n)) * load_at(u + i, n), o + i, n);
    });
  }
}

// gate_up [T, 2I] -> act(gate) * up [T, I]
template <typename Act>
torch::Tensor act_and_mul(const torch::Tensor& gate_up, const char* name) {
  check_rows(gate_up, name);
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) {
    act_and_mul_impl<float, Act>(gate_up, out);
  } else {
    act_and_mul_impl<bf16, Act>(gate_up, out);
  }
  return out;
}

}  // namespace

// residual += x; x = rms_norm(residual) * weight. Both in place: x is the sublayer output on entry and the
// next sublayer's input on exit.
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm_ x");
  check_rows(residual, "add_rms_norm_ residual");
  check_same_dtype(x, residual, "add_rms_norm_");
  check_same_dtype(x, weight, "add_rms_norm_");
  TORCH_CHECK(x.sizes() == residual.sizes() && weight.numel() == x.size(1) && weight.is_contiguous(),
              "add_rms_norm_: shapes do not match");
  if (x.scalar_type() == torch::kFloat32) {
    add_rms_norm_impl<float>(x, residual, weight, static_cast<float>(eps));
  } else {
    add_rms_norm_impl<bf16>(x, residual, weight, static_cast<float>(eps));
  }
}

// Rotate-half RoPE, in place, on the first num_heads heads of each row of qkv [T, W] (q heads then k heads
// of a fused projection): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, with cos/sin [T, R]: the first R <= D
// dims of each head rotate (partial RoPE where R < D), the others are left as they are.
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "rope_ qkv");
  check_same_dtype(qkv, cos, "rope_");
  check_same_dtype(qkv, sin, "rope_");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == qkv.size(0) &&
                  cos.size(1) <= head_dim && cos.size(1) % 2 == 0 && sin.sizes() == cos.sizes() &&
                  num_heads * head_dim <= qkv.size(1),
              "rope_: shapes do not match");
  if (qkv.scalar_type() == torch::kFloat32) {
    rope_impl<float>(qkv, cos, sin, num_heads, head_dim);
  } else {
    rope_impl<bf16>(qkv, cos, sin, num_heads, head_dim);
  }
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) { return act_and_mul<Silu>(gate_up, "silu_and_mul gate_up"); }

torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) {
  return act_and_mul<GeluTanh>(gate_up, "gelu_tanh_and_mul gate_up");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) * weight (in place)");
  m.def("rope_", &rope_, "rotate-half RoPE on the leading heads of each row (in place)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu(gate, approximate='tanh') * up (Gemma)");
  m.def("vector_width", []() { return Vec::kWidth; }, "float32 lanes of the vector code this build runs");
}
