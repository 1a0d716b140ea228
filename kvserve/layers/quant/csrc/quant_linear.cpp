// Weight-only quantized linear layers for CPU float32 activations: y[m, n] = sum_k x[m, k] * w[n, k], with w
// dequantized in registers for decode-sized inputs (linear_small) and in L2-sized panels for batches
// (linear_panels).
// PyTorch's own weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) are fast only with
// bfloat16 inputs; with float32 (or float16) ones they run scalar code. Here the weight bytes are read
// once per call (once per 8 rows at decode sizes), and the products equal a dense matmul on the dequantized weight up to summation order.
//
// Formats (w is [N, K], groups of `group` input columns, group a multiple of 32):
//   int8:  q [N, K] int8,  scale [N, K/group]            w = q * scale
//   int4:  q [N, K/2] uint8, scale, min [N, K/group]     w = q * scale + min,  q in 0..15; in each run of
//          32 weights the 16 bytes hold weights 0..15 in their low nibbles and 16..31 in the high ones
//          (GGUF's Q4_0/Q4_1 nibble order, so those blocks' bytes are used as stored).
//   bf16:  w [N, K] bfloat16                                w = float32(w): the top 16 bits of a float32 (a CPU
//          without native bfloat16 keeps the half-size storage and multiplies in float32).
//
// Instruction sets (the build's flags pick one: utils/cpu_isa.py): AVX-512 (vectors of 16 floats), AVX2 + FMA
// (vectors of 8), or neither (scalar dequantization feeding the panels' GEMM micro-kernel). The register and
// fixed-point kernels are written once over the ISA's vector primitives (the `simd` namespace).
#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define QL_AVX2 1
#endif

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
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= (g + 1) * group; i += 8) {
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + i))));
      _mm256_storeu_ps(w + i, _mm256_mul_ps(v, vs));
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
#elif defined(__AVX2__) && defined(__FMA__)
    const __m128i bytes = _mm_loadu_si128((const __m128i*)qs), mask = _mm_set1_epi8(0x0F);
    const __m128i nibbles[2] = {_mm_and_si128(bytes, mask), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask)};
    const __m256 vs = _mm256_set1_ps(scale[g]), vm = _mm256_set1_ps(mins[g]);
    for (int j = 0; j < 4; ++j) {  // weights 8j .. 8j+7: low nibbles of bytes 0..15, then the high ones
      const __m128i part = j % 2 ? _mm_srli_si128(nibbles[j / 2], 8) : nibbles[j / 2];
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
      _mm256_storeu_ps(out + 8 * j, _mm256_add_ps(_mm256_mul_ps(v, vs), vm));
    }
#else
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(qs[j] & 0x0F) * scale[g] + mins[g];
      out[j + 16] = static_cast<float>(qs[j] >> 4) * scale[g] + mins[g];
    }
#endif
  }
}

inline void dequant_row_bf16(const uint16_t* q, int64_t k, float* w) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= k; i += 16) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(q + i)));
    _mm512_storeu_ps(w + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= k; i += 8) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(q + i)));
    _mm256_storeu_ps(w + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
#endif
  for (; i < k; ++i) {
    const uint32_t bits = static_cast<uint32_t>(q[i]) << 16;
    std::memcpy(w + i, &bits, sizeof(float));
  }
}

