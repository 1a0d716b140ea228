// Paged attention for CPU, decode and prefill alike: each sequence's query tokens sit at consecutive positions
// ending at seq_len - 1 (one token for a decode, a few for a request verifying drafts, a whole chunk for a
// prefill), and attend causally to K/V read in place through the block table, never gathered into a copy.
// One pass with an online softmax (running max and sum per query row).
//
// Work is cut into items: some query tokens of one sequence (a tile), some of its KV heads, and a range of its
// blocks. A physical block is the unit of the inner loop: for each KV head the G query heads that share it are
// scored together (GQA: each K/V row is read once for the group), the running max/sum are corrected once per
// block, and the block's V rows are accumulated while it is still in L1; the next block is prefetched
// meanwhile. Decodes score a K row against their few query rows with dot products; tiles with many rows (a
// prefill, a draft verification, a shared prefix's group) put 16 query rows in the lanes of a vector (8 with
// AVX2) and score as many keys at a time with broadcast FMAs (lanes_keys): a small matrix product with the
// softmax done lane-wise. In the scalar build (or with a head_dim known only at run time) they first transpose
// the block's K into [D, block_size] and score 4 rows at a time (matrix_rows).
//
// Instruction sets (utils/cpu_isa.py builds one variant per set): AVX-512 and AVX2 + FMA have their own vector
// operations beneath lanes_keys, the exp, the int8 KV write and the Hadamard transform; the rest is plain loops
// that the compiler vectorises for the set it targets (the decode dot products, the widening of a bf16, int8
// or fp8 block, libmvec's expf in the softmax), and the scalar build is those loops alone.
//
// Shared prefixes (cascade attention): when several sequences start with the same physical blocks, the query
// rows of all of them attend to those blocks in one pass (K/V read once for the group, and more rows per K/V
// load), and each sequence then continues over its own blocks from that state. Continuing an online softmax from
// a state (max m, sum l, unnormalised output o) is the log-sum-exp merge of the two partial attentions:
// o = o1 * exp(m1 - m) + o2 * exp(m2 - m), l likewise, m = max(m1, m2).
//
// Sliding windows (Mistral, Gemma's local layers) and logit soft caps (Gemma 2) are arguments of each call, as
// windows differ per layer: a token at position p sees keys (p - W, p], so an item starts at the block of its
// first token's window (blocks before it may have been freed and are never read), each row's first visible key
// bounds its scores from below as its causal limit does from above, and lane chunks wholly before every lane's
// window are skipped. Without a window or a cap those steps are not taken.
//
// Element types are a template parameter behind `to_float` (float32; bfloat16, widened without scales; int8 and fp8 e4m3 with one bfloat16 scale
// per block, KV head and K/V as the engine lays them out, kvserve/kv_cache/quant.py, or one per slot): a block's
// rows of one KV head are widened to float times their scales into block-sized buffers that stay in L1, and the
// float code reads those. Another cache type is
// one more `to_float` overload and one more case in `dispatch_dtype`.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr float kNegBig = -1e30f;     // "no score yet": finite, since -ffast-math assumes no infinities
constexpr int64_t kRowBudget = 256;   // query rows (tokens x heads) of one item: its state stays in L2
constexpr int64_t kTransposeRows = 8; // rows per KV head from which a block's K is transposed first
constexpr int64_t kPrefetchAhead = 1; // blocks

struct Geometry {
  int64_t block_size, num_kv_heads, group, head_dim, max_blocks, slot_stride, block_stride;
  int64_t scale_slot_stride, scale_block_stride;  // of a quantized cache's scales (slot stride 0: one per block)
};

// fp8 e4m3fn, as its bit pattern (a distinct type so that overloading picks its conversion).
struct Fp8E4M3 {
  uint8_t bits;
};

// bfloat16, as its bit pattern: a --dtype bfloat16 cache. Widened like a quantized cache (into the same L1
// buffers), but it has no scales.
struct Bf16 {
  uint16_t bits;
};
// Types that need widening to float before the arithmetic, and those of them that carry a scale per row.
template <typename T>
constexpr bool kWidened = !std::is_same<T, float>::value;
template <typename T>
constexpr bool kScaled = kWidened<T> && !std::is_same<T, Bf16>::value;

inline float to_float(float x) { return x; }
inline float to_float(Bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float to_float(int8_t x) { return static_cast<float>(x); }
// The sign, exponent and mantissa bits moved to a float32's sign, low exponent and high mantissa bits give
// the value times 2^-120 (exponent bias 127 instead of 7), subnormals included. The cache never holds
// e4m3fn's NaN (values are clamped to +-448 when written), so there is no special case, and the loops
// that call this stay branch-free and vectorise.
inline float to_float(Fp8E4M3 x) {
  const uint32_t b = x.bits;
  const uint32_t u = ((b & 0x80u) << 24) | ((b & 0x7Fu) << 20);
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f * 0x1p120f;
}

// One unit of work. Its query tokens are `tokens` (rows of q), each seeing keys [0, limit) of the sequence, or
// with a sliding window W keys [limit - W, limit); it reads keys [first_block * BS, end_key) for KV heads
// [h0, h1). A window's first block is where the item starts: blocks wholly before it may have been freed (their
// table entries are stale) and are never read.
struct State {
  float* out;     // [T, Hq, D]: the final output, or the unnormalised accumulator between items
  float* m;       // [T, Hq] running max
  float* l;       // [T, Hq] running sum
};

struct Item {
  const int64_t* table;
  int64_t first_block, end_key, h0, h1;
  std::vector<int64_t> tokens, limits;
  bool seeded;    // start from the state in out/m/l (a shared prefix's result) rather than from nothing
  bool finish;    // normalise into out; otherwise store the raw state for a later item to continue
  const State* dest = nullptr;  // where the raw state goes instead of the call's State (a split's part)
  int64_t window = 0;           // sliding window W; 0: none
};

// The first key token i of an item sees (its window's start; 0 without one).
inline int64_t first_visible(const Item& it, int64_t i) {
  return it.window > 0 ? std::max<int64_t>(0, it.limits[i] - it.window) : 0;
}

// Gemma 2's logit soft cap c * tanh(s / c) on a row of scaled scores (cap 0: none).
inline void soft_cap_scores(float* s, int64_t n, float cap) {
  if (cap <= 0.0f) return;
  const float inv = 1.0f / cap;
  for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] * inv);
}

template <int kD, typename T>
inline void widen_rows(const T* src, const Bf16* scales, int64_t n, int64_t D_rt, int64_t stride,
                       int64_t scale_stride, float* dst) {
  const int64_t D = kD > 0 ? kD : D_rt;
  for (int64_t t = 0; t < n; ++t) {
    const T* __restrict row = src + t * stride;
    float* __restrict o = dst + t * D;
    const float s = kScaled<T> ? to_float(scales[t * scale_stride]) : 1.0f;
    for (int64_t d = 0; d < D; ++d) o[d] = to_float(row[d]) * s;
  }
}

// K rows [n, D] -> kt [D, BS] (columns past n zero), times their scales.
template <int kD, int kBS, typename T>
inline void transpose_rows(const T* src, const Bf16* scales, int64_t n, int64_t D_rt, int64_t BS_rt,
                           int64_t stride, int64_t scale_stride, float* kt) {
  const int64_t D = kD > 0 ? kD : D_rt, BS = kBS > 0 ? kBS : BS_rt;
  if (n < BS) std::fill(kt, kt + D * BS, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    const T* __restrict row = src + t * stride;
    const float s = kScaled<T> ? to_float(scales[t * scale_stride]) : 1.0f;
    for (int64_t d = 0; d < D; ++d) kt[d * BS + t] = to_float(row[d]) * s;
  }
}

// The online-softmax update of one row by a block's scores s[0, nv): s becomes the block's weights; returns the
// factor the row's accumulator is scaled by before they are added.
inline float softmax_update(float* s, int64_t nv, float& m, float& l) {
  float bmax = s[0];
  for (int64_t t = 1; t < nv; ++t) bmax = std::max(bmax, s[t]);
  const float nmax = std::max(m, bmax);
  const float corr = std::exp(m - nmax);  // 0 on the row's first block (m = kNegBig)
  float bsum = 0.0f;
  for (int64_t t = 0; t < nv; ++t) {
    s[t] = std::exp(s[t] - nmax);
    bsum += s[t];
  }
  l = l * corr + bsum;
  m = nmax;
  return corr;
}

