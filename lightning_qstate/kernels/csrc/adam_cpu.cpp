// The C++ CPU Adam(W) kernel for coded states: codebook and minifloat codes of 1 to 8 bits in blocks (m and v of any
// block sizes) and bf16/fp16 casts, rounded to nearest or stochastically; with optional stall counts, and parameters
// kept on a weight grid without master weights (fp32/bf16/fp16 values, RN or SR, ECO's feedback into m): adam_steps_u8
// steps every parameter of a param group in one call; momentum_steps does the same for SGD's and Muon's coded momentum
// buffers. What they compute and how they match the torch reference (kernels/adam_reference.py, torch's sgd and muon)
// bit for bit: kernels/native.py. The value-level pieces (codebooks, Adam's and the momentum's update of one value,
// block scales, parameter dtypes and weight grids, the AVX-512 and AVX2 forms): adam_cpu.h. The entry points are
// declared in steps.h and bound to Python in bindings.cpp: this file includes no Python headers (it compiles beside them).
#include "adam_cpu.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <vector>

#include "steps.h"

namespace lightning_qstate {
namespace {

// ---- One block of one parameter ----

// Values per pass of the portable loops that draw (code_lanes' SR loops, cast_lanes), check the hold (grid_lanes,
// cast_lanes) or pack (encode_codes): a multiple of 8 (whole dense groups).
constexpr int64_t kCodeChunk = 256;

// visit(done, size, draws) over [0, n) in parts of at most kCodeChunk elements, with draws[i] the draw_of<PerOutput>
// of element first + done + i for i < size (draws_of: random_bits, PerOutput 2; cast_bits, 4) where Draw, else nullptr.
template <int PerOutput, bool Draw, typename Visit>
inline void chunks_with_draws(uint64_t seed, int64_t first, int64_t n, Visit&& visit) {
  uint32_t buffer[kCodeChunk + kDrawSlack];
  for (int64_t done = 0; done < n; done += kCodeChunk) {
    const int64_t size = std::min(kCodeChunk, n - done);
    visit(done, size, Draw ? draws_of<PerOutput>(seed, first + done, size, buffer) : nullptr);
  }
}

// grid_lanes' portable loop over values [0, n) (draws[i]: value i's SR draw where Rounding draws).
template <typename T, typename Rounding, bool Eco>
QSTATE_INLINE void grid_loop(T* __restrict__ p, const T* __restrict__ g, const uint32_t* __restrict__ draws, const Hyper& h, int64_t n,
                             float* __restrict__ m, float* __restrict__ v) {
  for (int64_t i = 0; i < n; ++i) {
    float mi = m[i], vi = v[i], denom;
    const float updated = adam_lane(to_float(p[i]), to_float(g[i]), mi, vi, h, denom);
    const float rounded = Rounding::round(updated, Rounding::kStochastic ? draws[i] : 0u);
    if constexpr (Eco) mi = std::fma(h.eco * denom, updated - rounded, mi);
    p[i] = from_float<T>(rounded);
    m[i] = mi, v[i] = vi;
  }
}

// Adam on values [0, n) of a block of a parameter on a weight grid (KeepFp32: fp32 values, no grid), param and gradient
// of type T (read as fp32), moments decoded in m, v (updated in place), as adam_reference.adam_step_quantized:
// adam_lane's new value rounded to the grid with Rounding (element ``first + i`` of the parameter: its SR draw) and
// stored in T (round to nearest, as torch's copy_), and with Eco m = fma(eco * denom, updated - rounded, m) (the
// product rounded first, as eco_feedback). With AVX-512, 16 at a time by Update16::advance; the rest kCodeChunk at a
// time (chunks_with_draws): with AVX2 8 at a time by Update8::advance (the compiler's loop took 1.4-1.8 times as long
// for fp16 values and grids, whose conversions it spelled out in integer operations), the remainder, and everything
// without either, by grid_loop: its loop has no branches, so the compiler vectorizes it (-fno-math-errno: sqrt
// without its errno check) for the CPU it is built for.
template <typename T, typename Rounding, bool Eco>
QSTATE_FLATTEN void grid_lanes(T* __restrict__ p, const T* __restrict__ g, int64_t first, const Hyper h, uint64_t seed, int64_t n,
                               float* __restrict__ m, float* __restrict__ v) {
  int64_t i = 0;
#ifdef QSTATE_AVX512
  const Update16 update(h);
  for (; i + 16 <= n; i += 16) {
    __m512 mi = _mm512_loadu_ps(m + i), vi = _mm512_loadu_ps(v + i);
    update.advance<T, Rounding, Eco>(p + i, g + i, mi, vi, seed, first + i);
    _mm512_storeu_ps(m + i, mi), _mm512_storeu_ps(v + i, vi);
  }
#elif defined(QSTATE_AVX2)
  const Update8 update(h);
#endif
  chunks_with_draws<4, Rounding::kStochastic>(seed, first + i, n - i, [&](int64_t done, int64_t size, const uint32_t* draws) {
    int64_t at = i + done, j = 0;
#ifdef QSTATE_AVX2
    for (; j + 8 <= size; j += 8, at += 8) {
      __m256 mi = _mm256_loadu_ps(m + at), vi = _mm256_loadu_ps(v + at);
      update.advance<T, Rounding, Eco>(p + at, g + at, mi, vi, draws == nullptr ? nullptr : draws + j);
      _mm256_storeu_ps(m + at, mi), _mm256_storeu_ps(v + at, vi);
    }
#endif
    grid_loop<T, Rounding, Eco>(p + at, g + at, draws == nullptr ? nullptr : draws + j, h, size - j, m + at, v + at);
  });
}

// The SR draws of 16 elements from ``first`` (random_bits(seed, first + j)) as U[0, 1) (uniform_of).
#ifdef QSTATE_AVX512
inline __m512 uniform16(uint64_t seed, int64_t first) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(random16(seed, first), 8)), _mm512_set1_ps(0x1p-24f));
}
#endif

#ifdef QSTATE_VBMI
// The codes of an 8-bit codebook state s's block values [0, n) 64 at a time, to out: stochastic rounding by
// codebook_stochastic64 (its table lookups by byte permutes), round to nearest by segment_codes64 where the codebook
// has segments (else nothing: the 16-value loop's bucket gather). ``quotient(j)``: the 16 normalized values from j;
// element ``first + j`` draws random_bits(s.seed, first + j). Returns the number of values encoded (a multiple of 64).
template <bool Nonnegative, typename Quotient>
QSTATE_INLINE int64_t codebook_bytes64(const State& s, int64_t first, uint8_t* __restrict__ out, int64_t n, Quotient&& quotient) {
  if (s.kind != Kind::kCodebook || s.cb.depth != 8 || (!s.stochastic && s.cb.segments == nullptr)) return 0;
  const Codebook cb = s.cb;  // local copies of what the loop reads (SR 3 % faster than reading them through s)
  const int32_t last = s.last, min_code = s.min_code;
  const bool stochastic = s.stochastic;
  const uint64_t seed = s.seed;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512 q[4], uniform[4];
    for (int k = 0; k < 4; ++k) q[k] = quotient(i + 16 * k);
    if (stochastic) {
      for (int k = 0; k < 4; ++k) uniform[k] = uniform16(seed, first + i + 16 * k);
      _mm512_storeu_si512(out + i, codebook_stochastic64<Nonnegative>(q, cb, last, min_code, uniform));
    } else {
      _mm512_storeu_si512(out + i, segment_codes64<Nonnegative>(q, cb, min_code));
    }
  }
  return i;
}
#endif

// code_lanes' loop: lane(q, i) of q = x[i] / divisor (0.0 where not ``finite``), a byte each to out. ivdep: the byte
// stores alias none of the tables the lanes read (the vectorizer cannot prove it).
template <typename Lane>
QSTATE_NOINLINE void code_loop(const float* __restrict__ x, float divisor, bool finite, int64_t n, uint8_t* __restrict__ out, Lane lane) {
  const uint32_t keep = mask_of(finite);
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(lane(select(keep, x[i] / divisor, 0.0f), i));
}

#ifdef QSTATE_AVX2
// code_lanes' AVX2 loop: the codes8(q, uniform) of q = x[i:i+8] / divisor (0.0 where not ``finite``; uniform: their
// draws' uniform_of, draws[i]: value i's draw, under SR) for values [0, n), a byte each to out. Returns the number of
// values coded (a multiple of 8).
template <bool Stochastic, typename Codes8>
QSTATE_NOINLINE int64_t lanes8_loop(const float* __restrict__ x, float divisor, bool finite, int64_t n, uint8_t* __restrict__ out,
                                    const uint32_t* __restrict__ draws, Codes8 codes8) {
  const __m256 d = _mm256_set1_ps(divisor);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 q = finite ? _mm256_div_ps(_mm256_loadu_ps(x + i), d) : _mm256_setzero_ps();
    __m256 uniform = _mm256_setzero_ps();
    if constexpr (Stochastic) uniform = uniform_of8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(draws + i)));
    store_codes8<false>(codes8(q, uniform), out + i);
  }
  return i;
}
#endif

// The codes (Minifloat::encode; encode_lane or grid_code; codebook_stochastic or grid_stochastic) of x[0:n] / divisor
// (true division, as the reference's; 0.0 everywhere where not ``finite``) in block state s, a byte each to out;
// element ``first + i`` draws random_bits(s.seed, first + i) under SR (chunks_with_draws). One loop per kind and
// rounding over branch-free lanes, which the compiler vectorizes for the CPU it builds for; with AVX2 minifloats and
// codebooks of more than 16 codes go through lanes8_loop first (encode_minifloat8, bucket_codes8, bucket_stochastic8:
// the compiler's loops gather), with AVX-512 the 16- and 64-value loops leave only the tails to it.
void code_lanes(const State& s, const float* __restrict__ x, float divisor, bool finite, int64_t first, int64_t n,
                uint8_t* __restrict__ out) {
  const Codebook cb = s.cb;
  const Minifloat mf = s.mf;
  const int32_t last = s.last, min_code = s.min_code;
  // lanes8_loop's share of values [0, size) from x (draws[i]: value i's draw) where it has an encoder; else 0
  const auto lanes8 = [&]<bool Stochastic>(std::bool_constant<Stochastic>, const float* x, int64_t size, uint8_t* codes,
                                           const uint32_t* draws) -> int64_t {
#ifdef QSTATE_AVX2
    if (s.kind == Kind::kMinifloat)
      return lanes8_loop<Stochastic>(x, divisor, finite, size, codes, draws,
                                     [mf](__m256 q, __m256 uniform) { return encode_minifloat8<Stochastic>(q, mf, uniform); });
    if (cb.grid == 0.0f && cb.depth > 4)
      return lanes8_loop<Stochastic>(x, divisor, finite, size, codes, draws, [cb, min_code](__m256 q, __m256 uniform) {
        if constexpr (Stochastic)
          return bucket_stochastic8(q, cb, min_code, uniform);
        else
          return bucket_codes8(q, cb);
      });
#endif
    return 0;
  };
  if (!s.stochastic) {
    const int64_t i = lanes8(std::false_type{}, x, n, out, nullptr);
    if (s.kind == Kind::kMinifloat)
      code_loop(x + i, divisor, finite, n - i, out + i, [mf](float q, int64_t) { return mf.encode<false>(q); });
    else if (cb.grid != 0.0f)
      code_loop(x + i, divisor, finite, n - i, out + i, [grid = cb.grid](float q, int64_t) { return grid_code(q, grid, 0.5f); });
    else
      code_loop(x + i, divisor, finite, n - i, out + i, [cb](float q, int64_t) { return encode_lane(q, cb); });
    return;
  }
  chunks_with_draws<2, true>(s.seed, first, n, [&](int64_t done, int64_t size, const uint32_t* all_draws) {
    const int64_t i = lanes8(std::true_type{}, x + done, size, out + done, all_draws);
    const float* part = x + done + i;
    uint8_t* codes = out + done + i;
    const uint32_t* draws = all_draws + i;
    if (s.kind == Kind::kMinifloat)
      code_loop(part, divisor, finite, size - i, codes,
                [mf, draws](float q, int64_t j) { return mf.encode<true>(q, uniform_of(draws[j])); });
    else if (cb.grid != 0.0f)
      code_loop(part, divisor, finite, size - i, codes, [cb, last, min_code, draws](float q, int64_t j) {
        return grid_stochastic(q, cb.grid, grid_code(q, cb.grid, 1.0f), last, min_code, uniform_of(draws[j]));
      });
    else
      code_loop(part, divisor, finite, size - i, codes, [cb, last, min_code, draws](float q, int64_t j) {
        return codebook_stochastic(q, cb, last, min_code, uniform_of(draws[j]));
      });
  });
}

// formats.rounding.encode_codebook of x / divisor (true division, as the reference's) for one block of a byte codebook
// state s (RN, or SR with element ``first + i`` drawing random_bits(s.seed, first + i)); a non-finite block encodes 0.0
// everywhere. (A reciprocal and Markstein's correction were no faster, and wrong for scales beyond [2^-126, 2^126]:
// the reciprocal of a subnormal scale overflows, as a tiny v's does.)
template <bool Nonnegative>
void encode_block(const float* __restrict__ x, float divisor, bool finite, const State& s, uint8_t* __restrict__ out, int64_t n,
                  int64_t first) {
  const Codebook& cb = s.cb;
  if (!finite && !s.stochastic) {
    std::memset(out, encode_lane(0.0f, cb), n);
    return;
  }
  int64_t i = 0;
#ifdef QSTATE_AVX512
  const __m512 d = _mm512_set1_ps(divisor);
#ifdef QSTATE_VBMI
  i = codebook_bytes64<Nonnegative>(
      s, first, out, n, [x, d, finite](int64_t j) { return finite ? _mm512_div_ps(_mm512_loadu_ps(x + j), d) : _mm512_setzero_ps(); });
#endif
  with_depth(cb.depth, [&]<int Depth>(std::integral_constant<int, Depth>) {
    for (; i + 16 <= n; i += 16) {
      const __m512 q = finite ? _mm512_div_ps(_mm512_loadu_ps(x + i), d) : _mm512_setzero_ps();
      const __m128i codes = s.stochastic
                                ? codebook_stochastic16<Depth, Nonnegative>(q, cb, s.last, s.min_code, uniform16(s.seed, first + i))
                                : _mm512_cvtepi32_epi8(codebook_codes16<Depth, Nonnegative>(q, cb));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), codes);
    }
  });
