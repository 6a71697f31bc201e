// Decode attention over the KV pool's blocks in place (loaded with the other fused kernels, cpu_kernels.cpp):
// one task per (decode row, KV head), whose query heads (GQA) read each of the row's keys and values once,
// straight from its blocks up to its own length - no gather, no padding. Scores and softmax in fp32; in bf16
// on a CPU with AMX the scores of 16 keys come from one tile product, elsewhere from AVX-512 dot products (a
// portable loop without AVX-512).
#include <ATen/Parallel.h>

#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace fleet_kernels {
namespace {

// Each of the G rows of scores [G, n] softmaxed in place, in fp32.
inline void softmax_rows(float* scores, int64_t n, int64_t G) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    float m = -std::numeric_limits<float>::infinity();
    float sum = 0.f;
    int64_t t = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(m);
    for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + t));
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; t < n; ++t) m = std::max(m, sg[t]);
    t = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    mv = _mm512_set1_ps(m);
    for (; t + 16 <= n; t += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mv));
      _mm512_storeu_ps(sg + t, e);
      acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; t < n; ++t) { sg[t] = fast_exp(sg[t] - m); sum += sg[t]; }
    const float inv = 1.f / sum;
    t = 0;
#if defined(__AVX512F__)
    const __m512 iv = _mm512_set1_ps(inv);
    for (; t + 16 <= n; t += 16) _mm512_storeu_ps(sg + t, _mm512_mul_ps(_mm512_loadu_ps(sg + t), iv));
#endif
    for (; t < n; ++t) sg[t] *= inv;
  }
}

#if defined(__AVX512F__)
// Prefetch row `r` of block table[i] (i < 0: nothing), all of its cache lines.
template <typename T>
inline void prefetch_row(const T* base, const int64_t* table, int64_t i, int64_t r, int64_t bs, int64_t D) {
  if (i < 0) return;
  const char* p = reinterpret_cast<const char*>(base + (table[i] * bs + r) * D);
  for (int64_t off = 0; off < int64_t(D * sizeof(T)); off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// acc[g] = sum_t scores[g][t] v_t for the G heads of one task, D = 16*C. Keys outer: each value row is read and
// widened once per GS heads, whose accumulators stay in registers (GS * C <= 24 of the 32 zmm).
template <typename T, int C, int GS>
void weighted_values_group(const float* scores, int64_t n, const T* vbase, const int64_t* table, int64_t bs,
                           int64_t g0, float* acc) {
  constexpr int64_t D = 16 * C;
  __m512 o[GS][C];
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < C; ++c) o[g][c] = _mm512_setzero_ps();
  const int64_t last_block = (n - 1) / bs;
  for (int64_t blk = 0, t0 = 0; blk <= last_block; ++blk, t0 += bs) {   // no division per key
    const T* vb = vbase + table[blk] * bs * D;
    const int64_t rows = std::min(bs, n - t0);
    for (int64_t r = 0; r < rows; ++r) {
      if (g0 == 0) prefetch_row(vbase, table, blk + 1 <= last_block ? blk + 1 : -1, r, bs, D);
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load16(vb + r * D + 16 * c);
      for (int g = 0; g < GS; ++g) {
        const __m512 p = _mm512_set1_ps(scores[(g0 + g) * n + t0 + r]);
        for (int c = 0; c < C; ++c) o[g][c] = _mm512_fmadd_ps(p, vv[c], o[g][c]);
      }
    }
  }
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (g0 + g) * D + 16 * c, o[g][c]);
}

template <typename T, int C, int GS = 24 / C>
void weighted_values_heads(int64_t heads, const float* scores, int64_t n, const T* vbase, const int64_t* table,
                           int64_t bs, int64_t g0, float* acc) {
  if constexpr (GS > 1) {
    if (heads < GS) return weighted_values_heads<T, C, GS - 1>(heads, scores, n, vbase, table, bs, g0, acc);
  }
  weighted_values_group<T, C, GS>(scores, n, vbase, table, bs, g0, acc);
}

template <typename T, int C>
void weighted_values(const float* scores, int64_t n, int64_t G, const T* vbase, const int64_t* table, int64_t bs,
                     float* acc) {
  constexpr int64_t most = 24 / C;
  for (int64_t g0 = 0; g0 < G; g0 += most)
    weighted_values_heads<T, C>(std::min(most, G - g0), scores, n, vbase, table, bs, g0, acc);
}