// One block of one KV head for many query rows (a prefill tile): the block's K is transposed in kt [D, BS], and
// rows are taken 4 at a time (across tokens: a token's G heads and the next token's), so each load of kt and of
// a V row feeds 4 FMAs. Tokens ascend, so a group's causal limits do too.
template <int kD, int kBS>
void matrix_rows(const Item& it, int64_t hh, int64_t blk, int64_t n, const float* kt, const float* vrows,
                 int64_t vstride, const float* qs, float* acc, float* rm, float* rl, int64_t D_rt, int64_t BS_rt,
                 int64_t G, int64_t Hh, float cap) {
  const int64_t D = kD > 0 ? kD : D_rt, BS = kBS > 0 ? kBS : BS_rt;
  constexpr int64_t kMaxBS = kBS > 0 ? kBS : 64;
  const int64_t total = static_cast<int64_t>(it.tokens.size()) * G;
  for (int64_t p0 = 0; p0 < total; p0 += 4) {
    const int64_t nr = std::min<int64_t>(4, total - p0);
    int64_t r[4], lo[4], nv[4];  // row x sees the block's keys [lo[x], nv[x])
    bool any = false;
    for (int64_t x = 0; x < 4; ++x) {
      const int64_t p = p0 + std::min(x, nr - 1), i = p / G;
      r[x] = i * Hh + hh * G + p % G;
      nv[x] = x < nr ? std::max<int64_t>(0, std::min(n, it.limits[i] - blk * BS)) : 0;
      lo[x] = std::min(nv[x], std::max<int64_t>(0, first_visible(it, i) - blk * BS));
      any |= lo[x] < nv[x];
    }
    if (!any) continue;
    alignas(64) float s[4][kMaxBS];
    for (int64_t x = 0; x < 4; ++x)
      for (int64_t t = 0; t < BS; ++t) s[x][t] = 0.0f;
    const float *q0 = qs + r[0] * D, *q1 = qs + r[1] * D, *q2 = qs + r[2] * D, *q3 = qs + r[3] * D;
    for (int64_t d = 0; d < D; ++d) {
      const float* __restrict kd = kt + d * BS;
      const float a0 = q0[d], a1 = q1[d], a2 = q2[d], a3 = q3[d];
      for (int64_t t = 0; t < BS; ++t) {
        s[0][t] += a0 * kd[t];
        s[1][t] += a1 * kd[t];
        s[2][t] += a2 * kd[t];
        s[3][t] += a3 * kd[t];
      }
    }
    float corr[4];
    int64_t tmax = 0;
    for (int64_t x = 0; x < 4; ++x) {
      corr[x] = 1.0f;
      if (lo[x] < nv[x]) {
        soft_cap_scores(s[x] + lo[x], nv[x] - lo[x], cap);
        corr[x] = softmax_update(s[x] + lo[x], nv[x] - lo[x], rm[r[x]], rl[r[x]]);
      }
      for (int64_t t = 0; t < lo[x]; ++t) s[x][t] = 0.0f;
      for (int64_t t = nv[x]; t < BS; ++t) s[x][t] = 0.0f;
      tmax = std::max(tmax, nv[x]);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 64) {  // 4 rows x 64 columns of accumulator: 16 vector registers
      const int64_t dn = std::min<int64_t>(64, D - d0);
      alignas(64) float a[4][64];
      for (int64_t x = 0; x < 4; ++x)
        for (int64_t d = 0; d < dn; ++d) a[x][d] = acc[r[x] * D + d0 + d] * corr[x];
      for (int64_t t = 0; t < tmax; ++t) {
        const float* __restrict v = vrows + t * vstride + d0;
        const float w0 = s[0][t], w1 = s[1][t], w2 = s[2][t], w3 = s[3][t];
        for (int64_t d = 0; d < dn; ++d) {
          a[0][d] += w0 * v[d];
          a[1][d] += w1 * v[d];
          a[2][d] += w2 * v[d];
          a[3][d] += w3 * v[d];
        }
      }
      for (int64_t x = 0; x < nr; ++x)
        for (int64_t d = 0; d < dn; ++d) acc[r[x] * D + d0 + d] = a[x][d];
    }
  }
}

