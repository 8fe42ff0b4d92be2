// The fp32 vector the kernels' FMA chains run on, for every source of the library (small_gemm.cpp,
// decode_attention.cpp): 16 lanes where the build targets AVX-512 (mars.kernels adds -mavx512f on CPUs that have
// it), else 8.  Within one build every output element is one fixed sequence of operations.
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
