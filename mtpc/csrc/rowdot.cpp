// Row-vector products for decoding on x86 CPUs with AVX2 + FMA: y = x W^T (+ b), x and y float32,
// W float32 or bfloat16 *storage* (widened exactly to float32 as it is loaded; the arithmetic is
// float32 either way, so a W of bf16 numbers gives the same bits from either storage, reading half
// the bytes from bf16).
//
// Built on first use by mtpc/kernels.py (torch.utils.cpp_extension, -O3 -mavx2 -mfma; bound in
// module.cpp) and used by
// the compact engine's "rowdot" weight layout and the head decoder. W stays in its (out, in)
// row-major layout; x is (M, in) with M the rows of one call (1 for the plain step, n for the
// verify of n bytes).
//
// The bits of a row do not depend on M: every output (m, o) accumulates in one 8-lane register,
// lane l taking i = l, l + 8, ... in order, then a fixed horizontal sum, the tail (in % 8) in order
// and the bias. The tiling (how many rows and outputs share a pass) only changes which products
// run side by side, never a row's arithmetic. So a verify row equals the step's row exactly.
//
// Speed: per block of 48 outputs (48 rows of W stay in L2) the rows go through in tiles of 4, 3, 2
// or 1 with 3, 3, 4 or 8 outputs each, so a tile keeps 8-12 accumulators in registers and reuses
// each loaded W vector for every row of the tile; each tile prefetches the next tile's rows of W at
// the offset it reads (a prefetch past the end of W is a hint that never faults). The tiles are
// written out (not loops over arrays of __m256, whose may_alias type makes GCC store the
// accumulators on every iteration).

#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <torch/extension.h>

static inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                  // l0+l4, l1+l5, l2+l6, l3+l7
  __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// W as float32, or as bfloat16 storage (the top 16 bits of a float32, read as uint16): widened