#if defined(QL_AVX512) || defined(QL_AVX2)
// The vector primitives the register and fixed-point kernels below are written in. A run is 32 weights (the
// quantization formats' unit): kRunVectors float vectors, or one CodeRun of 32 int16 codes.
namespace simd {
#ifdef QL_AVX512
constexpr int kLanes = 16;
constexpr int kPassRows = 8;  // input rows per pass of linear_small: MR accumulators + 2 weight vectors in 32 zmm
using F = __m512;
inline F zero() { return _mm512_setzero_ps(); }
inline F load(const float* p) { return _mm512_loadu_ps(p); }
inline F set1(float v) { return _mm512_set1_ps(v); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline float sum(F v) { return _mm512_reduce_add_ps(v); }
inline F widen_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

struct CodeRun {
  __m512i v;  // codes 0..31 as int16
};
inline CodeRun int8_codes(const int8_t* p) { return {_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p))}; }
inline CodeRun int4_codes(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
  return {_mm512_inserti64x4(_mm512_castsi256_si512(lo), _mm256_srli_epi16(v, 4), 1)};
}
// The run's 32 products code * x summed in pairs (vpmaddwd), as floats: their lanes add up to the dot product.
inline F dot_run(const CodeRun& w, const int16_t* x) {
  return _mm512_cvtepi32_ps(_mm512_madd_epi16(w.v, _mm512_loadu_si512((const void*)x)));
}
// x[0..31] -> q[0..31] = round(x / step), step = max|x| / 32767 (returned).
inline float quantize_run(const float* x, int16_t* q) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
  _mm256_storeu_si256((__m256i*)q, _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
  _mm256_storeu_si256((__m256i*)(q + 16), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
  return amax / 32767.0f;
}
#else
constexpr int kLanes = 8;
constexpr int kPassRows = 4;  // MR x 2 accumulators + 4 weight vectors in 16 ymm
using F = __m256;
inline F zero() { return _mm256_setzero_ps(); }
inline F load(const float* p) { return _mm256_loadu_ps(p); }
inline F set1(float v) { return _mm256_set1_ps(v); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline float sum(F v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline F widen_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

struct CodeRun {
  __m256i v[2];  // codes 0..15 and 16..31 as int16
};
inline CodeRun int8_codes(const int8_t* p) {
  return {{_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)),
           _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16)))}};
}
inline CodeRun int4_codes(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  return {{_mm256_and_si256(v, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(v, 4)}};
}
// NOTE: the two halves' pair sums are added as integers (|code * x| < 2^22, so four of them fit in int32),
// one conversion per run as on AVX-512.
inline F dot_run(const CodeRun& w, const int16_t* x) {
  const __m256i lo = _mm256_madd_epi16(w.v[0], _mm256_loadu_si256((const __m256i*)x));
  const __m256i hi = _mm256_madd_epi16(w.v[1], _mm256_loadu_si256((const __m256i*)(x + 16)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}
inline float quantize_run(const float* x, int16_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + 8 * j), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
  for (int j = 0; j < 4; j += 2) {
    // packs interleaves the 128-bit lanes ([a0-3 b0-3 a4-7 b4-7]); the permute puts a before b again
    const __m256i packed = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)),
                                              _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inv)));
    _mm256_storeu_si256((__m256i*)(q + 8 * j), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  return amax / 32767.0f;
}
#endif
constexpr int kRunVectors = 32 / kLanes;

// Accumulators per input row in linear_block_rows. With AVX2's 4 FMAs per run into one register, each waits
// for the previous one's result: at 1-2 rows that latency chain, not the loads, would set the pace.
constexpr int accumulators(int rows) { return kLanes == 16 ? 1 : (rows <= 2 ? 4 : 2); }
}  // namespace simd

// The weight group of run b, b * 32 / group, without a division per run (it cost more than the run's
// arithmetic): a shift where group / 32 is a power of two, 0 when one group spans the row (per channel).
struct GroupOf {
  int64_t shift, div;
  GroupOf(int64_t group, int64_t k) : shift(-1), div(group / 32) {
    if (group == k) shift = 62;
    for (int64_t s = 0; shift < 0 && s < 31; ++s)
      if (int64_t{1} << s == div) shift = s;
  }
  inline int64_t operator()(int64_t b) const { return shift >= 0 ? b >> shift : b / div; }
};

// One run of 32 weights of row n, block b, as simd::kRunVectors float32 vectors (weights in order).
struct Int8Block {
  const int8_t* q;
  const float* scale;
  int64_t k, ng;
  GroupOf group_of;
  Int8Block(const int8_t* q, const float* scale, int64_t k, int64_t group)
      : q(q), scale(scale), k(k), ng(k / group), group_of(group, k) {}
  inline void operator()(int64_t n, int64_t b, simd::F* w) const {
    const int8_t* p = q + n * k + b * 32;
    const float s = scale[n * ng + group_of(b)];
#ifdef QL_AVX512
    const __m512 vs = _mm512_set1_ps(s);
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))), vs);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16)))), vs);
#else
    const __m256 vs = _mm256_set1_ps(s);
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * j)))), vs);
#endif
  }
};

