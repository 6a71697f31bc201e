// Helpers shared by the engine's CPU kernels (cpu_kernels.cpp, decode_attention.cpp, cpu_gemm.cpp): the dtype
// dispatch and row checks, fp32/bf16 loads and stores with torch's rounding (bf16: round to nearest even, NaN
// kept a NaN), a vectorizable exp, and AMX tile set-up where the CPU has tiles.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fleet_kernels {

using bf16 = c10::BFloat16;

// fp32 and bf16: the engine's compute dtypes on the CPU
#define FLOAT_OR_BF16(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const bf16* p, int64_t i) {
  uint32_t u = uint32_t(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, int64_t i, float f) { p[i] = f; }
inline void store(bf16* p, int64_t i, float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;   // round to nearest even, as torch's cast
  reinterpret_cast<uint16_t*>(p)[i] = (f != f) ? uint16_t(0x7FC0) : uint16_t(r);
}
// e^x from 2^(x log2 e): 2^round + a degree-6 polynomial on the rest (relative error ~1e-7, as a correctly
// rounded fp32 exp to within an ulp or two). Plain arithmetic, so loops over it vectorize (libm's expf does not
// without -ffast-math). x below -87.3 gives ~1e-38, not 0.
constexpr float EXP2_POLY[7] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f,
                                 2.4022651e-1f, 6.9314718e-1f, 1.0f};   // 2^f ~ sum c_k f^(6-k), |f| <= 1/2
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float t = x * 1.44269504089f;
  const float n = std::floor(t + 0.5f);
  const float f = t - n;
  float p = EXP2_POLY[0];
  for (int k = 1; k < 7; ++k) p = p * f + EXP2_POLY[k];
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// f rounded to T and back: the value a torch op storing T would leave.
template <typename T> inline float rnd(float f) { T b; store(&b, 0, f); return load(&b, 0); }

#if defined(__AVX512F__)
// 16 lanes of T as fp32, and back (bf16: round to nearest even, NaN kept a NaN, as torch's cast)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512i bf16_bits(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
}
inline void store16(float* p, __m512 f) { _mm512_storeu_ps(p, f); }
inline void store16(bf16* p, __m512 f) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(f)));
}
template <typename T> inline __m512 rnd16(__m512 f) { return f; }
template <> inline __m512 rnd16<bf16>(__m512 f) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(f), 16));
}
// fast_exp on 16 lanes
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
  for (int k = 1; k < 7; ++k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[k]));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX tiles (Xeons from Sapphire Rapids on): cpu_gemm.cpp's bf16 linear and decode attention's scores.
#define FLEET_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

struct TileConfig {   // the ldtilecfg memory layout (palette 1)
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out the 8 KB tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM); false where
// it says no (then the callers keep their AVX-512 paths).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Every tile 16 rows x 64 bytes (C tiles 0-3, A tiles 4-5, B tiles 6-7). The configuration is per thread and
// oneDNN sets its own, so each parallel region that uses tiles configures them first and releases them after.
inline void amx_configure() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}
#endif

}  // namespace fleet_kernels
