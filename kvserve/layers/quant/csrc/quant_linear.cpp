// Weight-only quantized linear layers for CPU float32 activations: y[m, n] = sum_k x[m, k] * w[n, k], with w
// dequantized one output row at a time into a float32 buffer (L1-sized) and dotted with every input row.
// PyTorch's own weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) are fast only with
// bfloat16 inputs; with float32 (or float16) ones they run scalar code. Here the weight bytes are read
// once per call, and the products equal a dense matmul on the dequantized weight up to summation order.
//
// Formats (w is [N, K], groups of `group` input columns, group a multiple of 32):
//   int8:  q [N, K] int8,  scale [N, K/group]            w = q * scale
//   int4:  q [N, K/2] uint8, scale, min [N, K/group]     w = q * scale + min,  q in 0..15; in each run of
//          32 weights the 16 bytes hold weights 0..15 in their low nibbles and 16..31 in the high ones
//          (GGUF's Q4_0/Q4_1 nibble order, so those blocks' bytes are used as stored).
#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

void check(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale, int64_t group,
           int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "quant_linear: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == k, "quant_linear: x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == torch::kFloat32,
              "quant_linear: codes and scales must be contiguous (scales float32)");
  TORCH_CHECK(group % 32 == 0 && k % group == 0, "quant_linear: group ", group, " must be a multiple of 32 ",
              "dividing K = ", k);
  TORCH_CHECK(scale.numel() == q.size(0) * (k / group), "quant_linear: scales must be [N, K / group]");
}

inline float dot(const float* a, const float* b, int64_t k) {
#ifdef __AVX512F__
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#else
  float s = 0.0f;
  int64_t i = 0;
#endif
  for (; i < k; ++i) s += a[i] * b[i];
  return s;
}

inline void dequant_row_int8(const int8_t* q, const float* scale, int64_t group, int64_t k, float* w) {
  for (int64_t g = 0; g < k / group; ++g) {
    const float s = scale[g];
    int64_t i = g * group;
#ifdef __AVX512F__
    const __m512 vs = _mm512_set1_ps(s);
    for (; i + 16 <= (g + 1) * group; i += 16) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + i))));
      _mm512_storeu_ps(w + i, _mm512_mul_ps(v, vs));
    }
#endif
    for (; i < (g + 1) * group; ++i) w[i] = static_cast<float>(q[i]) * s;
  }
}

inline void dequant_row_int4(const uint8_t* q, const float* scale, const float* mins, int64_t group, int64_t k,
                             float* w) {
  for (int64_t b = 0; b < k / 32; ++b) {
    const int64_t g = b * 32 / group;
    const uint8_t* qs = q + b * 16;
    float* out = w + b * 32;
#ifdef __AVX512F__
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
    const __m512 vs = _mm512_set1_ps(scale[g]), vm = _mm512_set1_ps(mins[g]);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_mul_ps(lo, vs), vm));
    _mm512_storeu_ps(out + 16, _mm512_add_ps(_mm512_mul_ps(hi, vs), vm));
#else
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(qs[j] & 0x0F) * scale[g] + mins[g];
      out[j + 16] = static_cast<float>(qs[j] >> 4) * scale[g] + mins[g];
    }
#endif
  }
}

#ifdef __AVX512F__
// One run of 32 weights of row n as two float32 vectors (weights b*32 .. b*32+15, then +16 .. +31).
struct Int8Block {
  const int8_t* q;
  const float* scale;
  int64_t k, group;
  inline void operator()(int64_t n, int64_t b, __m512& w0, __m512& w1) const {
    const int8_t* p = q + n * k + b * 32;
    const __m512 vs = _mm512_set1_ps(scale[n * (k / group) + b * 32 / group]);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))), vs);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16)))), vs);
  }
};

struct Int4Block {
  const uint8_t* q;
  const float* scale;
  const float* mins;
  int64_t k, group;
  inline void operator()(int64_t n, int64_t b, __m512& w0, __m512& w1) const {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + n * (k / 2) + b * 16)));
    const int64_t g = n * (k / group) + b * 32 / group;
    const __m512 vs = _mm512_set1_ps(scale[g]), vm = _mm512_set1_ps(mins[g]);
    w0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F))), vs), vm);
    w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), vs), vm);
  }
};

// Decode sizes: each weight block is dequantized in registers and used by MR input rows at once (one
// accumulator register per row), so for up to MR rows the weight is read once and never written back.
template <int MR, typename BlockFn>
void linear_block_rows(const float* xp, float* yp, int64_t n_out, int64_t k, const BlockFn& block) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < n_out; ++n) {
    __m512 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 32; ++b) {
      __m512 w0, w1;
      block(n, b, w0, w1);
      for (int i = 0; i < MR; ++i) {
        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + i * k + b * 32), w0, acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + i * k + b * 32 + 16), w1, acc[i]);
      }
    }
    for (int i = 0; i < MR; ++i) yp[i * n_out + n] = _mm512_reduce_add_ps(acc[i]);
  }
}