struct Int4Block {
  const uint8_t* q;
  const float* scale;
  const float* mins;
  int64_t k, ng;
  GroupOf group_of;
  Int4Block(const uint8_t* q, const float* scale, const float* mins, int64_t k, int64_t group)
      : q(q), scale(scale), mins(mins), k(k), ng(k / group), group_of(group, k) {}
  inline void operator()(int64_t n, int64_t b, simd::F* w) const {
    const uint8_t* p = q + n * (k / 2) + b * 16;
    const int64_t g = n * ng + group_of(b);
#ifdef QL_AVX512
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    const __m512 vs = _mm512_set1_ps(scale[g]), vm = _mm512_set1_ps(mins[g]);
    w[0] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F))), vs), vm);
    w[1] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), vs), vm);
#else
    const __m128i bytes = _mm_loadu_si128((const __m128i*)p), mask = _mm_set1_epi8(0x0F);
    const __m128i nibbles[2] = {_mm_and_si128(bytes, mask), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask)};
    const __m256 vs = _mm256_set1_ps(scale[g]), vm = _mm256_set1_ps(mins[g]);
    for (int j = 0; j < 4; ++j) {
      const __m128i part = j % 2 ? _mm_srli_si128(nibbles[j / 2], 8) : nibbles[j / 2];
      w[j] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part)), vs), vm);
    }
#endif
  }
};

struct Bf16Block {
  const uint16_t* q;
  int64_t k;
  inline void operator()(int64_t n, int64_t b, simd::F* w) const {
    for (int j = 0; j < simd::kRunVectors; ++j) w[j] = simd::widen_bf16(q + n * k + b * 32 + j * simd::kLanes);
  }
};

// Decode sizes: each weight block is dequantized in registers and used by MR input rows at once (accumulator
// registers per row), so for up to MR rows the weight is read once and never written back.
// Output rows n0 .. n1 of y; the caller owns the threads.
template <int MR, typename BlockFn>
void linear_block_rows(const float* xp, float* yp, int64_t n_out, int64_t k, int64_t n0, int64_t n1,
                       const BlockFn& block) {
  constexpr int NA = simd::accumulators(MR);
  for (int64_t n = n0; n < n1; ++n) {
    simd::F acc[MR][NA];
    for (int i = 0; i < MR; ++i)
      for (int a = 0; a < NA; ++a) acc[i][a] = simd::zero();
    for (int64_t b = 0; b < k / 32; ++b) {
      simd::F w[simd::kRunVectors];
      block(n, b, w);
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < simd::kRunVectors; ++j)
          acc[i][j % NA] = simd::fmadd(simd::load(xp + i * k + b * 32 + j * simd::kLanes), w[j], acc[i][j % NA]);
    }
    for (int i = 0; i < MR; ++i) {
      simd::F total = acc[i][0];
      for (int a = 1; a < NA; ++a) total = simd::add(total, acc[i][a]);
      yp[i * n_out + n] = simd::sum(total);
    }
  }
}

// linear_block_rows<rows> for 1 <= rows <= simd::kPassRows (a compile-time MR per count of rows).
template <int MR = 1, typename BlockFn>
void pass_rows(int64_t rows, const float* x, float* y, int64_t n_out, int64_t k, int64_t n0, int64_t n1,
               const BlockFn& block) {
  if constexpr (MR < simd::kPassRows) {
    if (rows > MR) return pass_rows<MR + 1>(rows, x, y, n_out, k, n0, n1, block);
  }
  linear_block_rows<MR>(x, y, n_out, k, n0, n1, block);
}