#endif
  code_lanes(s, x + i, divisor, finite, first + i, n - i, out + i);
}

// formats.count_stalls for one block: [stalled, moved] added to counts. ``old``: codes before the step. A value keeps
// its code where its unit value (decode) stays, as count_stalls compares them: a minifloat's +0 and -0 codes are one.
void count_block(const uint8_t* __restrict__ old, float old_scale, const uint8_t* __restrict__ codes, float scale,
                 const float* __restrict__ updated, const float* __restrict__ decode, int64_t n, int64_t* counts) {
  int64_t stalled = 0, moved = 0;
#pragma omp simd reduction(+ : stalled, moved)
  for (int64_t i = 0; i < n; ++i) {
    const float before_unit = decode[old[i]], unit = decode[codes[i]];
    const bool move = updated[i] != before_unit * old_scale;
    moved += move ? 1 : 0;
    stalled += (move && unit == before_unit && unit * scale != updated[i]) ? 1 : 0;
  }
  counts[0] += stalled;
  counts[1] += moved;
}

// Whether every value of x[0:n] is finite (x - x is 0, not NaN). The vector loop (AVX-512 or AVX2) reads eight
// far-apart parts of x side by side: a single stream leaves the memory system idle between cache misses.
bool all_finite(const float* __restrict__ x, int64_t n) {
  int64_t done = 0;
  bool bad = false;
#if defined(QSTATE_AVX512) || defined(QSTATE_AVX2)
#ifdef QSTATE_AVX512  // per vector of ``lanes`` values: the lanes that are inf/NaN, and whether any flag is set
  constexpr int64_t lanes = 16;
  __mmask16 nonfinite = 0;
  const auto nonfinite_of = [](const float* at) {
    const __m512 value = _mm512_loadu_ps(at);
    return _mm512_cmp_ps_mask(_mm512_sub_ps(value, value), _mm512_setzero_ps(), _CMP_UNORD_Q);
  };
  const auto any = [](__mmask16 flags) { return flags != 0; };
#else
  constexpr int64_t lanes = 8;
  __m256i nonfinite = _mm256_setzero_si256();
  const auto nonfinite_of = [](const float* at) {
    const __m256 value = _mm256_loadu_ps(at);
    return _mm256_castps_si256(_mm256_cmp_ps(_mm256_sub_ps(value, value), _mm256_setzero_ps(), _CMP_UNORD_Q));
  };
  const auto any = [](__m256i flags) { return !_mm256_testz_si256(flags, flags); };
#endif
  constexpr int parts = 8;
  const int64_t part = n / parts / lanes * lanes;
  for (int64_t i = 0; i < part; i += lanes)
    for (int k = 0; k < parts; ++k) nonfinite |= nonfinite_of(x + k * part + i);
  bad = any(nonfinite);
  done = parts * part;
#endif
  uint32_t rest_nonfinite = 0;  // a reduction the compiler vectorizes
  for (int64_t i = done; i < n; ++i) rest_nonfinite |= mask_of((bits_of(x[i]) & 0x7F800000u) == 0x7F800000u);
  return !bad && rest_nonfinite == 0;
}

// all_finite of bf16 or fp16 patterns: no exponent field (``exponent``: its mask) all ones.
bool all_finite16(const uint16_t* __restrict__ x, int64_t n, uint16_t exponent) {
  uint32_t nonfinite = 0;
  for (int64_t i = 0; i < n; ++i) nonfinite |= mask_of((x[i] & exponent) == exponent);
  return nonfinite == 0;
}

// Whether values [first, first + n) of ``values`` (elements of ``dtype``) are all finite.
bool values_finite(Dtype dtype, const void* values, int64_t first, int64_t n) {
  switch (dtype) {
    case Dtype::kBFloat16:
      return all_finite16(static_cast<const uint16_t*>(values) + first, n, 0x7F80u);
    case Dtype::kFloat16:
      return all_finite16(static_cast<const uint16_t*>(values) + first, n, 0x7C00u);
    default:
      return all_finite(static_cast<const float*>(values) + first, n);
  }
}

// ---- Any moment storage (State): decode, update, encode ----

// n values of 8-bit codes (decode[c] * scale) to out; ``planes``: the table's byte planes (VBMI: 64 at a time).
void decode_bytes(const uint8_t* __restrict__ codes, const float* __restrict__ decode, const uint8_t* planes, float scale, int64_t n,
                  float* __restrict__ out) {
  int64_t i = 0;
#ifdef QSTATE_VBMI
  for (; i + 64 <= n; i += 64) {
    __m512 values[4];
    decode64(codes + i, planes, scale, values);
    for (int r = 0; r < 4; ++r) _mm512_storeu_ps(out + i + 16 * r, values[r]);
  }
#endif
#ifdef QSTATE_AVX512
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, decode16(codes + i, decode, scale));
#endif
  for (; i < n; ++i) out[i] = decode[codes[i]] * scale;
}

// n values of 4-bit codes (value 2i in the low nibble of byte i) to out; the table's first 16 entries.
void decode_nibbles(const uint8_t* __restrict__ codes, const float* __restrict__ decode, float scale, int64_t n, float* __restrict__ out) {
  int64_t i = 0;
#ifdef QSTATE_AVX512
  const __m512 table = _mm512_loadu_ps(decode), factor = _mm512_set1_ps(scale);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (; i + 16 <= n; i += 16) {  // 8 bytes: low and high nibbles interleaved into 16 indices, one in-register lookup
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2));
    const __m128i index = _mm_unpacklo_epi8(_mm_and_si128(bytes, nibble), _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(index), table), factor));
  }
#endif
  const uint8_t* __restrict__ pairs = codes + i / 2;  // i even
  float* __restrict__ rest = out + i;
#pragma GCC ivdep
  for (int64_t j = 0; j < (n - i) / 2; ++j) {
    rest[2 * j] = decode[pairs[j] & 0x0F] * scale;
    rest[2 * j + 1] = decode[pairs[j] >> 4] * scale;
  }
  if ((n - i) % 2) out[n - 1] = decode[codes[(n - 1) / 2] & 0x0F] * scale;
}

#ifdef QSTATE_AVX512
// The 2 * bits bytes of two groups of dense codes (5 to 7 bits) as two words (a masked load: nothing read beyond them).
inline void load_two_groups(const uint8_t* codes, int32_t bits, uint64_t& low, uint64_t& high) {
  const __m128i bytes = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << (2 * bits)) - 1), codes);
  const uint64_t first = static_cast<uint64_t>(_mm_cvtsi128_si64(bytes)), second = static_cast<uint64_t>(_mm_extract_epi64(bytes, 1));
  const int32_t width = 8 * bits;  // 40 to 56
  low = first & ((uint64_t{1} << width) - 1);
  high = (first >> width) | (second << (64 - width));
}

#if defined(__BMI2__)
// The low ``bits`` bits of each of 8 bytes: a group of dense codes as pext gathers it from bytes (and pdep spreads it).
inline uint64_t dense_byte_fields(int32_t bits) { return 0x0101010101010101ull * ((uint64_t{1} << bits) - 1); }
#endif

// Two groups of dense codes (words ``low``, ``high``) stored in their 2 * bits bytes (a masked store).
inline void store_two_groups(uint64_t low, uint64_t high, int32_t bits, uint8_t* out) {
  const int32_t width = 8 * bits;
  const __m128i bytes = _mm_set_epi64x(static_cast<int64_t>(high >> (64 - width)), static_cast<int64_t>(low | (high << width)));
  _mm_mask_storeu_epi8(out, static_cast<__mmask16>((1u << (2 * bits)) - 1), bytes);
}
#endif

// n values of dense codes (groups of 8 codes of ``bits`` bits in ``bits`` bytes, State) to out; a group's bytes read
// as a little-endian word (x86-64), its codes shifted out of it (AVX-512: two groups at a time, 64-bit lane shifts and
// the table lookup of 2^bits entries).
void decode_dense(const uint8_t* __restrict__ codes, const float* __restrict__ decode, float scale, int64_t n, int32_t bits,
                  float* __restrict__ out) {
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  int64_t group = 0;
#ifdef QSTATE_AVX512
#if defined(__BMI2__)
  const uint64_t byte_fields = dense_byte_fields(bits);
#else
  const __m512i shifts = _mm512_set_epi64(7 * bits, 6 * bits, 5 * bits, 4 * bits, 3 * bits, 2 * bits, bits, 0);
  const __m512i code_mask = _mm512_set1_epi32(static_cast<int32_t>(mask));
#endif
  const __m512 factor = _mm512_set1_ps(scale);
  with_depth(bits, [&]<int Bits>(std::integral_constant<int, Bits>) {
    for (; group + 16 <= n; group += 16) {
      uint64_t low, high;
      load_two_groups(codes + group / 8 * bits, bits, low, high);
#if defined(__BMI2__)  // each group's 8 codes deposited into the low bits of 8 bytes
      const __m512i index = _mm512_cvtepu8_epi32(
          _mm_set_epi64x(static_cast<int64_t>(_pdep_u64(high, byte_fields)), static_cast<int64_t>(_pdep_u64(low, byte_fields))));
#else
      const __m256i first = _mm512_cvtepi64_epi32(_mm512_srlv_epi64(_mm512_set1_epi64(static_cast<int64_t>(low)), shifts));
      const __m256i second = _mm512_cvtepi64_epi32(_mm512_srlv_epi64(_mm512_set1_epi64(static_cast<int64_t>(high)), shifts));
      const __m512i index = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1), code_mask);
#endif
      _mm512_storeu_ps(out + group, _mm512_mul_ps(lookup<Bits>(decode, index), factor));
    }
  });
#endif
  for (; group < n; group += 8) {  // 8 bytes read where another group follows (an exact memcpy is a call)
    uint64_t word = 0;
    if (group + 8 < n)
      std::memcpy(&word, codes + group / 8 * bits, 8);
    else
      std::memcpy(&word, codes + group / 8 * bits, bits);
    const int64_t size = std::min<int64_t>(8, n - group);
    for (int64_t j = 0; j < size; ++j) out[group + j] = decode[(word >> (j * bits)) & mask] * scale;
  }
}

// ``count`` codes (a multiple of 8, a byte each) packed densely at out: each group of 8 into ``bits`` bytes (State);
// all 8 bytes of its word stored where another group follows (it overwrites the extra ones), the last one exactly.
// With AVX2 four groups at a time: code pairs merged by a byte multiply-add (c0 + c1 << bits), pairs of pairs by a
// 16-bit one, then each 64-bit lane's halves: a group's word per 64-bit lane (the scalar loop's shifts were ~3
// operations a code).
inline void pack_dense(const uint8_t* __restrict__ codes, int64_t count, int32_t bits, uint8_t* __restrict__ out) {
  int64_t group = 0;
#ifdef QSTATE_AVX2
  const __m256i pairs = _mm256_set1_epi16(static_cast<int16_t>(1 | (1 << (8 + bits))));  // unsigned bytes 1, 2^bits
  const __m256i quads = _mm256_set1_epi32(1 | (1 << (16 + 2 * bits)));                   // int16 1, 2^(2 bits)
  const __m128i shift = _mm_cvtsi32_si128(4 * bits);
  for (; group + 32 < count; group += 32) {  // another group follows the four
    const __m256i four =
        _mm256_madd_epi16(_mm256_maddubs_epi16(pairs, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + group))), quads);
    const __m256i words =
        _mm256_or_si256(_mm256_and_si256(four, _mm256_set1_epi64x(0xFFFFFFFF)), _mm256_sll_epi64(_mm256_srli_epi64(four, 32), shift));
    const __m128i low = _mm256_castsi256_si128(words), high = _mm256_extracti128_si256(words, 1);
    const uint64_t word[4] = {static_cast<uint64_t>(_mm_cvtsi128_si64(low)), static_cast<uint64_t>(_mm_extract_epi64(low, 1)),
                              static_cast<uint64_t>(_mm_cvtsi128_si64(high)), static_cast<uint64_t>(_mm_extract_epi64(high, 1))};
    for (int k = 0; k < 4; ++k) std::memcpy(out + (group / 8 + k) * bits, &word[k], 8);  // in order: each overwrites the last's extra bytes
  }
#endif
  for (; group < count; group += 8) {
    uint64_t word = 0;
    for (int64_t j = 0; j < 8; ++j) word |= static_cast<uint64_t>(codes[group + j]) << (j * bits);
    if (group + 8 < count)
      std::memcpy(out + group / 8 * bits, &word, 8);
    else
      std::memcpy(out + group / 8 * bits, &word, bits);
  }
}

#ifdef QSTATE_AVX512
// A bf16 or fp16 cast state's values 16 at a time: read as fp32 (exact) and stored as store_cast rounds them
// (``Rounding``: the state's dtype and rounding as a type, so that a loop over them is compiled once per cast; testing
// them at run time made cast_loop 10-20 % slower, one thread, bf16/fp16 RN); its fields copied (a loop that stores
// codes would reload them through the State: the stores could alias it).
template <typename Rounding>
struct Cast16 {
  using Element = typename Rounding::Element;
  Element* codes;
  bool zero_free;
  uint64_t seed;

  explicit Cast16(const State& s) : codes(static_cast<Element*>(s.codes)), zero_free(s.zero_free), seed(s.seed) {}

  // Elements [index, index + 16); ``top``: the lane-wise largest magnitudes of the patterns stored (for ``finite``).
  QSTATE_INLINE __m512 load(int64_t index) const { return load16(codes + index); }
  QSTATE_INLINE void store(int64_t index, __m512 value, __m256i& top) const {
    __m256i stored = patterns16(Rounding{}, value, seed, index);
    if (zero_free) stored = lift_flushed16(value, stored);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + index), stored);
    top = _mm256_max_epu16(top, _mm256_and_si256(stored, _mm256_set1_epi16(0x7FFF)));
  }
  // Whether the patterns whose magnitudes ``top`` gathered (from 0) are all finite.
  QSTATE_INLINE bool finite(__m256i top) const {
    const __m256i from = _mm256_set1_epi16(static_cast<int16_t>(kNonfiniteFrom<Element>));
    return _mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_max_epu16(top, from), top)) == 0;  // no lane at or above it
  }
};

