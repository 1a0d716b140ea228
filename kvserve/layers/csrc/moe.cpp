// The routed experts of one Mixture-of-Experts layer in one call (layers/moe.py, impl "fused"):
//   out[t] = sum_{j < k} weight[t, j] * W2[e] (SiLU(Wg[e] x[t]) * (Wu[e] x[t])),   e = ids[t, j]
// with w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I], held as float32, bfloat16, or int8 codes with
// float32 scales per group of input columns (w = q * scale; one group spanning the row: per channel).
//
// The (token, choice) pairs are bucketed by expert once (a counting sort); then two parallel passes over the
// active experts only, with no Python between them:
//   1. gate/up: one task per (active expert, tile of intermediate rows) reads the tile's gate and up rows once
//      for all of the expert's tokens and writes SiLU(g) * u for them (h [pairs, I]);
//   2. down: one task per tile of output columns walks every active expert and adds weight * (W2 h) into its
//      columns of out, so no two tasks write the same element and the sum over experts has a fixed order.
// At decode sizes each weight byte is read once per call, by all threads: the passes stream the active
// experts' weights. Products are computed in float32 (bfloat16 and int8 weights are widened in registers).
//
// The vector code is chosen at compile time (the build is -march=native and cached per CPU): AVX-512,
// AVX2 + FMA, or scalar; each is the same template over a vector type.
#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
struct Vec {
  using T = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kMaxRows = 4;  // tokens per pass: 4 weight rows x 4 tokens accumulators of 32 registers
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const at::BFloat16* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static T load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static float sum(T a) { return _mm512_reduce_add_ps(a); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using T = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kMaxRows = 2;  // 16 registers: 4 x 2 accumulators, 4 weight vectors, x
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float v) { return _mm256_set1_ps(v); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const at::BFloat16* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static T load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static float sum(T a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
};
#else
struct Vec {
  using T = float;
  static constexpr int kWidth = 1;
  static constexpr int kMaxRows = 4;
  static T zero() { return 0.f; }
  static T set1(float v) { return v; }
  static T load(const float* p) { return *p; }
  static T load(const at::BFloat16* p) { return static_cast<float>(*p); }
  static T load(const int8_t* p) { return static_cast<float>(*p); }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T mul(T a, T b) { return a * b; }
  static float sum(T a) { return a; }
};
#endif

// One matrix of one expert, [n, k] row-major: float32 / bfloat16 (scale null) or int8 with scale [n, k / group].
template <typename W>
struct Matrix {
  const W* w;
  const float* scale;
  int64_t k, group;
  inline float at(int64_t row, int64_t col) const {
    const float v = static_cast<float>(w[row * k + col]);
    return scale == nullptr ? v : v * scale[row * (k / group) + col / group];
  }
};

constexpr int kRowsPerStep = 4;  // weight rows whose dot products run together (independent FMA chains)

// The weight rows a step will read next are asked for ahead (into L2), at the column being read now: the rows
// kRowsPerStep on (the next step of the tile). A tile's rows are short streams (an int8 row of 2048 is 2 KiB),
// which the hardware prefetcher alone follows too late to keep the memory busy.
template <typename W>
inline void prefetch_next_rows(const W* at, int64_t k) {
  _mm_prefetch(reinterpret_cast<const char*>(at + kRowsPerStep * k), _MM_HINT_T1);
}

// y[m][r] = dot(x[m], W[row0 + r]) for r < nr <= kRowsPerStep, m < MR: each weight vector is loaded (and
// widened, and scaled) once for the MR inputs. A step of fewer than kRowsPerStep rows repeats its last row
// (from the cache) rather than branch in the loop.
template <int MR, typename W>
inline void dot_rows(const float* const* x, const Matrix<W>& mat, int64_t row0, int nr, float y[][kRowsPerStep]) {
  constexpr bool kScaled = std::is_same<W, int8_t>::value;
  const int64_t k = mat.k, vk = k - k % Vec::kWidth, span = kScaled ? mat.group : k;
  const W* rows[kRowsPerStep];
  const float* scales[kRowsPerStep];
  for (int r = 0; r < kRowsPerStep; ++r) {
    const int64_t row = row0 + std::min(r, nr - 1);
    rows[r] = mat.w + row * k;
    scales[r] = kScaled ? mat.scale + row * (k / mat.group) : nullptr;
  }
  typename Vec::T acc[kRowsPerStep][MR];
  for (int r = 0; r < kRowsPerStep; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = Vec::zero();
  for (int64_t c0 = 0, g = 0; c0 < vk; c0 += span, ++g) {  // g counted, not divided: a division per group costs
    typename Vec::T sv[kRowsPerStep];                         // as much as the group's multiply-adds
    if (kScaled)
      for (int r = 0; r < kRowsPerStep; ++r) sv[r] = Vec::set1(scales[r][g]);
    const int64_t c1 = std::min(vk, c0 + span);
    for (int64_t c = c0; c < c1; c += Vec::kWidth) {
      if ((c & (64 / sizeof(W) - 1)) < Vec::kWidth)  // once per cache line of weights
        for (int r = 0; r < kRowsPerStep; ++r) prefetch_next_rows(rows[r] + c, k);
      typename Vec::T xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = Vec::load(x[m] + c);
      for (int r = 0; r < kRowsPerStep; ++r) {
        typename Vec::T wv = Vec::load(rows[r] + c);
        if (kScaled) wv = Vec::mul(wv, sv[r]);
        for (int m = 0; m < MR; ++m) acc[r][m] = Vec::fma(wv, xv[m], acc[r][m]);
      }
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int m = 0; m < MR; ++m) {
      float s = Vec::sum(acc[r][m]);
      for (int64_t c = vk; c < k; ++c) s += mat.at(row0 + r, c) * x[m][c];
      y[m][r] = s;
    }
}

// y[m][j - j0] = dot(x[m], W[j]) for rows j0 <= j < j1 and m < rows (any count: passes of up to kMaxRows).
template <typename W>
void dot_tile(const float* const* x, int64_t rows, const Matrix<W>& mat, int64_t j0, int64_t j1, float* y,
              int64_t ldy) {
  for (int64_t m0 = 0; m0 < rows; m0 += Vec::kMaxRows) {
    const int mr = static_cast<int>(std::min<int64_t>(Vec::kMaxRows, rows - m0));
    for (int64_t j = j0; j < j1; j += kRowsPerStep) {
      const int nr = static_cast<int>(std::min<int64_t>(kRowsPerStep, j1 - j));
      float part[Vec::kMaxRows][kRowsPerStep];
      if (mr == 1) {
        dot_rows<1>(x + m0, mat, j, nr, part);
      } else if (mr == 2) {
        dot_rows<2>(x + m0, mat, j, nr, part);
      } else if constexpr (Vec::kMaxRows >= 4) {
        if (mr == 3) dot_rows<3>(x + m0, mat, j, nr, part);
        else dot_rows<4>(x + m0, mat, j, nr, part);
      }
      for (int m = 0; m < mr; ++m)
        for (int r = 0; r < nr; ++r) y[(m0 + m) * ldy + (j - j0) + r] = part[m][r];
    }
  }
}

// The input rows of a pass, row i at f + i * k; for int8 weights at one or two tokens (`fixed`) also a 16-bit
// fixed-point copy, x[i, c] ~= q[i, c] * s[i, c / 32] (error <= 2^-16 of each run of 32's largest |x|: the dense
// int8 kernels' rounding, layers/quant/csrc/quant_linear.cpp), so that a run of 32 weights costs one widening and
// one integer multiply-add per row (vpmaddwd) instead of widening, converting and scaling each weight: at one or
// two tokens a core's work per weight byte, not memory, sets the pace.
struct Rows {
  const float* f;
  int64_t k;
  const int16_t* q = nullptr;
  const float* s = nullptr;
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kFixedTokens = 2;

void to_fixed(const float* x, int64_t k, int16_t* q, float* s) {
  for (int64_t b = 0; b < k / 32; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * 32), v1 = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    s[b] = amax / 32767.f;
    _mm256_storeu_si256((__m256i*)(q + b * 32), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
    _mm256_storeu_si256((__m256i*)(q + b * 32 + 16),
                        _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
  }
}

// y[m][j - j0] = sum_b scale[j, g(b)] * xs[m][b] * (w[j, run b] . xq[m][run b]), rows j0 <= j < j1, m < MR.
template <int MR>
void fixed_tile(const int16_t* const* xq, const float* const* xs, const Matrix<int8_t>& mat, int64_t j0,
                int64_t j1, float* y, int64_t ldy) {
  const int64_t k = mat.k, nb = k / 32, ng = k / mat.group, per_group = mat.group / 32;
  std::vector<float> cs(MR * nb);  // row j's combined scales, weight's times input's, per run of 32
  for (int64_t j = j0; j < j1; ++j) {
    const float* sj = mat.scale + j * ng;
    for (int m = 0; m < MR; ++m)
      for (int64_t g = 0; g < ng; ++g)
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) cs[m * nb + b] = sj[g] * xs[m][b];
    const int8_t* wj = mat.w + j * k;
    // two accumulators per row (even and odd runs): one would chain every run's FMA on the previous one's
    __m512 acc[MR], odd[MR];
    for (int m = 0; m < MR; ++m) acc[m] = odd[m] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(wj + b * 32 + k), _MM_HINT_T1);  // the next row's line
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wj + b * 32)));
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wj + b * 32 + 32)));
      for (int m = 0; m < MR; ++m) {
        const __m512i x0 = _mm512_loadu_si512((const void*)(xq[m] + b * 32));
        const __m512i x1 = _mm512_loadu_si512((const void*)(xq[m] + b * 32 + 32));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(w0, x0)), _mm512_set1_ps(cs[m * nb + b]), acc[m]);
        odd[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(w1, x1)), _mm512_set1_ps(cs[m * nb + b + 1]),
                                 odd[m]);
      }
    }
    if (b < nb) {
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wj + b * 32)));
      for (int m = 0; m < MR; ++m) {
        const __m512i x0 = _mm512_loadu_si512((const void*)(xq[m] + b * 32));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(w0, x0)), _mm512_set1_ps(cs[m * nb + b]), acc[m]);
      }
    }
    for (int m = 0; m < MR; ++m) y[m * ldy + (j - j0)] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], odd[m]));
  }
}
#else
constexpr int64_t kFixedTokens = 0;
#endif

