// A development check only (``make kernel-emulate``, kernels/native.py: EMULATIONS): the kernel's AVX-512 branches
// built for a CPU without AVX-512, each AVX-512 intrinsic replaced by SIMDe's portable form (SIMD Everywhere, headers
// only; the Makefile fetches them from PyPI's simde-py), so that their codes can be tested bit for bit on any x86-64.
// Included by adam_cpu.h where QSTATE_EMULATE_AVX512 is defined; slow, never a build for use.
//
// Below, lane by lane, the intrinsics SIMDe 0.8.2 lacks and those it emulates unlike the hardware: _mm512_abs_ps
// (SIMDe negates values < 0, so -0.0 keeps its sign bit), _mm512_roundscale_ps (SIMDe misreads the scale field of
// imm8) and _mm512_cvttps_epi32 (SIMDe's out-of-range result is the C cast's, undefined; the hardware's INT32_MIN).
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace simde_avx512 {

template <typename Lane, typename Vector>
inline void lanes_of(const Vector& vector, Lane* lanes) {
  std::memcpy(lanes, &vector, sizeof(Vector));
}
template <typename Vector, typename Lane>
inline Vector vector_of(const Lane* lanes) {
  Vector vector;
  std::memcpy(&vector, lanes, sizeof(Vector));
  return vector;
}

// Lane k of the result from lane k of the input (Out, In: lane types; the result's lanes past the input's are zero).
template <typename OutVector, typename Out, typename In, int Lanes, typename InVector, typename Op>
inline OutVector map_lanes(const InVector& in, Op op) {
  In x[sizeof(InVector) / sizeof(In)];
  Out y[sizeof(OutVector) / sizeof(Out)] = {};
  lanes_of(in, x);
  for (int k = 0; k < Lanes; ++k) y[k] = op(x[k], k);
  return vector_of<OutVector>(y);
}

inline simde__m512i cvtepu8_epi32(simde__m128i a) {
  return map_lanes<simde__m512i, int32_t, uint8_t, 16>(a, [](uint8_t x, int) { return int32_t{x}; });
}
inline simde__m512i cvtepu8_epi64(simde__m128i a) {
  return map_lanes<simde__m512i, int64_t, uint8_t, 8>(a, [](uint8_t x, int) { return int64_t{x}; });
}
inline simde__m256i cvtepi32_epi16(simde__m512i a) {
  return map_lanes<simde__m256i, int16_t, int32_t, 16>(a, [](int32_t x, int) { return static_cast<int16_t>(x); });
}
inline simde__m128i cvtepi32_epi8(simde__m512i a) {
  return map_lanes<simde__m128i, int8_t, int32_t, 16>(a, [](int32_t x, int) { return static_cast<int8_t>(x); });
}
inline simde__m512 abs_ps(simde__m512 a) {
  return map_lanes<simde__m512, uint32_t, uint32_t, 16>(simde_mm512_castps_si512(a), [](uint32_t x, int) { return x & 0x7FFFFFFFu; });
}
inline simde__m512i cvttps_epi32(simde__m512 a) {
  return map_lanes<simde__m512i, int32_t, float, 16>(a, [](float x, int) {
    return (x > -2147483904.0f && x < 2147483648.0f) ? static_cast<int32_t>(x) : INT32_MIN;  // NaN: INT32_MIN
  });
}
// imm: bits 7-4 the fraction bits kept (M), bits 1-0 the rounding (0 nearest even, 1 down, 2 up, 3 toward zero).
inline simde__m512 roundscale_ps(simde__m512 a, int imm) {
  const float scale = std::ldexp(1.0f, imm >> 4);
  return map_lanes<simde__m512, float, float, 16>(a, [imm, scale](float x, int) {
    if (!std::isfinite(x)) return x;
    const float y = x * scale;
    const int rounding = imm & 3;
    const float r = rounding == 0 ? std::nearbyint(y) : rounding == 1 ? std::floor(y) : rounding == 2 ? std::ceil(y) : std::trunc(y);
    return std::copysign(r / scale, x);
  });
}
inline simde__m256i cvtps_ph(simde__m512 a, int) {
  return simde_mm256_set_m128i(simde_mm256_cvtps_ph(simde_mm512_extractf32x8_ps(a, 1), SIMDE_MM_FROUND_TO_NEAREST_INT),
                               simde_mm256_cvtps_ph(simde_mm512_castps512_ps256(a), SIMDE_MM_FROUND_TO_NEAREST_INT));
}
inline simde__m512i i32gather_epi32(simde__m512i index, const void* base, int scale) {
  return map_lanes<simde__m512i, int32_t, int32_t, 16>(index, [base, scale](int32_t i, int) {
    int32_t value;
    std::memcpy(&value, static_cast<const char*>(base) + static_cast<int64_t>(i) * scale, 4);
    return value;
  });
}
inline simde__mmask16 cmpeq_epi16_mask(simde__m256i a, simde__m256i b) {
  int16_t x[16], y[16];
  lanes_of(a, x), lanes_of(b, y);
  simde__mmask16 mask = 0;
  for (int k = 0; k < 16; ++k) mask |= static_cast<simde__mmask16>((x[k] == y[k]) << k);
  return mask;
}
inline simde__mmask64 kunpackd(simde__mmask64 a, simde__mmask64 b) { return (a << 32) | (b & 0xFFFFFFFFu); }
inline simde__mmask32 kunpackw(simde__mmask32 a, simde__mmask32 b) { return (a << 16) | (b & 0xFFFFu); }
template <typename Vector, typename Mask>
inline Vector maskz_loadu_bytes(Mask mask, const void* source) {
  uint8_t bytes[sizeof(Vector)] = {};
  for (size_t j = 0; j < sizeof(Vector); ++j)
    if ((mask >> j) & 1) bytes[j] = static_cast<const uint8_t*>(source)[j];
  return vector_of<Vector>(bytes);
}
inline simde__m512i maskz_loadu_epi8(simde__mmask64 mask, const void* source) { return maskz_loadu_bytes<simde__m512i>(mask, source); }
inline simde__m128i mm_maskz_loadu_epi8(simde__mmask16 mask, const void* source) { return maskz_loadu_bytes<simde__m128i>(mask, source); }
inline void mm_mask_storeu_epi8(void* target, simde__mmask16 mask, simde__m128i a) {
  uint8_t bytes[16];
  lanes_of(a, bytes);
  for (int j = 0; j < 16; ++j)
    if ((mask >> j) & 1) static_cast<uint8_t*>(target)[j] = bytes[j];
}
inline int64_t reduce_or_epi64(simde__m512i a) {
  int64_t x[8], all = 0;
  lanes_of(a, x);
  for (int64_t lane : x) all |= lane;
  return all;
}
inline simde__m512i srav_epi32(simde__m512i a, simde__m512i count) {
  int32_t x[16];
  uint32_t shift[16];
  lanes_of(a, x), lanes_of(count, shift);
  for (int k = 0; k < 16; ++k) x[k] = shift[k] > 31 ? (x[k] < 0 ? -1 : 0) : (x[k] >> shift[k]);
  return vector_of<simde__m512i>(x);
}

}  // namespace simde_avx512