// exactly, so a bf16-stored W whose values are bf16 numbers gives the float32 W's bits
static inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
static inline __m256 load8(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float to_f32(float v) { return v; }
static inline float to_f32(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename WT>
static inline float finish(__m256 acc, const float* x, const WT* w, int64_t k8, int64_t K, const float* b) {
  float s = hsum(acc);
  for (int64_t i = k8; i < K; ++i) s = std::fma(x[i], to_f32(w[i]), s);  // one rounding, whatever -ffp-contract
  return b ? s + *b : s;
}

// tile_RxC: R rows of x times C consecutive rows of W (C outputs), K inputs
template <typename WT>
static inline void tile_1x8(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t K,
                            float* __restrict y, int64_t ldy, const float* __restrict b) {
  __m256 a00 = _mm256_setzero_ps();
  __m256 a01 = _mm256_setzero_ps();
  __m256 a02 = _mm256_setzero_ps();
  __m256 a03 = _mm256_setzero_ps();
  __m256 a04 = _mm256_setzero_ps();
  __m256 a05 = _mm256_setzero_ps();
  __m256 a06 = _mm256_setzero_ps();
  __m256 a07 = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t i = 0; i < k8; i += 8) {
    _mm_prefetch((const char*)(w + (8 + 0) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (8 + 1) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (8 + 2) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (8 + 3) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (8 + 4) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (8 + 5) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (8 + 6) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (8 + 7) * K + i), _MM_HINT_T0);
    const __m256 w0 = load8(w + 0 * K + i);
    const __m256 w1 = load8(w + 1 * K + i);
    const __m256 w2 = load8(w + 2 * K + i);
    const __m256 w3 = load8(w + 3 * K + i);
    const __m256 w4 = load8(w + 4 * K + i);
    const __m256 w5 = load8(w + 5 * K + i);
    const __m256 w6 = load8(w + 6 * K + i);
    const __m256 w7 = load8(w + 7 * K + i);
    { const __m256 xv = _mm256_loadu_ps(x + 0 * ldx + i);
      a00 = _mm256_fmadd_ps(xv, w0, a00);
      a01 = _mm256_fmadd_ps(xv, w1, a01);
      a02 = _mm256_fmadd_ps(xv, w2, a02);
      a03 = _mm256_fmadd_ps(xv, w3, a03);
      a04 = _mm256_fmadd_ps(xv, w4, a04);
      a05 = _mm256_fmadd_ps(xv, w5, a05);
      a06 = _mm256_fmadd_ps(xv, w6, a06);
      a07 = _mm256_fmadd_ps(xv, w7, a07);
    }
  }
  y[0 * ldy + 0] = finish(a00, x + 0 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[0 * ldy + 1] = finish(a01, x + 0 * ldx, w + 1 * K, k8, K, b ? b + 1 : nullptr);
  y[0 * ldy + 2] = finish(a02, x + 0 * ldx, w + 2 * K, k8, K, b ? b + 2 : nullptr);
  y[0 * ldy + 3] = finish(a03, x + 0 * ldx, w + 3 * K, k8, K, b ? b + 3 : nullptr);
  y[0 * ldy + 4] = finish(a04, x + 0 * ldx, w + 4 * K, k8, K, b ? b + 4 : nullptr);
  y[0 * ldy + 5] = finish(a05, x + 0 * ldx, w + 5 * K, k8, K, b ? b + 5 : nullptr);
  y[0 * ldy + 6] = finish(a06, x + 0 * ldx, w + 6 * K, k8, K, b ? b + 6 : nullptr);
  y[0 * ldy + 7] = finish(a07, x + 0 * ldx, w + 7 * K, k8, K, b ? b + 7 : nullptr);
}

template <typename WT>
static inline void tile_1x1(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t K,
                            float* __restrict y, int64_t ldy, const float* __restrict b) {
  __m256 a00 = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t i = 0; i < k8; i += 8) {
    _mm_prefetch((const char*)(w + (1 + 0) * K + i), _MM_HINT_T0);
    const __m256 w0 = load8(w + 0 * K + i);
    { const __m256 xv = _mm256_loadu_ps(x + 0 * ldx + i);
      a00 = _mm256_fmadd_ps(xv, w0, a00);
    }
  }
  y[0 * ldy + 0] = finish(a00, x + 0 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
}

template <typename WT>
static inline void tile_2x4(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t K,
                            float* __restrict y, int64_t ldy, const float* __restrict b) {
  __m256 a00 = _mm256_setzero_ps();
  __m256 a01 = _mm256_setzero_ps();
  __m256 a02 = _mm256_setzero_ps();
  __m256 a03 = _mm256_setzero_ps();
  __m256 a10 = _mm256_setzero_ps();
  __m256 a11 = _mm256_setzero_ps();
  __m256 a12 = _mm256_setzero_ps();
  __m256 a13 = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t i = 0; i < k8; i += 8) {
    _mm_prefetch((const char*)(w + (4 + 0) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (4 + 1) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (4 + 2) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (4 + 3) * K + i), _MM_HINT_T0);
    const __m256 w0 = load8(w + 0 * K + i);
    const __m256 w1 = load8(w + 1 * K + i);
    const __m256 w2 = load8(w + 2 * K + i);
    const __m256 w3 = load8(w + 3 * K + i);
    { const __m256 xv = _mm256_loadu_ps(x + 0 * ldx + i);
      a00 = _mm256_fmadd_ps(xv, w0, a00);
      a01 = _mm256_fmadd_ps(xv, w1, a01);
      a02 = _mm256_fmadd_ps(xv, w2, a02);
      a03 = _mm256_fmadd_ps(xv, w3, a03);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 1 * ldx + i);
      a10 = _mm256_fmadd_ps(xv, w0, a10);
      a11 = _mm256_fmadd_ps(xv, w1, a11);
      a12 = _mm256_fmadd_ps(xv, w2, a12);
      a13 = _mm256_fmadd_ps(xv, w3, a13);
    }
  }
  y[0 * ldy + 0] = finish(a00, x + 0 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[0 * ldy + 1] = finish(a01, x + 0 * ldx, w + 1 * K, k8, K, b ? b + 1 : nullptr);
  y[0 * ldy + 2] = finish(a02, x + 0 * ldx, w + 2 * K, k8, K, b ? b + 2 : nullptr);
  y[0 * ldy + 3] = finish(a03, x + 0 * ldx, w + 3 * K, k8, K, b ? b + 3 : nullptr);
  y[1 * ldy + 0] = finish(a10, x + 1 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[1 * ldy + 1] = finish(a11, x + 1 * ldx, w + 1 * K, k8, K, b ? b + 1 : nullptr);
  y[1 * ldy + 2] = finish(a12, x + 1 * ldx, w + 2 * K, k8, K, b ? b + 2 : nullptr);
  y[1 * ldy + 3] = finish(a13, x + 1 * ldx, w + 3 * K, k8, K, b ? b + 3 : nullptr);
}

template <typename WT>
static inline void tile_2x1(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t K,
                            float* __restrict y, int64_t ldy, const float* __restrict b) {
  __m256 a00 = _mm256_setzero_ps();
  __m256 a10 = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t i = 0; i < k8; i += 8) {
    _mm_prefetch((const char*)(w + (1 + 0) * K + i), _MM_HINT_T0);
    const __m256 w0 = load8(w + 0 * K + i);
    { const __m256 xv = _mm256_loadu_ps(x + 0 * ldx + i);
      a00 = _mm256_fmadd_ps(xv, w0, a00);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 1 * ldx + i);
      a10 = _mm256_fmadd_ps(xv, w0, a10);
    }
  }
  y[0 * ldy + 0] = finish(a00, x + 0 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[1 * ldy + 0] = finish(a10, x + 1 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
}

template <typename WT>
static inline void tile_3x3(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t K,
                            float* __restrict y, int64_t ldy, const float* __restrict b) {
  __m256 a00 = _mm256_setzero_ps();
  __m256 a01 = _mm256_setzero_ps();
  __m256 a02 = _mm256_setzero_ps();
  __m256 a10 = _mm256_setzero_ps();
  __m256 a11 = _mm256_setzero_ps();
  __m256 a12 = _mm256_setzero_ps();
  __m256 a20 = _mm256_setzero_ps();
  __m256 a21 = _mm256_setzero_ps();
  __m256 a22 = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t i = 0; i < k8; i += 8) {
    _mm_prefetch((const char*)(w + (3 + 0) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (3 + 1) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (3 + 2) * K + i), _MM_HINT_T0);
    const __m256 w0 = load8(w + 0 * K + i);
    const __m256 w1 = load8(w + 1 * K + i);
    const __m256 w2 = load8(w + 2 * K + i);
    { const __m256 xv = _mm256_loadu_ps(x + 0 * ldx + i);
      a00 = _mm256_fmadd_ps(xv, w0, a00);
      a01 = _mm256_fmadd_ps(xv, w1, a01);
      a02 = _mm256_fmadd_ps(xv, w2, a02);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 1 * ldx + i);
      a10 = _mm256_fmadd_ps(xv, w0, a10);
      a11 = _mm256_fmadd_ps(xv, w1, a11);
      a12 = _mm256_fmadd_ps(xv, w2, a12);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 2 * ldx + i);
      a20 = _mm256_fmadd_ps(xv, w0, a20);
      a21 = _mm256_fmadd_ps(xv, w1, a21);
      a22 = _mm256_fmadd_ps(xv, w2, a22);
    }
  }
  y[0 * ldy + 0] = finish(a00, x + 0 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[0 * ldy + 1] = finish(a01, x + 0 * ldx, w + 1 * K, k8, K, b ? b + 1 : nullptr);
  y[0 * ldy + 2] = finish(a02, x + 0 * ldx, w + 2 * K, k8, K, b ? b + 2 : nullptr);
  y[1 * ldy + 0] = finish(a10, x + 1 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[1 * ldy + 1] = finish(a11, x + 1 * ldx, w + 1 * K, k8, K, b ? b + 1 : nullptr);
  y[1 * ldy + 2] = finish(a12, x + 1 * ldx, w + 2 * K, k8, K, b ? b + 2 : nullptr);
  y[2 * ldy + 0] = finish(a20, x + 2 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[2 * ldy + 1] = finish(a21, x + 2 * ldx, w + 1 * K, k8, K, b ? b + 1 : nullptr);
  y[2 * ldy + 2] = finish(a22, x + 2 * ldx, w + 2 * K, k8, K, b ? b + 2 : nullptr);
}

template <typename WT>
static inline void tile_3x1(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t K,
                            float* __restrict y, int64_t ldy, const float* __restrict b) {
  __m256 a00 = _mm256_setzero_ps();
  __m256 a10 = _mm256_setzero_ps();
  __m256 a20 = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t i = 0; i < k8; i += 8) {
    _mm_prefetch((const char*)(w + (1 + 0) * K + i), _MM_HINT_T0);
    const __m256 w0 = load8(w + 0 * K + i);
    { const __m256 xv = _mm256_loadu_ps(x + 0 * ldx + i);
      a00 = _mm256_fmadd_ps(xv, w0, a00);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 1 * ldx + i);
      a10 = _mm256_fmadd_ps(xv, w0, a10);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 2 * ldx + i);
      a20 = _mm256_fmadd_ps(xv, w0, a20);
    }
  }
  y[0 * ldy + 0] = finish(a00, x + 0 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[1 * ldy + 0] = finish(a10, x + 1 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[2 * ldy + 0] = finish(a20, x + 2 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
}

template <typename WT>
static inline void tile_4x3(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t K,
                            float* __restrict y, int64_t ldy, const float* __restrict b) {
  __m256 a00 = _mm256_setzero_ps();
  __m256 a01 = _mm256_setzero_ps();
  __m256 a02 = _mm256_setzero_ps();
  __m256 a10 = _mm256_setzero_ps();
  __m256 a11 = _mm256_setzero_ps();
  __m256 a12 = _mm256_setzero_ps();
  __m256 a20 = _mm256_setzero_ps();
  __m256 a21 = _mm256_setzero_ps();
  __m256 a22 = _mm256_setzero_ps();
  __m256 a30 = _mm256_setzero_ps();
  __m256 a31 = _mm256_setzero_ps();
  __m256 a32 = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t i = 0; i < k8; i += 8) {
    _mm_prefetch((const char*)(w + (3 + 0) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (3 + 1) * K + i), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + (3 + 2) * K + i), _MM_HINT_T0);
    const __m256 w0 = load8(w + 0 * K + i);
    const __m256 w1 = load8(w + 1 * K + i);
    const __m256 w2 = load8(w + 2 * K + i);
    { const __m256 xv = _mm256_loadu_ps(x + 0 * ldx + i);
      a00 = _mm256_fmadd_ps(xv, w0, a00);
      a01 = _mm256_fmadd_ps(xv, w1, a01);
      a02 = _mm256_fmadd_ps(xv, w2, a02);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 1 * ldx + i);
      a10 = _mm256_fmadd_ps(xv, w0, a10);
      a11 = _mm256_fmadd_ps(xv, w1, a11);
      a12 = _mm256_fmadd_ps(xv, w2, a12);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 2 * ldx + i);
      a20 = _mm256_fmadd_ps(xv, w0, a20);
      a21 = _mm256_fmadd_ps(xv, w1, a21);
      a22 = _mm256_fmadd_ps(xv, w2, a22);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 3 * ldx + i);
      a30 = _mm256_fmadd_ps(xv, w0, a30);
      a31 = _mm256_fmadd_ps(xv, w1, a31);
      a32 = _mm256_fmadd_ps(xv, w2, a32);
    }
  }
  y[0 * ldy + 0] = finish(a00, x + 0 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[0 * ldy + 1] = finish(a01, x + 0 * ldx, w + 1 * K, k8, K, b ? b + 1 : nullptr);
  y[0 * ldy + 2] = finish(a02, x + 0 * ldx, w + 2 * K, k8, K, b ? b + 2 : nullptr);
  y[1 * ldy + 0] = finish(a10, x + 1 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[1 * ldy + 1] = finish(a11, x + 1 * ldx, w + 1 * K, k8, K, b ? b + 1 : nullptr);
  y[1 * ldy + 2] = finish(a12, x + 1 * ldx, w + 2 * K, k8, K, b ? b + 2 : nullptr);
  y[2 * ldy + 0] = finish(a20, x + 2 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[2 * ldy + 1] = finish(a21, x + 2 * ldx, w + 1 * K, k8, K, b ? b + 1 : nullptr);
  y[2 * ldy + 2] = finish(a22, x + 2 * ldx, w + 2 * K, k8, K, b ? b + 2 : nullptr);
  y[3 * ldy + 0] = finish(a30, x + 3 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[3 * ldy + 1] = finish(a31, x + 3 * ldx, w + 1 * K, k8, K, b ? b + 1 : nullptr);
  y[3 * ldy + 2] = finish(a32, x + 3 * ldx, w + 2 * K, k8, K, b ? b + 2 : nullptr);
}

template <typename WT>
static inline void tile_4x1(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t K,
                            float* __restrict y, int64_t ldy, const float* __restrict b) {
  __m256 a00 = _mm256_setzero_ps();
  __m256 a10 = _mm256_setzero_ps();
  __m256 a20 = _mm256_setzero_ps();
  __m256 a30 = _mm256_setzero_ps();
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t i = 0; i < k8; i += 8) {
    _mm_prefetch((const char*)(w + (1 + 0) * K + i), _MM_HINT_T0);
    const __m256 w0 = load8(w + 0 * K + i);
    { const __m256 xv = _mm256_loadu_ps(x + 0 * ldx + i);
      a00 = _mm256_fmadd_ps(xv, w0, a00);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 1 * ldx + i);
      a10 = _mm256_fmadd_ps(xv, w0, a10);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 2 * ldx + i);
      a20 = _mm256_fmadd_ps(xv, w0, a20);
    }
    { const __m256 xv = _mm256_loadu_ps(x + 3 * ldx + i);
      a30 = _mm256_fmadd_ps(xv, w0, a30);
    }
  }
  y[0 * ldy + 0] = finish(a00, x + 0 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[1 * ldy + 0] = finish(a10, x + 1 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[2 * ldy + 0] = finish(a20, x + 2 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
  y[3 * ldy + 0] = finish(a30, x + 3 * ldx, w + 0 * K, k8, K, b ? b + 0 : nullptr);
}


#define ROWS(R, C)                                                                                  \
  template <typename WT>                                                                            \
  static void rows_##R(const float* x, int64_t ldx, const WT* w, int64_t K, float* y, int64_t ldy,  \
                       const float* b, int64_t o0, int64_t o1) {                                    \
    int64_t o = o0;                                                                                 \
    for (; o + C <= o1; o += C) tile_##R##x##C(x, ldx, w + o * K, K, y + o, ldy, b ? b + o : nullptr); \
    for (; o < o1; ++o) tile_##R##x1(x, ldx, w + o * K, K, y + o, ldy, b ? b + o : nullptr);           \
  }
ROWS(1, 8)
ROWS(2, 4)
ROWS(3, 3)
ROWS(4, 3)

template <typename WT>
static void product(const float* xp, const WT* wp, float* yp, const float* b, int64_t M, int64_t N, int64_t K) {
  constexpr int64_t BLOCK = 48;  // outputs per block: 48 rows of W stay in L2 across the row tiles
  const int64_t nblocks = (N + BLOCK - 1) / BLOCK;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t o0 = blk * BLOCK, o1 = std::min(N, o0 + BLOCK);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) rows_4(xp + m * K, K, wp, K, yp + m * N, N, b, o0, o1);
      switch (M - m) {
        case 3: rows_3(xp + m * K, K, wp, K, yp + m * N, N, b, o0, o1); break;
        case 2: rows_2(xp + m * K, K, wp, K, yp + m * N, N, b, o0, o1); break;
        case 1: rows_1(xp + m * K, K, wp, K, yp + m * N, N, b, o0, o1); break;
        default: break;
      }
    }
  });
}