// y[m][j - j0] = dot(input row idx[m], W[j]) for j0 <= j < j1, m < rows.
template <typename W>
void tile(const Rows& in, const int64_t* idx, int64_t rows, const Matrix<W>& mat, int64_t j0, int64_t j1, float* y,
          int64_t ldy) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (std::is_same<W, int8_t>::value) {
    if (in.q != nullptr) {  // rows <= kFixedTokens: an expert's rows are distinct tokens
      const int16_t* xq[kFixedTokens];
      const float* xs[kFixedTokens];
      for (int64_t m = 0; m < rows; ++m) xq[m] = in.q + idx[m] * in.k, xs[m] = in.s + idx[m] * (in.k / 32);
      if (rows == 1) fixed_tile<1>(xq, xs, mat, j0, j1, y, ldy);
      else fixed_tile<2>(xq, xs, mat, j0, j1, y, ldy);
      return;
    }
  }
#endif
  std::vector<const float*> xr(rows);
  for (int64_t m = 0; m < rows; ++m) xr[m] = in.f + idx[m] * in.k;
  dot_tile(xr.data(), rows, mat, j0, j1, y, ldy);
}

constexpr int64_t kTile = 16;  // intermediate rows (pass 1) or output columns (pass 2) per task

// The pairs bucketed by expert: rows [start[a], start[a + 1]) of the sorted order belong to expert active[a].
struct Buckets {
  std::vector<int64_t> active, start, token;
  std::vector<float> weight;
};