// M rows in passes of at most kPassRows (the accumulators and the weight vectors stay in registers).
// One parallel region for all passes, each thread over its own output rows in tiles of 64, every pass over a
// tile before the next: the tile's weights come from memory once and from L1/L2 for the later passes, and
// there is one fork and join per call (on a loaded 2-core machine each costs far more than the work).
template <typename BlockFn>
void linear_small(const float* xp, float* yp, int64_t m, int64_t n_out, int64_t k, const BlockFn& block) {
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), per = (n_out + threads - 1) / threads;
    const int64_t begin = std::min(n_out, omp_get_thread_num() * per), end = std::min(n_out, begin + per);
    for (int64_t t0 = begin; t0 < end; t0 += 64) {
      const int64_t t1 = std::min(end, t0 + 64);
      for (int64_t start = 0; start < m; start += simd::kPassRows)
        pass_rows(std::min<int64_t>(simd::kPassRows, m - start), xp + start * k, yp + start * n_out, n_out, k,
                  t0, t1, block);
    }
  }
}

// Single-stream sizes (M <= kFixedRows): the input rows are rounded to 16-bit fixed point with one scale
// per 32 columns, x[i, k] ~= xq[i, k] * xs[i, k / 32] (error <= 2^-16 of the run's largest |x|, 128x finer
// than bfloat16's rounding), so a run of 32 weights needs one widening (int8 or nibbles -> int16) and
// then per row integer multiply-adds of pairs (vpmaddwd), one conversion and one FMA, instead of
// widening each weight to float32 and multiplying it by its scale: fewer instructions per weight byte,
// where one core's work per byte, not memory, bounds a single-row matmul.
// Up to these rows (at most 4: linear_fixed's cases) the fixed-point kernel beats the float one (bench.py): on
// AVX-512 from 3 rows on the float kernel is as fast; AVX2's float kernel widens 8 weights per instruction.
#ifdef QL_AVX512
constexpr int64_t kFixedRows = 2;
#else
constexpr int64_t kFixedRows = 4;
#endif

struct FixedRows {
  std::vector<int16_t> q;     // [M, K]
  std::vector<float> scale;   // [M, K / 32]
  std::vector<float> sums;    // [M, K / group]: sum of x over each weight group (int4's min term)
  int64_t m, k;
};

// Into a per-thread copy reused across calls (a decode step makes ~120 of them; their buffers' malloc and free
// were a measurable part of the smallest layers' time).
const FixedRows& to_fixed(const float* x, int64_t m, int64_t k, int64_t sum_group) {
  thread_local FixedRows f;
  f.q.resize(m * k), f.scale.resize(m * (k / 32)), f.sums.resize(sum_group ? m * (k / sum_group) : 0);
  f.m = m, f.k = k;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < k / 32; ++b)
      f.scale[i * (k / 32) + b] = simd::quantize_run(x + i * k + b * 32, f.q.data() + i * k + b * 32);
    // of the rounded values, so that the result is exactly a matmul on the fixed-point copy of x
    for (int64_t g = 0; sum_group && g < k / sum_group; ++g) {
      float acc = 0.0f;
      for (int64_t j = g * sum_group; j < (g + 1) * sum_group; ++j)
        acc += static_cast<float>(f.q[i * k + j]) * f.scale[i * (k / 32) + j / 32];
      f.sums[i * (k / sum_group) + g] = acc;
    }
  }
  return f;
}

// Bytes ahead of the codes being read that fixed_rows asks the cache for (a prefetch past the weight's end is
// harmless): with the hardware prefetcher alone, a single-row step's layers, each streamed from memory once, ran
// short of the bandwidth a plain sum reaches. The distance is the best of those tried with `bench.py --rows 1
// --layers 30` (more layers than the L3 holds).
constexpr int64_t kPrefetchBytes = 4096;

// 32 weights of row n, block b, as int16 codes [w0 .. w31]; `at`: where they are stored (rows follow each other).
struct Int8Codes {
  const int8_t* q;
  int64_t k;
  inline simd::CodeRun operator()(int64_t n, int64_t b) const { return simd::int8_codes((const int8_t*)at(n, b)); }
  inline const char* at(int64_t n, int64_t b) const { return (const char*)(q + n * k + b * 32); }
};