torch::Tensor rowdot_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32, "rowdot: x must be float32");
  TORCH_CHECK(w.dtype() == torch::kFloat32 || w.dtype() == torch::kBFloat16,
              "rowdot: w must be float32 or bfloat16 storage");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "rowdot: w must be a contiguous (N, K) matrix");
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.size(-1) == K, "rowdot: x's last dim must equal w's K");
  auto lead = x.sizes().vec();
  lead.back() = N;
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* b = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == N && bc.dtype() == torch::kFloat32, "rowdot: bias must be (N,) float32");
    b = bc.data_ptr<float>();
  }
  if (w.dtype() == torch::kFloat32)
    product(x2.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), b, M, N, K);
  else
    product(x2.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
            y.data_ptr<float>(), b, M, N, K);
  return y.view(lead);
}


// A batch of row-vector products with short rows, one matrix per row, the matrix transposed:
// y[j] = x[j] WT[j] + bias[j / (J / G)] for x (J, K), WT (J, K, N) (float32 or bf16 storage), bias
// (G, N) (each bias row shared by J / G consecutive rows). For the head decoder's App. G leaves,
// B (A e) + U e with K = the delta rank (16): vectorised over the outputs (no horizontal sums),
// each output accumulating over k in order with FMAs, then + bias.
template <typename WT>
static void batched_kn(const float* xp, const WT* wp, const float* bp, float* yp, int64_t J, int64_t K,
                       int64_t N, int64_t per) {
  for (int64_t j = 0; j < J; ++j) {
    const float* x = xp + j * K;
    const WT* w = wp + j * K * N;
    const float* b = bp + (j / per) * N;
    float* y = yp + j * N;
    int64_t o = 0;
    for (; o + 32 <= N; o += 32) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
             a3 = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        const __m256 xv = _mm256_set1_ps(x[k]);
        const WT* row = w + k * N + o;
        a0 = _mm256_fmadd_ps(xv, load8(row), a0);
        a1 = _mm256_fmadd_ps(xv, load8(row + 8), a1);
        a2 = _mm256_fmadd_ps(xv, load8(row + 16), a2);
        a3 = _mm256_fmadd_ps(xv, load8(row + 24), a3);
      }
      _mm256_storeu_ps(y + o, _mm256_add_ps(a0, _mm256_loadu_ps(b + o)));
      _mm256_storeu_ps(y + o + 8, _mm256_add_ps(a1, _mm256_loadu_ps(b + o + 8)));
      _mm256_storeu_ps(y + o + 16, _mm256_add_ps(a2, _mm256_loadu_ps(b + o + 16)));
      _mm256_storeu_ps(y + o + 24, _mm256_add_ps(a3, _mm256_loadu_ps(b + o + 24)));
    }
    for (; o + 8 <= N; o += 8) {
      __m256 a0 = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) a0 = _mm256_fmadd_ps(_mm256_set1_ps(x[k]), load8(w + k * N + o), a0);
      _mm256_storeu_ps(y + o, _mm256_add_ps(a0, _mm256_loadu_ps(b + o)));
    }
    for (; o < N; ++o) {
      float a = 0.0f;
      for (int64_t k = 0; k < K; ++k) a = std::fma(x[k], to_f32(w[k * N + o]), a);
      y[o] = a + b[o];
    }
  }
}

