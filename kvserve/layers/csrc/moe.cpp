// The routed experts of one Mixture-of-Experts layer in one call (layers/moe.py, impl "fused"):
//   out[t] = sum_{j < k} weight[t, j] * W2[e] (SiLU(Wg[e] x[t]) * (Wu[e] x[t])),   e = ids[t, j]
// with w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I], held as float32, bfloat16, or int8 codes with
// float32 scales per group of input columns (w = q * scale; one group spanning the row: per channel).
//
// The (token, choice) pairs are bucketed by expert once (a counting sort); then, in one parallel region, two
// passes over the active experts only, with no Python between them:
//   1. gate/up: ranges of (active expert, intermediate rows) stream the range's gate rows and then its up rows,
//      each row once for all of the expert's tokens, and write SiLU(g) * u for them (h [pairs, I]);
//   2. down: ranges of output columns walk every active expert (its rows of w2 for those columns) and add
//      weight * (W2 h) into their columns of out, so no two threads write one element and the sum over a
//      token's experts has a fixed order.
// The ranges (struct Ranges) are contiguous runs of weights, long at first and shorter as a pass runs out, each
// read front to back by one thread with its own prefetch: at decode sizes the passes stream the active experts'
// weights once per call on every core, with one barrier. Products are in float32 (bfloat16 and int8 weights are
// widened in registers); a weight row meets up to kMaxRows tokens per read (register-blocked over tokens), so
// at batch 16, where most experts see one or two tokens, each weight byte is still read once.
//
// The vector code is chosen at compile time (utils/cpu_isa.py picks the build): AVX-512, AVX2 + FMA, or scalar;
// each is the same template over a vector type.
#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
struct Vec {
  using T = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kMaxRows = 4;  // tokens per pass over a weight row (dot_rows: 4 x 4 x 1 accumulators)
  static constexpr int kRows = 4;     // adjacent weight rows per read
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
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static float sum(T a) { return _mm512_reduce_add_ps(a); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using T = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kMaxRows = 4;  // 16 registers: 4 x 2 accumulators, two weight vectors, their scales
  static constexpr int kRows = 2;
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
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
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
  static constexpr int kRows = 4;
  static T zero() { return 0.f; }
  static T set1(float v) { return v; }
  static T load(const float* p) { return *p; }
  static T load(const at::BFloat16* p) { return static_cast<float>(*p); }
  static T load(const int8_t* p) { return static_cast<float>(*p); }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T mul(T a, T b) { return a * b; }
  static T add(T a, T b) { return a + b; }
  static float sum(T a) { return a; }
};
#endif

// One matrix of one expert, [n, k] row-major: float32 / bfloat16 (scale null) or int8 with scale [n, k / group].
template <typename W>
struct Matrix {
  const W* w;
  const float* scale;
  int64_t k, group;
};

constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of the read a run of weights is asked for (into L2)

// A range of rows is one contiguous run of weights, read front to back: each cache line of it is asked for
// kPrefetchBytes ahead, never past the run's end (the next run is another thread's, or another expert's).
inline void prefetch_run(const void* at, int64_t bytes, const char* end) {
  const char* p = static_cast<const char*>(at) + kPrefetchBytes;
  for (int64_t b = 0; b < bytes; b += 64)
    if (p + b < end) _mm_prefetch(p + b, _MM_HINT_T1);
}

// y[m * ldy + r] = dot(x[m], W[row + r]) for m < MR, r < NR: NR adjacent rows (one stretch of the run) read
// once for the MR inputs, each input vector loaded once for the NR rows, with NR * U independent accumulators
// per input (one would chain every multiply-add on the previous one's latency). int8 rows are scaled per group
// while read (group < k) or once at the end (one scale for the row).
template <int MR, int NR, typename W>
inline void dot_rows(const float* const* x, const Matrix<W>& mat, int64_t row, const char* end, float* y,
                     int64_t ldy) {
  constexpr bool kInt8 = std::is_same<W, int8_t>::value;
  constexpr int U = std::max(1, (MR == 1 ? 4 : 2) / NR);  // NR * U chains per input: 4 alone, else 2 or more
  constexpr int kW = Vec::kWidth;
  const int64_t k = mat.k, vk = k - k % kW, ng = k / mat.group;
  const W* w = mat.w + row * k;
  const float* sc = kInt8 ? mat.scale + row * ng : nullptr;
  const bool grouped = kInt8 && mat.group < k;  // then group % kW == 0 (group_of) and vk == k
  typename Vec::T acc[MR][NR][U], sv[NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < U; ++u) acc[m][r][u] = Vec::zero();
  for (int r = 0; r < NR; ++r) sv[r] = Vec::set1(grouped ? sc[r * ng] : 1.f);
  int64_t c = 0, g = 0, bound = grouped ? mat.group : k;
  auto step = [&](int u) {
    if (grouped && c >= bound) {  // a group spans at least one vector
      ++g, bound += mat.group;
      for (int r = 0; r < NR; ++r) sv[r] = Vec::set1(sc[r * ng + g]);
    }
    typename Vec::T wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = grouped ? Vec::mul(Vec::load(w + r * k + c), sv[r]) : Vec::load(w + r * k + c);
    for (int m = 0; m < MR; ++m) {
      const typename Vec::T xv = Vec::load(x[m] + c);
      for (int r = 0; r < NR; ++r) acc[m][r][u] = Vec::fma(wv[r], xv, acc[m][r][u]);
    }
    c += kW;
  };
  for (; c + U * kW <= vk;) {
    for (int r = 0; r < NR; ++r) prefetch_run(w + r * k + c, U * kW * sizeof(W), end);
    for (int u = 0; u < U; ++u) step(u);
  }
  for (; c < vk;) step(0);
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) {
      for (int u = 1; u < U; ++u) acc[m][r][0] = Vec::add(acc[m][r][0], acc[m][r][u]);
      float s = Vec::sum(acc[m][r][0]);
      for (int64_t t = vk; t < k; ++t) s += static_cast<float>(w[r * k + t]) * x[m][t];  // ungrouped: unscaled
      y[m * ldy + r] = kInt8 && !grouped ? s * sc[r * ng] : s;
    }
}