#undef _mm512_abs_ps
#undef _mm512_cvttps_epi32
#undef _mm512_roundscale_ps
#define _mm512_cvtepu8_epi32 simde_avx512::cvtepu8_epi32
#define _mm512_cvtepu8_epi64 simde_avx512::cvtepu8_epi64
#define _mm512_cvtepi32_epi16 simde_avx512::cvtepi32_epi16
#define _mm512_cvtepi32_epi8 simde_avx512::cvtepi32_epi8
#define _mm512_abs_ps simde_avx512::abs_ps
#define _mm512_cvttps_epi32 simde_avx512::cvttps_epi32
#define _mm512_roundscale_ps simde_avx512::roundscale_ps
#define _mm512_cvtps_ph simde_avx512::cvtps_ph
#define _mm512_i32gather_epi32 simde_avx512::i32gather_epi32
#define _mm256_cmpeq_epi16_mask simde_avx512::cmpeq_epi16_mask
#define _mm512_kunpackd simde_avx512::kunpackd
#define _mm512_kunpackw simde_avx512::kunpackw
#define _mm512_maskz_loadu_epi8 simde_avx512::maskz_loadu_epi8
#define _mm_maskz_loadu_epi8 simde_avx512::mm_maskz_loadu_epi8
#define _mm_mask_storeu_epi8 simde_avx512::mm_mask_storeu_epi8
#define _mm512_reduce_or_epi64 simde_avx512::reduce_or_epi64
#define _mm512_srav_epi32 simde_avx512::srav_epi32