#ifdef FLEET_AMX
// scores[g][t] = scale * q_g . k_t for the G <= 16 query heads of one task (bf16, D = 16*C), 16 keys per tile
// product: 16 key rows as they lie in a block are an A tile (block_size a multiple of 16), the heads' q rows
// laid out in k pairs (AMX's B layout, zero past G) the B tile; the 16 x 16 fp32 result holds the G columns used.
template <int C>
void amx_scores(const bf16* q, int64_t G, const bf16* kbase, const bf16* vbase, const int64_t* table, int64_t n,
                int64_t bs, float scale, float* scores) {
  constexpr int64_t D = 16 * C, CH = D / 32;
  alignas(64) uint16_t qt[CH][16][16][2] = {};
  const uint16_t* qs = reinterpret_cast<const uint16_t*>(q);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qt[d / 32][(d % 32) / 2][g][d % 2] = qs[g * D + d];
  alignas(64) float tile[16 * 16];
  const int64_t last_block = (n - 1) / bs;
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t blk = t0 / bs, r0 = t0 % bs;
    const bf16* k = kbase + (table[blk] * bs + r0) * D;
    for (int64_t r = r0; r < r0 + 16; ++r) {   // the next block's keys and these values, as attend_avx512
      prefetch_row(kbase, table, blk + 1 <= last_block ? blk + 1 : -1, r, bs, D);
      prefetch_row(vbase, table, blk, r, bs, D);
    }
    _tile_zero(0);
    for (int64_t c = 0; c < CH; ++c) {
      _tile_loadd(4, k + 32 * c, D * 2);
      _tile_loadd(6, qt[c], 64);
      _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, tile, 64);
    for (int64_t t = 0; t < std::min<int64_t>(16, n - t0); ++t)
      for (int64_t g = 0; g < G; ++g) scores[g * n + t0 + t] = tile[t * 16 + g] * scale;
  }
}
#endif

// One (row, KV head) task with head_dim = 16*C, AVX-512: each key row is converted to fp32 once and dotted
// with the G query heads; each value row is converted once and added into the G accumulators.
template <typename T, int C>
void attend_avx512(const float* qf, const T* kbase, const T* vbase, const int64_t* table, int64_t n, int64_t bs,
                   int64_t G, float* scores, float* acc) {
  constexpr int64_t D = 16 * C;
  // The pool is cold by the time a layer reads it (each step streams all weights through the caches): fetch
  // the next block's rows while this block's are used, K during the scores and V ahead of the sums.
  const int64_t last_block = (n - 1) / bs;
  for (int64_t t = 0; t < n; ++t) {
    const T* k = kbase + (table[t / bs] * bs + t % bs) * D;
    prefetch_row(kbase, table, t / bs + 1 <= last_block ? t / bs + 1 : -1, t % bs, bs, D);
    prefetch_row(vbase, table, t / bs <= last_block ? t / bs : -1, t % bs, bs, D);
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load16(k + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
      for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], s);
      scores[g * n + t] = _mm512_reduce_add_ps(s);
    }
  }
  softmax_rows(scores, n, G);
  weighted_values<T, C>(scores, n, G, vbase, table, bs, acc);
}

#ifdef FLEET_AMX
// The same task in bf16 with the scores from AMX tiles (q as stored, unscaled: the scale is applied to the sums).
template <int C>
void attend_amx(const bf16* q, const bf16* kbase, const bf16* vbase, const int64_t* table, int64_t n, int64_t bs,
                int64_t G, float scale, float* scores, float* acc) {
  amx_scores<C>(q, G, kbase, vbase, table, n, bs, scale, scores);
  softmax_rows(scores, n, G);
  weighted_values<bf16, C>(scores, n, G, vbase, table, bs, acc);
}
#endif
#endif

// Portable version of the same task (any head_dim; what GCC vectorises itself).
template <typename T>
void attend_generic(const float* qf, const T* kbase, const T* vbase, const int64_t* table, int64_t n, int64_t bs,
                    int64_t G, int64_t D, float* scores, float* acc, float* row) {
  for (int64_t t = 0; t < n; ++t) {
    const T* k = kbase + (table[t / bs] * bs + t % bs) * D;
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) row[j] = load(k, j);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < D; ++j) s += qg[j] * row[j];
      scores[g * n + t] = s;
    }
  }
  softmax_rows(scores, n, G);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const T* v = vbase + (table[t / bs] * bs + t % bs) * D;
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) row[j] = load(v, j);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + t];
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) ag[j] += p * row[j];
    }
  }
}