// visit(Cast16<Rounding>(s)) for a bf16 or fp16 cast state s.
template <typename Visit>
void with_cast16(const State& s, Visit&& visit) {
  with_rounding(s.cast, s.stochastic, [&]<typename Rounding>(Rounding) {
    if constexpr (!std::is_same_v<Rounding, KeepFp32>) visit(Cast16<Rounding>(s));
  });
}
#endif

// A cast state's values [base, base + n) as fp32 (exact).
void decode_cast(const State& s, int64_t base, int64_t n, float* __restrict__ out) {
  if (s.cast == Dtype::kFloat32) {
    std::memcpy(out, static_cast<const float*>(s.codes) + base, 4 * n);
    return;
  }
  int64_t i = 0;
#ifdef QSTATE_AVX512
  with_cast16(s, [&](const auto& cast) {
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, cast.load(base + i));
  });
#endif
  const uint16_t* codes = static_cast<const uint16_t*>(s.codes) + base;
  for (; i < n; ++i) out[i] = s.cast == Dtype::kBFloat16 ? to_float(BFloat16{codes[i]}) : to_float(Float16{codes[i]});
}

// Values [base, base + n) of state s decoded to out (base: a multiple of s's block); ``units``: in units of their
// block's scale (QuantizedTensor.unit_values: the decode table's values; a cast's values themselves).
void decode_state(const State& s, int64_t base, int64_t n, bool units, float* __restrict__ out) {
  if (s.kind == Kind::kCast) {
    decode_cast(s, base, n, out);
    return;
  }
  const uint8_t* codes = static_cast<const uint8_t*>(s.codes);
  for (int64_t first = 0; first < n; first += s.block) {
    const int64_t size = std::min(s.block, n - first);
    const float scale = units ? 1.0f : s.scales.load((base + first) / s.block);
    if (s.nibbles())
      decode_nibbles(codes + s.code_byte(base + first), s.cb.decode, scale, size, out + first);
    else if (s.dense())
      decode_dense(codes + s.code_byte(base + first), s.cb.decode, scale, size, s.bits, out + first);
    else
      decode_bytes(codes + base + first, s.cb.decode, s.cb.planes, scale, size, out + first);
  }
}

// The absmax of x[0:n] and whether all are finite (where not, the absmax is unused: 0): the largest magnitude pattern
// decides both (inf and NaN patterns lie above every finite one; max_magnitude_bits).
void absmax(const float* __restrict__ x, int64_t n, float& top, bool& ok) {
  uint32_t bits = 0;
  int64_t i = 0;
#ifdef QSTATE_AVX512
  __m512i running = _mm512_setzero_si512();
  for (; i + 16 <= n; i += 16) running = max_magnitude_bits(running, _mm512_loadu_ps(x + i));
  bits = _mm512_reduce_max_epu32(running);
#endif
  for (; i < n; ++i) bits = std::max(bits, bits_of(x[i]) & 0x7FFFFFFFu);
  ok = bits < 0x7F800000u;
  top = ok ? float_of(bits) : 0.0f;
}

#ifdef QSTATE_AVX512
// encode_codes' vector loop over values [i, n) of x, 16 at a time (returns where it stopped): x / d (zeros where not
// finite) coded by codes16(q, j) (q: the values from j) and stored at out in the layout of ``bits`` (8: a byte each, up
// to 4: two per byte, else dense). All by value: the byte stores can alias nothing the loop reads (through references
// they made it reload its captures and tables every 16 values).
template <typename Codes16>
QSTATE_INLINE int64_t encode16(const float* __restrict__ x, __m512 d, bool finite, uint8_t* __restrict__ out, int64_t i, int64_t n,
                               int32_t bits, Codes16 codes16) {
  const bool nibbles = bits <= 4, dense = bits > 4 && bits < 8;
#if defined(__BMI2__)
  const uint64_t byte_fields = dense ? dense_byte_fields(bits) : 0;
#else
  const int64_t b = bits;
  const __m512i dense_shifts = _mm512_set_epi64(7 * b, 6 * b, 5 * b, 4 * b, 3 * b, 2 * b, b, 0);
#endif
  for (; i + 16 <= n; i += 16) {
    const __m512 q = finite ? _mm512_div_ps(_mm512_loadu_ps(x + i), d) : _mm512_setzero_ps();
    const __m128i codes = codes16(q, i);
    if (nibbles) {
      pack16(codes, out + i / 2);
    } else if (dense) {
#if defined(__BMI2__)  // each group's 8 code bytes: their low bits extracted into its word
      const uint64_t low = _pext_u64(static_cast<uint64_t>(_mm_cvtsi128_si64(codes)), byte_fields);
      const uint64_t high = _pext_u64(static_cast<uint64_t>(_mm_extract_epi64(codes, 1)), byte_fields);
#else  // each group's 8 codes shifted to their bit fields in 64-bit lanes, OR-ed into its word
      const uint64_t low = _mm512_reduce_or_epi64(_mm512_sllv_epi64(_mm512_cvtepu8_epi64(codes), dense_shifts));
      const uint64_t high = _mm512_reduce_or_epi64(_mm512_sllv_epi64(_mm512_cvtepu8_epi64(_mm_srli_si128(codes, 8)), dense_shifts));
#endif
      store_two_groups(low, high, bits, out + i / 8 * bits);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), codes);
    }
  }
  return i;
}
#endif

#ifdef QSTATE_AVX2
// encode_codes' AVX2 loop over values [i, n) of x, 8 at a time (returns where it stopped; dense codes: it leaves them
// to code_lanes): x / d (zeros where not finite) coded by codes8(q, j) (q: the values from j) and stored at out, a
// byte each (``bits`` 8) or two per byte (up to 4; with_codes8's encoders: codes of up to 4 bits).
template <typename Codes8>
QSTATE_INLINE int64_t encode8(const float* __restrict__ x, __m256 d, bool finite, uint8_t* __restrict__ out, int64_t i, int64_t n,
                              int32_t bits, Codes8 codes8) {
  const auto loop = [&]<bool Nibbles>(std::bool_constant<Nibbles>) {
    for (; i + 8 <= n; i += 8) {
      const __m256 q = finite ? _mm256_div_ps(_mm256_loadu_ps(x + i), d) : _mm256_setzero_ps();
      store_codes8<Nibbles>(codes8(q, i), Nibbles ? out + i / 2 : out + i);
    }
  };
  if (bits <= 4)
    loop(std::true_type{});
  else if (bits == 8)
    loop(std::false_type{});
  return i;
}

// visit(codes8) with the 8-value encoder of block state s where it has one (a codebook of at most 16 codes:
// codebook_codes8, codebook_stochastic8), codes8(q, j) the codes of the normalized values q of elements first + j ..
// first + j + 7 (their SR draws); else nothing.
template <typename Visit>
QSTATE_INLINE void with_codes8(const State& s, int64_t first, Visit&& visit) {
  if (s.kind != Kind::kCodebook || s.cb.depth > 4) return;
  with_depth(s.cb.depth, [&]<int Depth>(std::integral_constant<int, Depth>) {
    if constexpr (Depth <= 4) {
      if (s.stochastic)
        visit([cb = s.cb, last = s.last, min_code = s.min_code, seed = s.seed, first](__m256 q, int64_t j) {
          return codebook_stochastic8<Depth>(q, cb, last, min_code, uniform8(seed, first + j));
        });
      else
        visit([cb = s.cb](__m256 q, int64_t) { return codebook_codes8<Depth>(q, cb); });
    }
  });
}
#endif

// The codes of x[0:n] / divisor (true division: correctly rounded, as the reference's) in a block state s, stored
// at out: a byte each, two per byte (value 2i in the low nibble; an odd last one: the high nibble 0) or dense (a last
// group of fewer than 8 padded with code 0, as formats.packing.pack). A non-finite
// block: the codes of 0.0. ``first``: the element index of x[0] in its parameter (its SR draw).
template <bool Nonnegative>
void encode_codes(const State& s, const float* __restrict__ x, float divisor, bool finite, uint8_t* __restrict__ out, int64_t n,
                  int64_t first) {
  const bool nibbles = s.nibbles(), dense = s.dense();
  int64_t i = 0;
#ifdef QSTATE_AVX512
  const bool minifloat = s.kind == Kind::kMinifloat;
  const __m512 d = _mm512_set1_ps(divisor);
#ifdef QSTATE_VBMI
  i = codebook_bytes64<Nonnegative>(
      s, first, out, n, [x, d, finite](int64_t j) { return finite ? _mm512_div_ps(_mm512_loadu_ps(x + j), d) : _mm512_setzero_ps(); });
#endif
  if (minifloat && s.stochastic)
    i = encode16(x, d, finite, out, i, n, s.bits, [mf = s.mf, seed = s.seed, first](__m512 q, int64_t j) {
      return encode_minifloat16<true>(q, mf, uniform16(seed, first + j));
    });
  else if (minifloat)
    i = encode16(x, d, finite, out, i, n, s.bits, [mf = s.mf](__m512 q, int64_t) { return encode_minifloat16<false>(q, mf, q); });
  else
    with_depth(s.cb.depth, [&]<int Depth>(std::integral_constant<int, Depth>) {
      if (s.stochastic)
        i = encode16(x, d, finite, out, i, n, s.bits,
                     [cb = s.cb, last = s.last, min_code = s.min_code, seed = s.seed, first](__m512 q, int64_t j) {
                       return codebook_stochastic16<Depth, Nonnegative>(q, cb, last, min_code, uniform16(seed, first + j));
                     });
      else
        i = encode16(x, d, finite, out, i, n, s.bits,
                     [cb = s.cb](__m512 q, int64_t) { return _mm512_cvtepi32_epi8(codebook_codes16<Depth, Nonnegative>(q, cb)); });
    });
#endif
#ifdef QSTATE_AVX2
  with_codes8(s, first, [&](auto codes8) { i = encode8(x, _mm256_set1_ps(divisor), finite, out, 0, n, s.bits, codes8); });
#endif
  uint8_t lanes[kCodeChunk];        // a byte per code, then packed
  for (; i < n; i += kCodeChunk) {  // i even (0 or after 8- or 16-value groups)
    const int64_t size = std::min(kCodeChunk, n - i);
    code_lanes(s, x + i, divisor, finite, first + i, size, lanes);
    if (dense) {
      const int64_t padded = (size + 7) / 8 * 8;
      std::memset(lanes + size, 0, padded - size);
      pack_dense(lanes, padded, s.bits, out + i / 8 * s.bits);
    } else if (nibbles) {
      uint8_t* pairs = out + i / 2;
      for (int64_t j = 0; j < size / 2; ++j) pairs[j] = static_cast<uint8_t>(lanes[2 * j] | (lanes[2 * j + 1] << 4));
      if (size % 2) pairs[size / 2] = lanes[size - 1];
    } else {
      std::memcpy(out + i, lanes, size);
    }
  }
}

// A cast state's values [base, base + n): x rounded in its dtype, to nearest (as torch's casts) or stochastically
// (element i drawing cast_bits(seed, base + i): bf16_stochastic, fp16_stochastic, unbiased as CastFormat.stochastic_reference);
// ``zero_free``: a positive value the cast flushes to 0 is stored as the dtype's smallest subnormal
// (CastFormat.lift_flushed; pattern 1). Returns whether every value stored is finite (a finite value past the dtype's
// largest is stored as inf, as torch's casts).
bool store_cast(const State& s, int64_t base, int64_t n, const float* __restrict__ x) {
  if (s.cast == Dtype::kFloat32) {
    std::memcpy(static_cast<float*>(s.codes) + base, x, 4 * n);
    return all_finite(x, n);
  }
  int64_t i = 0;
  bool finite = true;
#ifdef QSTATE_AVX512
  with_cast16(s, [&](const auto& cast) {
    __m256i top = _mm256_setzero_si256();
    for (; i + 16 <= n; i += 16) cast.store(base + i, _mm512_loadu_ps(x + i), top);
    finite = cast.finite(top);
  });
#endif
  uint16_t* __restrict__ out = static_cast<uint16_t*>(s.codes) + base + i;
  const float* __restrict__ values = x + i;
  const uint32_t zero_free = mask_of(s.zero_free);
  // The patterns of values [0, size) from ``values``, to ``codes`` (draws[j]: value j's SR draw); branch-free: vectorized.
  const auto store = [zero_free]<typename Rounding>(Rounding, const float* __restrict__ values, int64_t size, const uint32_t* draws,
                                                    uint16_t* __restrict__ codes) {
    for (int64_t j = 0; j < size; ++j) codes[j] = cast_pattern<Rounding>(values[j], Rounding::kStochastic ? draws[j] : 0u, zero_free);
  };
  with_rounding(s.cast, s.stochastic, [&]<typename Rounding>(Rounding) {
    if constexpr (std::is_same_v<Rounding, KeepFp32>) {
      return;  // a cast state is bf16 or fp16 here
    } else if constexpr (!Rounding::kStochastic) {
      store(Rounding{}, values, n - i, nullptr, out);
    } else {
      chunks_with_draws<4, true>(s.seed, base + i, n - i, [&](int64_t done, int64_t size, const uint32_t* draws) {
        store(Rounding{}, values + done, size, draws, out + done);
      });
    }
  });
  return finite && values_finite(s.cast, s.codes, base + i, n - i);
}

// Block ``index`` of state s (its values from element ``base``: n of them) stored from the new values x (absmax ``top``,
// all finite: ``ok``), as BlockFormat.quantize_reference: its scale (NaN where not ok), the codes of x / scale by
// encode_block for 8-bit codebooks, else encode_codes. Returns the stored scale.
template <bool Nonnegative>
float encode_one_block(const State& s, int64_t index, int64_t base, int64_t n, const float* x, float top, bool ok) {
  const float scale = ok ? s.scales.representable(top) : NAN, divisor = (ok && scale > 0.0f) ? scale : 1.0f;
  uint8_t* codes = static_cast<uint8_t*>(s.codes) + s.code_byte(base);
  if (s.kind == Kind::kCodebook && s.bits == 8)
    encode_block<Nonnegative>(x, divisor, ok, s, codes, n, base);
  else
    encode_codes<Nonnegative>(s, x, divisor, ok, codes, n, base);
  s.scales.store(index, scale);
  return scale;
}

