// bf16 linear layers for the engine's CPU steps: y = x W^T with W [N, K] bf16, x [M, K] bf16, y [M, N] bf16.
//
// A decode step multiplies every weight of the model by a few to a few dozen rows. oneDNN's bf16 GEMM is made
// for large M and, on CPUs without AMX, runs on vdpbf16ps, which some cores issue at half the rate of an fp32
// FMA (a 2-vCPU Xeon here: 1.2 G/s against 3.8 G/s). This kernel widens the bf16 weights to fp32 in registers
// (a shift and a mask: bf16 is fp32's upper half) and multiplies with fp32 FMAs, reading each weight once per
// six rows. Where the CPU has AMX, steps of more rows run on tiles instead (below), reading each weight once per
// 32 rows. Products and sums are fp32 (as oneDNN's); the output is rounded to bf16 as torch rounds. The model
// runner times it against oneDNN at start and keeps the faster (python_backends/engine/device.py).
//
// Weights are packed once: per block of 16 output columns, the K values of those columns in pairs,
// [ceil(N/16)][ceil(K/2)][16][2] (zero padded), so one 64-byte load gives 16 columns x 2 k and a block's
// weights are one contiguous run that the hardware prefetcher streams.
#include <ATen/Parallel.h>

#include "simd.h"

namespace fleet_kernels {
namespace {

constexpr int64_t COLS = 16;   // output columns per block: one zmm of fp32 accumulators
constexpr int64_t NB = 4;      // column blocks per micro-kernel call
constexpr int64_t MR = 6;      // rows per micro-kernel call: 6 x 4 accumulators + the widened weights fit 32 zmm

#if defined(__AVX512F__)
// 16 fp32 sums rounded to bf16 into y[0:min(16, left)) (a block's padding columns are not stored).
inline void store_cols(bf16* y, __m512 sums, int64_t left) {
  const __m256i out = _mm512_cvtepi32_epi16(bf16_bits(sums));
  if (left >= COLS)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), out);
  else if (left > 0)
    _mm256_mask_storeu_epi16(y, __mmask16((1u << left) - 1), out);
}

// y[0:R, 0:B*16) of one column group over all k pairs; x is fp32 [R, 2*kp] (zero padded to an even K).
template <int R, int B>
inline void micro(const float* x, int64_t ldx, const uint16_t* w, int64_t kp, bf16* y, int64_t ldy,
                  int64_t cols_left) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  const int64_t block = kp * COLS * 2;   // one column block's packed weights (uint16 elements)
  for (int64_t p = 0; p < kp; ++p) {
    for (int b = 0; b < B; ++b) {
      const uint16_t* src = w + b * block + p * COLS * 2;
      _mm_prefetch(reinterpret_cast<const char*>(src + 32 * COLS * 2), _MM_HINT_T0);
      const __m512i pair = _mm512_loadu_si512(src);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));   // W[col, 2p]
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pair, high));   // W[col, 2p + 1]
      for (int r = 0; r < R; ++r) {
        acc[r][b] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * p]), even, acc[r][b]);
        acc[r][b] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * p + 1]), odd, acc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) store_cols(y + r * ldy + b * COLS, acc[r][b], cols_left - b * COLS);
}

template <int B>
void micro_rows(int64_t rows, const float* x, int64_t ldx, const uint16_t* w, int64_t kp, bf16* y, int64_t ldy,
                int64_t cols_left) {
  switch (rows) {
    case 1: micro<1, B>(x, ldx, w, kp, y, ldy, cols_left); break;
    case 2: micro<2, B>(x, ldx, w, kp, y, ldy, cols_left); break;
    case 3: micro<3, B>(x, ldx, w, kp, y, ldy, cols_left); break;
    case 4: micro<4, B>(x, ldx, w, kp, y, ldy, cols_left); break;
    case 5: micro<5, B>(x, ldx, w, kp, y, ldy, cols_left); break;
    default: micro<6, B>(x, ldx, w, kp, y, ldy, cols_left); break;
  }
}