// Many query rows of one KV head (a prefill tile, a request verifying drafts) with the rows in the lanes of a
// vector (kLanes at a time: 16 with AVX-512, 8 with AVX2) against kLanes keys at a time: the scores of the keys
// are kLanes independent FMA chains (each K element broadcast from memory, q^T one vector load per d), the online
// softmax runs lane-wise on them (the block's max over keys is kLanes - 1 vector maxes, its exp kLanes vector
// exps), and the output accumulates as o^T[d] = o^T[d] * corr + sum_t V[t][d] * p[t], 8 columns of d at a time.
// No transpose of K per block (matrix_rows transposes the block's K and runs its scores as 4 latency-bound
// chains, which left a 5-token verification run at ~4x a decode's cost per sequence).
//
// The code is written once over a few vector operations per instruction set (VecF: a vector of float lanes).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;  // query rows per vector in lanes_keys
using VecF = __m512;
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, VecF x) { _mm512_storeu_ps(p, x); }
inline VecF vset(float x) { return _mm512_set1_ps(x); }
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vadd(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF vsub(VecF a, VecF b) { return _mm512_sub_ps(a, b); }
inline VecF vmul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF vdiv(VecF a, VecF b) { return _mm512_div_ps(a, b); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF vmax(VecF a, VecF b) { return _mm512_max_ps(a, b); }
inline VecF vmin(VecF a, VecF b) { return _mm512_min_ps(a, b); }
inline VecF vround(VecF x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integer-valued n
inline VecF vscale2(VecF p, VecF n) { return _mm512_scalef_ps(p, n); }

// Scores of keys key0 + t the lanes do not see become kNegBig: t >= nk, t at or past a lane's limit, or (lows:
// a sliding window's first visible keys; nullptr: none) before a lane's low.
inline void mask_scores(VecF* s, int64_t nk, int64_t key0, const int32_t* limits, const int32_t* lows) {
  const __m512i lim = _mm512_loadu_si512(limits);
  const __m512i low = lows != nullptr ? _mm512_loadu_si512(lows) : _mm512_setzero_si512();
  for (int t = 0; t < kLanes; ++t) {
    const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(key0 + t));
    __mmask16 ok = t < nk ? _mm512_cmpgt_epi32_mask(lim, key) : static_cast<__mmask16>(0);
    if (lows != nullptr) ok &= _mm512_cmple_epi32_mask(low, key);
    s[t] = _mm512_mask_blend_ps(ok, _mm512_set1_ps(kNegBig), s[t]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define KVSERVE_AVX2_LANES 1
constexpr int64_t kLanes = 8;
using VecF = __m256;
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, VecF x) { _mm256_storeu_ps(p, x); }
inline VecF vset(float x) { return _mm256_set1_ps(x); }
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vadd(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF vsub(VecF a, VecF b) { return _mm256_sub_ps(a, b); }
inline VecF vmul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF vdiv(VecF a, VecF b) { return _mm256_div_ps(a, b); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF vmax(VecF a, VecF b) { return _mm256_max_ps(a, b); }
inline VecF vmin(VecF a, VecF b) { return _mm256_min_ps(a, b); }
inline VecF vround(VecF x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integer-valued n in [-127, 127], n built into a float's exponent bits (AVX2 has no scalef):
// n = -127 gives 0, which exp_lanes relies on for scores far below the max.
inline VecF vscale2(VecF p, VecF n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline void mask_scores(VecF* s, int64_t nk, int64_t key0, const int32_t* limits, const int32_t* lows) {
  const __m256i lim = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(limits));
  const __m256i low = lows != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lows))
                                      : _mm256_setzero_si256();
  for (int t = 0; t < kLanes; ++t) {
    const __m256i key = _mm256_set1_epi32(static_cast<int32_t>(key0 + t));
    __m256i ok = t < nk ? _mm256_cmpgt_epi32(lim, key) : _mm256_setzero_si256();
    if (lows != nullptr) ok = _mm256_andnot_si256(_mm256_cmpgt_epi32(low, key), ok);  // low <= key
    s[t] = _mm256_blendv_ps(_mm256_set1_ps(kNegBig), s[t], _mm256_castsi256_ps(ok));
  }
}
#else
constexpr int64_t kLanes = 16;  // unused: no lanes without a vector unit
#endif

#if defined(__AVX512F__) || defined(KVSERVE_AVX2_LANES)
// e^x for float32 lanes, to ~1e-7 relative: 2^(x log2 e) as 2^n times 2^f, |f| <= 1/2, by its Taylor series to
// degree 7 (error below 3e-9). A large negative x (a masked score) gives 0.
inline VecF exp_lanes(VecF x) {
  VecF t = vmul(x, vset(1.44269504088896341f));
#ifndef __AVX512F__
  t = vmin(vmax(t, vset(-127.0f)), vset(127.0f));  // the range vscale2 builds 2^n for (scalef saturates itself)
#endif
  const VecF n = vround(t);
  const VecF f = vmul(vsub(t, n), vset(0.693147180559945309f));
  VecF p = vset(1.0f / 5040.0f);
  p = vfma(p, f, vset(1.0f / 720.0f));
  p = vfma(p, f, vset(1.0f / 120.0f));
  p = vfma(p, f, vset(1.0f / 24.0f));
  p = vfma(p, f, vset(1.0f / 6.0f));
  p = vfma(p, f, vset(0.5f));
  p = vfma(p, f, vset(1.0f));
  p = vfma(p, f, vset(1.0f));
  return vscale2(p, n);
}

// tanh for float32 lanes, (e^2x - 1) / (e^2x + 1), x clamped to +-9 first (tanh is 1 to float precision there,
// and e^2x stays finite).
inline VecF tanh_lanes(VecF x) {
  x = vmin(vmax(x, vset(-9.0f)), vset(9.0f));
  const VecF e = exp_lanes(vadd(x, x));
  const VecF one = vset(1.0f);
  return vdiv(vsub(e, one), vadd(e, one));
}

// One chunk of up to kLanes keys (positions key0.., rows of k and v `kstride` / `vstride` floats apart, nk of
// them real) for one chunk of kLanes lanes: qt, ot [D][kLanes], the lanes' running max and sum, and their causal
// limits (a lane sees keys below its limit; padding lanes have 0) and, with a sliding window, their first visible
// keys `lows` (nullptr: none). `masked`: some key of the chunk is past a lane's limit, before its low or past
// nk. `cap`: the logit soft cap (0: none).
template <int kD>
inline void lanes_keys(const float* k, int64_t kstride, const float* v, int64_t vstride, int64_t nk, int64_t key0,
                       bool masked, const float* qt, float* ot, float* m, float* l, const int32_t* limits,
                       const int32_t* lows, float cap) {
  VecF s[kLanes];
  for (int t = 0; t < kLanes; ++t) s[t] = vzero();
  const float* kr[kLanes];
  for (int t = 0; t < kLanes; ++t) kr[t] = k + std::min<int64_t>(t, nk - 1) * kstride;
  for (int d = 0; d < kD; ++d) {
    const VecF q = vload(qt + d * kLanes);
    for (int t = 0; t < kLanes; ++t) s[t] = vfma(vset(kr[t][d]), q, s[t]);
  }
  if (cap > 0.0f) {
    const VecF c = vset(cap), inv = vset(1.0f / cap);
    for (int t = 0; t < kLanes; ++t) s[t] = vmul(c, tanh_lanes(vmul(s[t], inv)));
  }
  if (masked) mask_scores(s, nk, key0, limits, lows);
  VecF bmax = s[0];
  for (int t = 1; t < kLanes; ++t) bmax = vmax(bmax, s[t]);
  const VecF mold = vload(m);
  const VecF mnew = vmax(mold, bmax);
  const VecF corr = exp_lanes(vsub(mold, mnew));
  VecF sum = vzero();
  for (int t = 0; t < kLanes; ++t) {
    s[t] = exp_lanes(vsub(s[t], mnew));
    sum = vadd(sum, s[t]);
  }
  vstore(l, vfma(vload(l), corr, sum));
  vstore(m, mnew);
  for (int d0 = 0; d0 < kD; d0 += 8) {
    VecF o[8];
    for (int j = 0; j < 8; ++j) o[j] = vmul(vload(ot + (d0 + j) * kLanes), corr);
    for (int64_t t = 0; t < nk; ++t) {
      const float* vr = v + t * vstride + d0;
      for (int j = 0; j < 8; ++j) o[j] = vfma(vset(vr[j]), s[t], o[j]);
    }
    for (int j = 0; j < 8; ++j) vstore(ot + (d0 + j) * kLanes, o[j]);
  }
}
#endif

// Whether an item's rows run in lanes (compile-time head_dim, a multiple of 8; blocks of whole 16-key chunks).
template <int kD>
constexpr bool kLanesBuilt =
#if defined(__AVX512F__) || defined(KVSERVE_AVX2_LANES)
    kD > 0 && kD % 8 == 0;
#else
    false;
#endif

template <int kD, int kBS, typename T>
void run_item(const Item& it, const float* q, const T* kv, const Bf16* kv_scales, const Geometry& g,
              float scale, float cap, const State& st, std::vector<float>& scratch) {
  constexpr bool kQuantized = kWidened<T>;  // widened into L1 buffers (int8, fp8: with scales; bf16: without)
  const int64_t D = kD > 0 ? kD : g.head_dim, BS = kBS > 0 ? kBS : g.block_size;
  const int64_t G = g.group, Hkv = g.num_kv_heads, Hq = Hkv * G;
  const int64_t ntok = static_cast<int64_t>(it.tokens.size()), nh = it.h1 - it.h0, Hh = nh * G;
  const int64_t rows = ntok * Hh;
  const bool transposed = ntok * G >= kTransposeRows;
  scratch.resize(static_cast<size_t>(2 * rows * D + 2 * rows + 4 * BS + 2 * BS * D));
  float* qs = scratch.data();       // [rows, D] the item's query rows, times the softmax scale
  float* acc = qs + rows * D;       // [rows, D]
  float* rm = acc + rows * D;       // [rows]
  float* rl = rm + rows;            // [rows]
  float* sc = rl + rows;            // [4, BS] scores of up to 4 rows
  float* kb = sc + 4 * BS;          // [BS, D] or [D, BS]: the block's K of one head, as floats
  float* vb = kb + BS * D;          // [BS, D] its V (quantized caches only)
  // row r = i * Hh + hh * G + j: token i, KV head h0 + hh, its j-th query head
  for (int64_t i = 0; i < ntok; ++i) {
    for (int64_t c = 0; c < Hh; ++c) {
      const int64_t r = i * Hh + c, head = it.tokens[i] * Hq + it.h0 * G + c;
      const float* src = q + head * D;
      for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * scale;
      if (it.seeded) {
        std::memcpy(acc + r * D, st.out + head * D, sizeof(float) * D);
        rm[r] = st.m[head], rl[r] = st.l[head];
      } else {
        std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
        rm[r] = kNegBig, rl[r] = 0.0f;
      }
    }
  }
  const int64_t end_key = std::min(it.end_key, *std::max_element(it.limits.begin(), it.limits.end()));
  const int64_t end_block = (end_key + BS - 1) / BS;
  // lanes: [chunks] of q^T and o^T [D][16], running max, sum and limits [16] (row r is lane r % 16 of chunk r / 16)
  const bool lanes = kLanesBuilt<kD> && transposed && BS % 16 == 0;
  const int64_t chunks = lanes ? (rows + kLanes - 1) / kLanes : 0;
  thread_local std::vector<float> lane_buf;
  thread_local std::vector<int32_t> lane_limits;
  thread_local std::vector<int64_t> chunk_min_limit;
  // with a sliding window: each lane's first visible key, and per chunk the least and greatest of them
  const bool windowed = it.window > 0;
  thread_local std::vector<int32_t> lane_lows;
  thread_local std::vector<int64_t> chunk_min_low, chunk_max_low;
  float *lq = nullptr, *lo = nullptr, *lm = nullptr, *ll = nullptr;
  if (lanes) {
    lane_buf.assign(static_cast<size_t>(chunks * kLanes * (2 * D + 2)), 0.0f);
    lane_limits.assign(static_cast<size_t>(chunks * kLanes), 0);
    chunk_min_limit.assign(static_cast<size_t>(chunks), INT64_MAX);
    if (windowed) {
      lane_lows.assign(static_cast<size_t>(chunks * kLanes), 0);
      chunk_min_low.assign(static_cast<size_t>(chunks), INT64_MAX);
      chunk_max_low.assign(static_cast<size_t>(chunks), 0);
    }
    lq = lane_buf.data(), lo = lq + chunks * kLanes * D, lm = lo + chunks * kLanes * D, ll = lm + chunks * kLanes;
    for (int64_t r = 0; r < chunks * kLanes; ++r) lm[r] = kNegBig;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = r / kLanes, x = r % kLanes;
      for (int64_t d = 0; d < D; ++d) {
        lq[(c * D + d) * kLanes + x] = qs[r * D + d];
        lo[(c * D + d) * kLanes + x] = acc[r * D + d];
      }
      lm[r] = rm[r], ll[r] = rl[r];
      const int64_t limit = it.limits[r / Hh];
      lane_limits[r] = static_cast<int32_t>(limit);
      chunk_min_limit[c] = std::min(chunk_min_limit[c], limit);
      if (windowed) {
        const int64_t low = first_visible(it, r / Hh);
        lane_lows[r] = static_cast<int32_t>(low);
        chunk_min_low[c] = std::min(chunk_min_low[c], low);
        chunk_max_low[c] = std::max(chunk_max_low[c], low);
      }
    }
    for (int64_t c = 0; c < chunks; ++c)
      if ((c + 1) * kLanes > rows) chunk_min_limit[c] = 0;  // padding lanes see nothing: always masked
  }
  for (int64_t blk = it.first_block; blk < end_block; ++blk) {
    const int64_t n = std::min(BS, end_key - blk * BS);
    const T* base = kv + it.table[blk] * g.block_stride;
    const Bf16* sbase = kScaled<T> ? kv_scales + it.table[blk] * g.scale_block_stride : nullptr;
    const int64_t ahead = blk + kPrefetchAhead;
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t h = it.h0 + hh;
      const T* next = ahead < end_block ? kv + it.table[ahead] * g.block_stride + h * D : nullptr;
      const int64_t next_tokens = next ? std::min(BS, end_key - ahead * BS) : 0;
      if (next && transposed) {
        // NOTE: blocks sit anywhere in the pool and the hardware prefetcher does not follow the block table;
        // asking for a block ahead now overlaps its DRAM latency with this block's arithmetic. One head's
        // K and V rows per head of this block, so the requests are spread over the block's work rather than
        // issued in one burst that fills the miss queues.
        const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
        for (int64_t t = 0; t < next_tokens; ++t) {
          const char* k = reinterpret_cast<const char*>(next + t * g.slot_stride);
          const char* v = k + Hkv * D * static_cast<int64_t>(sizeof(T));
          for (int64_t off = 0; off < bytes; off += 64) {
            __builtin_prefetch(k + off);
            __builtin_prefetch(v + off);
          }
        }
      }
      if (next && kScaled<T> && hh == 0) {
        const char* ns = reinterpret_cast<const char*>(kv_scales + it.table[ahead] * g.scale_block_stride);
        const int64_t scale_bytes = std::max<int64_t>(next_tokens * g.scale_slot_stride, 2 * Hkv) *
                                    static_cast<int64_t>(sizeof(Bf16));
        for (int64_t off = 0; off < scale_bytes; off += 64) __builtin_prefetch(ns + off);
      }
      const T* kraw = base + h * D;
      const T* vraw = base + (Hkv + h) * D;
      const float* vrows;
      int64_t vstride;
      if constexpr (kQuantized) {
        widen_rows<kD>(vraw, sbase ? sbase + Hkv + h : nullptr, n, D, g.slot_stride, g.scale_slot_stride, vb);
        vrows = vb, vstride = D;
      } else {
        vrows = vraw, vstride = g.slot_stride;
      }
      const float* krows = nullptr;  // [n, D] rows `kstride` apart, when not transposed
      int64_t kstride = D;
#if defined(__AVX512F__) || defined(KVSERVE_AVX2_LANES)
      if (lanes) {
        if constexpr (kQuantized) {
          widen_rows<kD>(kraw, sbase ? sbase + h : nullptr, n, D, g.slot_stride, g.scale_slot_stride, kb);
          krows = kb;
        } else {
          krows = kraw, kstride = g.slot_stride;
        }
        for (int64_t k0 = 0; k0 < n; k0 += kLanes) {
          const int64_t nk = std::min(kLanes, n - k0), key0 = blk * BS + k0;
          for (int64_t c = 0; c < chunks; ++c) {
            if (windowed && key0 + nk <= chunk_min_low[c]) continue;  // before every lane's window
            const bool masked = nk < kLanes || key0 + kLanes > chunk_min_limit[c] ||
                                (windowed && key0 < chunk_max_low[c]);
            lanes_keys<kD>(krows + k0 * kstride, kstride, vrows + k0 * vstride, vstride, nk, key0, masked,
                           lq + c * D * kLanes, lo + c * D * kLanes, lm + c * kLanes, ll + c * kLanes,
                           lane_limits.data() + c * kLanes, windowed ? lane_lows.data() + c * kLanes : nullptr, cap);
          }
        }
        continue;
      }
#endif
      if (transposed) {
        transpose_rows<kD, kBS>(kraw, sbase ? sbase + h : nullptr, n, D, BS, g.slot_stride, g.scale_slot_stride,
                                kb);
      } else if constexpr (kQuantized) {
        widen_rows<kD>(kraw, sbase ? sbase + h : nullptr, n, D, g.slot_stride, g.scale_slot_stride, kb);
        krows = kb;
      } else {
        krows = kraw, kstride = g.slot_stride;
      }
      if (transposed) {
        matrix_rows<kD, kBS>(it, hh, blk, n, kb, vrows, vstride, qs, acc, rm, rl, D, BS, G, Hh, cap);
        continue;
      }
      // Few rows (decodes): each K row scored against one token's G query heads, up to 4 at a time.
      for (int64_t i = 0; i < ntok; ++i) {
        // the block's keys [t0, nv) are visible: the causal limit, and the window's start
        const int64_t nv = std::min(n, it.limits[i] - blk * BS);
        const int64_t t0 = std::max<int64_t>(0, first_visible(it, i) - blk * BS);
        if (nv <= t0) continue;
        for (int64_t j0 = 0; j0 < G; j0 += 4) {
          const int64_t nr = std::min<int64_t>(4, G - j0), r0 = i * Hh + hh * G + j0;
          for (int64_t t = t0; t < nv; ++t) {
            if (t < next_tokens && i == 0 && j0 == 0) {
              // NOTE: decodes are memory-bound: the next block's rows of this head are requested one slot
              // per K row scored, so the misses overlap the arithmetic without a burst filling the queues.
              const char* pk = reinterpret_cast<const char*>(next + t * g.slot_stride);
              const char* pv = pk + Hkv * D * static_cast<int64_t>(sizeof(T));
              for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) {
                __builtin_prefetch(pk + off);
                __builtin_prefetch(pv + off);
              }
            }
            const float* __restrict k = krows + t * kstride;
            for (int64_t x = 0; x < nr; ++x) {
              const float* __restrict qr = qs + (r0 + x) * D;
              float s = 0.0f;
              for (int64_t d = 0; d < D; ++d) s += qr[d] * k[d];
              sc[x * BS + t] = s;
            }
          }
          for (int64_t x = 0; x < nr; ++x) {
            const int64_t r = r0 + x;
            float* s = sc + x * BS;
            soft_cap_scores(s + t0, nv - t0, cap);
            const float corr = softmax_update(s + t0, nv - t0, rm[r], rl[r]);
            // NOTE: a local copy of the row's accumulator: with D fixed at compile time and no aliasing the
            // compiler keeps it in vector registers across the block's tokens.
            float a[kD > 0 ? kD : 256];
            float* __restrict ar = acc + r * D;
            for (int64_t d = 0; d < D; ++d) a[d] = ar[d] * corr;
            for (int64_t t = t0; t < nv; ++t) {
              const float* __restrict v = vrows + t * vstride;
              const float w = s[t];
              for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
            }
            for (int64_t d = 0; d < D; ++d) ar[d] = a[d];
          }
        }
      }
    }
  }
  if (lanes) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = r / kLanes, x = r % kLanes;
      for (int64_t d = 0; d < D; ++d) acc[r * D + d] = lo[(c * D + d) * kLanes + x];
      rm[r] = lm[r], rl[r] = ll[r];
    }
  }
  const State& to = it.dest != nullptr ? *it.dest : st;
  for (int64_t i = 0; i < ntok; ++i) {
    for (int64_t c = 0; c < Hh; ++c) {
      const int64_t r = i * Hh + c, head = it.tokens[i] * Hq + it.h0 * G + c;
      float* dst = to.out + head * D;
      if (it.finish) {
        const float inv = 1.0f / rl[r];
        for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
      } else {
        std::memcpy(dst, acc + r * D, sizeof(float) * D);
        to.m[head] = rm[r], to.l[head] = rl[r];
      }
    }
  }
}

