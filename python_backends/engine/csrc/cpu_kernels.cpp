// Fused CPU kernels for the engine's step (loaded by python_backends/engine/cpu_kernels.py; this file is the module,
// decode attention is in decode_attention.cpp, the bf16 linear in cpu_gemm.cpp).
//
// Each replaces several torch ops per layer with one pass over the rows: on a 2-core machine a 32-row step
// is ~1,400 small torch ops whose dispatch and OpenMP barriers cost as much as the arithmetic. The results
// follow the torch reference's roundings (each intermediate a torch op would store is rounded to the
// storage dtype), except attention, which keeps everything in fp32 until its output.
#include <ATen/Parallel.h>

#include <limits>
#include <vector>

#include "simd.h"

namespace {

using namespace fleet_kernels;

void check_norm_weight(const torch::Tensor& w, const torch::Tensor& x) {
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == x.scalar_type(), "w: [n] of x's dtype");
}

// ---------------------------------------------------------------- RMSNorm (optionally after a residual add)
template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) { const __m512 v = load16(x + j); acc = _mm512_fmadd_ps(v, v, acc); }
    const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / float(n) + eps));
    for (int64_t j = 0; j < n; j += 16)
      store16(out + j, _mm512_mul_ps(load16(w + j), rnd16<T>(_mm512_mul_ps(load16(x + j), r))));
    return;
  }
#endif
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) { float v = load(x, j); ss += v * v; }
  const float r = 1.f / std::sqrt(ss / float(n) + eps);
  for (int64_t j = 0; j < n; ++j) store(out, j, load(w, j) * rnd<T>(load(x, j) * r));
}

template <typename T>
void rms_impl(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) rms_row(xp + i * xs, wp, op + i * os, n, float(eps));
  });
}

// w * rms(x): x [rows, n], w [n] -> [rows, n]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "x");
  check_norm_weight(w, x);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  FLOAT_OR_BF16(x.scalar_type(), "rms_norm", [&] { rms_impl<scalar_t>(x, w, out, eps); });
  return out;
}

template <typename T>
void add_rms_impl(torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& w, torch::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* yp = y.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), ys = y.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      T* xr = xp + i * xs;
      const T* yr = yp + i * ys;
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + 16 <= n; j += 16) store16(xr + j, _mm512_add_ps(load16(xr + j), load16(yr + j)));
#endif
      for (; j < n; ++j) store(xr, j, load(xr, j) + load(yr, j));
      rms_row(xr, wp, op + i * os, n, float(eps));
    }
  });
}

// x += y (in place, rounded as torch's add), then w * rms(x)
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps) {
  check_rows(x, "x");
  check_rows(y, "y");
  TORCH_CHECK(x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type(), "x and y: same shape and dtype");
  check_norm_weight(w, x);
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  FLOAT_OR_BF16(x.scalar_type(), "add_rms_norm", [&] { add_rms_impl<scalar_t>(x, y, w, out, eps); });
  return out;
}

// ---------------------------------------------------------------- SiLU(gate) * up
template <typename T>
void silu_mul_impl(const torch::Tensor& gu, torch::Tensor& out) {
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs = gu.stride(0);
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* g = gp + i * gs;
      const T* u = g + inter;
      T* o = op + i * inter;
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + 16 <= inter; j += 16) {
        const __m512 a = load16(g + j);
        const __m512 silu = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
        store16(o + j, _mm512_mul_ps(rnd16<T>(silu), load16(u + j)));
      }
#endif
      for (; j < inter; ++j) {
        const float a = load(g, j);
        store(o, j, rnd<T>(a / (1.f + fast_exp(-a))) * load(u, j));
      }
    }
  });
}

// gu [rows, 2*inter] (gate then up) -> [rows, inter]
torch::Tensor silu_mul(torch::Tensor gu) {
  check_rows(gu, "gu");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gu: [rows, 2*inter]");
  auto out = torch::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  FLOAT_OR_BF16(gu.scalar_type(), "silu_mul", [&] { silu_mul_impl<scalar_t>(gu, out); });
  return out;
}

// ---------------------------------------------------------------- RoPE on q and k, new K/V into the pool
template <typename T>
void rope_write_kv_impl(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, const int64_t* pos,
                        torch::Tensor& k_cache, torch::Tensor& v_cache, const int64_t* slot, int64_t heads,
                        int64_t kv_heads) {
  const int64_t T_ = qkv.size(0), D = cos.size(1), S = k_cache.size(1);
  T* base = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t rs = qkv.stride(0), half = D / 2;
  at::parallel_for(0, T_, 4, [&](int64_t b, int64_t e) {
    float x[1024];
    for (int64_t t = b; t < e; ++t) {
      const T* c = cp + pos[t] * D;
      const T* s = sp + pos[t] * D;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* xh = base + t * rs + h * D;
        for (int64_t j = 0; j < D; ++j) x[j] = load(xh, j);
#pragma omp simd
        for (int64_t j = 0; j < half; ++j)   // x*cos + rotate_half(x)*sin, each product rounded as torch's
          store(xh, j, rnd<T>(x[j] * load(c, j)) + rnd<T>(-x[j + half] * load(s, j)));
#pragma omp simd
        for (int64_t j = half; j < D; ++j)
          store(xh, j, rnd<T>(x[j] * load(c, j)) + rnd<T>(x[j - half] * load(s, j)));
        if (h >= heads) std::memcpy(kc + ((h - heads) * S + slot[t]) * D, xh, D * sizeof(T));
      }
      for (int64_t g = 0; g < kv_heads; ++g)
        std::memcpy(vc + (g * S + slot[t]) * D, base + t * rs + (heads + kv_heads + g) * D, D * sizeof(T));
    }
  });
}

