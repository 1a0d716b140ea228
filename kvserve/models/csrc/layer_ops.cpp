// Fused element-wise steps of a decoder layer, for CPU float32 and bfloat16 (the role of vLLM's
// fused_add_rms_norm, rotary_embedding, silu_and_mul and gelu_tanh_and_mul custom ops). Each replaces 3-14 PyTorch calls; at
// decode batch sizes a layer's element-wise work is tiny and the per-call dispatch cost is what these save.
// bfloat16 tensors are read into float, computed in float and rounded once when stored (PyTorch's reference
// rounds after every op: the fused result is the closer one to float32).
#include <torch/extension.h>

#include <c10/util/BFloat16.h>

#include <cmath>

namespace {

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
    float ss = 0.0f;
    for (int64_t h = 0; h < H; ++h) {
      // NOTE: the residual stream is stored in T, so the norm is taken of the stored (rounded) sum, as
      // transformers does.
      const T v = static_cast<T>(static_cast<float>(rr[h]) + static_cast<float>(xr[h]));
      rr[h] = v;
      const float f = static_cast<float>(v);
      ss += f * f;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
    for (int64_t h = 0; h < H; ++h)
      xr[h] = static_cast<T>(static_cast<float>(rr[h]) * inv * static_cast<float>(wp[h]));
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
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
        x[i] = static_cast<T>(x1 * static_cast<float>(c[i]) - x2 * static_cast<float>(s[i]));
        x[i + half] = static_cast<T>(x2 * static_cast<float>(c[i + half]) + x1 * static_cast<float>(s[i + half]));
      }
    }
  }
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// PyTorch's gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
inline float gelu_tanh(float g) {
  constexpr float kBeta = 0.7978845608028654f;
  constexpr float kKappa = 0.044715f;
  return 0.5f * g * (1.0f + std::tanh(kBeta * (g + kKappa * g * g * g)));
}

template <typename T, float (*Act)(float)>
void act_and_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t T_ = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
#pragma omp parallel for schedule(static) if (T_ > 8)
  for (int64_t t = 0; t < T_; ++t) {
    const T* g = gp + t * stride;
    const T* u = g + I;
    T* o = op + t * I;
    for (int64_t i = 0; i < I; ++i) {
      o[i] = static_cast<T>(Act(static_cast<float>(g[i])) * static_cast<float>(u[i]));
    }
  }
}

// gate_up [T, 2I] -> act(gate) * up [T, I]
template <float (*Act)(float)>
torch::Tensor act_and_mul(const torch::Tensor& gate_up, const char* name) {
  check_rows(gate_up, name);
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) {
    act_and_mul_impl<float, Act>(gate_up, out);
  } else {
    act_and_mul_impl<c10::BFloat16, Act>(gate_up, out);
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
    add_rms_norm_impl<c10::BFloat16>(x, residual, weight, static_cast<float>(eps));
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
    rope_impl<c10::BFloat16>(qkv, cos, sin, num_heads, head_dim);
  }
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) { return act_and_mul<silu>(gate_up, "silu_and_mul gate_up"); }

torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) {
  return act_and_mul<gelu_tanh>(gate_up, "gelu_tanh_and_mul gate_up");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) * weight (in place)");
  m.def("rope_", &rope_, "rotate-half RoPE on the leading heads of each row (in place)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu(gate, approximate='tanh') * up (Gemma)");
}