template <int kD, int kBS, typename T>
void run_items(const std::vector<Item>& items, const float* q, const T* kv, const Bf16* sp, const Geometry& g,
               float scale, float cap, const State& st) {
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    std::vector<float> scratch;  // per thread, reused across items
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) run_item<kD, kBS, T>(items[i], q, kv, sp, g, scale, cap, st, scratch);
  }
}

template <typename T>
void dispatch_shape(const std::vector<Item>& items, const float* q, const T* kv, const Bf16* sp, const Geometry& g,
                    float scale, float cap, const State& st) {
  const bool bs16 = g.block_size == 16;
  if (g.head_dim == 64 && bs16) {
    run_items<64, 16, T>(items, q, kv, sp, g, scale, cap, st);
  } else if (g.head_dim == 128 && bs16) {
    run_items<128, 16, T>(items, q, kv, sp, g, scale, cap, st);
  } else if (g.head_dim == 64) {
    run_items<64, 0, T>(items, q, kv, sp, g, scale, cap, st);
  } else if (g.head_dim == 128) {
    run_items<128, 0, T>(items, q, kv, sp, g, scale, cap, st);
  } else {
    run_items<0, 0, T>(items, q, kv, sp, g, scale, cap, st);
  }
}

void dispatch_dtype(const std::vector<Item>& items, const float* q, const torch::Tensor& kv, const Bf16* sp,
                    const Geometry& g, float scale, float cap, const State& st) {
  const void* p = kv.data_ptr();
  if (kv.scalar_type() == torch::kFloat32) {
    dispatch_shape(items, q, static_cast<const float*>(p), sp, g, scale, cap, st);
  } else if (kv.scalar_type() == torch::kBFloat16) {
    dispatch_shape(items, q, static_cast<const Bf16*>(p), sp, g, scale, cap, st);
  } else if (kv.scalar_type() == torch::kInt8) {
    dispatch_shape(items, q, static_cast<const int8_t*>(p), sp, g, scale, cap, st);
  } else {
    dispatch_shape(items, q, static_cast<const Fp8E4M3*>(p), sp, g, scale, cap, st);
  }
}