torch::Tensor rowdot_batched(torch::Tensor x, torch::Tensor wt, torch::Tensor bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && bias.dtype() == torch::kFloat32,
              "rowdot_batched: x and bias must be float32");
  TORCH_CHECK(wt.dtype() == torch::kFloat32 || wt.dtype() == torch::kBFloat16,
              "rowdot_batched: wt must be float32 or bfloat16 storage");
  TORCH_CHECK(x.dim() == 2 && wt.dim() == 3 && bias.dim() == 2 && x.is_contiguous() && wt.is_contiguous() &&
                  bias.is_contiguous(),
              "rowdot_batched: contiguous x (J, K), wt (J, K, N), bias (G, N)");
  const int64_t J = x.size(0), K = x.size(1), N = wt.size(2), G = bias.size(0);
  TORCH_CHECK(wt.size(0) == J && wt.size(1) == K && bias.size(1) == N && G > 0 && J % G == 0,
              "rowdot_batched: wt must be (J, K, N) and bias (G, N) with G dividing J");
  auto y = torch::empty({J, N}, x.options());
  if (wt.dtype() == torch::kFloat32)
    batched_kn(x.data_ptr<float>(), wt.data_ptr<float>(), bias.data_ptr<float>(), y.data_ptr<float>(), J, K, N,
               J / G);
  else
    batched_kn(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(wt.data_ptr<at::BFloat16>()),
               bias.data_ptr<float>(), y.data_ptr<float>(), J, K, N, J / G);
  return y;
}