// The new values x[0:n] of state s's values [base, base + n) (base: a multiple of s's block) stored, as
// BlockFormat.quantize_reference: per block its absmax, the stored scale and the codes of x / scale (a non-finite
// block: scale NaN, the codes of 0.0); a cast's values (store_cast). Returns whether every block was finite (a cast:
// whether every stored value is, as it stores a finite value past its dtype's range as inf).
template <bool Nonnegative>
bool encode_state(const State& s, int64_t base, int64_t n, const float* __restrict__ x) {
  if (s.kind == Kind::kCast) return store_cast(s, base, n, x);
  bool all_ok = true;
  for (int64_t first = 0; first < n; first += s.block) {
    const int64_t size = std::min(s.block, n - first);
    float top;
    bool ok;
    absmax(x + first, size, top, ok);
    encode_one_block<Nonnegative>(s, (base + first) / s.block, base + first, size, x + first, top, ok);
    all_ok = all_ok && ok;
  }
  return all_ok;
}

// Adam on n fp32 values without a weight grid: param p updated in place, moments decoded in m, v (updated in place);
// grid_lanes with KeepFp32.
void update_values(float* __restrict__ p, const float* __restrict__ g, const Hyper& h, int64_t n, float* __restrict__ m,
                   float* __restrict__ v) {
  grid_lanes<float, KeepFp32, false>(p, g, 0, h, 0, n, m, v);
}

// formats.count_stalls of one state's n values: [stalled, moved] added to counts.
void count_values(const float* before, const float* before_units, const float* updated, const float* stored, const float* stored_units,
                  int64_t n, int64_t* counts) {
  int64_t stalled = 0, moved = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool move = updated[i] != before[i];
    moved += move ? 1 : 0;
    stalled += (move && stored_units[i] == before_units[i] && stored[i] != updated[i]) ? 1 : 0;
  }
  counts[0] += stalled;
  counts[1] += moved;
}

// ---- The group's hyperparameters and step counters ----

// The group's hyperparameters: those of every step, and what the per-step ones (at) are computed from.
struct Schedule {
  Hyper constants;  // every field but step, bc2, m_bound and eco
  double lr, beta1, beta2;
  bool lr_fp32;  // lr is an fp32 tensor's value: torch divides it in fp32 (tensor arithmetic)

  // The hyperparameters of a parameter at its next step t = steps_done + 1: step size lr / (1 - beta1^t) and
  // sqrt(1 - beta2^t) in double, rounded to fp32 (lr_fp32: the step size in fp32, lr / fp32(1 - beta1^t)), as torch's
  // AdamW and adam_reference.adam_hyper have them. m_bound: the bound its updated m is held to (coded moments; inf,
  // no hold, for fp32 ones, which are exact).
  Hyper at(double steps_done, float m_bound) const {
    const double t = steps_done + 1;
    Hyper h = constants;
    const double bc1 = 1.0 - std::pow(beta1, t);
    h.step = lr_fp32 ? static_cast<float>(lr) / static_cast<float>(bc1) : static_cast<float>(lr / bc1);
    h.bc2 = static_cast<float>(std::pow(1.0 - std::pow(beta2, t), 0.5));
    h.m_bound = m_bound;
    return h;
  }
};

// The constants as torch's AdamW computes them, and adam_reference.adam_hyper for coded parameters: in double, rounded
// to fp32 once, where they meet a tensor (1.0f - 0.999f would be ~110 ulps below fp32(1 - 0.999)); with an fp32 tensor
// lr (lr_fp32), 1 - lr * weight_decay in fp32, each operation rounded (-ffp-contract=off), as torch's tensor arithmetic.
Schedule schedule(double lr, double weight_decay, double beta1, double beta2, double eps, bool decoupled, bool maximize, bool lr_fp32) {
  Hyper c{};
  c.sign = maximize ? -1.0f : 1.0f;
  c.decoupled = decoupled;
  const float decay =
      lr_fp32 ? 1.0f - static_cast<float>(lr) * static_cast<float>(weight_decay) : static_cast<float>(1.0 - lr * weight_decay);
  c.decay = decoupled ? decay : 1.0f;
  c.l2 = decoupled ? 0.0f : static_cast<float>(weight_decay);
  const Lerp lerp(1.0 - beta1);
  c.lerp_from_end = lerp.from_end, c.lerp_coeff = lerp.coeff;
  c.b2 = static_cast<float>(beta2), c.one_minus_b2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  return Schedule{c, lr, beta1, beta2, lr_fp32};
}

// A step counter: a 0-d fp32 or fp64 CPU tensor.
double steps_done(const at::Tensor& step) {
  return step.scalar_type() == at::kFloat ? static_cast<double>(*step.data_ptr<float>()) : *step.data_ptr<double>();
}

void count_step(const at::Tensor& step) {
  if (step.scalar_type() == at::kFloat)
    *step.data_ptr<float>() += 1.0f;
  else
    *step.data_ptr<double>() += 1.0;
}

// ---- The coded parameters ----

// What the block machinery (BlockOrder, check_gradients, step_blocks) needs of a parameter: its gradient g (fp32, or
// bf16/fp16 of ``dtype``), its numel and its chunks of ``chunk`` values (whole blocks of its states).
struct Chunks {
  const void* g;
  Dtype dtype;
  int64_t numel, chunk, chunks;
};

// One coded parameter of the multi-tensor Adam step. p, g: fp32 values, or (on a weight grid) of ``dtype``. It is
// stepped a chunk at a time: the larger block of its moments (blocks are powers of two: the smaller divides it; a
// cast's: the other's, CAST_CHUNK for two casts; a fast parameter's: at least FAST_CHUNK). ``fast``: both moments block states of one block
// size (step_block: decoded in registers, absmaxes taken on the way), ``bytes``: both of 8-bit codes (its stall counts too); else
// step_chunk decodes both into scratch first.
struct Param : Chunks {
  void* p;
  Grid grid;
  State m, v;
  Hyper h;
  bool fast, bytes;
};

// The chunk of a parameter whose moments are both casts, and the least chunk of a momentum buffer.
constexpr int64_t CAST_CHUNK = 1024;
// The least chunk of a fast parameter (whole blocks): per-call costs (constants, scale loads) spread over more values.
constexpr int64_t FAST_CHUNK = 1024;

// What the threads stepping one coded parameter's blocks report.
struct Outcome {
  std::atomic<int> grad_bad{0}, moments_bad{0};
  std::array<std::atomic<int64_t>, 4> stalls{};  // stalled_m, moved_m, stalled_v, moved_v (a momentum: stalled, moved)

  void add_stalls(const int64_t* counts, int n) {
    for (int c = 0; c < n; ++c) stalls[c].fetch_add(counts[c], std::memory_order_relaxed);
  }
};

// The tables of one state (kernels/native.py: _state_layout): decode, entries, planes, levels, segments.
constexpr int64_t kStateTables = 6;

// A state's Codebook from its kStateTables tables and its row of ``ints``; ``index``: a codebook (its entries, levels
// and segments are read), whose codes are at most ``last`` and clamped up to ``min_code``.
Codebook codebook(const at::Tensor* tables, int64_t key_base, int64_t key_shift, int64_t half, bool index, int64_t last, int64_t min_code) {
  const at::Tensor &decode = tables[0], &entries = tables[1], &planes = tables[2], &levels = tables[3], &segments = tables[4],
                   &windows = tables[5];
  TORCH_CHECK(segments.scalar_type() == at::kInt && (segments.numel() == 0 || (index && segments.numel() == segment::kZero + 1)),
              "a state's segment table: empty, or a codebook's ", segment::kZero + 1, " int32 entries (code_index.segment_table)");
  TORCH_CHECK(decode.numel() == 256 && decode.scalar_type() == at::kFloat && planes.numel() == 1024 && planes.scalar_type() == at::kByte &&
                  entries.scalar_type() == at::kInt && (!index || entries.numel() == 2 * half) && levels.numel() == 256 &&
                  levels.scalar_type() == at::kFloat && (!index || (last >= 1 && last <= 255)),
              "a state's tables: 256 fp32 decode values, int32 bucket entries (2 * half for a codebook), (4, 256) uint8 byte planes, "
              "256 fp32 search levels; a codebook's codes 2 to 256");
  TORCH_CHECK(windows.scalar_type() == at::kInt && windows.numel() == (index ? 8 * half : 0),
              "a state's floor windows: a codebook's (2 * half, 4) int32 (code_index.NearestCodeIndex.floor_windows), else none");
  const int32_t depth = index ? 32 - __builtin_clz(static_cast<uint32_t>(last)) : 1;  // codes <= last < 2^depth
  const float* values = decode.data_ptr<float>();
  const float size = static_cast<float>(1 << depth);
  bool on_grid = index && depth < 8 && last == (1 << depth) - 1 && min_code == 0;
  for (int64_t c = 0; on_grid && c <= last; ++c) on_grid = values[c] == static_cast<float>(c + 1) / size;
  return Codebook{values,
                  entries.data_ptr<int32_t>(),
                  index ? windows.data_ptr<int32_t>() : nullptr,
                  static_cast<int32_t>(key_base),
                  static_cast<int32_t>(key_shift),
                  static_cast<int32_t>(half),
                  planes.data_ptr<uint8_t>(),
                  levels.data_ptr<float>(),
                  depth,
                  segments.numel() == 0 ? nullptr : segments.data_ptr<int32_t>(),
                  on_grid ? size : 0.0f};
}

Scales scales_of(const at::Tensor& t, int64_t k) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "parameter ", k, ": scales must be fp32 or bf16");
  return Scales{t.data_ptr(), t.scalar_type() == at::kBFloat16};
}

// The Dtype of an fp32, bf16 or fp16 tensor (kNone for any other).
Dtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return Dtype::kFloat32;
    case at::kBFloat16:
      return Dtype::kBFloat16;
    case at::kHalf:
      return Dtype::kFloat16;
    default:
      return Dtype::kNone;
  }
}

// A parameter's weight grid from its row of ``grids`` [dtype code, stochastic, eco] and its SR seed (k: its index).
Grid grid_of(int64_t code, int64_t stochastic, int64_t eco, int64_t seed, int64_t k) {
  TORCH_CHECK(code >= 0 && code <= 3, "parameter ", k, ": grid dtype code ", code, " (0 none, 1 fp32, 2 bf16, 3 fp16)");
  TORCH_CHECK(code != 0 || (stochastic == 0 && eco == 0), "parameter ", k, ": stochastic rounding and ECO need a weight grid");
  return Grid{static_cast<Dtype>(code), stochastic != 0, eco != 0, static_cast<uint64_t>(seed)};
}

// Columns of a state's row of ``ints`` (kernels/native.py: _state_layout).
enum StateColumn {
  kKind,
  kBits,
  kBlock,
  kKeyBase,
  kKeyShift,
  kHalf,
  kMantissaBits,
  kBias,
  kMaxCode,
  kMinCode,
  kHasSign,
  kZeroFree,
  kStochastic,
  kStateColumns
};

// One moment of parameter k: its codes and scales, its tables (decode, entries, planes, levels, segments, windows) and its row of ``ints``,
// its minifloat's largest value; sizes checked against the parameter's numel.
State state_of(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor* tables, const int64_t* ints, float max_value,
               int64_t seed, int64_t numel, int64_t k) {
  State s{};
  s.stochastic = ints[kStochastic] != 0, s.seed = static_cast<uint64_t>(seed);
  s.last = static_cast<int32_t>(ints[kMaxCode]), s.min_code = static_cast<int32_t>(ints[kMinCode]);
  TORCH_CHECK(ints[kKind] >= 0 && ints[kKind] <= 2, "parameter ", k, ": state kind ", ints[kKind], " (0 codebook, 1 minifloat, 2 cast)");
  s.kind = static_cast<Kind>(ints[kKind]);
  s.bits = static_cast<int32_t>(ints[kBits]);
  s.block = ints[kBlock];
  s.codes = codes.data_ptr();
  s.zero_free = ints[kZeroFree] != 0;
  s.cb = codebook(tables, ints[kKeyBase], ints[kKeyShift], ints[kHalf], s.kind == Kind::kCodebook, ints[kMaxCode], ints[kMinCode]);
  s.mf.mantissa_bits = static_cast<int32_t>(ints[kMantissaBits]), s.mf.bias = static_cast<int32_t>(ints[kBias]);
  s.mf.max_code = static_cast<int32_t>(ints[kMaxCode]), s.mf.min_code = static_cast<int32_t>(ints[kMinCode]);
  s.mf.sign_shift = static_cast<int32_t>(ints[kBits] - 1), s.mf.has_sign = ints[kHasSign] != 0, s.mf.max_value = max_value;
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "parameter ", k, ": codes and scales must be contiguous");
  if (s.kind == Kind::kCast) {
    s.cast = dtype_of(codes);
    TORCH_CHECK(s.cast != Dtype::kNone && codes.numel() == numel, "parameter ", k, ": a cast state holds numel fp32, bf16 or fp16 values");
    s.smallest = s.cast == Dtype::kBFloat16 ? 0x1p-133f : (s.cast == Dtype::kFloat16 ? 0x1p-24f : 0.0f);
    return s;
  }
  TORCH_CHECK(
      codes.scalar_type() == at::kByte && s.bits >= 1 && s.bits <= 8 && s.block >= (s.dense() ? 8 : 2) && (s.block & (s.block - 1)) == 0,
      "parameter ", k, ": block codes are uint8 of 1 to 8 bits, blocks a power of two >= 2 (>= 8 for dense 5-7-bit codes)");
  TORCH_CHECK(s.kind != Kind::kMinifloat || (s.mf.max_code < (1 << s.bits) && s.mf.mantissa_bits >= 0 && s.mf.bias >= 0), "parameter ", k,
              ": a minifloat's codes must fit its bits");
  const int64_t blocks = (numel + s.block - 1) / s.block;
  TORCH_CHECK(codes.numel() == s.code_bytes(numel) && scales.numel() == blocks, "parameter ", k, ": codes or scales of the wrong size");
  s.scales = scales_of(scales, k);
  s.by_exponent = s.kind == Kind::kMinifloat && decodes_by_exponent(s.cb.decode, s.mf, s.bits);
  return s;
}