// Items over `tokens` (each with its limit). A decode's few rows take all KV heads in one item (memory-bound:
// each block's slots are read whole, in order); more rows (a prefill chunk, a shared prefix's group) are cut
// into one KV head per item and tiles of at most kRowBudget rows, at least 4 tiles of 8+ tokens where there
// are enough, so that a group's shared pass is spread over the threads rather than one item. With a sliding
// `window` (0: none) an item starts at the block of its first token's first visible key.
void add_items(std::vector<Item>& items, const int64_t* table, int64_t first_block, int64_t end_key,
               const std::vector<int64_t>& tokens, const std::vector<int64_t>& limits, bool seeded, bool finish,
               const Geometry& g, int64_t window = 0) {
  const int64_t ntok = static_cast<int64_t>(tokens.size());
  const bool all_heads = ntok * g.group < kTransposeRows;
  const int64_t per_item = all_heads ? ntok
                                     : std::clamp<int64_t>((ntok + 3) / 4, 8, std::max<int64_t>(1, kRowBudget / g.group));
  for (int64_t h = 0; h < g.num_kv_heads; h += all_heads ? g.num_kv_heads : 1) {
    for (int64_t a = 0; a < ntok; a += per_item) {
      const int64_t b = std::min(ntok, a + per_item);
      items.push_back(Item{table, first_block, end_key, h, all_heads ? g.num_kv_heads : h + 1,
                           std::vector<int64_t>(tokens.begin() + a, tokens.begin() + b),
                           std::vector<int64_t>(limits.begin() + a, limits.begin() + b), seeded, finish});
      Item& it = items.back();
      it.window = window;
      it.first_block = std::max(first_block, first_visible(it, 0) / g.block_size);  // limits ascend
    }
  }
}

// Fewer decode sequences than threads (single-stream decode): one item per sequence would leave threads idle,
// so each unseeded decode item is cut into `parts` ranges of its blocks (flash-decoding's split-K), each
// writing its raw state (output, max, sum) to a part's own State, merged afterwards by log-sum-exp.
struct Splits {
  std::vector<Item> parts;          // the pieces, run with the other items
  std::vector<State> states;        // one per piece (reserved up front: the pieces point into it)
  std::vector<float> buffer;        // their out/m/l arrays, each [T, Hq, D] / [T, Hq] as the call's State
  std::vector<Item> whole;          // the items that were split
  std::vector<int64_t> first, count;  // of each whole item: its first piece and its number of pieces
};

void split_decodes(std::vector<Item>& own, Splits& sp, int64_t threads, int64_t T, const Geometry& g) {
  constexpr int64_t kMinBlocksPerPart = 4;
  const auto last_key = [](const Item& it) {
    return std::min(it.end_key, *std::max_element(it.limits.begin(), it.limits.end()));
  };
  std::vector<Item> kept;
  for (Item& it : own) {
    const int64_t ntok = static_cast<int64_t>(it.tokens.size());
    const bool decode = ntok * g.group < kTransposeRows && !it.seeded && it.finish;
    const int64_t blocks = (last_key(it) + g.block_size - 1) / g.block_size - it.first_block;
    const int64_t parts = std::min(threads, blocks / kMinBlocksPerPart);
    if (decode && parts > 1) {
      sp.count.push_back(parts);
      sp.whole.push_back(std::move(it));
    } else {
      kept.push_back(std::move(it));
    }
  }
  own = std::move(kept);
  int64_t pieces = 0;
  for (int64_t c : sp.count) pieces += c;
  const int64_t rows = T * g.group * g.num_kv_heads, per = rows * (g.head_dim + 2);
  sp.buffer.resize(static_cast<size_t>(pieces * per));
  sp.states.reserve(pieces);
  for (size_t w = 0; w < sp.whole.size(); ++w) {
    const Item& it = sp.whole[w];
    const int64_t end_key = last_key(it), first = it.first_block;
    const int64_t blocks = (end_key + g.block_size - 1) / g.block_size - first, parts = sp.count[w];
    sp.first.push_back(static_cast<int64_t>(sp.states.size()));
    for (int64_t p = 0; p < parts; ++p) {
      float* base = sp.buffer.data() + static_cast<int64_t>(sp.states.size()) * per;
      sp.states.push_back(State{base, base + rows * g.head_dim, base + rows * g.head_dim + rows});
      Item part = it;
      part.first_block = first + blocks * p / parts;
      part.end_key = std::min(end_key, (first + blocks * (p + 1) / parts) * g.block_size);
      part.finish = false;
      part.dest = &sp.states.back();
      sp.parts.push_back(std::move(part));
    }
  }
}

// out[row] = sum_p o_p exp(m_p - m) / sum_p l_p exp(m_p - m), m = max_p m_p, over each split item's rows.
void merge_splits(const Splits& sp, const Geometry& g, float* out) {
  const int64_t D = g.head_dim, G = g.group, Hq = g.num_kv_heads * G;
  for (size_t w = 0; w < sp.whole.size(); ++w) {
    const Item& it = sp.whole[w];
    const State* parts = sp.states.data() + sp.first[w];
    for (int64_t tok : it.tokens) {
      for (int64_t head = tok * Hq + it.h0 * G; head < tok * Hq + it.h1 * G; ++head) {
        float m = kNegBig;
        for (int64_t p = 0; p < sp.count[w]; ++p) m = std::max(m, parts[p].m[head]);
        float l = 0.0f;
        float* dst = out + head * D;
        std::fill(dst, dst + D, 0.0f);
        for (int64_t p = 0; p < sp.count[w]; ++p) {
          const float f = std::exp(parts[p].m[head] - m);
          l += parts[p].l[head] * f;
          const float* o = parts[p].out + head * D;
          for (int64_t d = 0; d < D; ++d) dst[d] += o[d] * f;
        }
        const float inv = 1.0f / l;
        for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
      }
    }
  }
}

}  // namespace

