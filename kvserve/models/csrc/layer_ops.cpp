// Fused element-wise steps of a decoder layer, for CPU float32 (the role of vLLM's fused_add_rms_norm,
// rotary_embedding and silu_and_mul custom ops). Each replaces 3-14 PyTorch calls; at decode batch sizes a
// layer's element-wise work is tiny and the per-call dispatch cost is what these save.
#include <torch/extension.h>

#include <cmath>

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.scalar_type() == torch::kFloat32,
              name, ": expected a float32 [rows, cols] tensor with contiguous rows");
}

}  // namespace

// residual += x; x = rms_norm(residual) * weight. Both in place: x is the sublayer output on entry and the
// next sublayer's input on exit.
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm_ x");
  check_rows(residual, "add_rms_norm_ residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && weight.numel() == x.size(1) && weight.is_contiguous(),
              "add_rms_norm_: shapes do not match");
  const int64_t T = x.size(0), H = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  const float feps = static_cast<float>(eps);
#pragma omp parallel for schedule(static) if (T > 8)
  for (int64_t t = 0; t < T; ++t) {
    float* xr = xp + t * xs;
    float* rr = rp + t * rs;
    float ss = 0.0f;
    for (int64_t h = 0; h < H; ++h) {
      const float v = rr[h] + xr[h];
      rr[h] = v;
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + feps);
    for (int64_t h = 0; h < H; ++h) xr[h] = rr[h] * inv * wp[h];
  }
}

// Rotate-half RoPE, in place, on the first num_heads heads of each row of qkv [T, W] (q heads then k heads
// of a fused projection): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, with cos/sin [T, D].
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t head_dim) {
  check_rows(qkv, "rope_ qkv");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == qkv.size(0) * head_dim &&
                  sin.numel() == cos.numel() && head_dim % 2 == 0 && num_heads * head_dim <= qkv.size(1),
              "rope_: shapes do not match");
  const int64_t T = qkv.size(0), D = head_dim, half = head_dim / 2, stride = qkv.stride(0);
  float* p = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
#pragma omp parallel for schedule(static) if (T > 8)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cp + t * D;
    const float* s = sp + t * D;
    for (int64_t h = 0; h < num_heads; ++h) {
      float* x = p + t * stride + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i + half] + x1 * s[i + half];
      }
    }
  }
}

// gate_up [T, 2I] -> silu(gate) * up [T, I]
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (T > 8)
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gp + t * stride;
    const float* u = g + I;
    float* o = op + t * I;
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) * weight (in place)");
  m.def("rope_", &rope_, "rotate-half RoPE on the leading heads of each row (in place)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
}