// The coded parameters' pointers, codebooks and hyperparameters, their sizes checked (arguments as adam_steps_u8's).
std::vector<Param> coded_params(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                                const std::vector<at::Tensor>& m_codes, const std::vector<at::Tensor>& m_scales,
                                const std::vector<at::Tensor>& v_codes, const std::vector<at::Tensor>& v_scales,
                                const std::vector<at::Tensor>& tables, const at::Tensor& ints, const at::Tensor& floats,
                                const at::Tensor& bounds, const at::Tensor& grids, const at::Tensor& seeds, const at::Tensor& eco,
                                const std::vector<at::Tensor>& steps, const Schedule& group) {
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(grads.size() == params.size() && m_codes.size() == params.size() && m_scales.size() == params.size() &&
                  v_codes.size() == params.size() && v_scales.size() == params.size(),
              "grads, codes and scales: one per coded parameter");
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == 2 * kStateTables * n, "tables: ", 2 * kStateTables, " per coded parameter");
  TORCH_CHECK(ints.scalar_type() == at::kLong && ints.dim() == 3 && ints.size(0) == n && ints.size(1) == 2 && ints.size(2) == kStateColumns,
              "ints: (n, 2, ", static_cast<int>(kStateColumns), ") int64");
  TORCH_CHECK(floats.scalar_type() == at::kFloat && floats.numel() == 2 * n, "floats: (n, 2) fp32");
  TORCH_CHECK(bounds.scalar_type() == at::kFloat && bounds.numel() == n, "bounds: one fp32 moment bound per coded parameter");
  TORCH_CHECK(grids.scalar_type() == at::kLong && grids.dim() == 2 && grids.size(0) == n && grids.size(1) == 3,
              "grids: (n, 3) int64 [grid dtype code, stochastic, eco]");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 2 && seeds.size(0) == n && seeds.size(1) == 3,
              "seeds: (n, 3) int64 [weights, m, v]");
  TORCH_CHECK(eco.scalar_type() == at::kFloat && eco.numel() == n, "eco: one fp32 ECO coefficient per coded parameter");
  const at::Tensor ints_c = ints.contiguous(), floats_c = floats.contiguous();
  const int64_t* ints_p = ints_c.data_ptr<int64_t>();
  const float* floats_p = floats_c.data_ptr<float>();
  const auto grids_a = grids.accessor<int64_t, 2>();
  const auto bounds_a = bounds.accessor<float, 1>(), eco_a = eco.accessor<float, 1>();
  const auto seeds_a = seeds.accessor<int64_t, 2>();
  std::vector<Param> work(n);
  for (int64_t k = 0; k < n; ++k) {
    Param& w = work[k];
    w.grid = grid_of(grids_a[k][0], grids_a[k][1], grids_a[k][2], seeds_a[k][0], k);
    w.dtype = dtype_of(params[k]);
    TORCH_CHECK(w.dtype == Dtype::kFloat32 || (w.dtype != Dtype::kNone && w.grid.active()), "parameter ", k,
                ": fp32, or fp32/bf16/fp16 on a weight grid");
    TORCH_CHECK(grads[k].scalar_type() == params[k].scalar_type(), "parameter ", k, ": the gradient must have the parameter's dtype");
    w.p = params[k].data_ptr(), w.g = grads[k].data_ptr();
    w.numel = params[k].numel();
    TORCH_CHECK(grads[k].numel() == w.numel, "parameter ", k, ": grad of the wrong size");
    TORCH_CHECK(params[k].is_contiguous() && grads[k].is_contiguous(), "parameter ", k, ": every tensor must be contiguous");
    const int64_t* row = ints_p + 2 * kStateColumns * k;
    w.m = state_of(m_codes[k], m_scales[k], &tables[2 * kStateTables * k], row, floats_p[2 * k], seeds_a[k][1], w.numel, k);
    w.v = state_of(v_codes[k], v_scales[k], &tables[(2 * k + 1) * kStateTables], row + kStateColumns, floats_p[2 * k + 1], seeds_a[k][2],
                   w.numel, k);
    w.h = group.at(steps_done(steps[k]), bounds_a[k]);
    w.h.eco = eco_a[k];
    const bool m_cast = w.m.kind == Kind::kCast, v_cast = w.v.kind == Kind::kCast;
    w.fast = !m_cast && !v_cast && w.m.block == w.v.block;
    w.bytes = w.fast && w.m.bits == 8 && w.v.bits == 8;
    w.chunk = w.fast ? std::max(w.m.block, FAST_CHUNK)
                     : (m_cast && v_cast ? CAST_CHUNK : std::max(m_cast ? 0 : w.m.block, v_cast ? 0 : w.v.block));
    w.chunks = (w.numel + w.chunk - 1) / w.chunk;
  }
  return work;
}

// Every block of the coded parameters, in one global order: parameter 0's blocks, then parameter 1's, ...
struct BlockOrder {
  std::vector<int64_t> first;  // (n + 1,): index of each parameter's first block; first[n]: the total

  template <typename Work>  // Chunks
  explicit BlockOrder(const std::vector<Work>& work) : first(work.size() + 1, 0) {
    for (size_t k = 0; k < work.size(); ++k) first[k + 1] = first[k] + work[k].chunks;
  }
  int64_t params() const { return static_cast<int64_t>(first.size()) - 1; }
  int64_t total() const { return first.back(); }
  // The parameter holding a global block index.
  int64_t owner(int64_t block) const {
    int64_t low = 0, high = params() - 1;
    while (low < high) {
      const int64_t mid = (low + high + 1) / 2;
      if (first[mid] <= block)
        low = mid;
      else
        high = mid - 1;
    }
    return low;
  }
};

// Whether values [first, first + n) of a coded parameter's gradient are finite.
bool grad_finite(const Chunks& w, int64_t first, int64_t n) { return values_finite(w.dtype, w.g, first, n); }

// The gradient check of the coded parameters ``cut`` (indices into work), threaded over their blocks: flags each whose
// gradient holds inf/NaN (it is left untouched).
template <typename Work>  // Chunks
void check_gradients(const std::vector<Work>& work, const std::vector<int64_t>& cut, std::vector<Outcome>& outcomes) {
  std::vector<Chunks> checked;
  for (const int64_t k : cut) checked.push_back(work[k]);
  const BlockOrder order(checked);
  const int64_t n = order.params();
  at::parallel_for(0, order.total(), 64, [&](int64_t begin, int64_t end) {  // each parameter's part of blocks [begin, end)
    for (int64_t k = order.owner(begin); k < n && order.first[k] < end; ++k) {
      const Chunks& w = checked[k];
      const int64_t first = std::max<int64_t>(begin - order.first[k], 0) * w.chunk;
      const int64_t last = std::min((end - order.first[k]) * w.chunk, w.numel);
      if (first < last && !grad_finite(w, first, last - first)) outcomes[cut[k]].grad_bad.store(1, std::memory_order_relaxed);
    }
  });
}

// One block of a fast parameter's chunk: its moments' scales before the step, and the absmaxes and all-finite flags of
// their new values.
struct BlockStats {
  float m_scale, v_scale, m_max = 0.0f, v_max = 0.0f;
  bool m_ok = true, v_ok = true;

  void merge(float m_top, float v_top, bool m_finite, bool v_finite) {
    m_max = std::max(m_max, m_top), v_max = std::max(v_max, v_top), m_ok = m_ok && m_finite, v_ok = v_ok && v_finite;
  }
};

// A thread's buffers for one block: decoded new moments, and the codes before the step (stall counts only).
struct Scratch {
  std::vector<float> m, v;
  std::vector<BlockStats> stats;  // step_block's, per block of its chunk
  std::vector<uint8_t> old_m, old_v;
  // step_chunk's stall counts: the values and units before the step, and the stored values and units after it
  std::vector<float> before, before_units, stored, stored_units;
};

// Values [base, base + size) of a parameter on a weight grid updated in place from the moments decoded in m, v (updated
// in place): grid_lanes for w's element type, rounding and feedback.
void grid_update(const Param& w, int64_t base, int64_t size, float* m, float* v) {
  with_grid_values(w.dtype, w.grid, w.p, w.g, base,
                   [&]<typename T, typename Rounding, bool Eco>(T* p, const T* g, Rounding, std::bool_constant<Eco>) {
                     grid_lanes<T, Rounding, Eco>(p, g, base, w.h, w.grid.seed, size, m, v);
                   });
}

// visit(first, end, stats[j]) for each block j of a fast parameter's values [base, base + n) (block j: chunk values
// [first, end)), its stats started with the block's scales before the step.
template <typename Visit>
void for_each_block(const Param& w, int64_t base, int64_t n, BlockStats* stats, Visit&& visit) {
  const int64_t block = w.m.block;
  for (int64_t first = 0, j = 0; first < n; first += block, ++j) {
    const int64_t index = (base + first) / block;
    stats[j] = BlockStats{w.m.scales.load(index), w.v.scales.load(index)};
    visit(first, std::min(first + block, n), stats[j]);
  }
}

#if defined(QSTATE_VBMI) || defined(QSTATE_AVX2)
// The absmaxes and flags that update (Update16 or Update8) gathered (since its last take) merged into s; update's
// restarted.
template <typename Update>
QSTATE_INLINE void take_stats(Update& update, BlockStats& s) {
  bool m_finite, v_finite;
  const float m_top = top_of(update.m_top, m_finite), v_top = top_of(update.v_top, v_finite);
  s.merge(m_top, v_top, m_finite, v_finite);
  update.m_top = decltype(update.m_top){}, update.v_top = decltype(update.v_top){};
}
#endif

#ifdef QSTATE_VBMI
// A block's values [i, end) 64 at a time while whole (i: where it stops): both moments decoded (Decode64, with the
// block's scales in s), then step(at, mi, vi) on each 16 (at: their first value in the chunk).
template <typename Step>
QSTATE_INLINE void decode_both64(const Decode64& m_codes, const Decode64& v_codes, int64_t base, int64_t& i, int64_t end,
                                 const BlockStats& s, Step&& step) {
  for (; i + 64 <= end; i += 64) {
    __m512 mi[4], vi[4];
    m_codes(base + i, s.m_scale, mi);
    v_codes(base + i, s.v_scale, vi);
    for (int r = 0; r < 4; ++r) step(i + 16 * r, mi[r], vi[r]);
  }
}
#endif

// The rest of a block, values [i, end) of a fast parameter's chunk (from element ``base``; all of the block without
// VBMI): both moments decoded into m, v, ``update()`` on them, then their absmaxes and flags merged into s.
template <typename Update>
void update_rest(const Param& w, int64_t base, int64_t i, int64_t end, float* m, float* v, BlockStats& s, Update&& update) {
  if (i == end) return;
  decode_state(w.m, base + i, end - i, false, m + i);
  decode_state(w.v, base + i, end - i, false, v + i);
  update();
  float m_top, v_top;
  bool m_ok, v_ok;
  absmax(m + i, end - i, m_top, m_ok);
  absmax(v + i, end - i, v_top, v_ok);
  s.merge(m_top, v_top, m_ok, v_ok);
}

// A fast parameter's chunk, values [base, base + n) (whole blocks but its last), updated block by block, the new
// moments to m / v, each block's scales, absmaxes and flags to stats. With VBMI both moments are decoded 64 values at a
// time in registers (Decode64) and step16(update, at, mi, vi) steps each 16 (at: their first value in the chunk) and
// records them (update: the Update16 whose absmaxes are the block's); the rest of a block goes to update_rest with
// rest(i, end).
template <typename Step16, typename Rest>
QSTATE_INLINE void update_blocks(const Param& w, int64_t base, int64_t n, float* m, float* v, BlockStats* stats, Step16&& step16,
                                 Rest&& rest) {
#ifdef QSTATE_VBMI
  Update16 update(w.h);
  const Decode64 m_codes(w.m), v_codes(w.v);
#endif
  for_each_block(w, base, n, stats, [&](int64_t first, int64_t end, BlockStats& s) {
    int64_t i = first;
#ifdef QSTATE_VBMI
    decode_both64(m_codes, v_codes, base, i, end, s, [&](int64_t at, __m512 mi, __m512 vi) { step16(update, at, mi, vi); });
    take_stats(update, s);
#endif
    update_rest(w, base, i, end, m, v, s, [&] { rest(i, end); });
  });
}

#ifdef QSTATE_AVX2
// How a block state's codes are packed (formats.packing): a byte each, two per byte (up to 4 bits), or dense groups of
// 8 codes in ``bits`` bytes (5 to 7 bits); with_packing visits it as a type (std::integral_constant).
enum class Packing { kBytes, kNibbles, kDense };

template <typename Visit>
QSTATE_INLINE void with_packing(const State& s, Visit&& visit) {
  if (s.nibbles())
    visit(std::integral_constant<Packing, Packing::kNibbles>{});
  else if (s.dense())
    visit(std::integral_constant<Packing, Packing::kDense>{});
  else
    visit(std::integral_constant<Packing, Packing::kBytes>{});
}

// 8 values of a block state from element ``index`` (a multiple of 8), decoded as decode_bytes / decode_nibbles /
// decode_dense do: their table's values times the block's scale. 4-bit codes by register permutes of the table's first
// 16 values (lookup16), as 8-bit minifloat codes whose table allows it (State::by_exponent: exponent_decode, those 16
// values raised by powers of two), the others by gather_bytes8 (from the bytes) or gather8; a dense group's 8 codes
// from its word by a byte shuffle (the two bytes each code spans), a shift and a mask per lane.
template <Packing P>
struct Decode8 {
  const uint8_t* codes;
  const float* table;
  __m256 low, high;                            // table[0:8], table[8:16] (kNibbles; kBytes by exponent)
  int32_t bits;                                // kDense: bits per code
  int64_t whole_words;                         // kDense: the groups whose 8-byte word lies inside the codes (the others read exactly)
  __m256i spans, offsets, mask;                // kDense, per code j: the bytes of its span in the word, its first bit in them, its mask
  bool by_exponent;                            // kBytes: State::by_exponent, with
  __m256i sign_bit, magnitude_mask, max_code;  // the codes' sign bit (0: unsigned), the bits below it, the largest magnitude
  __m128i mantissa_bits;                       // and its mantissa bits (a shift count)