// q [T, Hq, D] float32; kv [num_blocks, block_size, 2, Hkv, D] (float32, or int8/float8_e4m3fn with kv_scales
// [num_blocks, 2, Hkv] bfloat16, one per block, or [num_blocks, block_size, 2, Hkv], one per slot); block_table [B, max_blocks] int64; seq_lens [B] int64.
// query_start (optional, [B + 1] int64): sequence b has the query tokens q[query_start[b]:query_start[b+1]] at
// consecutive positions ending at seq_lens[b] - 1; absent: one query token per sequence.
// Shared prefixes (optional, all three or none): group c is the sequences
// cascade_seqs[cascade_starts[c]:cascade_starts[c+1]], whose block tables all begin with the same
// cascade_blocks[c] blocks, which lie before every one of their query tokens' positions.
// sliding_window W > 0: a query token at position p sees keys (p - W, p] only, and the blocks wholly before its
// sequence's first query token's window are never read (they may have been freed); sequences in shared-prefix
// groups must then be no longer than the window (every query token of theirs sees the whole prefix). soft_cap c > 0: scores become c * tanh(s / c) after scaling (Gemma 2).
// fixed_order: no decode is split over its blocks (a split depends on how many other items the call has), so a
// one-token sequence is always reduced block by block in one pass (the batch-invariant mode, cpu_paged.py).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor block_table, torch::Tensor seq_lens,
                              double scale, c10::optional<torch::Tensor> query_start,
                              c10::optional<torch::Tensor> kv_scales, c10::optional<torch::Tensor> cascade_seqs,
                              c10::optional<torch::Tensor> cascade_starts, c10::optional<torch::Tensor> cascade_blocks,
                              int64_t sliding_window, double soft_cap, bool fixed_order) {
  TORCH_CHECK(sliding_window >= 0 && soft_cap >= 0.0, "paged_attention: sliding_window and soft_cap must be >= 0 "
              "(0: none)");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && block_table.is_contiguous() && seq_lens.is_contiguous(),
              "paged_attention: inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.dim() == 3, "paged_attention: q must be [T, Hq, D] float32");
  const Bf16* sp = nullptr;
  if (kv_scales.has_value()) {
    TORCH_CHECK(kv.scalar_type() == torch::kInt8 || kv.scalar_type() == at::kFloat8_e4m3fn,
                "paged_attention: a cache with scales must be int8 or float8_e4m3fn");
    const bool per_block = kv.dim() == 5 && kv_scales->dim() == 3 && kv_scales->size(0) == kv.size(0) &&
                           kv_scales->size(1) == 2 && kv_scales->size(2) == kv.size(3);
    TORCH_CHECK(kv_scales->is_contiguous() && kv_scales->scalar_type() == torch::kBFloat16 && kv.dim() == 5 &&
                    (per_block || (kv_scales->dim() == 4 && kv_scales->sizes() == kv.sizes().slice(0, 4))),
                "paged_attention: kv_scales must be contiguous bfloat16 shaped as kv without head_dim, or "
                "[num_blocks, 2, Hkv] (one per block)");
    sp = static_cast<const Bf16*>(kv_scales->data_ptr());
  } else {
    TORCH_CHECK(kv.scalar_type() == torch::kFloat32 || kv.scalar_type() == torch::kBFloat16,
                "paged_attention: an unquantized cache must be float32 or bfloat16 (int8/fp8 need kv_scales)");
  }
  TORCH_CHECK(kv.dim() == 5, "paged_attention: kv must be [num_blocks, block_size, 2, Hkv, D]");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_table and seq_lens must be int64");
  const int64_t B = seq_lens.size(0), T = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == B, "block_table must be [B, max_blocks]");
  std::vector<int64_t> qs(B + 1);
  if (query_start.has_value()) {
    TORCH_CHECK(query_start->is_contiguous() && query_start->scalar_type() == torch::kInt64 &&
                    query_start->size(0) == B + 1, "query_start must be [B + 1] int64");
    std::memcpy(qs.data(), query_start->data_ptr<int64_t>(), sizeof(int64_t) * (B + 1));
    TORCH_CHECK(qs[0] == 0 && qs[B] == T, "query_start must run from 0 to the number of query tokens");
  } else {
    TORCH_CHECK(T == B, "one query token per sequence without query_start");
    for (int64_t b = 0; b <= B; ++b) qs[b] = b;
  }
  const int64_t BS = kv.size(1), Hkv = kv.size(3);
  TORCH_CHECK(kv.size(4) == D && Hq % Hkv == 0, "paged_attention: head shapes do not match");
  TORCH_CHECK(D <= 256 && BS <= 64, "paged_attention: head_dim above 256 or block_size above 64 is not supported");
  const bool scale_per_slot = kv_scales.has_value() && kv_scales->dim() == 4;
  const Geometry g{BS, Hkv, Hq / Hkv, D, block_table.size(1), 2 * Hkv * D, BS * 2 * Hkv * D,
                   scale_per_slot ? 2 * Hkv : 0, scale_per_slot ? BS * 2 * Hkv : 2 * Hkv};
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* bt = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qs[b + 1] >= qs[b] && sl[b] >= qs[b + 1] - qs[b] && (sl[b] + BS - 1) / BS <= g.max_blocks,
                "paged_attention: a sequence's query tokens or length do not fit its block table");
  }

  std::vector<int64_t> skip(B, 0);  // blocks of each sequence covered by its group's shared pass
  std::vector<Item> shared;
  const bool cascade = cascade_seqs.has_value();
  TORCH_CHECK(cascade == cascade_starts.has_value() && cascade == cascade_blocks.has_value(),
              "paged_attention: cascade_seqs, cascade_starts and cascade_blocks go together");
  if (cascade) {
    const int64_t* cs = cascade_seqs->data_ptr<int64_t>();
    const int64_t* cst = cascade_starts->data_ptr<int64_t>();
    const int64_t* cb = cascade_blocks->data_ptr<int64_t>();
    const int64_t C = cascade_blocks->size(0);
    TORCH_CHECK(cascade_starts->size(0) == C + 1 && cst[0] == 0 && cst[C] == cascade_seqs->size(0),
                "paged_attention: cascade_starts must be [groups + 1] offsets into cascade_seqs");
    for (int64_t c = 0; c < C; ++c) {
      std::vector<int64_t> tokens;
      TORCH_CHECK(cst[c + 1] > cst[c] && cb[c] > 0, "paged_attention: an empty shared-prefix group");
      for (int64_t x = cst[c]; x < cst[c + 1]; ++x) {
        const int64_t b = cs[x];
        TORCH_CHECK(b >= 0 && b < B && skip[b] == 0, "paged_attention: a sequence in no or several groups");
        TORCH_CHECK(cb[c] * BS <= sl[b] - (qs[b + 1] - qs[b]),
                    "paged_attention: a shared prefix must lie before every query token of its group");
        TORCH_CHECK(sliding_window == 0 || sl[b] <= sliding_window,
                    "paged_attention: a shared prefix must lie inside every query token's sliding window");
        TORCH_CHECK(std::equal(bt + b * g.max_blocks, bt + b * g.max_blocks + cb[c], bt + cs[cst[c]] * g.max_blocks),
                    "paged_attention: a group's block tables must begin with the same blocks");
        skip[b] = cb[c];
        for (int64_t t = qs[b]; t < qs[b + 1]; ++t) tokens.push_back(t);
      }
      std::vector<int64_t> limits(tokens.size(), cb[c] * BS);
      add_items(shared, bt + cs[cst[c]] * g.max_blocks, 0, cb[c] * BS, tokens, limits, false, false, g);
    }
  }
  std::vector<Item> own;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t Q = qs[b + 1] - qs[b];
    if (Q == 0) continue;
    std::vector<int64_t> tokens(Q), limits(Q);
    for (int64_t i = 0; i < Q; ++i) tokens[i] = qs[b] + i, limits[i] = sl[b] - Q + i + 1;
    add_items(own, bt + b * g.max_blocks, skip[b], sl[b], tokens, limits, skip[b] > 0, true, g, sliding_window);
  }

  Splits splits;
  if (!fixed_order) split_decodes(own, splits, omp_get_max_threads() - static_cast<int64_t>(own.size()) + 1, T, g);
  own.insert(own.end(), std::make_move_iterator(splits.parts.begin()), std::make_move_iterator(splits.parts.end()));

  auto out = torch::empty_like(q);
  torch::Tensor ml;
  State st{out.data_ptr<float>(), nullptr, nullptr};
  if (!shared.empty()) {
    ml = torch::empty({2, T * Hq}, q.options());
    st.m = ml.data_ptr<float>(), st.l = st.m + T * Hq;
  }
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(soft_cap);
  if (!shared.empty()) dispatch_dtype(shared, q.data_ptr<float>(), kv, sp, g, fscale, fcap, st);
  dispatch_dtype(own, q.data_ptr<float>(), kv, sp, g, fscale, fcap, st);
  merge_splits(splits, g, out.data_ptr<float>());
  return out;
}

// kv [num_blocks, block_size, 2, Hkv, D] float32 or bfloat16: k and v [T, Hkv, D] of the same dtype (rows of any
// stride: views into the step's fused qkv projection) written at slot_mapping [T] int64 (block * block_size +
// offset). One call per layer for what torch.stack + index_copy_ did in two, each of which
// copied the step's K/V once more.
void write_kv_(torch::Tensor kv, torch::Tensor slot_mapping, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous() && kv.size(2) == 2, "write_kv_: kv must be a contiguous "
              "[num_blocks, block_size, 2, Hkv, D] tensor");
  TORCH_CHECK(kv.scalar_type() == torch::kFloat32 || kv.scalar_type() == torch::kBFloat16,
              "write_kv_: the cache must be float32 or bfloat16 (a quantized one is written through its scales)");
  const int64_t T = slot_mapping.size(0), Hkv = kv.size(3), D = kv.size(4), slots = kv.size(0) * kv.size(1);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() && slot_mapping.scalar_type() == torch::kInt64,
              "write_kv_: slot_mapping must be [T] int64");
  for (const torch::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == Hkv && t->size(2) == D &&
                    t->scalar_type() == kv.scalar_type() && t->stride(2) == 1 && t->stride(1) == D,
                "write_kv_: k and v must be [T, Hkv, D] of the cache's dtype with contiguous heads");
  }
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  const int64_t row = Hkv * D, bytes = row * static_cast<int64_t>(kv.element_size());
  char* dst = static_cast<char*>(kv.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  const int64_t kstride = k.stride(0) * kv.element_size(), vstride = v.stride(0) * kv.element_size();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sm[t] >= 0 && sm[t] < slots, "write_kv_: slot ", sm[t], " is outside the cache's ", slots, " slots");
    std::memcpy(dst + sm[t] * 2 * bytes, ks + t * kstride, bytes);
    std::memcpy(dst + (sm[t] * 2 + 1) * bytes, vs + t * vstride, bytes);
  }
}

// The quantized cache's write rule (kvserve/kv_cache/quant.py, write_block_scaled: this must give the same
// bytes). values [num_blocks, BS, 2, Hkv, D] int8 or float8_e4m3fn, scales [num_blocks, 2, Hkv] bfloat16; k and
// v [T, Hkv, D] float32 (already rotated) written at slot_mapping [T]. Per (block, K/V, head): the write's tokens
// take the scale max(old, theirs), or theirs alone when the write reaches the block's offset 0; a grown scale
// requantizes the block's codes (codes * old / new).
// NOTE: IEEE arithmetic here, not -ffast-math's: the codes must match the PyTorch rule bit for bit, and a
// reciprocal in place of a division (or a contracted multiply-add) moves a code across a rounding boundary.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
namespace {

float round_up_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0xFFFFu) & ~0xFFFFu;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