struct Int4Codes {
  const uint8_t* q;
  int64_t k;
  inline simd::CodeRun operator()(int64_t n, int64_t b) const { return simd::int4_codes((const uint8_t*)at(n, b)); }
  inline const char* at(int64_t n, int64_t b) const { return (const char*)(q + n * (k / 2) + b * 16); }
};

// Row n's dot products with MR fixed-point rows: sum_b cs[i, b] * (codes(n, b) . xq[i, b]).
// NOTE: two accumulators per row (even and odd runs): with one, each run's FMA waits for the previous one's
// result, and at one or two rows that latency chain, not memory, set the pace.
template <int MR, typename CodesFn>
inline void fixed_dots(const CodesFn& codes, int64_t n, const int16_t* xq, int64_t k, const float* cs, float* out) {
  const int64_t nb = k / 32;
  simd::F acc[MR], odd[MR];
  for (int i = 0; i < MR; ++i) acc[i] = odd[i] = simd::zero();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    _mm_prefetch(codes.at(n, b) + kPrefetchBytes, _MM_HINT_T0);
    const simd::CodeRun w0 = codes(n, b), w1 = codes(n, b + 1);
    for (int i = 0; i < MR; ++i) {
      const int16_t* xb = xq + i * k + b * 32;
      acc[i] = simd::fmadd(simd::dot_run(w0, xb), simd::set1(cs[i * nb + b]), acc[i]);
      odd[i] = simd::fmadd(simd::dot_run(w1, xb + 32), simd::set1(cs[i * nb + b + 1]), odd[i]);
    }
  }
  for (; b < nb; ++b) {
    const simd::CodeRun w = codes(n, b);
    for (int i = 0; i < MR; ++i)
      acc[i] = simd::fmadd(simd::dot_run(w, xq + i * k + b * 32), simd::set1(cs[i * nb + b]), acc[i]);
  }
  for (int i = 0; i < MR; ++i) out[i] = simd::sum(simd::add(acc[i], odd[i]));
}

// y[i, n] = sum_b scale[n, g(b)] * xs[i, b] * (codes(n, b) . xq[i, b]) + sum_g mins[n, g] * sums[i, g].
template <int MR, typename CodesFn>
void fixed_rows(const FixedRows& xf, float* yp, int64_t n_out, const CodesFn& codes, const float* scale,
                const float* mins, int64_t group) {
  const int64_t k = xf.k, nb = k / 32, ng = k / group;
  thread_local std::vector<int64_t> gidx;  // the weight group of each run of 32 columns
  gidx.resize(nb);
  for (int64_t b = 0; b < nb; ++b) gidx[b] = b * 32 / group;
  const int64_t* gi = gidx.data();
#pragma omp parallel
  {
    thread_local std::vector<float> buffer;
    buffer.resize(MR * nb);
    float* const cs = buffer.data();  // this row's combined scales scale[n, g(b)] * xs[i, b]
    const float* const xscale = xf.scale.data();
#pragma omp for schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
      const float* sn = scale + n * ng;
      for (int i = 0; i < MR; ++i) {
        float* c = cs + i * nb;
        const float* xs = xscale + i * nb;
        if (group == 32) {
          for (int64_t b = 0; b < nb; ++b) c[b] = sn[b] * xs[b];
        } else {
          for (int64_t b = 0; b < nb; ++b) c[b] = sn[gi[b]] * xs[b];
        }
      }
      float y[MR];
      fixed_dots<MR>(codes, n, xf.q.data(), k, cs, y);
      for (int i = 0; i < MR; ++i) {
        if (mins != nullptr)
          for (int64_t g = 0; g < ng; ++g) y[i] += mins[n * ng + g] * xf.sums[i * ng + g];
        yp[i * n_out + n] = y[i];
      }
    }
  }
}