  // s: a block state of a parameter of ``numel`` values.
  Decode8(const State& s, int64_t numel)
      : codes(static_cast<const uint8_t*>(s.codes)),
        table(s.cb.decode),
        low(_mm256_loadu_ps(table)),
        high(_mm256_loadu_ps(table + 8)),
        bits(s.bits),
        by_exponent(P == Packing::kBytes && s.by_exponent) {
    if (by_exponent) {
      sign_bit = _mm256_set1_epi32(s.mf.has_sign ? 0x80 : 0);
      magnitude_mask = _mm256_set1_epi32(s.mf.has_sign ? 0x7F : 0xFF);
      max_code = _mm256_set1_epi32(s.mf.max_code);
      mantissa_bits = _mm_cvtsi32_si128(s.mf.mantissa_bits);
    }
    if constexpr (P == Packing::kDense) {
      const int64_t bytes = s.code_bytes(numel);
      whole_words = bytes >= 8 ? (bytes - 8) / bits + 1 : 0;
      alignas(32) int32_t span[8], offset[8];
      for (int j = 0; j < 8; ++j) {
        const int32_t first = j * bits / 8;  // within each 128-bit lane: the word is broadcast to every 64-bit one
        span[j] = static_cast<int32_t>(0x80800000u | (first + 1) << 8 | first);  // bytes 2, 3: zero
        offset[j] = j * bits % 8;
      }
      spans = _mm256_load_si256(reinterpret_cast<const __m256i*>(span));
      offsets = _mm256_load_si256(reinterpret_cast<const __m256i*>(offset));
      mask = _mm256_set1_epi32((1 << bits) - 1);
    }
  }

  QSTATE_INLINE __m256 operator()(int64_t index, __m256 scale) const {
    if constexpr (P == Packing::kNibbles) {  // 4 bytes: low and high nibbles interleaved into 8 codes
      uint32_t word;
      std::memcpy(&word, codes + index / 2, 4);
      const __m128i pairs = _mm_cvtsi32_si128(static_cast<int32_t>(word)), nibble = _mm_set1_epi8(0x0F);
      const __m128i bytes = _mm_unpacklo_epi8(_mm_and_si128(pairs, nibble), _mm_and_si128(_mm_srli_epi16(pairs, 4), nibble));
      return _mm256_mul_ps(lookup16(low, high, _mm256_cvtepu8_epi32(bytes)), scale);
    } else if constexpr (P == Packing::kDense) {
      const int64_t group = index / 8;
      uint64_t word = 0;
      if (group < whole_words)
        std::memcpy(&word, codes + group * bits, 8);
      else
        std::memcpy(&word, codes + group * bits, bits);
      const __m256i spanned = _mm256_shuffle_epi8(_mm256_set1_epi64x(static_cast<int64_t>(word)), spans);
      const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(spanned, offsets), mask);
      return _mm256_mul_ps(gather8(table, code), scale);
    } else {
      if (!by_exponent) return _mm256_mul_ps(gather_bytes8(table, codes + index), scale);
      const __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + index)));
      const __m256i one = _mm256_set1_epi32(1);  // exponent_decode on 8 lanes
      const __m256i magnitude = _mm256_min_epi32(_mm256_and_si256(code, magnitude_mask), max_code);
      const __m256i raised = _mm256_sub_epi32(_mm256_max_epi32(_mm256_srl_epi32(magnitude, mantissa_bits), one), one);
      const __m256 first = lookup16(low, high, _mm256_sub_epi32(magnitude, _mm256_sll_epi32(raised, mantissa_bits)));
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, sign_bit), 24);
      const __m256i pattern = _mm256_or_si256(_mm256_add_epi32(_mm256_castps_si256(first), _mm256_slli_epi32(raised, 23)), sign);
      return _mm256_mul_ps(_mm256_castsi256_ps(pattern), scale);
    }
  }
};

// update_fp32_blocks with AVX2 (moments packed as MPacking, VPacking): each block's values 8 at a time decoded (Decode8),
// stepped by Update8 and recorded with their absmaxes; the rest of a block by update_rest.
template <Packing MPacking, Packing VPacking>
QSTATE_NOINLINE void update_fp32_blocks8(float* __restrict__ p, const float* __restrict__ g, const Param& w, int64_t base, int64_t n,
                                         float* __restrict__ m, float* __restrict__ v, BlockStats* stats) {
  Update8 update(w.h);
  const Decode8<MPacking> m_codes(w.m, w.numel);
  const Decode8<VPacking> v_codes(w.v, w.numel);
  for_each_block(w, base, n, stats, [&](int64_t first, int64_t end, BlockStats& s) {
    const __m256 m_scale = _mm256_set1_ps(s.m_scale), v_scale = _mm256_set1_ps(s.v_scale);
    int64_t i = first;
    for (; i + 8 <= end; i += 8) update(p + i, g + i, m_codes(base + i, m_scale), v_codes(base + i, v_scale), m + i, v + i);
    take_stats(update, s);
    update_rest(w, base, i, end, m, v, s, [&] { update_values(p + i, g + i, w.h, end - i, m + i, v + i); });
  });
}
#endif

// update_blocks of a parameter with fp32 values: Update16's Adam step, update_values for the rest (with AVX2:
// update_fp32_blocks8).
void update_fp32_blocks(float* __restrict__ p, const float* __restrict__ g, const Param& w, int64_t base, int64_t n, float* __restrict__ m,
                        float* __restrict__ v, BlockStats* stats) {
#ifdef QSTATE_AVX2
  with_packing(w.m, [&](auto m_packing) {
    with_packing(w.v, [&](auto v_packing) { update_fp32_blocks8<m_packing(), v_packing()>(p, g, w, base, n, m, v, stats); });
  });
#else
  update_blocks(
      w, base, n, m, v, stats, [&](auto& update, int64_t at, auto mi, auto vi) { update(p + at, g + at, mi, vi, m + at, v + at); },
      [&](int64_t i, int64_t end) { update_values(p + i, g + i, w.h, end - i, m + i, v + i); });
#endif
}

// update_blocks of a parameter on a weight grid: Update16::advance, grid_lanes for the rest. Never inlined: its
// loops (one per element type, rounding and feedback) inlined into step_block made the step of fp32 parameters 11 %
// slower (one thread, int8).
QSTATE_NOINLINE void update_grid_blocks(const Param& w, int64_t base, int64_t n, float* m, float* v, BlockStats* stats) {
  with_grid_values(
      w.dtype, w.grid, w.p, w.g, base, [&]<typename T, typename Rounding, bool Eco>(T* p, const T* g, Rounding, std::bool_constant<Eco>) {
        update_blocks(
            w, base, n, m, v, stats,
            [&](auto& update, int64_t at, auto mi, auto vi) {
              update.template advance<T, Rounding, Eco>(p + at, g + at, mi, vi, w.grid.seed, base + at);
              update.record(mi, vi, m + at, v + at);
            },
            [&](int64_t i, int64_t end) { grid_lanes<T, Rounding, Eco>(p + i, g + i, base + i, w.h, w.grid.seed, end - i, m + i, v + i); });
      });
}

// The step of a fast parameter's chunk ``index`` (whole blocks but its last): decoded, updated (update_fp32_blocks, or
// update_grid_blocks on a weight grid) and encoded in place block by block; its stall counts (8-bit codes only). Never
// inlined, nor step_chunk: inlined into step_blocks' batched loop they made the int8 and fp8 steps 10 % slower.
QSTATE_NOINLINE void step_block(const Param& w, int64_t index, bool track, Scratch& scratch, Outcome& outcome) {
  const int64_t base = index * w.chunk, size = std::min(w.chunk, w.numel - base), block = w.m.block;
  const uint8_t *mc = static_cast<const uint8_t*>(w.m.codes) + base, *vc = static_cast<const uint8_t*>(w.v.codes) + base;
  scratch.m.resize(size), scratch.v.resize(size), scratch.stats.resize((size + block - 1) / block);
  float *m = scratch.m.data(), *v = scratch.v.data();
  if (track) {
    scratch.old_m.assign(mc, mc + size);
    scratch.old_v.assign(vc, vc + size);
  }
  if (w.grid.active())
    update_grid_blocks(w, base, size, m, v, scratch.stats.data());
  else
    update_fp32_blocks(static_cast<float*>(w.p) + base, static_cast<const float*>(w.g) + base, w, base, size, m, v, scratch.stats.data());
  int64_t local[4] = {0, 0, 0, 0};
  bool ok = true;
  for (int64_t first = 0, j = 0; first < size; first += block, ++j) {
    const BlockStats& s = scratch.stats[j];
    const int64_t n = std::min(block, size - first), at = base + first;
    const float m_new = encode_one_block<false>(w.m, at / block, at, n, m + first, s.m_max, s.m_ok);
    const float v_new = encode_one_block<true>(w.v, at / block, at, n, v + first, s.v_max, s.v_ok);
    ok = ok && s.m_ok && s.v_ok;
    if (track) {
      count_block(scratch.old_m.data() + first, s.m_scale, mc + first, m_new, m + first, w.m.cb.decode, n, local);
      count_block(scratch.old_v.data() + first, s.v_scale, vc + first, v_new, v + first, w.v.cb.decode, n, local + 2);
    }
  }
  if (!ok) outcome.moments_bad.store(1, std::memory_order_relaxed);
  if (track) outcome.add_stalls(local, 4);
}

// The values and units of state s at [base, base + size) into scratch (before: ``after`` false; stored: true).
void snapshot(const State& s, int64_t base, int64_t size, bool after, Scratch& scratch, const float* decoded = nullptr) {
  std::vector<float>& values = after ? scratch.stored : scratch.before;
  std::vector<float>& units = after ? scratch.stored_units : scratch.before_units;
  values.resize(size), units.resize(size);
  if (decoded != nullptr)
    std::copy(decoded, decoded + size, values.begin());
  else
    decode_state(s, base, size, false, values.data());
  decode_state(s, base, size, true, units.data());
}

// count_values of state s's values [base, base + size), stored from ``updated``, against their snapshot before the
// step (``before``, ``before_units``): [stalled, moved] added to counts.
void count_stored(const State& s, int64_t base, int64_t size, const float* before, const float* before_units, const float* updated,
                  Scratch& scratch, int64_t* counts) {
  snapshot(s, base, size, true, scratch);
  count_values(before, before_units, updated, scratch.stored.data(), scratch.stored_units.data(), size, counts);
}

#ifdef QSTATE_AVX512
// cast_registers' loop for the casts m, v (Cast16): one function per pair of casts (in one function with the others the
// loops were 5-10 % slower). Returns the values done (whole vectors); ``finite``: whether all it stored are.
template <typename CastM, typename CastV>
QSTATE_NOINLINE int64_t cast_loop(const Param& w, const CastM& m, const CastV& v, int64_t base, int64_t n, bool& finite) {
  const Update16 update(w.h);
  float* p = static_cast<float*>(w.p) + base;
  const float* g = static_cast<const float*>(w.g) + base;
  int64_t i = 0;
  __m256i m_top = _mm256_setzero_si256(), v_top = _mm256_setzero_si256();
  for (; i + 16 <= n; i += 16) {
    __m512 mi = m.load(base + i), vi = v.load(base + i);
    update.advance(p + i, g + i, mi, vi);
    m.store(base + i, mi, m_top), v.store(base + i, vi, v_top);
  }
  finite = m.finite(m_top) && v.finite(v_top);
  return i;
}
#endif

// cast_registers' loop without AVX-512 (and for its last values with it): values [base, base + n) of the parameter,
// its moments' casts rounded by RoundingM and RoundingV, kCodeChunk at a time (SR draws by draws_of): with AVX2 8 at a
// time by Update8, the rest decoded, then updated (adam_lane) and stored in one branch-free loop, which the compiler
// vectorizes (as step_chunk's passes through scratch compute them). Returns whether every pattern stored is finite.
template <typename RoundingM, typename RoundingV>
QSTATE_NOINLINE bool cast_lanes(const Param& w, int64_t base, int64_t n) {
  using M = typename RoundingM::Element;
  using V = typename RoundingV::Element;
  const Hyper h = w.h;
  const uint32_t m_zero_free = mask_of(w.m.zero_free), v_zero_free = mask_of(w.v.zero_free);
#ifdef QSTATE_AVX2
  const Update8 update(h);
#endif
  float m[kCodeChunk], v[kCodeChunk];
  uint32_t m_buffer[kCodeChunk + kDrawSlack], v_buffer[kCodeChunk + kDrawSlack];
  uint32_t m_top = 0, v_top = 0;  // the largest magnitudes of the patterns stored
#ifdef QSTATE_AVX2
  __m128i m_tops = _mm_setzero_si128(), v_tops = _mm_setzero_si128();
  const __m128i magnitude = _mm_set1_epi16(0x7FFF);
#endif
  for (int64_t done = 0; done < n; done += kCodeChunk) {
    int64_t size = std::min(kCodeChunk, n - done);
    float* __restrict__ p = static_cast<float*>(w.p) + base + done;
    const float* __restrict__ g = static_cast<const float*>(w.g) + base + done;
    M* __restrict__ mc = static_cast<M*>(w.m.codes) + base + done;
    V* __restrict__ vc = static_cast<V*>(w.v.codes) + base + done;
    const uint32_t* __restrict__ m_draws = RoundingM::kStochastic ? draws_of<4>(w.m.seed, base + done, size, m_buffer) : nullptr;
    const uint32_t* __restrict__ v_draws = RoundingV::kStochastic ? draws_of<4>(w.v.seed, base + done, size, v_buffer) : nullptr;
#ifdef QSTATE_AVX2
    const int64_t whole = size / 8 * 8;
    for (int64_t j = 0; j < whole; j += 8) {
      __m256 mi = load8(mc + j), vi = load8(vc + j);
      update.advance(p + j, g + j, mi, vi);
      m_tops = _mm_max_epu16(m_tops, _mm_and_si128(store_cast8<RoundingM>(mc + j, mi, m_draws, j, w.m.zero_free), magnitude));
      v_tops = _mm_max_epu16(v_tops, _mm_and_si128(store_cast8<RoundingV>(vc + j, vi, v_draws, j, w.v.zero_free), magnitude));
    }
    p += whole, g += whole, mc += whole, vc += whole, size -= whole;
    if (RoundingM::kStochastic) m_draws += whole;
    if (RoundingV::kStochastic) v_draws += whole;
#endif
    for (int64_t j = 0; j < size; ++j) m[j] = to_float(mc[j]), v[j] = to_float(vc[j]);
    for (int64_t j = 0; j < size; ++j) {
      float mi = m[j], vi = v[j], denom;
      p[j] = adam_lane(p[j], g[j], mi, vi, h, denom);
      const uint16_t m_pattern = cast_pattern<RoundingM>(mi, RoundingM::kStochastic ? m_draws[j] : 0u, m_zero_free);
      const uint16_t v_pattern = cast_pattern<RoundingV>(vi, RoundingV::kStochastic ? v_draws[j] : 0u, v_zero_free);
      mc[j] = M{m_pattern}, vc[j] = V{v_pattern};
      m_top = std::max<uint32_t>(m_top, m_pattern & 0x7FFFu), v_top = std::max<uint32_t>(v_top, v_pattern & 0x7FFFu);
    }
  }
#ifdef QSTATE_AVX2
  for (int k = 0; k < 8; ++k, m_tops = _mm_srli_si128(m_tops, 2), v_tops = _mm_srli_si128(v_tops, 2)) {
    m_top = std::max<uint32_t>(m_top, static_cast<uint16_t>(_mm_extract_epi16(m_tops, 0)));
    v_top = std::max<uint32_t>(v_top, static_cast<uint16_t>(_mm_extract_epi16(v_tops, 0)));
  }
#endif
  return m_top < kNonfiniteFrom<M> && v_top < kNonfiniteFrom<V>;
}

