// A matmul whose every output element is reduced over K in one fixed order, whatever the number of rows M,
// the tile an element falls in, or the thread that computes it: y[m, n] = (sum over k = 0, 1, .., K-1 of
// x[m, k] * w[n, k], one FMA after another into a lane of a vector that starts at 0) + bias[n]. So a row's
// result is bit-identical whether it is multiplied alone or among 600 rows (the batch-invariant mode,
// docs/features/batch-invariance.md). BLAS libraries do not promise that: MKL's sgemm switches between gemv
// and blocked gemm kernels, and oneDNN changes its K blocking with M, so their partial sums differ by shape.
//
// The weight [N, K] is packed once into panels of 16 output columns, K-major: panel p holds w[16p + j, k] at
// [p][k][j] (bfloat16 weights stay bfloat16 there and are widened in registers), zero-padded past N. A tile
// of up to kRows rows by kPanels panels keeps its accumulators in registers; at every k it broadcasts each
// row's x[m, k] and FMAs it into the panels' lanes. Edge tiles (fewer rows, fewer panels) run the same
// template with smaller counts: the per-element chain of operations does not change, only how many run side
// by side. K is never split across threads (that would be a second, thread-count-dependent sum).
//
// Instruction sets (utils/cpu_isa.py builds one variant per set): AVX-512 (16 lanes, 2 panels x 6 rows),
// AVX2 + FMA (8 lanes, 1 panel x 6 rows), scalar (plain loops over a panel's 16 columns: the compiler
// vectorises across columns, never across k, so the order along k stays the one written).
#include <torch/extension.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

// NOTE: kernels are built with -ffast-math, which lets the compiler reassociate a sum (split the chain along k
// into partial sums, differently for each tile shape it unrolls): exactly what this file must not do.
#if defined(__clang__)
#pragma clang fp reassociate(off)
#elif defined(__GNUC__)
#pragma GCC optimize("no-associative-math")
#endif