void group(int64_t blocks, int64_t rows, const float* x, int64_t ldx, const uint16_t* w, int64_t kp, bf16* y,
           int64_t ldy, int64_t cols_left) {
  switch (blocks) {
    case 1: micro_rows<1>(rows, x, ldx, w, kp, y, ldy, cols_left); break;
    case 2: micro_rows<2>(rows, x, ldx, w, kp, y, ldy, cols_left); break;
    case 3: micro_rows<3>(rows, x, ldx, w, kp, y, ldy, cols_left); break;
    default: micro_rows<4>(rows, x, ldx, w, kp, y, ldy, cols_left); break;
  }
}

#ifdef FLEET_AMX
// AMX tiles (Sapphire Rapids and later): one tdpbf16ps multiplies a 16 x 32 block of x by a 32 x 16 block of
// W, fp32 sums. The packed layout above is already AMX's B layout: 16 k pairs of one column block are one 1 KB
// tile at a 64-byte stride. Used for M >= AMX_MIN_ROWS, where the FMA path reads each weight once per six rows
// but AMX reads it once per 32 (a 32-row step's GEMMs at ~11 GB/s with oneDNN's AMX GEMM, see docs/engine.md).
constexpr int64_t AMX_MIN_ROWS = MR + 1;   // more rows than one FMA micro-kernel call: it would read W twice

// c[0:16*MT, 0:16*NT] (fp32, row stride 32) = x[0:16*MT, :] times NT column blocks of the packed weight.
template <int MT, int NT>
void amx_block(const bf16* x, int64_t ldx, const uint16_t* w, int64_t kp, float* c) {
  const int64_t block = kp * COLS * 2;
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  for (int64_t p = 0; p < kp; p += 16) {
    _tile_loadd(4, x + 2 * p, ldx * 2);
    _tile_loadd(6, w + p * COLS * 2, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) {
      _tile_loadd(7, w + block + p * COLS * 2, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MT == 2) {
      _tile_loadd(5, x + 16 * ldx + 2 * p, ldx * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 32 * 4);
  if constexpr (NT == 2) _tile_stored(1, c + 16, 32 * 4);
  if constexpr (MT == 2) _tile_stored(2, c + 16 * 32, 32 * 4);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, c + 16 * 32 + 16, 32 * 4);
}

// y = x W^T through AMX; x has a multiple of 16 rows (zero padded) of which the first `rows` are stored.
void amx_linear(const bf16* x, int64_t ldx, int64_t rows, const uint16_t* w, int64_t kp, int64_t blocks, bf16* y,
                int64_t n) {
  const int64_t padded = (rows + 15) / 16 * 16, block = kp * COLS * 2;
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t q0, int64_t q1) {
    amx_configure();
    alignas(64) float c[32 * 32];
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t b = 2 * q, col = b * COLS;
      const bool two_blocks = b + 1 < blocks;
      for (int64_t m = 0; m < padded; m += 32) {
        const bool two_tiles = m + 16 < padded;
        const bf16* xm = x + m * ldx;
        if (two_tiles && two_blocks) amx_block<2, 2>(xm, ldx, w + b * block, kp, c);
        else if (two_tiles) amx_block<2, 1>(xm, ldx, w + b * block, kp, c);
        else if (two_blocks) amx_block<1, 2>(xm, ldx, w + b * block, kp, c);
        else amx_block<1, 1>(xm, ldx, w + b * block, kp, c);
        for (int64_t r = 0; r < std::min<int64_t>(32, rows - m); ++r)
          for (int64_t t = 0; t < (two_blocks ? 2 : 1); ++t)
            store_cols(y + (m + r) * n + col + t * COLS, _mm512_load_ps(c + r * 32 + t * COLS), n - col - t * COLS);
      }
    }
    _tile_release();
  });
}
#endif
#else
// Portable loop (CPUs without AVX-512: the model runner's timing then keeps oneDNN).
void group(int64_t blocks, int64_t rows, const float* x, int64_t ldx, const uint16_t* w, int64_t kp, bf16* y,
           int64_t ldy, int64_t cols_left) {
  const int64_t block = kp * COLS * 2;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < std::min(blocks * COLS, cols_left); ++c) {
      const uint16_t* col = w + (c / COLS) * block + (c % COLS) * 2;
      float acc = 0.f;
      for (int64_t p = 0; p < kp; ++p) {
        acc += x[r * ldx + 2 * p] * load(reinterpret_cast<const bf16*>(col + p * COLS * 2), 0);
        acc += x[r * ldx + 2 * p + 1] * load(reinterpret_cast<const bf16*>(col + p * COLS * 2), 1);
      }
      store(y, r * ldy + c, acc);
    }
}
#endif

}  // namespace