// Values [base, base + n) of a parameter with fp32 values whose moments are both bf16/fp16 casts, each value decoded,
// updated and stored in registers (as step_chunk's passes through scratch compute them): with AVX-512 16 at a time,
// cast_lanes for the rest. Returns whether every moment stored is finite (casts store a finite value past their range as
// inf: an overflow, as a block state's non-finite scale).
bool cast_registers(const Param& w, int64_t base, int64_t n) {
  int64_t i = 0;
  bool finite = true;
#ifdef QSTATE_AVX512
  with_cast16(w.m, [&](const auto& m) { with_cast16(w.v, [&](const auto& v) { i = cast_loop(w, m, v, base, n, finite); }); });
#endif
  if (i == n) return finite;
  with_rounding(w.m.cast, w.m.stochastic, [&]<typename RoundingM>(RoundingM) {
    with_rounding(w.v.cast, w.v.stochastic, [&]<typename RoundingV>(RoundingV) {
      if constexpr (!std::is_same_v<RoundingM, KeepFp32> && !std::is_same_v<RoundingV, KeepFp32>)
        finite = cast_lanes<RoundingM, RoundingV>(w, base + i, n - i) && finite;
    });
  });
  return finite;
}

// The per-chunk step of any other parameter: chunk ``index`` of w (both moments' blocks whole, but the parameter's
// last) decoded into scratch, updated (update_values, or grid_update on a weight grid), each moment encoded block by
// block (encode_state); and its stall counts. Two bf16/fp16 casts of fp32 values without stall counts: cast_registers,
// scratch for the rest.
QSTATE_NOINLINE void step_chunk(const Param& w, int64_t index, bool track, Scratch& scratch, Outcome& outcome) {
  const int64_t base = index * w.chunk, size = std::min(w.chunk, w.numel - base);
  const auto short_cast = [](const State& s) { return s.kind == Kind::kCast && s.cast != Dtype::kFloat32; };
  if (!track && !w.grid.active() && short_cast(w.m) && short_cast(w.v)) {
    if (!cast_registers(w, base, size)) outcome.moments_bad.store(1, std::memory_order_relaxed);
    return;
  }
  scratch.m.resize(size), scratch.v.resize(size);
  float *m = scratch.m.data(), *v = scratch.v.data();
  decode_state(w.m, base, size, false, m);
  decode_state(w.v, base, size, false, v);
  int64_t local[4] = {0, 0, 0, 0};
  std::vector<float> before_m, before_m_units;
  if (track) {  // m's snapshot kept aside while v's is taken
    snapshot(w.m, base, size, false, scratch, m);
    before_m.swap(scratch.before), before_m_units.swap(scratch.before_units);
    snapshot(w.v, base, size, false, scratch, v);
  }
  if (w.grid.active())
    grid_update(w, base, size, m, v);
  else
    update_values(static_cast<float*>(w.p) + base, static_cast<const float*>(w.g) + base, w.h, size, m, v);
  const bool m_ok = encode_state<false>(w.m, base, size, m);
  const bool v_ok = encode_state<true>(w.v, base, size, v);
  if (!(m_ok && v_ok)) outcome.moments_bad.store(1, std::memory_order_relaxed);
  if (track) {
    count_stored(w.v, base, size, scratch.before.data(), scratch.before_units.data(), v, scratch, local + 2);
    count_stored(w.m, base, size, before_m.data(), before_m_units.data(), m, scratch, local);
    outcome.add_stalls(local, 4);
  }
}

// The gradients of a batch checked at a time: the parameters a thread steps whole, checked just before it steps them,
// a batch of at least this many values (their gradients then read from cache by the step).
constexpr int64_t CHECK_BATCH = 1 << 16;

// The coded parameters' steps: ``step(w, chunk index, scratch, outcome)`` on every chunk of every parameter of
// ``work`` (Chunks) whose gradient is finite. The global block order is cut into one part per thread; a thread checks
// the gradients of the parameters wholly in its part a batch at a time (CHECK_BATCH), each batch just before it steps
// it; the parameters cut between parts are checked first, by all threads. Returns what each parameter's threads
// reported.
template <typename Work, typename Step>
std::vector<Outcome> step_blocks(const std::vector<Work>& work, Step&& step) {
  const BlockOrder order(work);
  const int64_t n = order.params(), total = order.total();
  std::vector<Outcome> outcomes(work.size());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / 16));
  const auto bound = [&](int64_t t) { return total * t / parts; };
  std::vector<int64_t> cut;
  for (int64_t t = 1; t < parts; ++t) {
    const int64_t k = order.owner(bound(t));
    if (order.first[k] < bound(t) && (cut.empty() || cut.back() != k)) cut.push_back(k);
  }
  check_gradients(work, cut, outcomes);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t low = bound(t), high = bound(t + 1);
      const auto whole = [&](int64_t k) { return order.first[k] >= low && order.first[k + 1] <= high; };
      for (int64_t k = low < high ? order.owner(low) : n, next; k < n && order.first[k] < high; k = next) {
        next = k + 1;
        if (whole(k)) {
          for (int64_t values = work[k].numel; next < n && whole(next) && values < CHECK_BATCH; ++next) values += work[next].numel;
          for (int64_t j = k; j < next; ++j)
            if (!grad_finite(work[j], 0, work[j].numel)) outcomes[j].grad_bad.store(1, std::memory_order_relaxed);
        }
        for (int64_t j = k; j < next; ++j) {
          if (outcomes[j].grad_bad.load(std::memory_order_relaxed)) continue;
          for (int64_t b = std::max(low, order.first[j]); b < std::min(high, order.first[j + 1]); ++b)
            step(work[j], b - order.first[j], scratch, outcomes[j]);
        }
      }
    }
  });
  return outcomes;
}

// (rows, 2 + stalls) int64, its first rows per parameter [grad_finite, states_finite, its first ``stalls`` stall counts]
// from ``outcomes``, the rest 0.
at::Tensor outcome_rows(const std::vector<Outcome>& outcomes, int64_t rows, int stalls) {
  const int64_t columns = 2 + stalls;
  at::Tensor result(at::detail::empty_cpu({rows, columns}, at::kLong));
  int64_t* out = result.data_ptr<int64_t>();
  std::fill(out, out + rows * columns, int64_t{0});
  for (size_t k = 0; k < outcomes.size(); ++k) {
    int64_t* row = out + static_cast<int64_t>(k) * columns;
    row[0] = outcomes[k].grad_bad.load() ? 0 : 1;
    row[1] = outcomes[k].moments_bad.load() ? 0 : 1;
    for (int c = 0; c < stalls; ++c) row[2 + c] = outcomes[k].stalls[c].load();
  }
  return result;
}

// ---- The fp32-state parameters ----

// One fp32-state parameter (a small one, as a rule): the same gradient check and update, moments stored as they are.
// Returns whether its gradient was finite (else nothing changed).
bool step_plain(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, const Hyper& h) {
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float *m = exp_avg.data_ptr<float>(), *v = exp_avg_sq.data_ptr<float>();
  const int64_t numel = param.numel();
  std::atomic<int> bad{0};
  at::parallel_for(0, numel, 1 << 16, [&](int64_t begin, int64_t end) {
    if (!all_finite(g + begin, end - begin)) bad.store(1, std::memory_order_relaxed);
  });
  if (bad.load()) return false;
  at::parallel_for(0, numel, 1 << 16,
                   [&](int64_t begin, int64_t end) { update_values(p + begin, g + begin, h, end - begin, m + begin, v + begin); });
  return true;
}

// ---- SGD's and Muon's momentum (QSGD, QMuon) ----

// One parameter with a coded momentum buffer: values p (SGD's step updates them) and gradient g, fp32 or (SGD on a
// weight grid) of ``dtype``, the buffer, and Muon's update (fp32, numel values; nullptr: SGD). Stepped a chunk at a
// time: whole blocks of the buffer, at least CAST_CHUNK values. ``eco``: ECO's coefficient of the rounding error in the
// buffer (optim.weights.sgd_feedback_coefficient, as fp32) where the grid feeds it back. ``created``: SGD's first step,
// which creates the buffer (its codes are written, not read).
struct MomentumParam : Chunks {
  void* p;
  float* update;
  State buf;
  Grid grid;
  float eco;
  bool created;
};

// torch's sgd / muon hyperparameters as fp32 (Momentum): each Python float rounded once from double, as torch rounds
// a scalar that meets an fp32 tensor (1 - dampening, -lr, and Muon's lerp weights computed in double first).
Momentum momentum_of(double lr, double weight_decay, double momentum, double dampening, bool nesterov, bool maximize) {
  return Momentum{maximize ? -1.0f : 1.0f,
                  static_cast<float>(weight_decay),
                  static_cast<float>(momentum),
                  static_cast<float>(1.0 - dampening),
                  static_cast<float>(-lr),
                  weight_decay != 0.0,
                  nesterov,
                  false,
                  Lerp(1.0 - momentum),
                  Lerp(momentum)};
}

// SGD's momentum step on n values (sgd_lane): param p and the decoded buffer buf in place. Branch-free: the compiler
// vectorizes the loop (as grid_lanes).
QSTATE_FLATTEN void sgd_lanes(float* __restrict__ p, const float* __restrict__ g, const Momentum h, int64_t n, float* __restrict__ buf) {
  for (int64_t i = 0; i < n; ++i) p[i] = sgd_lane(p[i], g[i], buf[i], h);
}

// sgd_grid_lanes' loop over values [0, n) (draws[i]: value i's SR draw where Rounding draws).
template <typename T, typename Rounding, bool Eco>
QSTATE_INLINE void sgd_grid_loop(T* __restrict__ p, const T* __restrict__ g, const uint32_t* __restrict__ draws, const Momentum& h,
                                 float eco, int64_t n, float* __restrict__ buf) {
  for (int64_t i = 0; i < n; ++i) {
    float b = buf[i];
    const float updated = sgd_lane(to_float(p[i]), to_float(g[i]), b, h);
    const float rounded = Rounding::round(updated, Rounding::kStochastic ? draws[i] : 0u);
    if constexpr (Eco) b = b + eco * (updated - rounded);
    p[i] = from_float<T>(rounded);
    buf[i] = b;
  }
}

// SGD's step on values [0, n) of a parameter on a weight grid, param and gradient of type T (read as fp32), the decoded
// buffer in place, as the reference path's QSGD with ``weights``: sgd_lane's new value rounded to the grid with
// Rounding (element ``first + i``: its SR draw) and stored in T, and with Eco buf = buf + eco * (updated - rounded) (the
// product rounded first, as QSGD._feed_back_error). As grid_lanes: with AVX-512 16 values at a time by sgd16 and
// round_store16; the rest kCodeChunk at a time (chunks_with_draws), with AVX2 8 at a time by sgd8 and round_store8, the
// remainder by the branch-free loop the compiler vectorizes.
template <typename T, typename Rounding, bool Eco>
QSTATE_FLATTEN void sgd_grid_lanes(T* __restrict__ p, const T* __restrict__ g, int64_t first, const Momentum h, uint64_t seed, float eco,
                                   int64_t n, float* __restrict__ buf) {
#ifdef QSTATE_AVX512
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 b = _mm512_loadu_ps(buf + i);
    const __m512 updated = sgd16(load16(p + i), load16(g + i), b, h);
    const __m512 rounded = round_store16(Rounding{}, p + i, updated, seed, first + i);
    if constexpr (Eco) b = _mm512_add_ps(b, _mm512_mul_ps(_mm512_set1_ps(eco), _mm512_sub_ps(updated, rounded)));
    _mm512_storeu_ps(buf + i, b);
  }
  p += i, g += i, buf += i, first += i, n -= i;
#endif
  chunks_with_draws<4, Rounding::kStochastic>(seed, first, n, [&](int64_t done, int64_t size, const uint32_t* draws) {
    int64_t j = 0;
#ifdef QSTATE_AVX2
    for (; j + 8 <= size; j += 8) {
      const int64_t at = done + j;
      __m256 b = _mm256_loadu_ps(buf + at);
      const __m256 updated = sgd8(load8(p + at), load8(g + at), b, h);
      const __m256 rounded = round_store8(Rounding{}, p + at, updated, draws == nullptr ? nullptr : draws + j);
      if constexpr (Eco) b = _mm256_add_ps(b, _mm256_mul_ps(_mm256_set1_ps(eco), _mm256_sub_ps(updated, rounded)));
      _mm256_storeu_ps(buf + at, b);
    }
#endif
    sgd_grid_loop<T, Rounding, Eco>(p + done + j, g + done + j, draws == nullptr ? nullptr : draws + j, h, eco, size - j, buf + done + j);
  });
}

// SGD's step on values [base, base + size) of w: sgd_lanes, or on a weight grid sgd_grid_lanes for w's element type,
// rounding and feedback.
void sgd_update(const MomentumParam& w, const Momentum& h, int64_t base, int64_t size, float* buf) {
  if (!w.grid.active()) {
    sgd_lanes(static_cast<float*>(w.p) + base, static_cast<const float*>(w.g) + base, h, size, buf);
    return;
  }
  with_grid_values(w.dtype, w.grid, w.p, w.g, base,
                   [&]<typename T, typename Rounding, bool Eco>(T* p, const T* g, Rounding, std::bool_constant<Eco>) {
                     sgd_grid_lanes<T, Rounding, Eco>(p, g, base, h, w.grid.seed, w.eco, size, buf);
                   });
}