namespace {

constexpr int64_t kPanel = 16;  // output columns per packed panel (the same on every instruction set)

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRows = 6, kPanels = 2;
using VecF = __m512;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vset(float x) { return _mm512_set1_ps(x); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vload(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, VecF x) { _mm512_storeu_ps(p, x); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kRows = 6, kPanels = 1;
using VecF = __m256;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vset(float x) { return _mm256_set1_ps(x); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vload(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, VecF x) { _mm256_storeu_ps(p, x); }
#else
constexpr int kLanes = 1;
constexpr int kRows = 4, kPanels = 1;
#endif

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// One tile: rows x[0..R) (ld apart), panels w[0..P) (each K * 16 elements), out[R][P * 16] (ld_out apart, the
// first n_valid columns written). R <= kRows and P <= kPanels are compile-time, so the accumulators stay in
// registers; the operations on each element are the same for every R and P.
template <int R, int P, typename W>
void tile(const float* x, int64_t ldx, const W* w, int64_t K, const float* bias, float* out, int64_t ld_out,
          int64_t n_valid) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  constexpr int V = P * kPanel / kLanes;  // vectors across the tile's columns
  VecF acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    VecF wv[V];
    for (int v = 0; v < V; ++v) {
      const int p = v * kLanes / kPanel, j = v * kLanes % kPanel;
      wv[v] = vload(w + (p * K + k) * kPanel + j);
    }
    for (int r = 0; r < R; ++r) {
      const VecF xb = vset(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(xb, wv[v], acc[r][v]);
    }
  }
  float buf[P * kPanel];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) vstore(buf + v * kLanes, acc[r][v]);
#else
  float acc[R][P * kPanel] = {};
  for (int64_t k = 0; k < K; ++k) {
    for (int p = 0; p < P; ++p) {
      const W* wk = w + (p * K + k) * kPanel;
      for (int r = 0; r < R; ++r) {
        const float xv = x[r * ldx + k];
        for (int j = 0; j < kPanel; ++j) acc[r][p * kPanel + j] += xv * widen(wk[j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* buf = acc[r];
#endif
    float* o = out + r * ld_out;
    if (bias != nullptr) {
      for (int64_t n = 0; n < n_valid; ++n) o[n] = buf[n] + bias[n];
    } else {
      for (int64_t n = 0; n < n_valid; ++n) o[n] = buf[n];
    }
  }
}

template <int R, typename W>
void tile_panels(int64_t panels, const float* x, int64_t ldx, const W* w, int64_t K, const float* bias, float* out,
                 int64_t ld_out, int64_t n_valid) {
  if (panels == kPanels) {
    tile<R, kPanels, W>(x, ldx, w, K, bias, out, ld_out, n_valid);
  } else if constexpr (kPanels > 1) {
    tile<R, 1, W>(x, ldx, w, K, bias, out, ld_out, n_valid);
  }
}

template <typename W>
void tile_rows(int64_t rows, int64_t panels, const float* x, int64_t ldx, const W* w, int64_t K, const float* bias,
               float* out, int64_t ld_out, int64_t n_valid) {
  switch (rows) {
    case 1: return tile_panels<1, W>(panels, x, ldx, w, K, bias, out, ld_out, n_valid);
    case 2: return tile_panels<2, W>(panels, x, ldx, w, K, bias, out, ld_out, n_valid);
    case 3: return tile_panels<3, W>(panels, x, ldx, w, K, bias, out, ld_out, n_valid);
    case 4: return tile_panels<4, W>(panels, x, ldx, w, K, bias, out, ld_out, n_valid);
#if !(defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
    default: return;
#else
    case 5: return tile_panels<5, W>(panels, x, ldx, w, K, bias, out, ld_out, n_valid);
    default: return tile_panels<6, W>(panels, x, ldx, w, K, bias, out, ld_out, n_valid);
#endif
  }
}

// Tiles in (column block, row block) order, so a thread's consecutive tiles reuse one block of panels from
// its cache while rows stream past; every tile is computed whole by one thread.
template <typename W>
void run(const float* x, const W* w, const float* bias, float* out, int64_t M, int64_t N, int64_t K) {
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  const int64_t col_blocks = (num_panels + kPanels - 1) / kPanels, row_blocks = (M + kRows - 1) / kRows;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t cb = 0; cb < col_blocks; ++cb) {
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t p0 = cb * kPanels, panels = std::min<int64_t>(kPanels, num_panels - p0);
      const int64_t m0 = rb * kRows, rows = std::min<int64_t>(kRows, M - m0);
      const int64_t n0 = p0 * kPanel, n_valid = std::min<int64_t>(panels * kPanel, N - n0);
      tile_rows<W>(rows, panels, x + m0 * K, K, w + p0 * K * kPanel, K, bias ? bias + n0 : nullptr,
                   out + m0 * N + n0, N, n_valid);
    }
  }
}

}  // namespace

// weight [N, K] float32 or bfloat16 -> packed [ceil(N / 16), K, 16] of the same dtype, zero past N.
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "batch_invariant.pack: weight must be [N, K]");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kBFloat16,
              "batch_invariant.pack: weight must be float32 or bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// x [M, K] float32 (contiguous), packed from `pack`, n its N; bias [N] float32 or none -> [M, N] float32.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "batch_invariant.linear: x must be a contiguous [M, K] float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kPanel && packed.size(1) == x.size(1) &&
                  n > (packed.size(0) - 1) * kPanel && n <= packed.size(0) * kPanel,
              "batch_invariant.linear: packed must come from pack() of an [n, K] weight");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kFloat32 && bias->numel() == n,
                "batch_invariant.linear: bias must be [N] float32");
    b = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
  if (packed.scalar_type() == torch::kBFloat16) {
    run<uint16_t>(x.data_ptr<float>(), static_cast<const uint16_t*>(packed.data_ptr()), b, out.data_ptr<float>(),
                  M, n, K);
  } else {
    TORCH_CHECK(packed.scalar_type() == torch::kFloat32, "batch_invariant.linear: packed must be float32 or bfloat16");
    run<float>(x.data_ptr<float>(), packed.data_ptr<float>(), b, out.data_ptr<float>(), M, n, K);
  }
  return out;
}

int64_t vector_width() { return kLanes; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "weight [N, K] -> panels [ceil(N/16), K, 16] for linear()", py::arg("weight"));
  m.def("linear", &linear, "x [M, K] float32 times a packed weight: each output reduced over K in one fixed order",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("vector_width", &vector_width, "float32 lanes of this build's vector code (16, 8 or 1)");
}