template <typename CodesFn>
void linear_fixed(const float* xp, float* yp, int64_t m, int64_t n_out, int64_t k, const CodesFn& codes,
                  const float* scale, const float* mins, int64_t group) {
  const FixedRows& xf = to_fixed(xp, m, k, mins != nullptr ? group : 0);
  switch (m) {
    case 1: fixed_rows<1>(xf, yp, n_out, codes, scale, mins, group); break;
    case 2: fixed_rows<2>(xf, yp, n_out, codes, scale, mins, group); break;
    case 3: fixed_rows<3>(xf, yp, n_out, codes, scale, mins, group); break;
    default: fixed_rows<4>(xf, yp, n_out, codes, scale, mins, group); break;
  }
}
#endif

// Batch sizes (more rows than linear_small takes in one pass): the weight goes through in panels of
// output rows, each dequantized into a per-thread buffer that stays in L2 and multiplied by all of x with
// oneDNN's single-thread GEMM micro-kernel (ATen's cpublas::brgemm), as y^T[panel] = W[panel] x^T. The
// weight is read once as stored, and no float32 copy of it ever reaches memory: dequantizing a whole layer
// and handing it to a GEMM wrote and re-read 4 bytes per weight (and oneDNN reordered it again per call).
constexpr int64_t kPanelRows = 64;
constexpr int64_t kPanelCols = 48;
// Input rows up to which linear_small's passes beat the panels (bench.py): AVX-512's passes are of 8 rows,
// AVX2's of 4.
#ifdef QL_AVX512
constexpr int64_t kSmallRows = 24;
#else
constexpr int64_t kSmallRows = 12;
#endif

template <typename RowFn>
void linear_panels(const float* xp, float* yp, int64_t m, int64_t n_out, int64_t k, RowFn row) {
  // Input rows in blocks of at most kPanelCols (the micro-kernel's N, in vectors of 16), whole vectors but the
  // last block's: 80 rows as 48 + 32 (5 vectors) rather than 40 + 40 (6, each a partial one).
  const int64_t blocks = (m + kPanelCols - 1) / kPanelCols, cols = ((m + blocks - 1) / blocks + 15) / 16 * 16;
  // x^T by blocks of input rows, each [K, cols] on its own (the micro-kernel's B operand): one [K, M] matrix
  // would put B's rows M floats apart, and at M = 128, 256, ... those strides alias in the caches (the
  // panels took twice as long at 128 rows as at 112).
  std::vector<float> xt(k * cols * blocks, 0.0f);
  for (int64_t i = 0; i < m; ++i) {
    float* dst = xt.data() + (i / cols) * k * cols + i % cols;
    for (int64_t j = 0; j < k; ++j) dst[j * cols] = xp[i * k + j];
  }
  const int64_t panels = (n_out + kPanelRows - 1) / kPanelRows;
#pragma omp parallel
  {
    std::vector<float> w(kPanelRows * k), yt(kPanelRows * cols);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kPanelRows, rows = std::min(kPanelRows, n_out - n0);
      for (int64_t r = 0; r < rows; ++r) row(n0 + r, w.data() + r * k);
      for (int64_t i0 = 0; i0 < m; i0 += cols) {
        const int64_t c = std::min(cols, m - i0);
        at::native::cpublas::brgemm(rows, c, k, k, cols, c, false, w.data(), xt.data() + (i0 / cols) * k * cols,
                                    yt.data(), false);
        for (int64_t i = 0; i < c; ++i)
          for (int64_t r = 0; r < rows; ++r) yp[(i0 + i) * n_out + n0 + r] = yt[r * c + i];
      }
    }
    at::native::cpublas::brgemm_release(false);
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

// From kTileRows input rows: blocks of kTileBlock output rows, each dequantized and transposed into a [K][64]
// tile in L2 (a vector's width of rows at a time, through an L1-sized buffer) and multiplied as the micro-kernel's B operand by
// all of x (A, as stored) straight into y's columns. This is the layout oneDNN's float32 GEMM packs its weights
// in, and it runs level with the prepacked float32 layer from 48 rows to prefill sizes (bench.py), where
// dequantizing the whole layer for oneDNN wrote and re-read 4 bytes per weight and paid oneDNN's reorder of a
// plain weight on every call (0.8-0.9x float32 at 128-384 rows). The panels' orientation (y^T = W x^T) needs
// x^T and y transposed per call and streams x once per 64 output rows from a narrower B.
constexpr int64_t kTileBlock = 64;
constexpr int64_t kTileRows = 48;

#if defined(QL_AVX512) || defined(QL_AVX2)
#ifdef QL_AVX512
// r[i], row i of a 16 x 16 block -> r[i], column i.
inline void transpose_lanes(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
  }
}
inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#else
// r[i], row i of an 8 x 8 block -> r[i], column i.
inline void transpose_lanes(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x31);
  }
}
inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#endif