template <typename T>
struct Codes;
template <>
struct Codes<int8_t> {
  static constexpr float kMax = 127.0f;
  static float get(int8_t c) { return static_cast<float>(c); }
  static int8_t put(float y) { return static_cast<int8_t>(std::nearbyint(std::min(std::max(y, -kMax), kMax))); }
};
template <>
struct Codes<c10::Float8_e4m3fn> {
  static constexpr float kMax = 448.0f;
  static float get(c10::Float8_e4m3fn c) { return static_cast<float>(c); }
  static c10::Float8_e4m3fn put(float y) { return c10::Float8_e4m3fn(std::min(std::max(y, -kMax), kMax)); }
};

// The row operations of the write, int8 and fp8 in AVX-512 or AVX2 vectors (IEEE division, round-half-even,
// clamp: the scalar rule's results exactly), the tails through Codes<T>.
inline float row_amax(const float* x, int64_t D) {
  float amax = 0.0f;
  int64_t d = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
  amax = _mm512_reduce_max_ps(m);
#elif defined(KVSERVE_AVX2_LANES)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + d), magnitude));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
#endif
  for (; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  return amax;
}

#ifdef __AVX512F__
inline void put_int8_lanes(__m512 y, int8_t* out) {
  y = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(y)));
}
#elif defined(KVSERVE_AVX2_LANES)
inline void put_int8_lanes(__m256 y, int8_t* out) {
  y = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  const __m256i c = _mm256_cvtps_epi32(y);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(w, w));
}
#endif

// fp8 e4m3fn in vector lanes: c10's fp8e4m3fn_from_fp32_value and its inverse, lane by lane in integer
// arithmetic (and the one float add that rounds a subnormal), so the codes are the scalar rule's: the clamp to
// +-448 keeps a NaN as std::min/max do (the vector max/min return their second operand for a NaN), a NaN
// encodes as 0x7F, an overflow saturates to 0x7E, and the mantissa rounds half to even.
constexpr int32_t kFp8Rebias = static_cast<int32_t>((static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu);
constexpr int32_t kFp8Denorm = 141 << 23;       // c10's denorm_mask
constexpr int32_t kFp8MinNormal = 121 << 23;    // 2^-6
constexpr int32_t kFp8Overflow = 1087 << 20;    // 480.0f
constexpr int32_t kFp8Inf = 0x7F800000;
#ifdef __AVX512F__
inline void put_fp8_lanes(__m512 y, c10::Float8_e4m3fn* out) {
  y = _mm512_min_ps(_mm512_set1_ps(448.0f), _mm512_max_ps(_mm512_set1_ps(-448.0f), y));
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(INT32_MIN));
  const __m512i a = _mm512_xor_si512(bits, sign);
  const __m512i dm = _mm512_set1_epi32(kFp8Denorm);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(dm))), dm);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(kFp8Rebias)), odd), 20),
      _mm512_set1_epi32(0xFF));
  const __m512i sat = _mm512_set1_epi32(0x7E);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpeq_epi32_mask(r, _mm512_set1_epi32(0x7F)), sat);
  r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(kFp8MinNormal)),
                            _mm512_and_si512(sub, _mm512_set1_epi32(0xFF)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(kFp8Overflow)), sat);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(kFp8Inf)), _mm512_set1_epi32(0x7F));
  r = _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(r));
}

// c10's fp8e4m3fn_to_fp32_value: the bits moved into place times 2^120 (exact), a NaN code (0x7F, 0xFF) a NaN
// of its sign.
inline __m512 get_fp8_lanes(const c10::Float8_e4m3fn* in) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
  const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
  const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_slli_epi32(mag, 20))),
                                 _mm512_set1_ps(0x1p120f));
  const __m512 nan = _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_set1_epi32(0x7FC00000)));
  return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), nan);
}
#elif defined(KVSERVE_AVX2_LANES)
inline void put_fp8_lanes(__m256 y, c10::Float8_e4m3fn* out) {
  y = _mm256_min_ps(_mm256_set1_ps(448.0f), _mm256_max_ps(_mm256_set1_ps(-448.0f), y));
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN));
  const __m256i a = _mm256_xor_si256(bits, sign);  // < 2^31: signed comparisons order it
  const __m256i dm = _mm256_set1_epi32(kFp8Denorm);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(dm))), dm);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
  __m256i r = _mm256_and_si256(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(kFp8Rebias)), odd), 20),
      _mm256_set1_epi32(0xFF));
  const __m256i sat = _mm256_set1_epi32(0x7E);
  r = _mm256_blendv_epi8(r, sat, _mm256_cmpeq_epi32(r, _mm256_set1_epi32(0x7F)));
  r = _mm256_blendv_epi8(r, _mm256_and_si256(sub, _mm256_set1_epi32(0xFF)),
                         _mm256_cmpgt_epi32(_mm256_set1_epi32(kFp8MinNormal), a));
  r = _mm256_blendv_epi8(r, sat, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(kFp8Overflow - 1)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(kFp8Inf)));
  r = _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(w, w));
}

inline __m256 get_fp8_lanes(const c10::Float8_e4m3fn* in) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(sign, _mm256_slli_epi32(mag, 20))),
                                 _mm256_set1_ps(0x1p120f));
  const __m256 nan = _mm256_castsi256_ps(_mm256_or_si256(sign, _mm256_set1_epi32(0x7FC00000)));
  return _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F))));
}
#endif

template <typename T>
void encode_row(const float* x, float scale, T* out, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale);
  if constexpr (std::is_same<T, int8_t>::value) {
    for (; d + 16 <= D; d += 16) put_int8_lanes(_mm512_div_ps(_mm512_loadu_ps(x + d), s), out + d);
  } else {
    for (; d + 16 <= D; d += 16) put_fp8_lanes(_mm512_div_ps(_mm512_loadu_ps(x + d), s), out + d);
  }
#elif defined(KVSERVE_AVX2_LANES)
  const __m256 s = _mm256_set1_ps(scale);
  if constexpr (std::is_same<T, int8_t>::value) {
    for (; d + 8 <= D; d += 8) put_int8_lanes(_mm256_div_ps(_mm256_loadu_ps(x + d), s), out + d);
  } else {
    for (; d + 8 <= D; d += 8) put_fp8_lanes(_mm256_div_ps(_mm256_loadu_ps(x + d), s), out + d);
  }
#endif
  for (; d < D; ++d) out[d] = Codes<T>::put(x[d] / scale);
}

template <typename T>
void rescale_row(T* codes, float ratio, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 r = _mm512_set1_ps(ratio);
  if constexpr (std::is_same<T, int8_t>::value) {
    for (; d + 16 <= D; d += 16) {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + d));
      put_int8_lanes(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), r), codes + d);
    }
  } else {
    for (; d + 16 <= D; d += 16) put_fp8_lanes(_mm512_mul_ps(get_fp8_lanes(codes + d), r), codes + d);
  }
#elif defined(KVSERVE_AVX2_LANES)
  const __m256 r = _mm256_set1_ps(ratio);
  if constexpr (std::is_same<T, int8_t>::value) {
    for (; d + 8 <= D; d += 8) {
      const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + d));
      put_int8_lanes(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), r), codes + d);
    }
  } else {
    for (; d + 8 <= D; d += 8) put_fp8_lanes(_mm256_mul_ps(get_fp8_lanes(codes + d), r), codes + d);
  }
#endif
  for (; d < D; ++d) codes[d] = Codes<T>::put(Codes<T>::get(codes[d]) * ratio);
}

template <typename T>
void write_quantized(T* values, Bf16* scales, const int64_t* sm, int64_t T_, const float* k, const float* v,
                     int64_t kstride, int64_t vstride, int64_t BS, int64_t Hkv, int64_t D) {
  // the write's tokens grouped by block (a block's tokens are one request's, in order)
  std::vector<int64_t> blocks;
  std::vector<std::vector<int64_t>> tokens;
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t b = sm[t] / BS;
    const auto it = std::find(blocks.begin(), blocks.end(), b);
    if (it == blocks.end()) {
      blocks.push_back(b);
      tokens.emplace_back(1, t);
    } else {
      tokens[it - blocks.begin()].push_back(t);
    }
  }
  const int64_t U = static_cast<int64_t>(blocks.size());
