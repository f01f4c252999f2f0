// SIMD and 16-bit float conversions for cpu_adam.cpp.
//
// One `Vec` type per ISA, chosen by the compiler flags of this build (the Python loader builds with
// -march=native for the machine it runs on, or pins an ISA for tests). bf16 uses integer ops only,
// so it works on AVX2; float -> bf16/fp16 rounds to nearest even like torch's `.to()`.
// The 16-bit vector stores are non-temporal (the output goes to the GPU, not back to this CPU: no
// read-for-ownership) and need 2*kWidth-byte aligned addresses.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace elixir {

enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_f32(uint16_t h) { return u2f(uint32_t(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) return u2f(sign | f2u(float(mant) * 5.9604644775390625e-8f));  // zero/subnormal
  if (exp == 31) return u2f(sign | 0x7f800000u | (mant << 13));               // inf/NaN
  return u2f(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u = f2u(f), sign = u & 0x80000000u;
  u ^= sign;
  uint32_t o;
  if (u >= (143u << 23)) {                 // overflow to inf, or NaN
    o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < (113u << 23)) {           // result is subnormal or zero: let the FPU round
    const float magic = u2f(126u << 23);
    o = f2u(u2f(u) + magic) - f2u(magic);
  } else {                                 // normal: rebias and round to nearest even
    o = (u + (uint32_t(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  }
  return uint16_t(o | (sign >> 16));
}

template <int D> struct Scalar;
template <> struct Scalar<kF32> {
  static float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
};
template <> struct Scalar<kBF16> {
  static float load(const void* p, int64_t i) { return bf16_to_f32(static_cast<const uint16_t*>(p)[i]); }
  static void store(void* p, int64_t i, float x) { static_cast<uint16_t*>(p)[i] = f32_to_bf16(x); }
};
template <> struct Scalar<kF16> {
  static float load(const void* p, int64_t i) { return f16_to_f32(static_cast<const uint16_t*>(p)[i]); }
  static void store(void* p, int64_t i, float x) { static_cast<uint16_t*>(p)[i] = f32_to_f16(x); }
};

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
constexpr int kWidth = 16;
struct Vec {
  __m512 x;
  static Vec set1(float a) { return {_mm512_set1_ps(a)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, x); }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.x, b.x)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.x, b.x)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.x, b.x)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.x, b.x)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.x, b.x, c.x)}; }
  static Vec sqrt(Vec a) { return {_mm512_sqrt_ps(a.x)}; }
};
inline Vec load_bf16(const uint16_t* p) {
  __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(u, 16))};
}
inline Vec load_f16(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline void stream_bf16(uint16_t* p, Vec v) {
  __m512i u = _mm512_castps_si512(v.x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v.x, v.x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void stream_f16(uint16_t* p, Vec v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr const char* kIsa = "avx2";
constexpr int kWidth = 8;
struct Vec {
  __m256 x;
  static Vec set1(float a) { return {_mm256_set1_ps(a)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  void store(float* p) const { _mm256_storeu_ps(p, x); }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.x, b.x)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.x, b.x)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.x, b.x)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.x, b.x)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.x, b.x, c.x)}; }
  static Vec sqrt(Vec a) { return {_mm256_sqrt_ps(a.x)}; }
};
inline Vec load_bf16(const uint16_t* p) {
  __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(u, 16))};
}
inline Vec load_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline void stream_bf16(uint16_t* p, Vec v) {
  __m256i u = _mm256_castps_si256(v.x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v.x, v.x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, qnan, nan);
  // Values fit in 16 bits, so unsigned saturation is exact; pack the two 128-bit halves.
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void stream_f16(uint16_t* p, Vec v) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
constexpr const char* kIsa = "scalar";
constexpr int kWidth = 1;
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define ELIXIR_HAS_VEC 1
template <int D> struct Simd;
template <> struct Simd<kF32> {
  static Vec load(const void* p, int64_t i) { return Vec::load(static_cast<const float*>(p) + i); }
};
template <> struct Simd<kBF16> {
  static Vec load(const void* p, int64_t i) { return load_bf16(static_cast<const uint16_t*>(p) + i); }
  static void stream(void* p, int64_t i, Vec v) { stream_bf16(static_cast<uint16_t*>(p) + i, v); }
};
template <> struct Simd<kF16> {
  static Vec load(const void* p, int64_t i) { return load_f16(static_cast<const uint16_t*>(p) + i); }
  static void stream(void* p, int64_t i, Vec v) { stream_f16(static_cast<uint16_t*>(p) + i, v); }
};
#endif

}  // namespace elixir