template <typename RowFn>
void linear_tiles(const float* xp, float* yp, int64_t m, int64_t n_out, int64_t k, RowFn row) {
  const int64_t blocks = n_out / kTileBlock;
#pragma omp parallel
  {
    // NOTE: reused across calls: a fresh 150-400 KB buffer is an mmap whose pages fault in on every call
    constexpr int L = simd::kLanes;
    thread_local std::vector<float> tile, rows;
    tile.resize(kTileBlock * k);
    rows.resize(L * k);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t j0 = 0; j0 < kTileBlock; j0 += L) {
        for (int64_t r = 0; r < L; ++r) row(b * kTileBlock + j0 + r, rows.data() + r * k);
        for (int64_t k0 = 0; k0 < k; k0 += L) {
          simd::F v[L];
          for (int i = 0; i < L; ++i) v[i] = simd::load(rows.data() + i * k + k0);
          transpose_lanes(v);
          for (int i = 0; i < L; ++i) store(tile.data() + (k0 + i) * kTileBlock + j0, v[i]);
        }
      }
      at::native::cpublas::brgemm(m, kTileBlock, k, k, kTileBlock, n_out, false, xp, tile.data(),
                                  yp + b * kTileBlock, false);
    }
    at::native::cpublas::brgemm_release(false);
  }
}
#endif

// Batch sizes past linear_small's: the tiles where the layer's shape allows them, else the panels.
template <typename RowFn>
void linear_batch(const float* xp, float* yp, int64_t m, int64_t n_out, int64_t k, RowFn row, bool tiles = true) {
#if defined(QL_AVX512) || defined(QL_AVX2)
  if (tiles && m >= kTileRows && n_out % kTileBlock == 0 && k % 16 == 0) {
    linear_tiles(xp, yp, m, n_out, k, row);
    return;
  }
#endif
  linear_panels(xp, yp, m, n_out, k, row);
}

#if defined(QL_AVX512) || defined(QL_AVX2)
constexpr int64_t kSmallRowsOrZero = kSmallRows;
constexpr int64_t kFixedRowsOrZero = kFixedRows;
constexpr int64_t kTileRowsOrZero = kTileRows;
#else
constexpr int64_t kTileRowsOrZero = 0;
constexpr int64_t kSmallRowsOrZero = 0;
constexpr int64_t kFixedRowsOrZero = 0;
#endif

#ifdef QL_AVX512
constexpr const char* kIsa = "avx512";
#elif defined(QL_AVX2)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "scalar";
#endif

}  // namespace

// x [M, K] float32, q [N, K] int8, scale [N, K / group] float32 -> [M, N] float32.
// `small` and `tiles` false: skip those kernels (bench.py compares each with the next one's rates).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t group, bool fixed,
                          bool small, bool tiles) {
  const int64_t k = q.size(1);
  check(x, q, scale, group, k);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t m = x.size(0), n_out = q.size(0);
  auto y = torch::empty({m, n_out}, x.options());
#if defined(QL_AVX512) || defined(QL_AVX2)
  if (m <= kFixedRows && fixed) {
    linear_fixed(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, Int8Codes{qp, k}, sp, nullptr, group);
    return y;
  }
  if (small && m <= kSmallRows) {
    linear_small(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, Int8Block{qp, sp, k, group});
    return y;
  }
#endif
  const auto row = [&](int64_t n, float* w) { dequant_row_int8(qp + n * k, sp + n * (k / group), group, k, w); };
  linear_batch(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, row, tiles);
  return y;
}