// The head decoder's whole parameter pass for one context in one call (HeadDecoder.params on the
// row-dot path): u = e (+ E[c] for a known-byte head), y = u W^T + bias, the leaves (App. G:
// B (A u) + U u from y's blocks with batched_kn, else y's first n r v), then log_softmax over each
// leaf row and over each sum unit's r children (ATen's own kernel, so the same bits as the
// separate calls). Returns {leaves (n, r, v), every sum unit's log-weights, flat}.
std::vector<torch::Tensor> head_params(torch::Tensor e, torch::Tensor c, torch::Tensor known, torch::Tensor w,
                                       torch::Tensor bias, torch::Tensor bt, int64_t n, int64_t r, int64_t v) {
  TORCH_CHECK(e.dtype() == torch::kFloat32 && e.dim() == 1 && e.is_contiguous(), "head_params: e (d,) float32");
  const int64_t d = e.size(0), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == d && w.is_contiguous() &&
                  (w.dtype() == torch::kFloat32 || w.dtype() == torch::kBFloat16),
              "head_params: w (N, d) float32 or bf16 storage");
  TORCH_CHECK(bias.dtype() == torch::kFloat32 && bias.numel() == N && bias.is_contiguous(), "head_params: bias (N,)");
  auto u = torch::empty({1, d}, e.options());
  float* up = u.data_ptr<float>();
  const float* ep = e.data_ptr<float>();
  if (known.defined() && known.numel() > 0) {
    TORCH_CHECK(known.dtype() == torch::kFloat32 && known.dim() == 2 && known.size(1) == d && known.is_contiguous(),
                "head_params: known (V, d) float32");
    TORCH_CHECK(c.defined() && c.numel() == 1 && c.dtype() == torch::kInt64 && c.device().is_cpu(),
                "head_params: the known byte c, one int64 id on the CPU");
    const int64_t id = c.data_ptr<int64_t>()[0];
    TORCH_CHECK(id >= 0 && id < known.size(0), "head_params: known byte out of range");
    const float* kp = known.data_ptr<float>() + id * d;
    for (int64_t i = 0; i < d; ++i) up[i] = ep[i] + kp[i];
  } else {
    std::memcpy(up, ep, d * sizeof(float));
  }
  auto y = torch::empty({N}, e.options());
  if (w.dtype() == torch::kFloat32)
    product(up, w.data_ptr<float>(), y.data_ptr<float>(), bias.data_ptr<float>(), 1, N, d);
  else
    product(up, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), y.data_ptr<float>(),
            bias.data_ptr<float>(), 1, N, d);
  torch::Tensor leaves, rest;
  if (bt.defined() && bt.numel() > 0) {
    const int64_t J = bt.size(0), k = bt.size(1);
    TORCH_CHECK(bt.dim() == 3 && bt.size(2) == v && J == n * r && bt.is_contiguous() && n * v + J * k <= N,
                "head_params: bt (n r, k, v)");
    leaves = torch::empty({J, v}, e.options());
    const float* yp = y.data_ptr<float>();
    if (bt.dtype() == torch::kFloat32)
      batched_kn(yp + n * v, bt.data_ptr<float>(), yp, leaves.data_ptr<float>(), J, k, v, r);
    else
      batched_kn(yp + n * v, reinterpret_cast<const uint16_t*>(bt.data_ptr<at::BFloat16>()), yp,
                 leaves.data_ptr<float>(), J, k, v, r);
    rest = y.narrow(0, n * v + J * k, N - n * v - J * k);
  } else {
    TORCH_CHECK(n * r * v <= N, "head_params: fewer outputs than leaves");
    leaves = y.narrow(0, 0, n * r * v);
    rest = y.narrow(0, n * r * v, N - n * r * v);
  }
  leaves = at::_log_softmax(leaves.view({n, r, v}), -1, false);
  auto sums = rest.numel() ? at::_log_softmax(rest.view({-1, r}), -1, false).view({-1}) : rest;
  return {leaves, sums};
}