#pragma omp parallel for schedule(static) if (U > 1)
  for (int64_t u = 0; u < U; ++u) {
    const int64_t b = blocks[u];
    bool reset = false;
    for (const int64_t t : tokens[u]) reset |= sm[t] % BS == 0;
    for (int64_t part = 0; part < 2; ++part) {
      const float* src = part == 0 ? k : v;
      const int64_t stride = part == 0 ? kstride : vstride;
      for (int64_t h = 0; h < Hkv; ++h) {
        float amax = 0.0f;
        for (const int64_t t : tokens[u]) amax = std::max(amax, row_amax(src + t * stride + h * D, D));
        const float need = round_up_to_bf16(std::min(std::max(amax, 1e-30f), 3e38f) / Codes<T>::kMax);
        Bf16& stored = scales[(b * 2 + part) * Hkv + h];
        const float old = to_float(stored);
        const float scale = reset ? need : std::max(old, need);
        if (!reset && scale > old) {
          const float ratio = old / scale;
          for (int64_t s = 0; s < BS; ++s) rescale_row(values + (((b * BS + s) * 2 + part) * Hkv + h) * D, ratio, D);
        }
        uint32_t bits;
        std::memcpy(&bits, &scale, sizeof bits);
        stored.bits = static_cast<uint16_t>(bits >> 16);  // exact: both candidates are bf16 values
        for (const int64_t t : tokens[u])
          encode_row(src + t * stride + h * D, scale, values + ((sm[t] * 2 + part) * Hkv + h) * D, D);
      }
    }
  }
}

}  // namespace

void write_kv_quantized_(torch::Tensor values, torch::Tensor scales, torch::Tensor slot_mapping, torch::Tensor k,
                         torch::Tensor v) {
  TORCH_CHECK(values.dim() == 5 && values.is_contiguous() && values.size(2) == 2 &&
                  (values.scalar_type() == torch::kInt8 || values.scalar_type() == at::kFloat8_e4m3fn),
              "write_kv_quantized_: values must be a contiguous int8 or float8_e4m3fn [num_blocks, block_size, 2, "
              "Hkv, D] tensor");
  const int64_t N = values.size(0), BS = values.size(1), Hkv = values.size(3), D = values.size(4);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kBFloat16 && scales.dim() == 3 &&
                  scales.size(0) == N && scales.size(1) == 2 && scales.size(2) == Hkv,
              "write_kv_quantized_: scales must be contiguous bfloat16 [num_blocks, 2, Hkv]");
  const int64_t T = slot_mapping.size(0);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() && slot_mapping.scalar_type() == torch::kInt64,
              "write_kv_quantized_: slot_mapping must be [T] int64");
  for (const torch::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == Hkv && t->size(2) == D &&
                    t->scalar_type() == torch::kFloat32 && t->stride(2) == 1 && t->stride(1) == D,
                "write_kv_quantized_: k and v must be float32 [T, Hkv, D] with contiguous heads");
  }
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sm[t] >= 0 && sm[t] < N * BS, "write_kv_quantized_: slot ", sm[t], " is outside the cache's ",
                N * BS, " slots");
  Bf16* sp = static_cast<Bf16*>(scales.data_ptr());
  if (values.scalar_type() == torch::kInt8) {
    write_quantized(values.data_ptr<int8_t>(), sp, sm, T, k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0),
                    v.stride(0), BS, Hkv, D);
  } else {
    write_quantized(static_cast<c10::Float8_e4m3fn*>(values.data_ptr()), sp, sm, T, k.data_ptr<float>(),
                    v.data_ptr<float>(), k.stride(0), v.stride(0), BS, Hkv, D);
  }
}
#pragma GCC pop_options

#if defined(__AVX512F__) || defined(KVSERVE_AVX2_LANES)
constexpr int64_t kWidth = sizeof(VecF) / sizeof(float);

// Each vector's butterflies between lanes 1, 2, 4 (and 8) apart: lane i takes x[i ^ L] + (+-1) x[i], a permute
// and an exact multiply-add.
inline void butterflies_in_vector(VecF* v, int64_t nv) {
#if defined(__AVX512F__)
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int L = 1; L < 16; L <<= 1) {
    const __m512i partner = _mm512_xor_si512(lane, _mm512_set1_epi32(L));
    const __mmask16 high = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(L));
    const __m512 sign = _mm512_mask_blend_ps(high, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
    for (int64_t i = 0; i < nv; ++i) v[i] = _mm512_fmadd_ps(v[i], sign, _mm512_permutexvar_ps(partner, v[i]));
  }
#else
  const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1), s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1),
               s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
  for (int64_t i = 0; i < nv; ++i) {
    __m256 x = _mm256_fmadd_ps(v[i], s1, _mm256_permute_ps(v[i], 0xB1));  // partner lanes 1 0 3 2
    x = _mm256_fmadd_ps(x, s2, _mm256_permute_ps(x, 0x4E));               // 2 3 0 1
    v[i] = _mm256_fmadd_ps(x, s4, _mm256_permute2f128_ps(x, x, 1));      // the other 128-bit half
  }
#endif
}

// One block of n (kWidth..256, a power of two) floats: the butterflies within each vector, then between whole
// vectors.
inline void hadamard_lanes(const float* in, float* out, int64_t n, float norm) {
  VecF v[256 / kWidth];
  const int64_t nv = n / kWidth;
  for (int64_t i = 0; i < nv; ++i) v[i] = vload(in + kWidth * i);
  butterflies_in_vector(v, nv);
  for (int64_t L = 1; L < nv; L <<= 1) {
    for (int64_t i = 0; i < nv; i += 2 * L) {
      for (int64_t j = i; j < i + L; ++j) {
        const VecF a = v[j], c = v[j + L];
        v[j] = vadd(a, c);
        v[j + L] = vsub(a, c);
      }
    }
  }
  const VecF s = vset(norm);
  for (int64_t i = 0; i < nv; ++i) vstore(out + kWidth * i, vmul(v[i], s));
}
#endif

// x [T, H, D] float32 (rows of D contiguous, heads D apart, tokens any stride: a view into the fused qkv)
// -> x R, contiguous: R the orthonormal Hadamard matrix of kvserve/kv_cache/rotation.py (blocks of n, the largest
// power of two dividing D, along the diagonal), by the fast Walsh-Hadamard transform (n log n adds per row
// instead of a D x D matmul: a quantized cache rotates q, k, v and the output of every layer).
torch::Tensor hadamard(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "hadamard: x must be float32 [T, H, D] with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), n = D & -D;
  auto out = torch::empty({T, H, D}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t s0 = x.stride(0);
  const float norm = 1.0f / std::sqrt(static_cast<float>(n));
#pragma omp parallel for schedule(static) if (T * H * D >= 16384)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float* y = dst + (t * H + h) * D;
      const float* in = src + t * s0 + h * D;
#if defined(__AVX512F__) || defined(KVSERVE_AVX2_LANES)
      if (n >= kWidth && n <= 256) {
        for (int64_t b0 = 0; b0 < D; b0 += n) hadamard_lanes(in + b0, y + b0, n, norm);
        continue;
      }
#endif
      for (int64_t d = 0; d < D; ++d) y[d] = in[d] * norm;
      for (int64_t b0 = 0; b0 < D; b0 += n) {
        float* z = y + b0;
        for (int64_t len = 1; len < n; len <<= 1) {
          for (int64_t i = 0; i < n; i += 2 * len) {
            for (int64_t j = i; j < i + len; ++j) {
              const float a = z[j], c = z[j + len];
              z[j] = a + c;
              z[j + len] = a - c;
            }
          }
        }
      }
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv_", &write_kv_, "write a step's K/V rows into a float32 or bfloat16 paged cache (in place)",
        py::arg("kv"), py::arg("slot_mapping"), py::arg("k"), py::arg("v"));
  m.def("hadamard", &hadamard, "x [T, H, D] float32 times the orthonormal Hadamard rotation over D", py::arg("x"));
  m.def("write_kv_quantized_", &write_kv_quantized_,
        "quantize a step's K/V rows into an int8 or fp8 paged cache with one scale per block (in place)",
        py::arg("values"), py::arg("scales"), py::arg("slot_mapping"), py::arg("k"), py::arg("v"));
  m.def("paged_attention", &paged_attention,
        "paged attention, decode and prefill (CPU; float32 queries, a float32, int8 or fp8 e4m3 cache; optional "
        "shared-prefix groups)",
        py::arg("q"), py::arg("kv"), py::arg("block_table"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("query_start") = py::none(), py::arg("kv_scales") = py::none(), py::arg("cascade_seqs") = py::none(),
        py::arg("cascade_starts") = py::none(), py::arg("cascade_blocks") = py::none(),
        py::arg("sliding_window") = 0, py::arg("soft_cap") = 0.0, py::arg("fixed_order") = false);
  // The decode kernel's name, kept for its callers: the same kernel.
  m.def("paged_decode_attention", &paged_attention, "alias of paged_attention", py::arg("q"), py::arg("kv"),
        py::arg("block_table"), py::arg("seq_lens"), py::arg("scale"), py::arg("query_start") = py::none(),
        py::arg("kv_scales") = py::none(), py::arg("cascade_seqs") = py::none(),
        py::arg("cascade_starts") = py::none(), py::arg("cascade_blocks") = py::none(),
        py::arg("sliding_window") = 0, py::arg("soft_cap") = 0.0, py::arg("fixed_order") = false);
}