template <int NR, typename W>
inline void dot_rows_any(int mr, const float* const* x, const Matrix<W>& mat, int64_t row, const char* end, float* y,
                         int64_t ldy) {
  if (mr == 1) dot_rows<1, NR>(x, mat, row, end, y, ldy);
  else if (mr == 2) dot_rows<2, NR>(x, mat, row, end, y, ldy);
  else if (mr == 3) dot_rows<3, NR>(x, mat, row, end, y, ldy);
  else dot_rows<4, NR>(x, mat, row, end, y, ldy);
}

// y[m * ldy + (j - j0)] = dot(x[m], W[j]) for rows j0 <= j < j1 and m < rows: Vec::kRows rows at a time (the
// run streams once), each stretch against the inputs in passes of up to kMaxRows (later passes from L1).
template <typename W>
void dot_run(const float* const* x, int64_t rows, const Matrix<W>& mat, int64_t j0, int64_t j1, float* y,
             int64_t ldy) {
  const char* end = reinterpret_cast<const char*>(mat.w + j1 * mat.k);
  for (int64_t j = j0; j < j1;) {
    const int64_t nr = j + Vec::kRows <= j1 ? Vec::kRows : 1;  // the run's last rows one by one
    for (int64_t m0 = 0; m0 < rows; m0 += Vec::kMaxRows) {
      const int mr = static_cast<int>(std::min<int64_t>(Vec::kMaxRows, rows - m0));
      float* yj = y + m0 * ldy + (j - j0);
      if (nr == Vec::kRows) dot_rows_any<Vec::kRows>(mr, x + m0, mat, j, end, yj, ldy);
      else dot_rows_any<1>(mr, x + m0, mat, j, end, yj, ldy);
    }
    j += nr;
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
    const bool ahead = j + 1 < j1;  // the run's next row is asked for while this one is read (not past the run)
    // two accumulators per row (even and odd runs): one would chain every run's FMA on the previous one's
    __m512 acc[MR], odd[MR];
    for (int m = 0; m < MR; ++m) acc[m] = odd[m] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(wj + b * 32 + k), _MM_HINT_T0);
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
inline void to_fixed(const float*, int64_t, int16_t*, float*) {}  // never called: `fixed` is false here
#endif

// y[m * ldy + (j - j0)] = dot(input row idx[m], W[j]) for j0 <= j < j1, m < rows.
template <typename W>
void run_rows(const Rows& in, const int64_t* idx, int64_t rows, const Matrix<W>& mat, int64_t j0, int64_t j1,
              float* y, int64_t ldy) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (std::is_same<W, int8_t>::value) {
    if (in.q != nullptr) {  // rows <= kFixedTokens: an expert's rows are distinct tokens
      const int16_t* xq[kFixedTokens];
      const float* xs[kFixedTokens];
      for (int64_t m = 0; m < rows; ++m) {
        const int64_t i = idx ? idx[m] : m;
        xq[m] = in.q + i * in.k, xs[m] = in.s + i * (in.k / 32);
      }
      if (rows == 1) fixed_tile<1>(xq, xs, mat, j0, j1, y, ldy);
      else fixed_tile<2>(xq, xs, mat, j0, j1, y, ldy);
      return;
    }
  }
#endif
  const float* xr[64];  // the inputs in groups of 64: no allocation per run
  for (int64_t m0 = 0; m0 < rows; m0 += 64) {
    const int64_t n = std::min<int64_t>(64, rows - m0);
    for (int64_t m = 0; m < n; ++m) xr[m] = in.f + (idx ? idx[m0 + m] : m0 + m) * in.k;
    dot_run(xr, n, mat, j0, j1, y + m0 * ldy, ldy);
  }
}