// q [B, H*D] (rows may be strided: a view of qkv), k_cache / v_cache [KV, S, D] (one layer), block_tables
// [B, W] int64, lens [B] int64 (keys per row, the new token's included) -> [B, H*D]. One task per (row,
// KV head): its H/KV query heads (GQA) read each key and value once, straight from the row's blocks.
template <typename T>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const int64_t* tables, int64_t W, const int64_t* lens, int64_t bs, float scale,
                           torch::Tensor& out) {
  const int64_t B = q.size(0), KV = k_cache.size(0), S = k_cache.size(1), D = k_cache.size(2);
  const int64_t H = q.size(1) / D, G = H / KV;
  const T* qp = q.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs = q.stride(0);
  bool amx = false;   // bf16 scores on AMX tiles: 16 keys of a block per tile product
#ifdef FLEET_AMX
  if constexpr (std::is_same_v<T, bf16>) amx = bs % 16 == 0 && G <= 16 && (D == 64 || D == 128) && amx_permitted();
#endif
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), row(D), scores;
#ifdef FLEET_AMX
    if (amx) amx_configure();
#endif
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KV, g0 = task % KV, n = lens[b];
      const int64_t* table = tables + b * W;
      scores.resize(G * n);
      const T* qrow = qp + b * qs + g0 * G * D;
      const T* kbase = kc + g0 * S * D;
      const T* vbase = vc + g0 * S * D;
      bool attended = false;
#ifdef FLEET_AMX
      if constexpr (std::is_same_v<T, bf16>) {
        if (amx) {
          if (D == 64) attend_amx<4>(qrow, kbase, vbase, table, n, bs, G, scale, scores.data(), acc.data());
          else attend_amx<8>(qrow, kbase, vbase, table, n, bs, G, scale, scores.data(), acc.data());
          attended = true;
        }
      }
#endif
      if (!attended) {
        for (int64_t j = 0; j < G * D; ++j) qf[j] = load(qrow, j) * scale;
#if defined(__AVX512F__)
        if (D == 64)
          attend_avx512<T, 4>(qf.data(), kbase, vbase, table, n, bs, G, scores.data(), acc.data());
        else if (D == 128)
          attend_avx512<T, 8>(qf.data(), kbase, vbase, table, n, bs, G, scores.data(), acc.data());
        else
#endif
          attend_generic<T>(qf.data(), kbase, vbase, table, n, bs, G, D, scores.data(), acc.data(), row.data());
      }
      T* o = op + b * H * D + g0 * G * D;
      for (int64_t j = 0; j < G * D; ++j) store(o, j, acc[j]);
    }
#ifdef FLEET_AMX
    if (amx) _tile_release();
#endif
  });
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor lens, int64_t block_size, double scale) {
  check_rows(q, "q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
              k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache, v_cache: contiguous [KV, S, D], same shape and dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables: contiguous int64 [B, W]");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.numel() == q.size(0), "lens: int64, one per row");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the caches: same dtype");
  const int64_t B = q.size(0), KV = k_cache.size(0), S = k_cache.size(1), D = k_cache.size(2);
  const int64_t W = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == B, "block_tables: one row per query row");
  TORCH_CHECK(q.size(1) % (KV * D) == 0, "q's width must be a multiple of kv_heads * head_dim (whole GQA groups)");
  auto lens_c = lens.contiguous();
  const int64_t* ln = lens_c.data_ptr<int64_t>();
  const int64_t* tb = block_tables.data_ptr<int64_t>();
  const int64_t blocks_in_pool = S / block_size;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= W * block_size, "row ", b, ": length ", ln[b], " outside its block table");
    for (int64_t i = 0; i < (ln[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tb[b * W + i] >= 0 && tb[b * W + i] < blocks_in_pool, "row ", b, ": block id outside the pool");
  }
  auto out = torch::empty({B, q.size(1)}, q.options());
  FLOAT_OR_BF16(q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, k_cache, v_cache, tb, W, ln, block_size, float(scale), out);
  });
  return out;
}

}  // namespace fleet_kernels