Buckets bucket(const torch::Tensor& ids, const torch::Tensor& weights, int64_t num_experts) {
  const int64_t pairs = ids.numel(), k = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = weights.data_ptr<float>();
  std::vector<int64_t> count(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "moe: expert id ", id[p], " out of range");
    ++count[id[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) count[e + 1] += count[e];
  Buckets b;
  b.token.resize(pairs);
  b.weight.resize(pairs);
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {  // stable: each expert's rows in token order
    const int64_t row = next[id[p]]++;
    b.token[row] = p / k;
    b.weight[row] = wt[p];
  }
  for (int64_t e = 0; e < num_experts; ++e)
    if (count[e + 1] > count[e]) {
      b.active.push_back(e);
      b.start.push_back(count[e]);
    }
  b.start.push_back(pairs);
  return b;
}

template <typename W>
void gate_up_pass(const Rows& x, const Buckets& b, const W* w13, const float* s13, int64_t group13, int64_t inter,
                  float* h) {
  const int64_t hidden = x.k, tiles = (inter + kTile - 1) / kTile, n_active = static_cast<int64_t>(b.active.size());
  const int64_t per_expert = 2 * inter * hidden, scales_per_expert = s13 ? 2 * inter * (hidden / group13) : 0;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < n_active * tiles; ++task) {
    const int64_t a = task / tiles, j0 = (task % tiles) * kTile, j1 = std::min(inter, j0 + kTile);
    const int64_t e = b.active[a], r0 = b.start[a], rows = b.start[a + 1] - r0;
    const Matrix<W> mat{w13 + e * per_expert, s13 ? s13 + e * scales_per_expert : nullptr, hidden, group13};
    std::vector<float> gate(rows * kTile), up(rows * kTile);
    tile(x, b.token.data() + r0, rows, mat, j0, j1, gate.data(), kTile);
    tile(x, b.token.data() + r0, rows, mat, inter + j0, inter + j1, up.data(), kTile);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < j1 - j0; ++j) {
        const float g = gate[m * kTile + j];
        h[(r0 + m) * inter + j0 + j] = g / (1.f + std::exp(-g)) * up[m * kTile + j];
      }
  }
}