// The pairs bucketed by expert: rows [start[a], start[a + 1]) of the sorted order belong to expert active[a];
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

// [0, total) handed out to the threads in contiguous ranges, large first and shrinking as the work runs out (a
// guided schedule, each range lo..hi units, a multiple of `align`): a range is a run of memory its thread streams
// front to back, and the last ranges still balance the threads (or a thread the machine took away for a while).
struct Ranges {
  std::atomic<int64_t> next{0};
  int64_t total, lo, hi, align;

  bool grab(int threads, int64_t& begin, int64_t& end) {
    int64_t at = next.load(std::memory_order_relaxed);
    while (at < total) {
      int64_t want = std::clamp<int64_t>((total - at) / (2 * threads), lo, hi);
      want = (want + align - 1) / align * align;
      const int64_t stop = std::min(total, at + want);
      if (next.compare_exchange_weak(at, stop, std::memory_order_relaxed)) {
        begin = at, end = stop;
        return true;
      }
    }
    return false;
  }
};

constexpr int64_t kMinRun = 32 << 10, kMaxRun = 512 << 10;  // bytes of one matrix a range streams in one run
constexpr int64_t kMaxRange = 4 << 20;                          // bytes of a down range over all active experts
constexpr int64_t kMinRows = 16;  // rows of a range at least: many active experts' short runs cost per run

// Units of `unit_bytes` (one weight row of each run a unit spans) in ranges of one run between kMinRun and
// kMaxRun bytes, and at most `max_bytes` in all (`runs` runs per range).
Ranges ranges_of(int64_t total, int64_t row_bytes, int64_t runs, int64_t max_bytes, int64_t align) {
  const int64_t lo = std::max<int64_t>(kMinRows, kMinRun / row_bytes);
  const int64_t hi = std::max(lo, std::min(kMaxRun / row_bytes, max_bytes / (row_bytes * runs)));
  return Ranges{{0}, total, lo, hi, std::max<int64_t>(align, Vec::kRows)};
}

Rows from_row(Rows in, int64_t r0) {  // in's rows from r0 on
  in.f += r0 * in.k;
  if (in.q != nullptr) in.q += r0 * in.k, in.s += r0 * (in.k / 32);
  return in;
}

// Pass 1, over (active expert, intermediate row j): a range [j0, j1) of one expert streams its gate rows and then
// its up rows, for all of the expert's tokens, and writes h = SiLU(gate) * up there (and h's fixed-point copy,
// whose runs of 32 the ranges then align to: `hq` / `hs`, or null).
template <typename W>
void gate_up_pass(Ranges& ranges, int threads, const Rows& x, const Buckets& b, const Matrix<W>& w13, int64_t inter,
                  float* h, int16_t* hq, float* hs, std::vector<float>& buf) {
  const int64_t hidden = x.k, per_expert = 2 * inter * hidden, scales = w13.scale ? 2 * inter * (hidden / w13.group) : 0;
  int64_t begin, end;
  while (ranges.grab(threads, begin, end))
    for (int64_t u = begin; u < end;) {  // a range may span two experts
      const int64_t a = u / inter, j0 = u % inter, j1 = std::min(inter, j0 + (end - u)), n = j1 - j0;
      const int64_t e = b.active[a], r0 = b.start[a], rows = b.start[a + 1] - r0;
      const Matrix<W> mat{w13.w + e * per_expert, w13.scale ? w13.scale + e * scales : nullptr, hidden, w13.group};
      buf.resize(2 * rows * n);
      run_rows(x, b.token.data() + r0, rows, mat, j0, j1, buf.data(), n);
      run_rows(x, b.token.data() + r0, rows, mat, inter + j0, inter + j1, buf.data() + rows * n, n);
      for (int64_t m = 0; m < rows; ++m) {
        float* hr = h + (r0 + m) * inter + j0;
        for (int64_t j = 0; j < n; ++j) {
          const float g = buf[m * n + j];
          hr[j] = g / (1.f + std::exp(-g)) * buf[(rows + m) * n + j];
        }
        if (hq != nullptr) {
          const int64_t at = (r0 + m) * inter + j0;
          to_fixed(hr, n, hq + at, hs + at / 32);
        }
      }
      u += n;
    }
}