// qkv [T, (H + 2*KV) * D]: q and k heads rotated in place (HF's rotate_half layout, cos/sin [P, D] rows taken
// at each token's position); then each token's k and v heads are written at its slot of the pool
// k_cache / v_cache [KV, S, D] (one layer).
void rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                   torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, int64_t heads, int64_t kv_heads) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2, "cos, sin: contiguous [P, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
              k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache, v_cache: contiguous [KV, S, D], same shape and dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong, "positions, slots: int64");
  const int64_t T_ = qkv.size(0), D = cos.size(1), S = k_cache.size(1), P = cos.size(0);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * D && k_cache.size(2) == D && k_cache.size(0) == kv_heads,
              "qkv / cache shapes do not match heads, kv_heads and head_dim");
  TORCH_CHECK(D % 2 == 0 && D <= 1024, "head_dim must be even and at most 1024");
  TORCH_CHECK(positions.numel() == T_ && slots.numel() == T_, "one position and one slot per token");
  const auto positions_c = positions.contiguous(), slots_c = slots.contiguous();
  const int64_t* pos = positions_c.data_ptr<int64_t>();
  const int64_t* slot = slots_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " outside the RoPE table");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < S, "slot ", slot[t], " outside the KV pool");
  }
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && k_cache.scalar_type() == qkv.scalar_type(),
              "cos/sin and the caches must have qkv's dtype");
  FLOAT_OR_BF16(qkv.scalar_type(), "rope_write_kv", [&] {
    rope_write_kv_impl<scalar_t>(qkv, cos, sin, pos, k_cache, v_cache, slot, heads, kv_heads);
  });
}

// ---------------------------------------------------------------- greedy ids
// Index of each row's first maximum (a NaN counts as the maximum, as torch's max does), logits [R, V] -> int64 [R].
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t best = 0;
  float m = load(x, 0);
  if (m != m) return 0;
  int64_t j = 1;
#if defined(__AVX512F__)
  if (n >= 32) {
    __m512 mv = load16(x);
    __m512i iv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = _mm512_add_epi32(iv, _mm512_set1_epi32(16));
    const __m512i step = _mm512_set1_epi32(16);
    bool nan = _mm512_cmp_ps_mask(mv, mv, _CMP_UNORD_Q) != 0;
    for (j = 16; j + 16 <= n && !nan; j += 16) {
      const __m512 v = load16(x + j);
      nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
      const __mmask16 gt = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);   // strictly greater: the first maximum stays
      mv = _mm512_mask_mov_ps(mv, gt, v);
      iv = _mm512_mask_mov_epi32(iv, gt, cur);
      cur = _mm512_add_epi32(cur, step);
    }
    if (nan) {                       // rare: find the first NaN the way the scalar loop does
      for (int64_t i = 0; i < n; ++i) { const float v = load(x, i); if (v != v) return i; }
    }
    alignas(64) float vals[16];
    alignas(64) int32_t idx[16];
    _mm512_store_ps(vals, mv);
    _mm512_store_si512(reinterpret_cast<__m512i*>(idx), iv);
    m = vals[0];
    best = idx[0];
    for (int l = 1; l < 16; ++l)
      if (vals[l] > m || (vals[l] == m && idx[l] < best)) { m = vals[l]; best = idx[l]; }
  }
#endif
  for (; j < n; ++j) {
    const float v = load(x, j);
    if (v != v) return j;
    if (v > m) { m = v; best = j; }
  }
  return best;
}

template <typename T>
void argmax_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) op[i] = argmax_row(xp + i * xs, n);
  });
}

torch::Tensor argmax_rows(torch::Tensor x) {
  check_rows(x, "logits");
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) < (int64_t(1) << 31), "logits: 1 to 2^31 - 1 columns");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  FLOAT_OR_BF16(x.scalar_type(), "argmax_rows", [&] { argmax_impl<scalar_t>(x, out); });
  return out;
}

}  // namespace

namespace fleet_kernels {   // decode_attention.cpp, cpu_gemm.cpp
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_tables, torch::Tensor lens, int64_t block_size, double scale);
torch::Tensor pack_linear_weight(torch::Tensor w);
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t n);
bool amx_tiles();
}  // namespace fleet_kernels

// Every kernel lets go of the GIL while it runs, as torch's own ops do: the replica's courier thread builds and
// sends the step's responses in Python meanwhile (held, it made the stepping thread wait for the GIL between
// kernels: py-spy --gil on a served burst showed the GIL held in linear_packed most of the step).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "w * rms(x)", nogil);
  m.def("add_rms_norm", &add_rms_norm, "x += y in place, then w * rms(x)", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [rows, 2*inter]", nogil);
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q and k in place; k and v written into the pool", nogil);
  m.def("decode_attention", &fleet_kernels::decode_attention, "one-token-per-row attention over the pool's blocks in place", nogil);
  m.def("argmax_rows", &argmax_rows, "index of each row's first maximum (NaN first), as torch's max(dim=-1)", nogil);
  m.def("pack_linear_weight", &fleet_kernels::pack_linear_weight, "[N, K] bf16 weight -> linear_packed's layout", nogil);
  m.def("amx_tiles", &fleet_kernels::amx_tiles, "whether linear_packed and decode attention use AMX tiles here", nogil);
  m.def("linear_packed", &fleet_kernels::linear_packed, "x [M, K] bf16 times a packed weight's transpose -> [M, n]", nogil);
}