template <typename W>
void down_pass(const Rows& h, const Buckets& b, const W* w2, const float* s2, int64_t group2, int64_t hidden,
               float* out) {
  const int64_t inter = h.k, tiles = (hidden + kTile - 1) / kTile, n_active = static_cast<int64_t>(b.active.size());
  const int64_t per_expert = hidden * inter, scales_per_expert = s2 ? hidden * (inter / group2) : 0;
  std::vector<int64_t> pair(b.token.size());  // h's rows are the sorted pairs themselves
  for (size_t r = 0; r < pair.size(); ++r) pair[r] = static_cast<int64_t>(r);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < tiles; ++task) {
    const int64_t c0 = task * kTile, c1 = std::min(hidden, c0 + kTile);
    std::vector<float> y;
    for (int64_t a = 0; a < n_active; ++a) {
      const int64_t e = b.active[a], r0 = b.start[a], rows = b.start[a + 1] - r0;
      const Matrix<W> mat{w2 + e * per_expert, s2 ? s2 + e * scales_per_expert : nullptr, inter, group2};
      y.resize(rows * kTile);
      tile(h, pair.data() + r0, rows, mat, c0, c1, y.data(), kTile);
      for (int64_t m = 0; m < rows; ++m) {
        float* o = out + b.token[r0 + m] * hidden;
        const float wt = b.weight[r0 + m];
        for (int64_t c = c0; c < c1; ++c) o[c] += wt * y[m * kTile + c - c0];
      }
    }
  }
}

// Rows `in` with a fixed-point copy in `q` / `s` (sized here) when `fixed`.
Rows with_fixed(Rows in, int64_t n, bool fixed, std::vector<int16_t>& q, std::vector<float>& s) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (fixed) {
    q.resize(n * in.k), s.resize(n * (in.k / 32));
    for (int64_t i = 0; i < n; ++i) to_fixed(in.f + i * in.k, in.k, q.data() + i * in.k, s.data() + i * (in.k / 32));
    in.q = q.data(), in.s = s.data();
  }
#endif
  return in;
}

