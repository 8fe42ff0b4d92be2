// The fp32 vector the kernels' FMA chains run on, for every source of the library (small_gemm.cpp,
// decode_attention.cpp): 16 lanes where the build targets AVX-512 (mars.decoding.kernels adds -mavx512f on CPUs
// that have it), else 8.  Within one build every output element is one fixed sequence of operations.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace mars_simd {

// A weight element as fp32: itself, or a bf16 (its 16 bits) widened exactly.
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

#ifdef __AVX512F__
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kVectorRegisters = 32;  // zmm0-31
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
// 16 bf16 values (their bits) widened to fp32: exact, a bf16 is the upper half of an fp32
inline Vec vload(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vround(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n for integral n in [-126, 127]: n + 127 in the exponent bits
inline Vec vpow2i(Vec n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// y where x >= limit, else 0
inline Vec vkeep_at_least(Vec x, Vec y, float limit) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_GE_OQ), y);
}
// Fixed order: the two 256-bit halves added, then hsum8.
inline float vsum(Vec v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return hsum8(_mm256_add_ps(lo, hi));
}
// Lane t: vsum(a[t]) for the N <= 16 vectors a[0..N-1] together (lanes from N on: 0): the same additions in the
// same order (lo + hi halves, then hsum8's three steps), each level one shuffle pair and one add for two vectors
// instead of per vector, then the lanes put in key order.  46 instructions for 16 sums where 16 vsums take about
// 150; pairs past N are skipped (zero), and a lane's value never depends on another vector's.
template <int N = 16>
__attribute__((always_inline)) inline Vec vsum_each(const Vec* a) {
  static_assert(N >= 1 && N <= 16);
  Vec s1[8], s2[4], s3[2];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p)  // lanes 0-7: a[2p]'s halves added, 8-15: a[2p + 1]'s
    if (2 * p < N) {
      const Vec b = 2 * p + 1 < N ? a[2 * p + 1] : vzero();
      s1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], b, 0x44), _mm512_shuffle_f32x4(a[2 * p], b, 0xEE));
    } else {
      s1[p] = vzero();
    }
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p)  // 128-bit block b: vector 4p + b's quarters added
    s2[p] = 4 * p < N ? _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * p], s1[2 * p + 1], 0x88),
                                      _mm512_shuffle_f32x4(s1[2 * p], s1[2 * p + 1], 0xDD))
                      : vzero();
#pragma GCC unroll 2
  for (int p = 0; p < 2; ++p)  // as hsum8's movehl step, two vectors per block
    s3[p] = 8 * p < N ? _mm512_add_ps(_mm512_shuffle_ps(s2[2 * p], s2[2 * p + 1], 0x44),
                                      _mm512_shuffle_ps(s2[2 * p], s2[2 * p + 1], 0xEE))
                      : vzero();
  // as hsum8's last step: lane 4b + c holds vector 4c + b's sum
  const Vec s4 = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s4);
}
// s with -inf at the lanes whose kLanes bools (from keep) are false / whose additive mask value is -inf
inline Vec vhide_bools(Vec s, const bool* keep) {
  const __m512i k = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keep)));
  return _mm512_mask_mov_ps(s, _mm512_cmpeq_epi32_mask(k, _mm512_setzero_si512()), _mm512_set1_ps(-__builtin_inff()));
}
inline Vec vhide_neg_inf(Vec s, Vec add) {
  const Vec neg_inf = _mm512_set1_ps(-__builtin_inff());
  return _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(add, neg_inf, _CMP_EQ_OQ), neg_inf);
}
// whether any lane is NaN
inline bool vany_nan(Vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
// the first lane equal to m, or -1
inline int vfirst_equal(Vec v, float m) {
  const __mmask16 hit = _mm512_cmp_ps_mask(v, _mm512_set1_ps(m), _CMP_EQ_OQ);
  return hit ? __builtin_ctz(hit) : -1;
}
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kVectorRegisters = 16;  // ymm0-15
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vround(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2i(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline Vec vkeep_at_least(Vec x, Vec y, float limit) {
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(limit), _CMP_GE_OQ), y);
}
inline float vsum(Vec v) { return hsum8(v); }
// Lane t: vsum(a[t]) for the N <= 8 vectors a[0..N-1] together, hsum8's additions in its order (see the AVX-512 one).
template <int N = 8>
__attribute__((always_inline)) inline Vec vsum_each(const Vec* a) {
  static_assert(N >= 1 && N <= 8);
  Vec s1[4], s2[2];
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p)  // block 0: a[2p]'s halves added, block 1: a[2p + 1]'s
    if (2 * p < N) {
      const Vec b = 2 * p + 1 < N ? a[2 * p + 1] : vzero();
      s1[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], b, 0x20), _mm256_permute2f128_ps(a[2 * p], b, 0x31));
    } else {
      s1[p] = vzero();
    }
#pragma GCC unroll 2
  for (int p = 0; p < 2; ++p)
    s2[p] = 4 * p < N ? _mm256_add_ps(_mm256_shuffle_ps(s1[2 * p], s1[2 * p + 1], 0x44),
                                      _mm256_shuffle_ps(s1[2 * p], s1[2 * p + 1], 0xEE))
                      : vzero();
  // lane 4b + c holds vector 2c + b's sum
  const Vec s3 = _mm256_add_ps(_mm256_shuffle_ps(s2[0], s2[1], 0x88), _mm256_shuffle_ps(s2[0], s2[1], 0xDD));
  return _mm256_permutevar8x32_ps(s3, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline Vec vhide_bools(Vec s, const bool* keep) {
  const __m256i k = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(keep)));
  const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(k, _mm256_setzero_si256()));
  return _mm256_blendv_ps(s, _mm256_set1_ps(-__builtin_inff()), hidden);
}
inline Vec vhide_neg_inf(Vec s, Vec add) {
  const Vec neg_inf = _mm256_set1_ps(-__builtin_inff());
  return _mm256_blendv_ps(s, neg_inf, _mm256_cmp_ps(add, neg_inf, _CMP_EQ_OQ));
}
// whether any lane is NaN
inline bool vany_nan(Vec v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
// the first lane equal to m, or -1
inline int vfirst_equal(Vec v, float m) {
  const int hit = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(m), _CMP_EQ_OQ));
  return hit ? __builtin_ctz(hit) : -1;
}
#endif

// The largest lane (no NaN among them).
inline float vmax_lanes(Vec v) {
  alignas(64) float lanes[kLanes];
  vstore(lanes, v);
  float m = lanes[0];
  for (int64_t i = 1; i < kLanes; ++i) m = lanes[i] > m ? lanes[i] : m;
  return m;
}

// Below this, exp is 0 (and at -inf: masked positions contribute exactly nothing).
constexpr float kExpFloor = -87.0f;

// exp(x) for x <= 0 (a score minus its row's maximum): Cephes' expf, x = n ln2 + r with |r| <= ln2 / 2, a
// degree-5 polynomial in r, scaled by 2^n; 0 below kExpFloor.
inline Vec vexp_nonpositive(Vec x) {
  const Vec xc = vmax(x, vset1(kExpFloor));
  const Vec n = vround(vmul(xc, vset1(1.44269504088896341f)));
  Vec r = vfma(n, vset1(-0.693359375f), xc);  // ln2 in two parts: the first exact in float
  r = vfma(n, vset1(2.12194440e-4f), r);
  Vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vkeep_at_least(x, vmul(p, vpow2i(n)), kExpFloor);
}

}  // namespace mars_simd