// Whether linear_packed multiplies steps of AMX_MIN_ROWS or more rows on AMX tiles in this process.
bool amx_tiles() {
#ifdef FLEET_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// [N, K] bf16 -> the packed layout above.
torch::Tensor pack_linear_weight(torch::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "weight must be a 2-D bf16 CPU tensor");
  TORCH_CHECK(w.size(0) > 0 && w.size(1) > 0, "weight must not be empty");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + COLS - 1) / COLS, kp = (K + 1) / 2;
  auto out = torch::zeros({blocks, kp, COLS, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < std::min(COLS, N - b * COLS); ++c) {
        const uint16_t* row = src + (b * COLS + c) * K;
        uint16_t* col = dst + b * kp * COLS * 2 + c * 2;
        for (int64_t k = 0; k < K; ++k) col[(k / 2) * COLS * 2 + k % 2] = row[k];
      }
  });
  return out;
}

// x [M, K] bf16 times the packed weight of `n` output columns -> [M, n] bf16.
torch::Tensor linear_packed(torch::Tensor x, torch::Tensor packed, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a 2-D bf16 CPU tensor");
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == COLS && packed.size(3) == 2 && packed.is_contiguous(),
              "packed weight must come from pack_linear_weight");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), kp = packed.size(1);
  TORCH_CHECK(kp == (K + 1) / 2, "x has ", K, " columns; the packed weight was made for ", 2 * kp - 1, " or ", 2 * kp);
  TORCH_CHECK(n > (blocks - 1) * COLS && n <= blocks * COLS, "n = ", n, " does not match the packed weight's ",
              blocks, " column blocks");
  auto y = torch::empty({M, n}, x.options());
  if (M == 0) return y;
#ifdef FLEET_AMX
  if (M >= AMX_MIN_ROWS && K % 32 == 0 && amx_permitted()) {   // whole 32-k tiles of x (an odd K has none)
    // A tiles read 16 rows at a time: rows past M must exist (zeros), so a ragged x is copied once
    auto xa = (M % 16 == 0 && x.is_contiguous()) ? x : torch::zeros({(M + 15) / 16 * 16, K}, x.options());
    if (!xa.is_same(x)) xa.narrow(0, 0, M).copy_(x);
    amx_linear(xa.data_ptr<bf16>(), K, M, reinterpret_cast<const uint16_t*>(packed.data_ptr()), kp, blocks,
               y.data_ptr<bf16>(), n);
    return y;
  }
#endif
  // x widened once to fp32 (and to an even K) so the micro-kernel broadcasts fp32 values
  auto xf = torch::zeros({M, 2 * kp}, x.options().dtype(at::kFloat));
  xf.narrow(1, 0, K).copy_(x);
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  bf16* yp = y.data_ptr<bf16>();
  const int64_t ldx = 2 * kp, block = kp * COLS * 2;
  // threads split the column blocks (every row of a block on one thread: its weights are read once per MR rows)
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b += NB) {
      const int64_t nb = std::min(NB, b1 - b), col = b * COLS;
      for (int64_t m = 0; m < M; m += MR)
        group(nb, std::min(MR, M - m), xp + m * ldx, ldx, wp + b * block, kp, yp + m * n + col, n, n - col);
    }
  });
  return y;
}

}  // namespace fleet_kernels