// x [M, K] float32, q [N, K / 2] uint8, scale and min [N, K / group] float32 -> [M, N] float32.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor mins,
                          int64_t group, bool fixed, bool small, bool tiles) {
  const int64_t k = q.size(1) * 2;
  check(x, q, scale, group, k);
  TORCH_CHECK(mins.sizes() == scale.sizes() && mins.is_contiguous(), "int4_linear: mins must match scales");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  const int64_t m = x.size(0), n_out = q.size(0);
  auto y = torch::empty({m, n_out}, x.options());
#if defined(QL_AVX512) || defined(QL_AVX2)
  if (m <= kFixedRows && fixed) {
    linear_fixed(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, Int4Codes{qp, k}, sp, mp, group);
    return y;
  }
  if (small && m <= kSmallRows) {
    linear_small(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, Int4Block{qp, sp, mp, k, group});
    return y;
  }
#endif
  const auto row = [&](int64_t n, float* w) {
    dequant_row_int4(qp + n * (k / 2), sp + n * (k / group), mp + n * (k / group), group, k, w);
  };
  linear_batch(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, row, tiles);
  return y;
}

// x [M, K] float32, w [N, K] bfloat16 -> [M, N] float32: w widened to float32 in registers (decode sizes) or
// per panel / tile, never as a whole float32 copy.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, bool small, bool tiles) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "bf16_linear: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == torch::kBFloat16,
              "bf16_linear: w must be a contiguous bfloat16 [N, K] tensor");
  const int64_t m = x.size(0), n_out = w.size(0), k = w.size(1);
  TORCH_CHECK(x.size(1) == k && k % 32 == 0, "bf16_linear: x has ", x.size(1), " columns, the weight ", k,
              " (a multiple of 32)");
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto y = torch::empty({m, n_out}, x.options());
#if defined(QL_AVX512) || defined(QL_AVX2)
  if (small && m <= kSmallRows) {
    linear_small(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, Bf16Block{wp, k});
    return y;
  }
#endif
  const auto row = [&](int64_t n, float* out) { dequant_row_bf16(wp + n * k, k, out); };
  linear_batch(x.data_ptr<float>(), y.data_ptr<float>(), m, n_out, k, row, tiles);
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
  m.def("int8_linear", &int8_linear, "weight-only int8 linear (float32 activations)", py::arg("x"), py::arg("q"),
        py::arg("scale"), py::arg("group"), py::arg("fixed") = true, py::arg("small") = true, py::arg("tiles") = true);
  m.def("int4_linear", &int4_linear, "weight-only int4 linear (float32 activations)", py::arg("x"), py::arg("q"),
        py::arg("scale"), py::arg("mins"), py::arg("group"), py::arg("fixed") = true, py::arg("small") = true,
        py::arg("tiles") = true);
  m.def("fixed_rows", []() { return kFixedRowsOrZero; }, "input rows up to which x is rounded to 16-bit fixed point");
  m.def("small_rows", []() { return kSmallRowsOrZero; }, "input rows up to which the register kernel runs");
  m.def("int8_dequantize", &int8_dequantize, "int8 codes and group scales -> float32 weight", py::arg("q"),
        py::arg("scale"), py::arg("group"), py::arg("out") = py::none());
  m.def("int4_dequantize", &int4_dequantize, "int4 codes, group scales and mins -> float32 weight", py::arg("q"),
        py::arg("scale"), py::arg("mins"), py::arg("group"), py::arg("out") = py::none());
  m.def("tile_rows", []() { return kTileRowsOrZero; }, "input rows from which the tiled kernel runs (0: none)");
  m.def("bf16_linear", &bf16_linear, "bfloat16-weight linear computed in float32", py::arg("x"), py::arg("w"),
        py::arg("small") = true, py::arg("tiles") = true);
  m.def("isa", []() { return std::string(kIsa); }, "the instruction set this build's kernels use");
  m.def("tile_block", []() { return kTileBlock; }, "output rows per tile (the tiled kernel needs them to divide N)");
}