template <typename W>
void run(const float* x, int64_t tokens, int64_t hidden, const Buckets& b, const torch::Tensor& w13,
         const torch::Tensor& w2, const float* s13, const float* s2, int64_t group13, int64_t group2, bool fixed,
         float* h, float* out) {
  const int64_t inter = w2.size(2);
  std::vector<int16_t> xq, hq;
  std::vector<float> xs, hs;
  gate_up_pass<W>(with_fixed(Rows{x, hidden}, tokens, fixed, xq, xs), b, w13.data_ptr<W>(), s13, group13, inter, h);
  const Rows hr = with_fixed(Rows{h, inter}, static_cast<int64_t>(b.token.size()), fixed, hq, hs);
  down_pass<W>(hr, b, w2.data_ptr<W>(), s2, group2, hidden, out);
}

int64_t group_of(const torch::Tensor& scales, int64_t k, const char* what) {
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 3,
              "moe: ", what, " scales must be contiguous float32 [E, N, K / group]");
  const int64_t groups = scales.size(2);
  TORCH_CHECK(groups > 0 && k % groups == 0, "moe: ", what, " has ", groups, " scale groups for K = ", k);
  const int64_t group = k / groups;
  TORCH_CHECK(group == k || group % Vec::kWidth == 0, "moe: group ", group, " must be a multiple of ",
              Vec::kWidth);
  return group;
}

// x [T, H] float32, ids [T, k] int64, weights [T, k] float32, w13 [E, 2I, H], w2 [E, H, I] (float32, bfloat16
// or int8; int8 with s13 [E, 2I, H / g13] and s2 [E, H, I / g2], else empty scale tensors) -> [T, H] float32.
// `fixed`: int8 weights at up to kFixedTokens tokens may take the 16-bit fixed-point inputs (see Rows).
torch::Tensor moe_experts(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                          const torch::Tensor& w13, const torch::Tensor& w2, const torch::Tensor& s13,
                          const torch::Tensor& s2, bool fixed) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "moe: x must be a contiguous float32 [T, H] tensor");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == torch::kInt64 && ids.is_contiguous(),
              "moe: ids must be contiguous int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat32 && weights.is_contiguous(),
              "moe: weights must be contiguous float32 [T, k]");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.scalar_type() == w2.scalar_type(),
              "moe: w13 [E, 2I, H] and w2 [E, H, I] must be contiguous, of one dtype");
  const int64_t hidden = x.size(1), num_experts = w13.size(0), inter = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == hidden && w2.size(0) == num_experts && w2.size(1) == hidden,
              "moe: w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not match x ", x.sizes());
  const Buckets b = bucket(ids, weights, num_experts);
  torch::Tensor out = torch::zeros_like(x);
  torch::Tensor h = torch::empty({ids.numel(), inter}, x.options());
  const float* xp = x.data_ptr<float>();
  switch (w13.scalar_type()) {
    case torch::kFloat32:
      run<float>(xp, x.size(0), hidden, b, w13, w2, nullptr, nullptr, hidden, inter, false, h.data_ptr<float>(),
                 out.data_ptr<float>());
      break;
    case torch::kBFloat16:
      run<at::BFloat16>(xp, x.size(0), hidden, b, w13, w2, nullptr, nullptr, hidden, inter, false,
                        h.data_ptr<float>(), out.data_ptr<float>());
      break;
    case torch::kInt8: {
      const int64_t g13 = group_of(s13, hidden, "w13"), g2 = group_of(s2, inter, "w2");
      TORCH_CHECK(s13.size(0) == num_experts && s13.size(1) == 2 * inter && s2.size(0) == num_experts &&
                      s2.size(1) == hidden, "moe: scales do not match the codes");
      fixed = fixed && x.size(0) <= kFixedTokens && g13 % 32 == 0 && g2 % 32 == 0;
      run<int8_t>(xp, x.size(0), hidden, b, w13, w2, s13.data_ptr<float>(), s2.data_ptr<float>(), g13, g2, fixed,
                  h.data_ptr<float>(), out.data_ptr<float>());
      break;
    }
    default:
      TORCH_CHECK(false, "moe: expert weights must be float32, bfloat16 or int8, got ", w13.scalar_type());
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_experts", &moe_experts, "the routed experts of one MoE layer (float32 activations)");
  m.def("vector_width", []() { return Vec::kWidth; }, "float32 lanes of the vector code this build runs");
  m.def("fixed_tokens", []() { return kFixedTokens; }, "tokens up to which int8 experts may take fixed-point inputs");
}