// Muon's momentum on n values (muon_lane): the decoded buffer buf in place, the update to ``update``.
QSTATE_FLATTEN void muon_lanes(const float* __restrict__ g, const Momentum h, int64_t n, float* __restrict__ buf,
                               float* __restrict__ update) {
  for (int64_t i = 0; i < n; ++i) update[i] = muon_lane(g[i], buf[i], h);
}

// The per-chunk step of a momentum buffer: chunk ``index`` of w decoded into scratch (unless the step creates it), SGD's
// step (the param in place, on its weight grid if it has one) or Muon's momentum (its update written), the buffer
// encoded back block by block (encode_state); and its stall counts (none for a buffer created now, as the reference
// path counts).
void momentum_chunk(const MomentumParam& w, const Momentum& h, int64_t index, bool track, Scratch& scratch, Outcome& outcome) {
  const int64_t base = index * w.chunk, size = std::min(w.chunk, w.numel - base);
  scratch.m.resize(size);
  float* buf = scratch.m.data();
  const bool counted = track && !w.created;
  if (!w.created) decode_state(w.buf, base, size, false, buf);
  if (counted) snapshot(w.buf, base, size, false, scratch, buf);
  if (w.update != nullptr) {
    muon_lanes(static_cast<const float*>(w.g) + base, h, size, buf, w.update + base);
  } else {
    Momentum step = h;
    step.created = w.created;
    sgd_update(w, step, base, size, buf);
  }
  if (!encode_state<false>(w.buf, base, size, buf)) outcome.moments_bad.store(1, std::memory_order_relaxed);
  if (counted) {
    int64_t local[2] = {0, 0};
    count_stored(w.buf, base, size, scratch.before.data(), scratch.before_units.data(), buf, scratch, local);
    outcome.add_stalls(local, 2);
  }
}

// The momentum parameters' pointers and buffers, their sizes checked (arguments as momentum_steps').
std::vector<MomentumParam> momentum_params(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                                           const std::vector<at::Tensor>& codes, const std::vector<at::Tensor>& scales,
                                           const std::vector<at::Tensor>& tables, const at::Tensor& ints, const at::Tensor& floats,
                                           const at::Tensor& grids, const at::Tensor& seeds, const at::Tensor& eco,
                                           const at::Tensor& created, const std::vector<at::Tensor>& updates) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && codes.size() == n && scales.size() == n && (updates.empty() || updates.size() == n),
              "grads, codes, scales (and Muon's updates): one per parameter");
  TORCH_CHECK(grids.scalar_type() == at::kLong && grids.dim() == 2 && grids.size(0) == static_cast<int64_t>(n) && grids.size(1) == 3,
              "grids: (n, 3) int64 [grid dtype code, stochastic, eco]");
  TORCH_CHECK(eco.scalar_type() == at::kFloat && eco.numel() == static_cast<int64_t>(n), "eco: one fp32 ECO coefficient per parameter");
  TORCH_CHECK(created.scalar_type() == at::kBool && created.numel() == static_cast<int64_t>(n), "created: one bool per parameter");
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == kStateTables * static_cast<int64_t>(n), "tables: ", kStateTables, " per parameter");
  TORCH_CHECK(
      ints.scalar_type() == at::kLong && ints.dim() == 2 && ints.size(0) == static_cast<int64_t>(n) && ints.size(1) == kStateColumns,
      "ints: (n, ", static_cast<int>(kStateColumns), ") int64");
  TORCH_CHECK(floats.scalar_type() == at::kFloat && floats.numel() == static_cast<int64_t>(n), "floats: (n,) fp32");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 2 && seeds.size(0) == static_cast<int64_t>(n) && seeds.size(1) == 2,
              "seeds: (n, 2) int64 [weights, buffer]");
  const at::Tensor ints_c = ints.contiguous(), floats_c = floats.contiguous();
  const auto grids_a = grids.accessor<int64_t, 2>(), seeds_a = seeds.accessor<int64_t, 2>();
  const auto eco_a = eco.accessor<float, 1>();
  const auto created_a = created.accessor<bool, 1>();
  std::vector<MomentumParam> work(n);
  for (size_t k = 0; k < n; ++k) {
    MomentumParam& w = work[k];
    w.numel = params[k].numel();
    w.grid = grid_of(grids_a[k][0], grids_a[k][1], grids_a[k][2], seeds_a[k][0], static_cast<int64_t>(k));
    w.eco = eco_a[k];
    w.created = created_a[k];
    TORCH_CHECK(!w.created || updates.empty(), "parameter ", k, ": only SGD's buffers are created by the kernel (Muon's start at zero)");
    w.dtype = dtype_of(params[k]);
    const auto held = [&w](const at::Tensor& t, Dtype dtype) { return dtype_of(t) == dtype && t.is_contiguous() && t.numel() == w.numel; };
    TORCH_CHECK(
        (w.dtype == Dtype::kFloat32 || (w.dtype != Dtype::kNone && w.grid.active() && updates.empty())) && held(params[k], w.dtype) &&
            held(grads[k], w.dtype) && (updates.empty() || held(updates[k], Dtype::kFloat32)),
        "parameter ", k,
        ": param and grad (and Muon's update, fp32) contiguous, of one size and dtype: fp32, or fp32/bf16/fp16 on SGD's weight grid");
    w.p = params[k].data_ptr(), w.g = grads[k].data_ptr();
    w.update = updates.empty() ? nullptr : updates[k].data_ptr<float>();
    w.buf = state_of(codes[k], scales[k], &tables[kStateTables * k], ints_c.data_ptr<int64_t>() + kStateColumns * k,
                     floats_c.data_ptr<float>()[k], seeds_a[k][1], w.numel, static_cast<int64_t>(k));
    w.chunk = std::max(w.buf.kind == Kind::kCast ? 0 : w.buf.block, CAST_CHUNK);
    w.chunks = (w.numel + w.chunk - 1) / w.chunk;
  }
  return work;
}

}  // namespace

// Adam(W) step of every parameter of one param group: n with coded moments (codebook or minifloat codes of 1 to 8
// bits, or bf16/fp16/fp32 casts: State), then ``plain`` ones with fp32 moments. ``tables``: per coded parameter
// [m_decode, m_entries, m_planes, m_levels, m_segments, v_decode, v_entries, v_planes, v_levels, v_segments]; ``ints``: (n, 2, 13) int64,
// per moment [kind, bits, block, key_base, key_shift, half, mantissa_bits, bias, max_code (a codebook: its last code), min_code, has_sign,
// zero_free, stochastic] (StateColumn; stochastic: SR, element i drawing random_bits(seed, i), a cast cast_bits);
// ``floats``: (n, 2) fp32, per moment a minifloat's largest value; ``bounds``: (n,) fp32 moment bounds;
// ``grids``: (n, 3) int64 [grid dtype code (0 none, 1 fp32, 2 bf16, 3 fp16), stochastic, eco] (a coded parameter and
// its gradient are fp32, or of one of fp32/bf16/fp16 with a grid), ``seeds``: (n, 3) int64 SR seeds of the weights, m and v,
// ``eco``: (n,) fp32 ECO coefficients (adam_reference.eco_coefficient of the step; used where eco);
// ``plain``: per fp32-state parameter [param, grad, exp_avg, exp_avg_sq]; ``steps``: per parameter (coded first) its
// 0-d fp32/fp64 step count, incremented here unless its gradient holds inf/NaN (then the parameter is left untouched).
// Returns (n + plain, 6) int64 [grad_finite, moments_finite, stalled_m, moved_m, stalled_v, moved_v] (stall columns 0
// unless ``track``; moments_finite 1 for fp32 states).
at::Tensor adam_steps_u8(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& m_codes, const std::vector<at::Tensor>& m_scales,
                         const std::vector<at::Tensor>& v_codes, const std::vector<at::Tensor>& v_scales,
                         const std::vector<at::Tensor>& tables, const at::Tensor& ints, const at::Tensor& floats, const at::Tensor& bounds,
                         const at::Tensor& grids, const at::Tensor& seeds, const at::Tensor& eco, const std::vector<at::Tensor>& plain,
                         const std::vector<at::Tensor>& steps, double lr, double weight_decay, double beta1, double beta2, double eps,
                         bool decoupled, bool maximize, bool track, bool lr_fp32) {
  const int64_t n = static_cast<int64_t>(params.size()), n_plain = static_cast<int64_t>(plain.size()) / 4;
  TORCH_CHECK(static_cast<int64_t>(plain.size()) == 4 * n_plain && static_cast<int64_t>(steps.size()) == n + n_plain,
              "steps: one per parameter");
  for (const at::Tensor& step : steps)
    TORCH_CHECK(step.numel() == 1 && step.device().is_cpu() && (step.scalar_type() == at::kFloat || step.scalar_type() == at::kDouble),
                "steps: 0-d fp32/fp64 CPU tensors");
  for (int64_t j = 0; j < n_plain; ++j)
    for (int c = 0; c < 4; ++c)
      TORCH_CHECK(plain[4 * j + c].is_contiguous() && plain[4 * j + c].scalar_type() == at::kFloat &&
                      plain[4 * j + c].numel() == plain[4 * j].numel(),
                  "fp32-state parameter ", j, ": param, grad and moments must be contiguous fp32 tensors of one size");
  const Schedule group = schedule(lr, weight_decay, beta1, beta2, eps, decoupled, maximize, lr_fp32);
  const std::vector<Param> work =
      coded_params(params, grads, m_codes, m_scales, v_codes, v_scales, tables, ints, floats, bounds, grids, seeds, eco, steps, group);

  // Coded parameters: first every gradient is checked, then every block of the finite ones is stepped.
  const std::vector<Outcome> outcomes = step_blocks(work, [track](const Param& w, int64_t index, Scratch& scratch, Outcome& outcome) {
    if (w.fast && (w.bytes || !track))
      step_block(w, index, track, scratch, outcome);
    else
      step_chunk(w, index, track, scratch, outcome);
  });
  at::Tensor result = outcome_rows(outcomes, n + n_plain, 4);
  auto out = result.accessor<int64_t, 2>();

  // fp32-state parameters, one after another (each threaded over its values).
  for (int64_t j = 0; j < n_plain; ++j) {
    const Hyper h = group.at(steps_done(steps[n + j]), INFINITY);
    out[n + j][0] = step_plain(plain[4 * j], plain[4 * j + 1], plain[4 * j + 2], plain[4 * j + 3], h) ? 1 : 0;
    out[n + j][1] = 1;
  }

  // Step counters: one more for every parameter that stepped.
  for (int64_t row = 0; row < n + n_plain; ++row)
    if (out[row][0]) count_step(steps[row]);
  return result;
}

// The momentum step of every parameter of one param group with a coded momentum buffer (momentum != 0): torch's
// single-tensor SGD (params updated in place), or, with ``updates`` (one fp32 tensor per
// parameter), Muon's momentum: buffer and the update Muon orthogonalizes (written there; params left to the caller).
// ``params``, ``grads``: contiguous fp32, or for SGD on a weight grid fp32/bf16/fp16 of one dtype; ``grids``: (n, 3) int64
// [grid dtype code (0 none, 1 fp32, 2 bf16, 3 fp16), stochastic, eco] (SGD only) and ``eco``: (n,) fp32, ECO's
// coefficient of each parameter's rounding error in its buffer; the buffers as adam_steps_u8's moments: ``codes``,
// ``scales``, ``tables`` (five per parameter: decode, entries, planes, levels, segments), ``ints`` ((n, 13) int64, StateColumn),
// ``floats`` ((n,) fp32); ``seeds``: (n, 2) int64, the SR seeds of each parameter's weights and buffer; ``created``: (n,)
// bool, SGD's buffers this step creates (torch's first step: buf = d, not read; codes and scales allocated for all
// values). A parameter whose gradient holds inf/NaN is left untouched.
// Returns (n, 4) int64 [grad_finite, buffer_finite, stalled, moved] (stall columns 0 unless ``track``).
at::Tensor momentum_steps(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& codes,
                          const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& tables, const at::Tensor& ints,
                          const at::Tensor& floats, const at::Tensor& grids, const at::Tensor& seeds, const at::Tensor& eco,
                          const at::Tensor& created, const std::vector<at::Tensor>& updates, double lr, double weight_decay,
                          double momentum, double dampening, bool nesterov, bool maximize, bool track) {
  const std::vector<MomentumParam> work =
      momentum_params(params, grads, codes, scales, tables, ints, floats, grids, seeds, eco, created, updates);
  const Momentum h = momentum_of(lr, weight_decay, momentum, dampening, nesterov, maximize);
  const std::vector<Outcome> outcomes =
      step_blocks(work, [&h, track](const MomentumParam& w, int64_t index, Scratch& scratch, Outcome& outcome) {
        momentum_chunk(w, h, index, track, scratch, outcome);
      });
  return outcome_rows(outcomes, static_cast<int64_t>(work.size()), 2);
}

// fp32 ``values`` rounded to a weight grid (code 1 fp32, 2 bf16, 3 fp16; under SR element i takes draw i of ``seed``) and
// stored in its dtype: the kernel's rounding of new parameter values on its own (the Rounding types and from_float
// grid_lanes uses), threaded as the step is (tests).
at::Tensor round_to_grid(const at::Tensor& values, int64_t grid, bool stochastic, int64_t seed) {
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous() && values.device().is_cpu(),
              "values: a contiguous fp32 CPU tensor");
  const Grid g = grid_of(grid, stochastic, 0, seed, 0);
  TORCH_CHECK(g.active(), "grid: 1 fp32, 2 bf16 or 3 fp16");
  const auto dtype = g.dtype == Dtype::kFloat32 ? at::kFloat : (g.dtype == Dtype::kBFloat16 ? at::kBFloat16 : at::kHalf);
  at::Tensor out(at::detail::empty_cpu(values.sizes(), dtype));
  const float* x = values.data_ptr<float>();
  with_element(g.dtype, [&]<typename T>(T) {
    T* y = static_cast<T*>(out.data_ptr());
    with_rounding(g.dtype, g.stochastic, [&]<typename Rounding>(Rounding) {
      at::parallel_for(0, values.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
          y[i] = from_float<T>(Rounding::round(x[i], Rounding::kStochastic ? cast_bits(g.seed, i) : 0u));
      });
    });
  });
  return out;
}

}  // namespace lightning_qstate
