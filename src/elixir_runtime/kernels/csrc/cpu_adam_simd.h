// SIMD and 16-bit float conversions for cpu_adam.cpp.
//
// One `Vec` type per ISA, chosen by the compiler flags of this build (the Python loader builds with
// -march=native for the machine it runs on, or pins an ISA for tests). bf16 uses integer ops only,
// so it works on AVX2; float -> bf16/fp16 rounds to nearest even like torch's `.to()`.
// The 16-bit vector stores are non-temporal (the output goes to the GPU, not back to this CPU: no
// read-for-ownership) and need 2*kWidth-byte aligned addresses. The 8-bit moments' table lookups
// (CodeTable, store_codes) give the scalar code's results exactly: permutes or gathers.
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
// 8-bit moments ([Note: 8-bit kernel] in cpu_adam.cpp).
// A 256-entry float table in registers: 8 two-source permutes of 32 entries, the pick by the code's
// top three bits (faster than a gather here).
struct CodeTable {
  __m512 t[16];
  explicit CodeTable(const float* code) {
    for (int k = 0; k < 16; ++k) t[k] = _mm512_loadu_ps(code + 16 * k);
  }
  Vec lookup(const uint8_t* codes) const {  // code[codes[k]] for kWidth codes
    __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    __m512 r[8];
    for (int k = 0; k < 8; ++k) r[k] = _mm512_permutex2var_ps(t[2 * k], i, t[2 * k + 1]);
    __mmask16 b5 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(32)), b6 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(64)),
              b7 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(128));
    for (int k = 0; k < 4; ++k) r[k] = _mm512_mask_mov_ps(r[2 * k], b5, r[2 * k + 1]);
    for (int k = 0; k < 2; ++k) r[k] = _mm512_mask_mov_ps(r[2 * k], b6, r[2 * k + 1]);
    return {_mm512_mask_mov_ps(r[0], b7, r[1])};
  }
};
// Lane-wise unsigned max of `acc` and |x|'s bit pattern (a float's magnitude orders as its bits;
// NaN above inf): exact in any order.
inline Vec max_abs_bits(Vec acc, Vec x) {
  __m512i a = _mm512_and_si512(_mm512_castps_si512(x.x), _mm512_set1_epi32(0x7fffffff));
  return {_mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(acc.x), a))};
}
inline uint32_t hmax_bits(Vec acc) { return _mm512_reduce_max_epu32(_mm512_castps_si512(acc.x)); }
// The codes of kWidth values x (encode() in cpu_adam.cpp): one gather of the key table.
inline void store_codes(uint8_t* dst, Vec x, const uint32_t* key) {
  __m512i b = _mm512_castps_si512(x.x);
  __m512i e = _mm512_i32gather_epi32(_mm512_srli_epi32(b, 16), key, 4);
  __m512i low = _mm512_and_si512(_mm512_xor_si512(b, _mm512_srai_epi32(b, 31)), _mm512_set1_epi32(0xffff));
  __mmask16 up = _mm512_cmpgt_epu32_mask(low, _mm512_and_si512(e, _mm512_set1_epi32(0xffff)));
  __m512i c = _mm512_srli_epi32(e, 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(c, up, c, _mm512_set1_epi32(1))));
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
struct CodeTable {  // a gather: AVX2 has no wide permutes
  const float* code;
  explicit CodeTable(const float* c) : code(c) {}
  Vec lookup(const uint8_t* codes) const {
    __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
    return {_mm256_i32gather_ps(code, idx, 4)};
  }
};
inline Vec max_abs_bits(Vec acc, Vec x) {
  __m256i a = _mm256_and_si256(_mm256_castps_si256(x.x), _mm256_set1_epi32(0x7fffffff));
  return {_mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(acc.x), a))};
}
inline uint32_t hmax_bits(Vec acc) {
  __m128i a = _mm_max_epu32(_mm256_castsi256_si128(_mm256_castps_si256(acc.x)),
                            _mm256_extracti128_si256(_mm256_castps_si256(acc.x), 1));
  a = _mm_max_epu32(a, _mm_shuffle_epi32(a, _MM_SHUFFLE(1, 0, 3, 2)));
  a = _mm_max_epu32(a, _mm_shuffle_epi32(a, _MM_SHUFFLE(2, 3, 0, 1)));
  return uint32_t(_mm_cvtsi128_si32(a));
}
inline void store_codes(uint8_t* dst, Vec x, const uint32_t* key) {
  __m256i b = _mm256_castps_si256(x.x);
  __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(key), _mm256_srli_epi32(b, 16), 4);
  __m256i low = _mm256_and_si256(_mm256_xor_si256(b, _mm256_srai_epi32(b, 31)), _mm256_set1_epi32(0xffff));
  __m256i thr = _mm256_and_si256(e, _mm256_set1_epi32(0xffff));
  __m256i code = _mm256_sub_epi32(_mm256_srli_epi32(e, 16), _mm256_cmpgt_epi32(low, thr));  // both < 2^16: signed compare
  __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(w, w));
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
