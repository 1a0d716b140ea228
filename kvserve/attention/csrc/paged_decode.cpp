// Paged decode attention for CPU: one query token per sequence, K/V read in place through the block
// table (no gathered copy of the context). Each K/V row is read once for its whole group of query
// heads (GQA).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q,            // [B, Hq, D] float32, contiguous
                                     torch::Tensor kv,           // [num_blocks, block_size, 2, Hkv, D]
                                     torch::Tensor block_table,  // [B, max_blocks] int64
                                     torch::Tensor seq_lens,     // [B] int64
                                     double scale) {
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && block_table.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && kv.scalar_type() == torch::kFloat32, "float32 only");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = kv.size(1), Hkv = kv.size(3);
  const int64_t G = Hq / Hkv;
  const int64_t MB = block_table.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kvp = kv.data_ptr<float>();
  const int64_t* bt = block_table.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t slot_stride = 2 * Hkv * D;
  const int64_t block_stride = BS * slot_stride;
  const float fscale = static_cast<float>(scale);

  // NOTE: one task per sequence, covering all KV heads: a token's K (and V) for every head sit side by side
  // in its slot, so each slot is streamed once, whole, instead of once per head.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = sl[b];
    std::vector<float> scores(Hq * L);
    std::vector<float> acc(Hq * D, 0.0f);
    const float* qb = qp + b * Hq * D;
    const int64_t* table = bt + b * MB;
    for (int64_t t = 0; t < L; ++t) {
      const float* slot = kvp + table[t / BS] * block_stride + (t % BS) * slot_stride;
      for (int64_t h = 0; h < Hkv; ++h) {
        const float* k = slot + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qh = qb + (h * G + g) * D;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * k[d];
          scores[(h * G + g) * L + t] = s * fscale;
        }
      }
    }
    for (int64_t i = 0; i < Hq; ++i) {
      float* si = scores.data() + i * L;
      float m = -INFINITY;
      for (int64_t t = 0; t < L; ++t) m = std::max(m, si[t]);
      float sum = 0.0f;
      for (int64_t t = 0; t < L; ++t) {
        si[t] = std::exp(si[t] - m);
        sum += si[t];
      }
      const float inv = 1.0f / sum;
      for (int64_t t = 0; t < L; ++t) si[t] *= inv;
    }
    for (int64_t t = 0; t < L; ++t) {
      const float* vslot = kvp + table[t / BS] * block_stride + (t % BS) * slot_stride + Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h) {
        const float* v = vslot + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[(h * G + g) * L + t];
          float* a = acc.data() + (h * G + g) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
        }
      }
    }
    std::copy(acc.begin(), acc.end(), op + b * Hq * D);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