// Pass 2, over output columns: a range [c0, c1) walks every active expert (its rows c0..c1 of w2: one run) and
// adds weight * (W2 h) into those columns of out, so no two threads write one element and each token's sum over
// its experts runs in expert order (the reference's).
template <typename W>
void down_pass(Ranges& ranges, int threads, const Rows& h, const Buckets& b, const Matrix<W>& w2, int64_t hidden,
               float* out, std::vector<float>& buf) {
  const int64_t inter = h.k, per_expert = hidden * inter, scales = w2.scale ? hidden * (inter / w2.group) : 0;
  int64_t c0, c1;
  while (ranges.grab(threads, c0, c1))
    for (size_t a = 0; a < b.active.size(); ++a) {
      const int64_t e = b.active[a], r0 = b.start[a], rows = b.start[a + 1] - r0, n = c1 - c0;
      const Matrix<W> mat{w2.w + e * per_expert, w2.scale ? w2.scale + e * scales : nullptr, inter, w2.group};
      buf.resize(rows * n);
      run_rows(from_row(h, r0), nullptr, rows, mat, c0, c1, buf.data(), n);
      for (int64_t m = 0; m < rows; ++m) {
        float* o = out + b.token[r0 + m] * hidden + c0;
        const float wt = b.weight[r0 + m];
        for (int64_t c = 0; c < n; ++c) o[c] += wt * buf[m * n + c];
      }
    }
}

// Rows `in` with a fixed-point copy in `q` / `s` (sized here) when `fixed`.
Rows with_fixed(Rows in, int64_t n, bool fixed, std::vector<int16_t>& q, std::vector<float>& s) {
  if (fixed) {
    q.resize(n * in.k), s.resize(n * (in.k / 32));
    for (int64_t i = 0; i < n; ++i) to_fixed(in.f + i * in.k, in.k, q.data() + i * in.k, s.data() + i * (in.k / 32));
    in.q = q.data(), in.s = s.data();
  }
  return in;
}

// Both passes in one parallel region: the one barrier between them is its only wait.
template <typename W>
void run(const float* x, int64_t tokens, int64_t hidden, const Buckets& b, const torch::Tensor& w13,
         const torch::Tensor& w2, const float* s13, const float* s2, int64_t group13, int64_t group2, bool fixed,
         float* out) {
  const int64_t inter = w2.size(2), pairs = static_cast<int64_t>(b.token.size());
  const int64_t n_active = static_cast<int64_t>(b.active.size()), wsize = sizeof(W);
  std::vector<float> h(pairs * inter);
  std::vector<int16_t> xq, hq(fixed ? pairs * inter : 0);
  std::vector<float> xs, hs(fixed ? pairs * (inter / 32) : 0);
  const Rows xr = with_fixed(Rows{x, hidden}, tokens, fixed, xq, xs);
  Rows hr{h.data(), inter};
  if (fixed) hr.q = hq.data(), hr.s = hs.data();
  const Matrix<W> m13{w13.data_ptr<W>(), s13, hidden, group13}, m2{w2.data_ptr<W>(), s2, inter, group2};
  Ranges up = ranges_of(n_active * inter, hidden * wsize, 2, 2 * kMaxRun, fixed ? 32 : 1);
  Ranges down = ranges_of(hidden, inter * wsize, n_active, kMaxRange, 1);
#pragma omp parallel
  {
    const int threads = omp_get_num_threads();
    std::vector<float> buf;
    gate_up_pass(up, threads, xr, b, m13, inter, h.data(), fixed ? hq.data() : nullptr, hs.data(), buf);
#pragma omp barrier
    down_pass(down, threads, hr, b, m2, hidden, out, buf);
  }
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
  const float* xp = x.data_ptr<float>();
  switch (w13.scalar_type()) {
    case torch::kFloat32:
      run<float>(xp, x.size(0), hidden, b, w13, w2, nullptr, nullptr, hidden, inter, false, out.data_ptr<float>());
      break;
    case torch::kBFloat16:
      run<at::BFloat16>(xp, x.size(0), hidden, b, w13, w2, nullptr, nullptr, hidden, inter, false,
                        out.data_ptr<float>());
      break;
    case torch::kInt8: {
      const int64_t g13 = group_of(s13, hidden, "w13"), g2 = group_of(s2, inter, "w2");
      TORCH_CHECK(s13.size(0) == num_experts && s13.size(1) == 2 * inter && s2.size(0) == num_experts &&
                      s2.size(1) == hidden, "moe: scales do not match the codes");
      fixed = fixed && x.size(0) <= kFixedTokens && g13 % 32 == 0 && g2 % 32 == 0;
      run<int8_t>(xp, x.size(0), hidden, b, w13, w2, s13.data_ptr<float>(), s2.data_ptr<float>(), g13, g2, fixed,
                  out.data_ptr<float>());
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