// M rows in chunks of at most 8 (the accumulators and the two weight vectors stay in the 32 zmm registers).
template <typename BlockFn>
void linear_small(const float* xp, float* yp, int64_t m, int64_t n_out, int64_t k, const BlockFn& block) {
  for (int64_t start = 0; start < m; start += 8) {
    const float* x = xp + start * k;
    float* y = yp + start * n_out;
    switch (std::min<int64_t>(8, m - start)) {
      case 1: linear_block_rows<1>(x, y, n_out, k, block); break;
      case 2: linear_block_rows<2>(x, y, n_out, k, block); break;
      case 3: linear_block_rows<3>(x, y, n_out, k, block); break;
      case 4: linear_block_rows<4>(x, y, n_out, k, block); break;
      case 5: linear_block_rows<5>(x, y, n_out, k, block); break;
      case 6: linear_block_rows<6>(x, y, n_out, k, block); break;
      case 7: linear_block_rows<7>(x, y, n_out, k, block); break;
      default: linear_block_rows<8>(x, y, n_out, k, block); break;
    }
  }
}
#endif

// Dequantize row n of the weight into w (K floats) with `row`, then y[:, n] = x w.
template <typename RowFn>
void linear_rows(const float* xp, float* yp, int64_t m, int64_t n_out, int64_t k, RowFn row) {
#pragma omp parallel
  {
    std::vector<float> w(k);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
      row(n, w.data());
      for (int64_t i = 0; i < m; ++i) yp[i * n_out + n] = dot(xp + i * k, w.data(), k);
    }
  }
}

// Into `out` when given (a caller's reused buffer: a fresh multi-megabyte tensor per call pays page faults).
template <typename RowFn>
torch::Tensor dequantize(int64_t n_out, int64_t k, const c10::optional<torch::Tensor>& out, RowFn row) {
  torch::Tensor w;
  if (out.has_value()) {
    w = *out;
    TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.dim() == 2 && w.size(0) == n_out &&
                w.size(1) == k, "dequantize: out must be a contiguous float32 [", n_out, ", ", k, "] tensor");
  } else {
    w = torch::empty({n_out, k}, torch::kFloat32);
  }
  float* wp = w.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < n_out; ++n) row(n, wp + n * k);
  return w;
}

}  // namespace

// x [M, K] float32, q [N, K] int8, scale [N, K / group] float32 -> [M, N] float32.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t group) {
  const int64_t k = q.size(1);
  check(x, q, scale, group, k);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t m = x.size(0), n_out = q.size(0);
  auto y = torch::empty({m, n_out}, x.options());
#ifdef __AVX512F__
  if (m <= 32) {
    linear_small(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, Int8Block{qp, sp, k, group});
    return y;
  }
#endif
  linear_rows(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, [&](int64_t n, float* w) {
    dequant_row_int8(qp + n * k, sp + n * (k / group), group, k, w);
  });
  return y;
}

// x [M, K] float32, q [N, K / 2] uint8, scale and min [N, K / group] float32 -> [M, N] float32.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor mins,
                          int64_t group) {
  const int64_t k = q.size(1) * 2;
  check(x, q, scale, group, k);
  TORCH_CHECK(mins.sizes() == scale.sizes() && mins.is_contiguous(), "int4_linear: mins must match scales");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  const int64_t m = x.size(0), n_out = q.size(0);
  auto y = torch::empty({m, n_out}, x.options());
#ifdef __AVX512F__
  if (m <= 32) {
    linear_small(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, Int4Block{qp, sp, mp, k, group});
    return y;
  }
#endif
  linear_rows(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, [&](int64_t n, float* w) {
    dequant_row_int4(qp + n * (k / 2), sp + n * (k / group), mp + n * (k / group), group, k, w);
  });
  return y;
}

torch::Tensor int8_dequantize(torch::Tensor q, torch::Tensor scale, int64_t group,
                              c10::optional<torch::Tensor> out) {
  const int64_t k = q.size(1);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  return dequantize(q.size(0), k, out, [&](int64_t n, float* w) {
    dequant_row_int8(qp + n * k, sp + n * (k / group), group, k, w);
  });
}

torch::Tensor int4_dequantize(torch::Tensor q, torch::Tensor scale, torch::Tensor mins, int64_t group,
                              c10::optional<torch::Tensor> out) {
  const int64_t k = q.size(1) * 2;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  return dequantize(q.size(0), k, out, [&](int64_t n, float* w) {
    dequant_row_int4(qp + n * (k / 2), sp + n * (k / group), mp + n * (k / group), group, k, w);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "weight-only int8 linear (float32 activations)");
  m.def("int4_linear", &int4_linear, "weight-only int4 linear (float32 activations)");
  m.def("int8_dequantize", &int8_dequantize, "int8 codes and group scales -> float32 weight", py::arg("q"),
        py::arg("scale"), py::arg("group"), py::arg("out") = py::none());
  m.def("int4_dequantize", &int4_dequantize, "int4 codes, group scales and mins -> float32 weight", py::arg("q"),
        py::arg("scale"), py::arg("mins"), py::arg("group"), py::arg("out") = py::none());
}
