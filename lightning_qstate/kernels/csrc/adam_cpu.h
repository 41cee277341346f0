// The value-level pieces of the C++ CPU kernels (adam_cpu.cpp): a state's codebook and its round-to-nearest encoder,
// Adam's and SGD's / Muon's momentum update of one value, stored block scales, parameter values in fp32/bf16/fp16 and
// the weight grids they are rounded to without master weights (RN and counter-based SR), and the AVX-512 and AVX2
// forms of the fp32 update. Plain C++ on raw pointers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

// The SIMD branches compiled (QSTATE_AVX512 and QSTATE_VBMI; QSTATE_AVX2; else none): the build CPU's, or with
// QSTATE_EMULATE_AVX512 (make kernel-emulate, a development check) the AVX-512 ones under emulation (simde_avx512.h).
#if defined(QSTATE_EMULATE_AVX512)
#include "simde_avx512.h"
#define QSTATE_AVX512 1
#if defined(QSTATE_EMULATE_VBMI)
#define QSTATE_VBMI 1
#endif
#if defined(QSTATE_EMULATE_DQ)
#define QSTATE_AVX512DQ 1
#endif
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define QSTATE_AVX512 1
#if defined(__AVX512VBMI__)
#define QSTATE_VBMI 1
#endif
#if defined(__AVX512DQ__)
#define QSTATE_AVX512DQ 1
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QSTATE_AVX2 1
#endif

// Every call inside the function inlined (where the compiler would call some): a call in a loop keeps it from
// vectorizing (adam_cpu.cpp: grid_lanes). QSTATE_INLINE: this function inlined wherever it is called (a vector
// helper called per 16 values: a call would pass its registers through memory). QSTATE_NOINLINE: never inlined (a
// rarely taken branch's loops that would crowd its caller's).
#if defined(__GNUC__)
#define QSTATE_FLATTEN __attribute__((flatten))
#define QSTATE_INLINE inline __attribute__((always_inline))
#define QSTATE_NOINLINE __attribute__((noinline))
#else
#define QSTATE_FLATTEN
#define QSTATE_INLINE inline
#define QSTATE_NOINLINE
#endif

namespace lightning_qstate {

// One state's kernels.code_index.NearestCodeIndex (the format's min_code built into its entries and levels).
struct Codebook {
  const float* decode;     // (256,) value of every code
  const int32_t* entries;  // bucket -> first | inside << 8 | offset << 9
  const int32_t* windows;  // bucket -> its floor entry and the fp32 patterns of decode[first .. first + 2]
                           // (NearestCodeIndex.floor_windows: stochastic rounding's floor and its values)
  int32_t key_base, key_shift, half;
  const uint8_t* planes;    // (4, 256): byte j of decode[c] at [j][c] (the VBMI decoder's tables)
  const float* levels;      // (256,): the thresholds by level of the binary search (NearestCodeIndex.search_levels),
                            // from kFloorLevels the values' (codes < 128: stochastic rounding's floor)
  int32_t depth;            // its levels: codes < 2^depth (1 to 8)
  const int32_t* segments;  // NearestCodeIndex.segments (code_index.segment_table's layout), or nullptr
  float grid;               // 2^depth where its values are (c + 1) / 2^depth of every code c (int4's unsigned map) and
                            // its min_code 0: codes and floors by arithmetic (grid_codes16); else 0
};

// Where Codebook::levels holds the search of a codebook's values (code_index.FLOOR_LEVELS; codes < 128).
constexpr int kFloorLevels = 128;

// code_index.segment_table's layout: offsets of its int32 entries.
namespace segment {
constexpr int kBinades = 32, kBinade0 = 96;  // binades 2^-31 .. 2^0; the first also holds every smaller |x|
constexpr int kFirst = 0, kSplit = 32, kFloorFirst = 64, kFloorSplit = 96, kScale = 128, kOffset = 144, kFloorOffset = 160;
constexpr int kBase = 176, kLast = 192, kThresholds = 208, kZero = 464;
}  // namespace segment

// Adam(W) hyperparameters as fp32. The moments follow adam_reference.adam_math as torch's vectorized CPU kernels compute
// them: add(alpha=) is fma(other, alpha, self), lerp_ is fma(coeff, end - self, base) (coeff = w, base = self if
// |w| < 0.5, else w - 1 and end), addcmul_ is fma(value * t1, t2, self); the param update divides by
// bias_correction2_sqrt and by the denominator, as the reference and torch's addcdiv_ (a reciprocal and a Newton step
// were no faster, and turned a v that overflows a cast state to inf, where the update is 0, into a NaN param).
// m_bound: the updated m is held to |m| <= m_bound * max(sqrt(v), kRootFloor) of the updated v (adam_reference.hold_moment;
// inf: kept, as fp32 moments are). bc2: bias_correction2_sqrt itself; eco: adam_reference.eco_coefficient of the step (parameters
// with ECO's feedback).
struct Hyper {
  float sign, l2, decay, lerp_coeff, b2, one_minus_b2, step, eps, m_bound, bc2, eco;
  bool lerp_from_end, decoupled;
};

inline uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

inline float float_of(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// a where ``mask`` is all ones, b where it is 0 (mask_of a condition): selects that GCC's vectorizer takes, where it
// takes no ``flag ? a : b`` of a loop-invariant bool and not every ``c ? a : b`` of computed values.
inline uint32_t mask_of(bool flag) { return 0u - static_cast<uint32_t>(flag); }
inline uint32_t pick(uint32_t mask, uint32_t a, uint32_t b) { return (a & mask) | (b & ~mask); }
inline float select(uint32_t mask, float a, float b) { return float_of(pick(mask, bits_of(a), bits_of(b))); }

// The largest finite bf16 and fp16 values.
constexpr float kBf16Max = 0x1.fep127f, kFp16Max = 65504.0f;

// adam_reference.ROOT_FLOOR: the least root the hold of m takes (sqrt of fp32's least normal value).
constexpr float kRootFloor = 0x1p-63f;

// One value of the Adam(W) update as adam_reference.adam_math rounds it, operation for operation (params and codes are
// the reference's bit for bit, also on a weight grid): the weight decay only in its own form (the decoupled decay
// multiplies the param, the L2 term is added to the gradient), the updated m held by the updated v's root (m_bound),
// true divisions by bias_correction2_sqrt and by the denominator. Moments m, v (decoded) in place; returns the new
// param value (before any grid) and sets Adam's denominator sqrt(v) / bc2 + eps. Both sides of each choice computed,
// then selected, no branches: a loop over it vectorizes (grid_lanes).
inline float adam_lane(float p, float g, float& m, float& v, const Hyper& h, float& denom) {
  const uint32_t decoupled = mask_of(h.decoupled), from_end = mask_of(h.lerp_from_end);
  const float signed_g = h.sign * g;
  const float gi = select(decoupled, signed_g, std::fma(p, h.l2, signed_g));
  const float decayed = select(decoupled, p * h.decay, p);
  m = std::fma(h.lerp_coeff, gi - m, select(from_end, gi, m));
  v = std::fma(h.one_minus_b2 * gi, gi, v * h.b2);
  const float root = std::sqrt(v), limit = (root < kRootFloor ? kRootFloor : root) * h.m_bound;
  m = m > limit ? limit : (m < -limit ? -limit : m);
  denom = root / h.bc2 + h.eps;
  return decayed - (h.step * m) / denom;
}

// torch's lerp of fp32 values with weight w, as its vectorized CPU kernel computes it (Hyper above): fp32 w, then
// fma(w, end - self, self) where |w| < 0.5, else fma(w - 1, end - self, end).
struct Lerp {
  float coeff;
  bool from_end;

  explicit Lerp(double weight) {
    const float w = static_cast<float>(weight);
    from_end = !(std::fabs(w) < 0.5f);
    coeff = from_end ? w - 1.0f : w;
  }
  float operator()(float self, float end) const { return std::fma(coeff, end - self, select(mask_of(from_end), end, self)); }
};

// The momentum of torch's single-tensor SGD and Muon as fp32 (kernels/native.py: native_momentum_steps). SGD (momentum
// != 0, its buffer present): d = sign * g, d = fma(p, weight_decay, d) where weight_decay != 0 (add(alpha=)),
// buf = fma(d, dampened, buf * momentum) (mul_, add_(alpha=1 - dampening)), step = fma(buf, momentum, d) with
// nesterov else buf, p = fma(step, neg_lr, p) (add_(alpha=-lr)). Muon: buf = buf.lerp_(g, 1 - momentum) (``buffer_lerp``),
// update = g.lerp(buf, momentum) with nesterov (``nesterov_lerp``), else buf.
// created: the buffer is created by this step (SGD's first: torch clones d into it, no dampening, -0 kept).
struct Momentum {
  float sign, weight_decay, momentum, dampened, neg_lr;
  bool has_weight_decay, nesterov, created;
  Lerp buffer_lerp, nesterov_lerp;
};

// One value of SGD's momentum step: buf (decoded; ignored where h.created) in place; returns the new param value.
// Branch-free (sgd_lanes).
inline float sgd_lane(float p, float g, float& buf, const Momentum& h) {
  const float signed_g = h.sign * g;
  const float d = select(mask_of(h.has_weight_decay), std::fma(p, h.weight_decay, signed_g), signed_g);
  buf = select(mask_of(h.created), d, std::fma(d, h.dampened, buf * h.momentum));
  return std::fma(select(mask_of(h.nesterov), std::fma(buf, h.momentum, d), buf), h.neg_lr, p);
}

// One value of Muon's momentum: buf (decoded) in place; returns the update Muon orthogonalizes. Branch-free (muon_lanes).
inline float muon_lane(float g, float& buf, const Momentum& h) {
  buf = h.buffer_lerp(buf, g);
  return select(mask_of(h.nesterov), h.nesterov_lerp(g, buf), buf);
}

// The code of a normalized value: its bucket's entry and at most one threshold compare. Branch-free, one table read
// (the bucket half - 1 - key of a negative value is half + ~key), so that a loop over it vectorizes (code_lanes).
inline uint8_t encode_lane(float value, const Codebook& cb) {
  const int32_t bits = static_cast<int32_t>(bits_of(std::fabs(value)));
  const int32_t key = std::min(std::max((bits - cb.key_base) >> cb.key_shift, 0), cb.half - 1);
  const int32_t negative = -static_cast<int32_t>(value < 0.0f);
  const int32_t entry = cb.entries[cb.half + (key ^ negative)];
  const int32_t threshold = cb.key_base + (key << cb.key_shift) + (entry >> 9);
  const bool up = ((entry & 0x100) != 0) & (negative ? bits <= threshold : bits >= threshold);
  return static_cast<uint8_t>((entry & 0xFF) + (up ? 1 : 0));
}

// A block scale as stored: fp32, or bf16 (the upper half of an fp32 pattern), as formats.block has it.
struct Scales {
  void* data;
  bool bf16;

  float load(int64_t i) const {
    if (!bf16) return static_cast<const float*>(data)[i];
    const uint32_t pattern = static_cast<uint32_t>(static_cast<const uint16_t*>(data)[i]) << 16;
    float value;
    std::memcpy(&value, &pattern, 4);
    return value;
  }
  // formats.block.BlockFormat.stored_scale of a finite absmax >= 0: itself, or rounded up to bf16 (saturating).
  float representable(float absmax) const {
    if (!bf16) return absmax;
    uint32_t pattern;
    std::memcpy(&pattern, &absmax, 4);
    pattern = (pattern + 0xFFFFu) & 0xFFFF0000u;
    float rounded;
    std::memcpy(&rounded, &pattern, 4);
    return std::min(rounded, kBf16Max);
  }
  // Store a value that is representable (or NaN): the bf16 pattern is its upper half.
  void store(int64_t i, float value) const {
    if (!bf16) {
      static_cast<float*>(data)[i] = value;
      return;
    }
    uint32_t pattern;
    std::memcpy(&pattern, &value, 4);
    static_cast<uint16_t*>(data)[i] = static_cast<uint16_t>(pattern >> 16);
  }
};

// ---- Parameter values and weight grids (training without fp32 master weights: optim/weights.py) ----
// Every function here is branch-free (selects), so that the loops over them (adam_cpu.cpp: grid_lanes) vectorize: each
// lane computes what the scalar code computes, IEEE operations rounded once, so vector and scalar give the same bits.

// 2^k as an fp32 value, for -126 <= k <= 127.
inline float pow2(int32_t k) { return float_of(static_cast<uint32_t>(k + 127) << 23); }

// x rounded to an integer, ties to even, for 0 <= x < 2^23 (adding 2^23 leaves no fraction bits; subtracting it is exact).
inline float round_integer(float x) { return (x + 0x1p23f) - 0x1p23f; }

// floor(x) for 0 <= x < 2^23, from round_integer (std::floor does not vectorize without -fno-trapping-math).
inline float floor_integer(float x) {
  const float nearest = round_integer(x);
  return nearest - select(mask_of(nearest > x), 1.0f, 0.0f);
}

// The U[0, 1) draw of stochastic rounding from 32 random bits: the upper 24 times 2^-24 (as an fp32 uniform of torch).
inline float uniform_of(uint32_t random) { return static_cast<float>(static_cast<int32_t>(random >> 8)) * 0x1p-24f; }

// The dtype of a parameter (and its gradient), or of the grid it is rounded to: the codes kernels/native.py passes
// (GRID_DTYPES); kNone: no grid.
enum class Dtype : int32_t { kNone = 0, kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

// A bf16 / fp16 element: its 16-bit pattern.
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

// The exponent field of an Element's pattern (all ones in inf and NaN): a pattern's magnitude (``& 0x7FFF``) at or
// above it is not finite.
template <typename Element>
constexpr uint16_t kNonfiniteFrom = std::is_same_v<Element, BFloat16> ? 0x7F80u : 0x7C00u;

inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return float_of(static_cast<uint32_t>(x.bits) << 16); }
inline float to_float(Float16 x) {
  const uint32_t sign = (x.bits & 0x8000u) << 16, exponent = (x.bits >> 10) & 0x1Fu, mantissa = x.bits & 0x3FFu;
  const float subnormal = static_cast<float>(static_cast<int32_t>(mantissa)) * 0x1p-24f;  // zero too
  const uint32_t wide = pick(mask_of(exponent == 0x1Fu), 0xFFu, exponent + 112);          // inf, NaN (payload kept)
  return float_of(sign | pick(mask_of(exponent == 0), bits_of(subnormal), (wide << 23) | (mantissa << 13)));
}

// fp32 -> bf16 round to nearest even on the bit pattern, as torch's cast (overflow to inf); a NaN stays a (quiet) NaN.
inline uint16_t bf16_nearest(float x) {
  const uint32_t bits = bits_of(x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(std::isnan(x) ? (bits >> 16) | 0x40u : rounded);
}

// The fp16 value nearest x (ties to even), as fp32: torch's x.to(torch.float16), subnormals included; |x| >= 65520
// (halfway past fp16's largest 65504) is inf; NaN stays NaN. x's binade (at least fp16's subnormal one, 2^-14) scaled to
// [0, 2048): fp16's values there are the integers, so the scaled value (exact: a power of two) is rounded to an integer
// (round_integer: ties to even) and scaled back (exact).
QSTATE_INLINE float fp16_nearest(float x) {
  const float magnitude = std::fabs(x);
  const int32_t exponent = std::max(static_cast<int32_t>((bits_of(x) >> 23) & 0xFFu) - 127, -14);
  const float steps = round_integer(magnitude * pow2(10 - exponent));
  const float rounded = std::copysign(steps * pow2(exponent - 10), x);
  return select(mask_of(magnitude < 65520.0f), rounded, std::isnan(x) ? x : std::copysign(INFINITY, x));
}

// The fp16 pattern of x, a value fp16 represents (fp16_nearest's results: also inf, and NaN as a quiet NaN).
inline uint16_t fp16_bits(float x) {
  const uint32_t bits = bits_of(x);
  const float magnitude = std::fabs(x);
  const uint32_t small = mask_of(magnitude < 0x1p-14f);
  const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>(select(small, magnitude, 0.0f) * 0x1p24f));  // of 2^-24
  const uint32_t normal = ((((bits >> 23) & 0xFFu) - 112) << 10) | ((bits >> 13) & 0x3FFu);
  const uint32_t large = pick(mask_of(magnitude < INFINITY), normal, pick(mask_of(std::isnan(x)), 0x7E00u, 0x7C00u));
  return static_cast<uint16_t>(((bits >> 16) & 0x8000u) | pick(small, subnormal, large));
}

// An fp32 value stored in a tensor of dtype T: torch's copy_ (round to nearest even).
template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline BFloat16 from_float<BFloat16>(float x) {
  return BFloat16{bf16_nearest(x)};
}
template <>
inline Float16 from_float<Float16>(float x) {
  return Float16{fp16_bits(fp16_nearest(x))};
}

// splitmix64's output number n from state ``seed`` (the state after n steps: seed + n * 0x9E3779B97F4A7C15, mixed).
inline uint64_t splitmix64(uint64_t seed, uint64_t n) {
  uint64_t z = seed + n * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Element ``index``'s part of splitmix64 output z (the output index / PerOutput + 1 of its seed), as the word a
// rounding reads: PerOutput 2, the 32 random bits of codebooks' and minifloats' stochastic rounding (random_bits);
// PerOutput 4, the 16 of a bf16/fp16 cast's or grid's (cast_bits), in the upper half of the word.
template <int PerOutput>
inline uint32_t draw_of(uint64_t z, int64_t index) {
  if constexpr (PerOutput == 2) return static_cast<uint32_t>(z >> ((index & 1) ? 0 : 32));
  return static_cast<uint32_t>(static_cast<uint16_t>(z >> (16 * (index & 3)))) << 16;
}

// The counter-based random source of stochastic rounding: 32 random bits for element ``index`` of the parameter whose
// step has seed ``seed`` (drawn in Python from optimizer.rounding_generator): half of splitmix64's output number
// index / 2 + 1 from state ``seed``, its upper half for an even index and its lower half for an odd one (each output
// serves two elements), so a draw depends on (seed, index) only, not on which thread steps the element.
inline uint32_t random_bits(uint64_t seed, int64_t index) {
  return draw_of<2>(splitmix64(seed, static_cast<uint64_t>(index) / 2 + 1), index);
}

// The draws of a bf16/fp16 cast's or weight grid's stochastic rounding: 16 random bits for element ``index``, quarter
// index % 4 of splitmix64's output index / 4 + 1 (bits 16 * (index % 4) up; each output serves four elements), in the
// upper half of the word, so that bf16_stochastic adds them as they are and fp16_stochastic their upper 13 (it drops
// 13 bits of a normal fp16's binade: exactly unbiased there).
inline uint32_t cast_bits(uint64_t seed, int64_t index) {
  return draw_of<4>(splitmix64(seed, static_cast<uint64_t>(index) / 4 + 1), index);
}

// Stochastic rounding to bf16 as formats.rounding.bf16_stochastic: the upper 16 random bits added to the fp32 pattern,
// the low 16 cleared (rounds up with probability equal to the dropped fraction of an ulp: unbiased); past kBf16Max the
// nearest (0x8000 added: bf16's last mantissa is odd, so a tie goes up, to inf, as bf16_nearest); inf/NaN pass.
inline float bf16_stochastic(float x, uint32_t random) {
  const float magnitude = std::fabs(x);
  const float rounded = float_of((bits_of(x) + pick(mask_of(magnitude <= kBf16Max), random >> 16, 0x8000u)) & 0xFFFF0000u);
  return select(mask_of(magnitude < INFINITY), rounded, x);
}

// Stochastic rounding to fp16 (subnormals included), additive as bf16_stochastic: 13 random bits (8191 less the draw's
// upper 13) added to the 13 bits of |x|'s fp32 pattern below the fp16 mantissa, which are then cleared: rounds up with
// probability equal to the dropped fraction of an ulp, exactly unbiased for fp16's normals (the decision a U[0, 1) on
// steps of 2^-16 below that fraction makes: (q >> 3) < d where q < 8d). Below 2^-14, where fp16's grid is 2^-24 in
// every binade, the pattern is that of |x| + 2^-14 (an fp32 sum, rounded to 2^-37: unbiased within 2^-14 of fp16's ulp
// there), whose 13 low bits are the dropped ones. |x| > 65504 and inf/NaN: fp16_nearest.
inline float fp16_stochastic(float x, uint32_t random) {
  const float magnitude = std::fabs(x), lift = select(mask_of(magnitude < 0x1p-14f), 0x1p-14f, 0.0f);
  const float stepped = float_of((bits_of(magnitude + lift) + (~random >> 19)) & ~0x1FFFu) - lift;  // exact
  return select(mask_of(magnitude <= 65504.0f), std::copysign(stepped, x), fp16_nearest(x));
}

// The grid a parameter's new values are rounded to (formats.weights.WeightGrid of a cast format): fp32, bf16 or fp16
// values, round to nearest even (CastFormat.quantize_reference) or stochastic (drawing with ``seed``); ``eco``: the
// rounding error is fed into m (adam_reference.eco_feedback).
struct Grid {
  Dtype dtype;
  bool stochastic, eco;
  uint64_t seed;

  bool active() const { return dtype != Dtype::kNone; }
};

// x clamped to [-largest, largest] (a NaN stays): a weight grid saturates (formats.cast.CastFormat.round_saturated).
inline float saturated(float x, float largest) { return select(mask_of(x > largest), largest, select(mask_of(x < -largest), -largest, x)); }

// The roundings of a grid, as types (Rounding::round(x, random): x on the grid, as fp32, saturating at kLargest;
// ``random``: the element's SR draw, cast_bits of its position in its parameter, read only where kStochastic), so that a
// loop is compiled once per rounding.
struct KeepFp32 {
  static constexpr bool kStochastic = false;
  static float round(float x, uint32_t) { return x; }
};
struct Bf16Nearest {
  using Element = BFloat16;
  static constexpr bool kStochastic = false;
  static constexpr float kLargest = kBf16Max;
  static float round(float x, uint32_t) { return to_float(BFloat16{bf16_nearest(saturated(x, kLargest))}); }
};
struct Bf16Stochastic {
  using Element = BFloat16;
  static constexpr bool kStochastic = true;
  static constexpr float kLargest = kBf16Max;
  static float round(float x, uint32_t random) { return bf16_stochastic(saturated(x, kLargest), random); }
};
struct Fp16Nearest {
  using Element = Float16;
  static constexpr bool kStochastic = false;
  static constexpr float kLargest = kFp16Max;
  static float round(float x, uint32_t) { return fp16_nearest(saturated(x, kLargest)); }
};
struct Fp16Stochastic {
  using Element = Float16;
  static constexpr bool kStochastic = true;
  static constexpr float kLargest = kFp16Max;
  static float round(float x, uint32_t random) { return fp16_stochastic(saturated(x, kLargest), random); }
};

// The bf16 / fp16 pattern of x rounded by a cast state's Rounding (adam_cpu.cpp: store_cast; patterns16 for 16 values);
// ``random``: x's SR draw (cast_bits).
inline uint32_t pattern_of(Bf16Nearest, float x, uint32_t) { return bf16_nearest(x); }
inline uint32_t pattern_of(Bf16Stochastic, float x, uint32_t random) { return bf16_nearest(bf16_stochastic(x, random)); }
inline uint32_t pattern_of(Fp16Nearest, float x, uint32_t) { return fp16_bits(fp16_nearest(x)); }
inline uint32_t pattern_of(Fp16Stochastic, float x, uint32_t random) { return fp16_bits(fp16_stochastic(x, random)); }

// A cast state's stored pattern of x (pattern_of); ``zero_free`` (all ones: State::zero_free): a positive x the cast
// flushes to 0 is stored as the dtype's smallest subnormal (CastFormat.lift_flushed; pattern 1).
template <typename Rounding>
inline uint16_t cast_pattern(float x, uint32_t random, uint32_t zero_free) {
  const uint32_t stored = pattern_of(Rounding{}, x, random);
  return static_cast<uint16_t>(pick(zero_free & mask_of(x > 0.0f) & mask_of(stored == 0), 1u, stored));
}

#if defined(QSTATE_AVX2) || defined(QSTATE_AVX512)
// The low 64 bits of a * b in each 64-bit lane (AVX2 has no 64-bit multiply): from three 32 x 32-bit products.
inline __m256i multiply64(__m256i a, uint64_t b) {
  const __m256i low = _mm256_set1_epi64x(static_cast<int64_t>(b & 0xFFFFFFFFu)), high = _mm256_set1_epi64x(static_cast<int64_t>(b >> 32));
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), low), _mm256_mul_epu32(a, high));
  return _mm256_add_epi64(_mm256_mul_epu32(a, low), _mm256_slli_epi64(cross, 32));
}

// splitmix64(seed, n + k) of k = 0..3 in 64-bit lanes.
inline __m256i splitmix64x4(uint64_t seed, uint64_t n) {
  constexpr uint64_t gamma = 0x9E3779B97F4A7C15ull;
  __m256i z = _mm256_add_epi64(
      _mm256_set1_epi64x(static_cast<int64_t>(seed + n * gamma)),
      _mm256_setr_epi64x(0, static_cast<int64_t>(gamma), static_cast<int64_t>(2 * gamma), static_cast<int64_t>(3 * gamma)));
  z = multiply64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), 0xBF58476D1CE4E5B9ull);
  z = multiply64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), 0x94D049BB133111EBull);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

// The draws four splitmix64 outputs (``outputs``, splitmix64x4) give, to out (draw_of<PerOutput> of each in order):
// PerOutput 2, each output's upper half, then its lower half (8 words); 4, its 16-bit quarters from the lowest, each
// in the upper half of a word (16 words).
template <int PerOutput>
QSTATE_INLINE void store_draws4(__m256i outputs, uint32_t* out) {
  if constexpr (PerOutput == 2) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_shuffle_epi32(outputs, 0xB1));
  } else {
    const auto words = [](__m128i quarters) { return _mm256_slli_epi32(_mm256_cvtepu16_epi32(quarters), 16); };
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), words(_mm256_castsi256_si128(outputs)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8), words(_mm256_extracti128_si256(outputs, 1)));
  }
}
#endif

// Words of slack a draws_of buffer needs past its ``size`` draws (the draws of whole outputs around them).
constexpr int64_t kDrawSlack = 6;

// draws[i] = draw_of<PerOutput> of element first + i for i < size (random_bits, PerOutput 2; cast_bits, 4): each
// splitmix64 output computed once for its PerOutput elements (a loop over a lane that draws its own computes it
// PerOutput times; with AVX2 four at a time, splitmix64x4), in ``buffer`` (size + kDrawSlack words); returns draws.
template <int PerOutput>
inline const uint32_t* draws_of(uint64_t seed, int64_t first, int64_t size, uint32_t* __restrict__ buffer) {
  const int64_t start = first / PerOutput * PerOutput, outputs = (first + size - start + PerOutput - 1) / PerOutput;
  int64_t k = 0;
#ifdef QSTATE_AVX2
  for (; k + 4 <= outputs; k += 4) store_draws4<PerOutput>(splitmix64x4(seed, start / PerOutput + k + 1), buffer + PerOutput * k);
#endif
  for (; k < outputs; ++k) {
    const uint64_t z = splitmix64(seed, static_cast<uint64_t>(start / PerOutput + k) + 1);
    for (int j = 0; j < PerOutput; ++j) buffer[PerOutput * k + j] = draw_of<PerOutput>(z, j);
  }
  return buffer + (first - start);
}

// visit(Rounding{}) with the rounding to ``dtype`` (fp32: KeepFp32) to nearest or ``stochastic``: an active grid's, or
// a cast state's.
template <typename Visit>
inline void with_rounding(Dtype dtype, bool stochastic, Visit&& visit) {
  switch (dtype) {
    case Dtype::kBFloat16:
      return stochastic ? visit(Bf16Stochastic{}) : visit(Bf16Nearest{});
    case Dtype::kFloat16:
      return stochastic ? visit(Fp16Stochastic{}) : visit(Fp16Nearest{});
    default:  // fp32: every value is on the grid
      return visit(KeepFp32{});
  }
}

// visit(T{}) with the element type of fp32, bf16 or fp16 values.
template <typename Visit>
inline void with_element(Dtype dtype, Visit&& visit) {
  switch (dtype) {
    case Dtype::kBFloat16:
      return visit(BFloat16{});
    case Dtype::kFloat16:
      return visit(Float16{});
    default:
      return visit(float{});
  }
}

// visit(values, grads, Rounding{}, std::bool_constant<Eco>{}) for a parameter kept on ``grid``: its values p and gradient
// g from element ``base`` on, typed as its element type T (``dtype``), the grid's rounding, and whether the grid feeds
// ECO's error back; so that a loop over them is compiled once per element type, rounding and feedback.
template <typename Visit>
inline void with_grid_values(Dtype dtype, const Grid& grid, void* p, const void* g, int64_t base, Visit&& visit) {
  with_element(dtype, [&]<typename T>(T) {
    T* values = static_cast<T*>(p) + base;
    const T* grads = static_cast<const T*>(g) + base;
    with_rounding(grid.dtype, grid.stochastic, [&]<typename Rounding>(Rounding) {
      if (grid.eco)
        visit(values, grads, Rounding{}, std::true_type{});
      else
        visit(values, grads, Rounding{}, std::false_type{});
    });
  });
}

// ---- How a moment is stored (kernels/native.py: _state_layout) ----

// A moment's storage: block-scaled codes of a codebook (encoded with its NearestCodeIndex) or of a minifloat (ExMy,
// encoded as formats.rounding.encode_minifloat), or a cast (bf16 / fp16 / fp32 values, no scales).
enum class Kind : int32_t { kCodebook = 0, kMinifloat = 1, kCast = 2 };

// formats.block.MinifloatFormat.encode of a normalized value: |x| (max(x, 0) for an unsigned spec) times the format's
// largest value, its binade exponent from the fp32 pattern (at least the subnormal binade's), the mantissa scaled to
// an integer by a power of two and rounded (RN: to nearest even, adding and subtracting 2^23; SR: its floor, plus one
// where ``uniform`` is below the fraction), the code ((exponent + bias - 1) << M) + mantissa (a round-up carries into
// the next binade), clamped to [min_code, max_code], and the sign bit of a signed spec for x < 0. The same fp32
// operations as the reference (formats.rounding.encode_minifloat), so under RN the same codes.
struct Minifloat {
  int32_t mantissa_bits, bias, max_code, min_code, sign_shift;  // sign_shift: the sign bit of a signed spec (bits - 1)
  bool has_sign;
  float max_value;

  template <bool Stochastic>
  uint32_t encode(float normalized, float uniform = 0.0f) const {
    const float magnitude = select(mask_of(has_sign), std::fabs(normalized), select(mask_of(normalized > 0.0f), normalized, 0.0f));
    const float scaled = magnitude * max_value;
    const int32_t exponent = std::max(static_cast<int32_t>((bits_of(scaled) >> 23) & 0xFFu) - 127, 1 - bias);
    const float mantissa = scaled * pow2(mantissa_bits - exponent);
    float rounded;
    if constexpr (Stochastic) {
      const float low = floor_integer(mantissa);  // 0 <= mantissa < 2^(M + 1)
      rounded = low + (uniform < mantissa - low ? 1.0f : 0.0f);
    } else {
      rounded = round_integer(mantissa);
    }
    const int32_t code = std::max(std::min(((exponent + bias - 1) << mantissa_bits) + static_cast<int32_t>(rounded), max_code), min_code);
    return static_cast<uint32_t>(code) | pick(mask_of(has_sign) & mask_of(normalized < 0.0f), 1u << sign_shift, 0u);
  }
};

// The fp32 pattern of code ``code``'s value in a minifloat's decode table (its codes' values / max_value), computed from
// the table's first 2^(M + 1) values: the magnitude code min(code without its sign bit, max_code) with exponent field e
// and mantissa m reads decode[e ? 2^M + m : m] (e = 0, 1: itself) times 2^max(e - 1, 0) (its exponent bits raised), and
// takes the code's sign. Equal to the table where its values are exact powers of two apart (decodes_by_exponent).
inline uint32_t exponent_decode(const float* decode, const Minifloat& mf, int32_t bits, uint32_t code) {
  const uint32_t magnitude_mask = mf.has_sign ? (1u << mf.sign_shift) - 1u : (1u << bits) - 1u;
  const int32_t magnitude = std::min(static_cast<int32_t>(code & magnitude_mask), mf.max_code);
  const int32_t raised = std::max(magnitude >> mf.mantissa_bits, 1) - 1;
  const uint32_t sign = mf.has_sign ? (code >> mf.sign_shift) & 1u : 0u;
  return (bits_of(decode[magnitude - (raised << mf.mantissa_bits)]) + (static_cast<uint32_t>(raised) << 23)) | sign << 31;
}

// Whether every code of ``bits`` bits reads the same pattern from exponent_decode as from the table (8-bit minifloats of
// up to 3 mantissa bits only: their 16 first values fit the AVX2 decoder's registers, Decode8).
inline bool decodes_by_exponent(const float* decode, const Minifloat& mf, int32_t bits) {
  if (bits != 8 || mf.mantissa_bits > 3) return false;
  for (uint32_t code = 0; code < 256; ++code)
    if (exponent_decode(decode, mf, bits, code) != bits_of(decode[code])) return false;
  return true;
}

// formats.rounding.encode_codebook (SR) clamped up to min_code, between code ``low`` (value low_value) and low + 1
// (high_value): x rounds up where ``uniform`` times their gap is below x's distance from low_value.
inline uint32_t stochastic_between(float x, int32_t low, float low_value, float high_value, int32_t min_code, float uniform) {
  return static_cast<uint32_t>(std::max(low + (uniform * (high_value - low_value) < x - low_value ? 1 : 0), min_code));
}

// stochastic_between from x's floor code ``floor`` (the largest value <= x; any code below 0 stands for 0) held to
// [0, last - 1] in a Codebook::grid codebook, whose values (c + 1) / grid are exact by arithmetic (grid: a power of 2).
// (Where the clamp to min_code hides the floor, both neighbours are <= min_code: the clamped result is min_code either
// way.)
inline uint32_t grid_stochastic(float x, float grid, int32_t floor, int32_t last, int32_t min_code, float uniform) {
  const int32_t low = std::min(std::max(floor, 0), last - 1);
  return stochastic_between(x, low, static_cast<float>(low + 1) / grid, static_cast<float>(low + 2) / grid, min_code, uniform);
}

// stochastic_between with the floor from the round-to-nearest code (encode_lane): it, or the one below where its value
// is above x, held to [0, last - 1]. That pair of codes holds the nearest one on either side (the clamps only move a
// floor of -1 up to it, or keep ``last`` below it), so one more table read gives the other value.
inline uint32_t codebook_stochastic(float x, const Codebook& cb, int32_t last, int32_t min_code, float uniform) {
  const int32_t nearest = encode_lane(x, cb);
  const float nearest_value = cb.decode[nearest];
  const int32_t low = std::min(std::max(nearest - (nearest_value > x ? 1 : 0), 0), last - 1);
  const uint32_t from_nearest = mask_of(low == nearest);
  const float other = cb.decode[low + (low == nearest ? 1 : 0)];
  return stochastic_between(x, low, select(from_nearest, nearest_value, other), select(from_nearest, other, nearest_value), min_code,
                            uniform);
}

// grid_codes16 of one normalized value: floor(x * grid - offset) held to [0, grid - 1] (offset 0.5: the nearest code of
// a Codebook::grid codebook; 1: its floor code); the product is held to [0, grid] first, for floor_integer.
inline int32_t grid_code(float x, float grid, float offset) {
  const float below = std::min(std::max(std::fma(x, grid, -offset), 0.0f), grid);
  return static_cast<int32_t>(std::min(floor_integer(below), grid - 1.0f));
}

// One moment of a coded parameter as stored: ``codes`` holds a byte per 8-bit code, two codes of <= 4 bits per byte
// (value 2i in the low nibble), or, dense, each group of 8 codes of 5 to 7 bits in ``bits`` bytes (a little-endian
// bit stream: code j of the group in bits [j * bits, (j + 1) * bits)), all as formats.packing.pack; a cast's values
// in its dtype. Blocks of ``block`` values
// share a scale (``scales``; a cast has none).
struct State {
  Kind kind;
  int32_t bits;    // 8, <= 4 (nibbles) or 5-7 (dense); a cast: its dtype's
  int64_t block;   // values per scale (a cast: 0)
  Dtype cast;      // a cast's dtype
  bool zero_free;  // a cast of a non-negative state: a positive value the cast flushes to 0 is stored as its smallest subnormal
  float smallest;  // that subnormal
  void* codes;
  Scales scales;
  Codebook cb;       // decode table (codebooks and minifloats); the NearestCodeIndex (codebooks)
  Minifloat mf;      // minifloats
  int32_t last;      // a codebook's last code (its values - 1)
  int32_t min_code;  // a codebook's min_code
  bool stochastic;   // SR, element i drawing random_bits(seed, i) (a cast: cast_bits)
  uint64_t seed;
  bool by_exponent;  // a minifloat whose decode table is exponent_decode's (decodes_by_exponent)

  bool nibbles() const { return kind != Kind::kCast && bits <= 4; }
  bool dense() const { return kind != Kind::kCast && bits > 4 && bits < 8; }
  // The byte holding the first code of element ``index`` (a multiple of 8: a block's first; formats.packing).
  int64_t code_byte(int64_t index) const { return nibbles() ? index / 2 : (dense() ? index / 8 * bits : index); }
  // The number of code bytes of ``numel`` values (formats.packing.packed_numel).
  int64_t code_bytes(int64_t numel) const { return nibbles() ? (numel + 1) / 2 : (dense() ? (numel + 7) / 8 * bits : numel); }
};

// How far ahead (in values) the vector loops prefetch param, gradient and codes: a cold step waits on memory otherwise.
constexpr int64_t PREFETCH_AHEAD = 512;

// visit(std::integral_constant<int, D>{}) with D = depth (1 to 8; another depth visits nothing): a codebook's search
// depth (or a dense code's bits) as a compile-time constant, so that a loop over search16<D> is compiled once per depth.
template <typename Visit>
inline void with_depth(int32_t depth, Visit&& visit) {
  [&]<int... D>(std::integer_sequence<int, D...>) {
    ((depth == D + 1 && (visit(std::integral_constant<int, D + 1>{}), true)) || ...);
  }(std::make_integer_sequence<int, 8>{});
}

#ifdef QSTATE_AVX512
// table[index] for a table of 2^Log2 fp32 values (Log2 <= 8) and 16 indices in [0, 2^Log2): one permute up to 16
// entries (a broadcast for one), two-register permutes of 32 entries each beyond, blended by index bits 5, 6, 7 (no
// gathers, which are slow on recent Intel cores). Reads at least 16 values from ``table`` (one, for a broadcast).
template <int Log2>
QSTATE_INLINE __m512 lookup(const float* table, __m512i index) {
  static_assert(Log2 >= 0 && Log2 <= 8);
  if constexpr (Log2 == 0) {
    return _mm512_set1_ps(table[0]);
  } else if constexpr (Log2 <= 4) {
    return _mm512_permutexvar_ps(index, _mm512_loadu_ps(table));
  } else {
    constexpr int parts = 1 << (Log2 - 5);
    __m512 part[parts];
    for (int k = 0; k < parts; ++k)
      part[k] = _mm512_permutex2var_ps(_mm512_loadu_ps(table + 32 * k), index, _mm512_loadu_ps(table + 32 * k + 16));
    for (int bit = 5, n = parts; n > 1; ++bit, n /= 2) {
      const __mmask16 high = _mm512_test_epi32_mask(index, _mm512_set1_epi32(1 << bit));
      for (int k = 0; k < n / 2; ++k) part[k] = _mm512_mask_blend_ps(high, part[2 * k], part[2 * k + 1]);
    }
    return part[0];
  }
}

// encode_lane on 16 values without a table of buckets (NearestCodeIndex.search_levels): a branch-free binary search of
// the rounding thresholds (code = the count of thresholds <= x), level L comparing x with one threshold of the 2^L
// that its code so far selects (a register permute, not a gather).
template <int Depth, int L = 0>
QSTATE_INLINE __m512i search16(__m512 value, const float* levels, __m512i code = _mm512_setzero_si512()) {
  if constexpr (L == Depth) {
    return code;
  } else {
    const __m512 threshold = lookup<L>(levels + (1 << L) - 1, _mm512_srli_epi32(code, Depth - L));
    const __mmask16 up = _mm512_cmp_ps_mask(threshold, value, _CMP_LE_OQ);
    return search16<Depth, L + 1>(value, levels, _mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(1 << (Depth - 1 - L))));
  }
}

// 16 codes decoded and times the block scale.
inline __m512 decode16(const uint8_t* codes, const float* decode, float scale) {
  const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  return _mm512_mul_ps(lookup<8>(decode, index), _mm512_set1_ps(scale));
}

#ifdef QSTATE_VBMI
// table[c] of 64 byte codes c (a 256-entry fp32 table by its byte planes, Codebook::planes): out[r] holds those of codes
// 16r .. 16r + 15. Each byte plane is looked up with two 128-entry byte permutes (bit 7 of the code picks one), then
// bytes are interleaved into fp32 lanes. The interleave leaves value 16L + 4r + t in lane 4L + t of out[r] (L: 128-bit
// lane); the codes are permuted first so that this is value 16r + 4L + t.
QSTATE_INLINE void lookup64(__m512i codes, const uint8_t* planes, __m512 out[4]) {
  // clang-format off: one row per 128-bit lane
  alignas(64) static const uint8_t order[64] = {
      0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
      4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
      8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
      12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
  // clang-format on
  const __m512i index = _mm512_permutexvar_epi8(_mm512_load_si512(order), codes);
  const __mmask64 high = _mm512_movepi8_mask(index);
  __m512i byte[4];
  for (int j = 0; j < 4; ++j) {
    const uint8_t* plane = planes + 256 * j;
    const __m512i low_half = _mm512_permutex2var_epi8(_mm512_loadu_si512(plane), index, _mm512_loadu_si512(plane + 64));
    const __m512i high_half = _mm512_permutex2var_epi8(_mm512_loadu_si512(plane + 128), index, _mm512_loadu_si512(plane + 192));
    byte[j] = _mm512_mask_blend_epi8(high, low_half, high_half);
  }
  const __m512i low01 = _mm512_unpacklo_epi8(byte[0], byte[1]), high01 = _mm512_unpackhi_epi8(byte[0], byte[1]);
  const __m512i low23 = _mm512_unpacklo_epi8(byte[2], byte[3]), high23 = _mm512_unpackhi_epi8(byte[2], byte[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(low01, low23));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(low01, low23));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(high01, high23));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(high01, high23));
}

// decode16 of 64 codes: out[r] holds values 16r .. 16r + 15.
inline void decode64(const uint8_t* codes, const uint8_t* planes, float scale, __m512 out[4]) {
  lookup64(_mm512_loadu_si512(codes), planes, out);
  for (int r = 0; r < 4; ++r) out[r] = _mm512_mul_ps(out[r], _mm512_set1_ps(scale));
}

// decode64 of elements [index, index + 64) of any block state's codes (``index``: a multiple of 64 inside one block):
// 8-bit codes loaded as they are; 4-bit (nibbles) and dense 5- to 7-bit ones (8 codes in ``bits`` bytes, code k in bits
// [k * bits, (k + 1) * bits) of the little-endian group, as formats.packing) spread one group per 64-bit lane by a byte
// permute, each code's field shifted to its byte by a multishift and masked.
struct Decode64 {
  const uint8_t* codes;
  const uint8_t* planes;
  int32_t bits;    // bits per stored code: 4 (nibbles), 5-7 (dense) or 8
  __m512 first16;  // the decode table's first 16 values
  __m512i spread, shifts, field;
  __mmask64 used;  // the 8 * bits bytes of 8 groups

  explicit Decode64(const State& s)
      : codes(static_cast<const uint8_t*>(s.codes)),
        planes(s.cb.planes),
        bits(s.nibbles() ? 4 : s.bits),
        first16(_mm512_loadu_ps(s.cb.decode)) {
    // per stored width 4 to 8: byte j of lane L reads group byte L * bits + j; code k's field starts at bit k * bits
    struct Tables {
      alignas(64) uint8_t spread[5][64], shifts[5][64];
    };
    static constexpr Tables tables = [] {
      Tables t{};
      for (int b = 4; b <= 8; ++b)
        for (int j = 0; j < 64; ++j)
          t.spread[b - 4][j] = static_cast<uint8_t>(j / 8 * b + j % 8), t.shifts[b - 4][j] = static_cast<uint8_t>(j % 8 * b);
      return t;
    }();
    spread = _mm512_load_si512(tables.spread[bits - 4]), shifts = _mm512_load_si512(tables.shifts[bits - 4]);
    field = _mm512_set1_epi8(static_cast<char>((1 << bits) - 1));
    used = bits == 8 ? ~__mmask64{0} : (__mmask64{1} << (8 * bits)) - 1;
  }

  // The byte codes of elements [index, index + 64).
  QSTATE_INLINE __m512i bytes(int64_t index) const {
    const uint8_t* group = codes + index / 8 * bits;
    __builtin_prefetch(group + PREFETCH_AHEAD);
    if (bits == 8) return _mm512_loadu_si512(group);
    const __m512i packed = _mm512_permutexvar_epi8(spread, _mm512_maskz_loadu_epi8(used, group));
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, packed), field);
  }

  // Their values times ``scale``: out[r] holds elements index + 16r .. index + 16r + 15. Codes of 4 bits or fewer:
  // one in-register permute of the table's first 16 values per 16 (lookup64 would read all 1 KB of byte planes).
  QSTATE_INLINE void operator()(int64_t index, float scale, __m512 out[4]) const {
    const __m512i codes = bytes(index);
    if (bits == 4) {
      for (int r = 0; r < 4; ++r) out[r] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, r)), first16);
    } else {
      lookup64(codes, planes, out);
    }
    for (int r = 0; r < 4; ++r) out[r] = _mm512_mul_ps(out[r], _mm512_set1_ps(scale));
  }
};

// The 64 bytes of code[0..3] (each 16 codes < 256 in 32-bit lanes), in order.
QSTATE_INLINE __m512i bytes64(const __m512i code[4]) {
  __m512i packed = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(code[0]));
  for (int r = 1; r < 4; ++r) packed = _mm512_inserti32x4(packed, _mm512_cvtepi32_epi8(code[r]), r);
  return packed;
}
#endif

// encode_lane on 16 values by the bucket table (a gather); ``value`` already normalized (``Nonnegative``: no value is
// < 0, as for Adam's v). Magnitude patterns and thresholds are compared relative to key_base.
template <bool Nonnegative>
QSTATE_INLINE __m512i bucket16(__m512 value, const Codebook& cb) {
  const __m512i shift = _mm512_set1_epi32(cb.key_shift);
  const __m512i bits = _mm512_sub_epi32(_mm512_castps_si512(_mm512_abs_ps(value)), _mm512_set1_epi32(cb.key_base));
  __m512i key = _mm512_srav_epi32(bits, shift);
  key = _mm512_min_epi32(_mm512_max_epi32(key, _mm512_setzero_si512()), _mm512_set1_epi32(cb.half - 1));
  const __mmask16 negative = Nonnegative ? 0 : _mm512_cmp_ps_mask(value, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512i bucket =
      _mm512_mask_sub_epi32(_mm512_add_epi32(_mm512_set1_epi32(cb.half), key), negative, _mm512_set1_epi32(cb.half - 1), key);
  const __m512i entry = _mm512_i32gather_epi32(bucket, cb.entries, 4);
  const __m512i threshold = _mm512_add_epi32(_mm512_sllv_epi32(key, shift), _mm512_srai_epi32(entry, 9));
  const __mmask16 inside = _mm512_test_epi32_mask(entry, _mm512_set1_epi32(0x100));
  const __mmask16 up =
      inside & ((negative & _mm512_cmple_epi32_mask(bits, threshold)) | (~negative & _mm512_cmpge_epi32_mask(bits, threshold)));
  const __m512i first = _mm512_and_si512(entry, _mm512_set1_epi32(0xFF));
  return _mm512_mask_add_epi32(first, up, first, _mm512_set1_epi32(1));
}

#ifdef QSTATE_VBMI
// The 64-bit mask of four 16-bit ones (mask[r]: values 16r .. 16r + 15).
QSTATE_INLINE __mmask64 mask64(const __mmask16 mask[4]) {
  return _mm512_kunpackd(_mm512_kunpackw(mask[3], mask[2]), _mm512_kunpackw(mask[1], mask[0]));
}

// NearestCodeIndex.segment_codes' candidate magnitude code of 16 normalized values (int32 lanes) from the positive
// runs: the magnitude code of |x| (of the largest float below |x| where x < 0: ``key``, as an fp32 pattern) or one
// below it; with Floor, the largest magnitude <= key or one below it (segment_floors). The run of key from its
// binade's first run and split (two-register permutes of 32 entries), its position in the run by an fma, the floor
// biased down, clamped to the run. ``negative``: x < 0.
template <bool Nonnegative, bool Floor = false>
QSTATE_INLINE __m512i segment_candidate16(__m512 value, const int32_t* table, __mmask16& negative) {
  using namespace segment;
  negative = Nonnegative ? 0 : _mm512_cmp_ps_mask(value, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512i bits = _mm512_castps_si512(_mm512_abs_ps(value));
  const __m512i key = Nonnegative ? bits : _mm512_mask_sub_epi32(bits, negative, bits, _mm512_set1_epi32(1));
  __m512i binade = _mm512_sub_epi32(_mm512_srli_epi32(key, 23), _mm512_set1_epi32(kBinade0));
  binade = _mm512_min_epi32(_mm512_max_epi32(binade, _mm512_setzero_si512()), _mm512_set1_epi32(kBinades - 1));
  const auto table32 = [&](int offset) {
    return _mm512_permutex2var_epi32(_mm512_loadu_si512(table + offset), binade, _mm512_loadu_si512(table + offset + 16));
  };
  const __m512i first = table32(Floor ? kFloorFirst : kFirst), split = table32(Floor ? kFloorSplit : kSplit);
  const __m512i run = _mm512_mask_add_epi32(first, _mm512_cmpge_epi32_mask(key, split), first, _mm512_set1_epi32(1));
  const auto table16 = [&](int offset) { return _mm512_permutexvar_epi32(run, _mm512_loadu_si512(table + offset)); };
  const __m512 position = _mm512_fmadd_ps(_mm512_castsi512_ps(key), _mm512_castsi512_ps(table16(kScale)),
                                          _mm512_castsi512_ps(table16(Floor ? kFloorOffset : kOffset)));
  const __m512i step = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(position), _mm512_setzero_si512()), table16(kLast));
  return _mm512_add_epi32(table16(kBase), step);
}

// The magnitude codes of 64 normalized values (value[r]: values 16r .. 16r + 15) of a codebook with segments, as bytes,
// and which values are < 0 (``negative``): the candidates (segment_candidate16) repaired by one compare each with the
// table entry (by byte permutes, lookup64) at the signed code of the next magnitude's rounding threshold or, with
// Floor, of the next magnitude's value (``table``: the thresholds' or the values' byte planes): for x >= 0 code
// zero + c (+ 1 with Floor), up where x reaches it; for x < 0 code zero - 1 - c, up where x is below it. The index
// wraps, and the result saturates, where c is beyond the codebook's side (the signed code saturates there too).
template <bool Nonnegative, bool Floor>
QSTATE_INLINE __m512i segment_magnitudes64(const __m512 value[4], const Codebook& cb, const uint8_t* table, __mmask64& negative) {
  __m512i candidate[4];
  __mmask16 negative16[4], reached[4];
  for (int r = 0; r < 4; ++r) candidate[r] = segment_candidate16<Nonnegative, Floor>(value[r], cb.segments, negative16[r]);
  negative = mask64(negative16);
  const __m512i magnitude = bytes64(candidate), zero = _mm512_set1_epi8(static_cast<char>(cb.segments[segment::kZero]));
  const __m512i one = _mm512_set1_epi8(1), positive_index = _mm512_add_epi8(zero, Floor ? _mm512_add_epi8(magnitude, one) : magnitude);
  const __m512i index = _mm512_mask_sub_epi8(positive_index, negative, _mm512_sub_epi8(zero, one), magnitude);
  __m512 entry[4];
  lookup64(index, table, entry);
  for (int r = 0; r < 4; ++r) reached[r] = _mm512_cmp_ps_mask(value[r], entry[r], _CMP_GE_OQ);
  return _mm512_mask_adds_epu8(magnitude, mask64(reached) ^ negative, magnitude, one);
}

// NearestCodeIndex.segment_codes of 64 normalized values (value[r]: values 16r .. 16r + 15) of a codebook with
// segments, clamped up to min_code, as bytes in order: zero +- the magnitude code (segment_magnitudes64).
template <bool Nonnegative>
QSTATE_INLINE __m512i segment_codes64(const __m512 value[4], const Codebook& cb, int32_t min_code) {
  __mmask64 negative;
  const __m512i magnitude =
      segment_magnitudes64<Nonnegative, false>(value, cb, reinterpret_cast<const uint8_t*>(cb.segments + segment::kThresholds), negative);
  const __m512i zero = _mm512_set1_epi8(static_cast<char>(cb.segments[segment::kZero]));
  const __m512i code = _mm512_mask_subs_epu8(_mm512_adds_epu8(zero, magnitude), negative, zero, magnitude);
  return _mm512_max_epu8(code, _mm512_set1_epi8(static_cast<char>(min_code)));
}
#endif

// Counts of 16 normalized values of a codebook on a grid (Codebook::grid: its values (c + 1) / grid): floor(value * grid
// - offset) held to [0, grid - 1]. Offset 0.5: the nearest code, the count of the thresholds (c + 1.5) / grid that
// are <= value; offset 1: stochastic rounding's floor, the count of the values (c + 1) / grid, c >= 1, that are <=
// value (search16 of Codebook::levels from kFloorLevels). The fma rounds nothing where the floor is >= 0 (value * grid
// - offset is then a multiple of value * grid's ulp); a NaN or negative value counts 0, as in the searches.
QSTATE_INLINE __m512i grid_codes16(__m512 value, float grid, float offset) {
  const __m512 below = _mm512_fmsub_ps(value, _mm512_set1_ps(grid), _mm512_set1_ps(offset));
  const __m512 held =
      _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(below, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), _mm512_setzero_ps()),
                    _mm512_set1_ps(grid - 1.0f));
  return _mm512_cvttps_epi32(held);
}

// encode_lane on 16 values of a codebook of codes < 2^Depth: arithmetic on a grid (grid_codes16), else the search of
// its thresholds up to 7 levels, the bucket table for 8 (measured on an AMD Zen 4: its gather beats 8 levels of
// permutes and loses to 7 or fewer).
template <int Depth, bool Nonnegative>
QSTATE_INLINE __m512i codebook_codes16(__m512 value, const Codebook& cb) {
  if constexpr (Depth == 8)
    return bucket16<Nonnegative>(value, cb);
  else
    return cb.grid != 0.0f ? grid_codes16(value, cb.grid, 0.5f) : search16<Depth>(value, cb.levels);
}

// Minifloat::encode of 16 normalized values: the same fp32 and integer operations, lane by lane.
template <bool Stochastic>
QSTATE_INLINE __m128i encode_minifloat16(__m512 value, const Minifloat& mf, __m512 uniform) {
  const __m512 magnitude = mf.has_sign ? _mm512_abs_ps(value) : _mm512_max_ps(value, _mm512_setzero_ps());
  const __m512 scaled = _mm512_mul_ps(magnitude, _mm512_set1_ps(mf.max_value));
  const __m512i field = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(scaled), 23), _mm512_set1_epi32(0xFF));
  const __m512i exponent = _mm512_max_epi32(_mm512_sub_epi32(field, _mm512_set1_epi32(127)), _mm512_set1_epi32(1 - mf.bias));
  const __m512i power = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(mf.mantissa_bits + 127), exponent), 23);  // pow2(M - e)
  const __m512 mantissa = _mm512_mul_ps(scaled, _mm512_castsi512_ps(power));
  __m512 rounded;
  if constexpr (Stochastic) {
    const __m512 low = _mm512_roundscale_ps(mantissa, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __mmask16 up = _mm512_cmp_ps_mask(uniform, _mm512_sub_ps(mantissa, low), _CMP_LT_OQ);
    rounded = _mm512_mask_add_ps(low, up, low, _mm512_set1_ps(1.0f));
  } else {
    const __m512 magic = _mm512_set1_ps(0x1p23f);
    rounded = _mm512_sub_ps(_mm512_add_ps(mantissa, magic), magic);
  }
  const __m512i binade = _mm512_sllv_epi32(_mm512_add_epi32(exponent, _mm512_set1_epi32(mf.bias - 1)), _mm512_set1_epi32(mf.mantissa_bits));
  __m512i code = _mm512_add_epi32(binade, _mm512_cvttps_epi32(rounded));
  code = _mm512_max_epi32(_mm512_min_epi32(code, _mm512_set1_epi32(mf.max_code)), _mm512_set1_epi32(mf.min_code));
  if (mf.has_sign) {
    const __mmask16 negative = _mm512_cmp_ps_mask(value, _mm512_setzero_ps(), _CMP_LT_OQ);
    code = _mm512_mask_or_epi32(code, negative, code, _mm512_set1_epi32(1 << mf.sign_shift));
  }
  return _mm512_cvtepi32_epi8(code);
}

// codebook_stochastic of 16 normalized values (a codebook of codes < 2^Depth): the floor by a search of the values
// (codes < 128: Codebook::levels from kFloorLevels), else from the round-to-nearest code (codebook_codes16), held to
// [0, last - 1]; then the rounding up between it and the next value.
template <int Depth, bool Nonnegative>
QSTATE_INLINE __m128i codebook_stochastic16(__m512 value, const Codebook& cb, int32_t last, int32_t min_code, __m512 uniform) {
  __m512i floor;
  if constexpr (Depth < 8) {
    floor = cb.grid != 0.0f ? grid_codes16(value, cb.grid, 1.0f) : search16<Depth>(value, cb.levels + kFloorLevels);
  } else {
    const __m512i code = codebook_codes16<Depth, Nonnegative>(value, cb);
    const __mmask16 above = _mm512_cmp_ps_mask(lookup<Depth>(cb.decode, code), value, _CMP_GT_OQ);
    floor = _mm512_max_epi32(_mm512_mask_sub_epi32(code, above, code, _mm512_set1_epi32(1)), _mm512_setzero_si512());
  }
  const __m512i low = _mm512_min_epi32(floor, _mm512_set1_epi32(last - 1));
  const __m512 low_value = lookup<Depth>(cb.decode, low),
               high_value = lookup<Depth>(cb.decode, _mm512_add_epi32(low, _mm512_set1_epi32(1)));
  const __mmask16 up =
      _mm512_cmp_ps_mask(_mm512_mul_ps(uniform, _mm512_sub_ps(high_value, low_value)), _mm512_sub_ps(value, low_value), _CMP_LT_OQ);
  const __m512i result = _mm512_max_epi32(_mm512_mask_add_epi32(low, up, low, _mm512_set1_epi32(1)), _mm512_set1_epi32(min_code));
  return _mm512_cvtepi32_epi8(result);
}

#ifdef QSTATE_VBMI
// codebook_stochastic's floor code (held to [0, last - 1]) of 64 normalized values (value[r]: values 16r .. 16r + 15)
// of a codebook with segments, as bytes (NearestCodeIndex.segment_floors): the largest magnitude <= key
// (segment_magnitudes64 with Floor), zero + it for x >= 0, zero - 1 - it for x < 0.
template <bool Nonnegative>
QSTATE_INLINE __m512i segment_floors64(const __m512 value[4], const Codebook& cb, int32_t last) {
  __mmask64 negative;
  const __m512i magnitude = segment_magnitudes64<Nonnegative, true>(value, cb, cb.planes, negative);
  const __m512i zero = _mm512_set1_epi8(static_cast<char>(cb.segments[segment::kZero]));
  const __m512i positive = _mm512_min_epu8(_mm512_adds_epu8(zero, magnitude), _mm512_set1_epi8(static_cast<char>(last - 1)));
  return _mm512_mask_subs_epu8(positive, negative, _mm512_sub_epi8(zero, _mm512_set1_epi8(1)), magnitude);
}

// codebook_stochastic16 of 64 values (value[r]: values 16r .. 16r + 15; uniform[r] their draws) of an 8-bit codebook,
// as its 64 byte codes: the floor by segment_floors64 where the codebook has segments, else from the bucket gather's
// nearest code; the table lookups by byte permutes of 64 codes at a time (lookup64), not by lookup<8>'s 16 at a time.
template <bool Nonnegative>
QSTATE_INLINE __m512i codebook_stochastic64(const __m512 value[4], const Codebook& cb, int32_t last, int32_t min_code,
                                            const __m512 uniform[4]) {
  __m512i low;
  if (cb.segments != nullptr) {
    low = segment_floors64<Nonnegative>(value, cb, last);
  } else {
    __m512i nearest[4];
    __m512 nearest_value[4];
    for (int r = 0; r < 4; ++r) nearest[r] = bucket16<Nonnegative>(value[r], cb);
    lookup64(bytes64(nearest), cb.planes, nearest_value);
    for (int r = 0; r < 4; ++r) {
      const __mmask16 above = _mm512_cmp_ps_mask(nearest_value[r], value[r], _CMP_GT_OQ);
      const __m512i floor = _mm512_mask_sub_epi32(nearest[r], above, nearest[r], _mm512_set1_epi32(1));
      nearest[r] = _mm512_min_epi32(_mm512_max_epi32(floor, _mm512_setzero_si512()), _mm512_set1_epi32(last - 1));
    }
    low = bytes64(nearest);
  }
  __m512 low_value[4], high_value[4];
  lookup64(low, cb.planes, low_value);
  lookup64(_mm512_add_epi8(low, _mm512_set1_epi8(1)), cb.planes, high_value);
  __mmask16 up[4];
  for (int r = 0; r < 4; ++r)
    up[r] = _mm512_cmp_ps_mask(_mm512_mul_ps(uniform[r], _mm512_sub_ps(high_value[r], low_value[r])), _mm512_sub_ps(value[r], low_value[r]),
                               _CMP_LT_OQ);
  return _mm512_max_epu8(_mm512_mask_add_epi8(low, mask64(up), low, _mm512_set1_epi8(1)), _mm512_set1_epi8(static_cast<char>(min_code)));
}
#endif

// 16 codes of <= 4 bits (a byte each) packed into 8 bytes: code 2i in the low nibble of byte i.
inline void pack16(__m128i codes, uint8_t* out) {
  const __m128i low = _mm_and_si128(codes, _mm_set1_epi16(0x00FF));                      // code 2i
  const __m128i high = _mm_and_si128(_mm_srli_epi16(codes, 4), _mm_set1_epi16(0x00F0));  // code 2i + 1, shifted to bits 4-7
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(_mm_or_si128(low, high), _mm_setzero_si128()));
}

// random_bits(seed, index + k) of k = 0..15, bit for bit: for an even index, splitmix64's outputs index / 2 + 1 to
// index / 2 + 8 in 64-bit lanes (their states by one scalar multiply and a vector add; AVX512DQ's 64-bit multiply
// for the mixing), their halves swapped (lane 2k: the upper half of output k); else lane by lane.
QSTATE_INLINE __m512i random16(uint64_t seed, int64_t index) {
#ifdef QSTATE_AVX512DQ
  if (index % 2 == 0) {
    constexpr uint64_t gamma = 0x9E3779B97F4A7C15ull;  // output n's state: seed + n * gamma
    alignas(64) static constexpr uint64_t lane_steps[8] = {0, gamma, 2 * gamma, 3 * gamma, 4 * gamma, 5 * gamma, 6 * gamma, 7 * gamma};
    const uint64_t first = seed + (static_cast<uint64_t>(index) / 2 + 1) * gamma;  // lane 0's; lane k's k * gamma on
    __m512i z = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(first)), _mm512_load_si512(lane_steps));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(static_cast<int64_t>(0xBF58476D1CE4E5B9ull)));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(static_cast<int64_t>(0x94D049BB133111EBull)));
    return _mm512_ror_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 31)), 32);
  }
#endif
  alignas(64) uint32_t random[16];
  for (int k = 0; k < 16; ++k) random[k] = random_bits(seed, index + k);
  return _mm512_load_si512(random);
}

// cast_bits(seed, index + k) of k = 0..15, bit for bit: for an index that is a multiple of 4, the quarters of
// splitmix64's outputs index / 4 + 1 to index / 4 + 4 (splitmix64x4) widened to words; else lane by lane.
QSTATE_INLINE __m512i cast_random16(uint64_t seed, int64_t index) {
  if (index % 4 == 0) return _mm512_slli_epi32(_mm512_cvtepu16_epi32(splitmix64x4(seed, static_cast<uint64_t>(index) / 4 + 1)), 16);
  alignas(64) uint32_t random[16];
  for (int k = 0; k < 16; ++k) random[k] = cast_bits(seed, index + k);
  return _mm512_load_si512(random);
}

// bf16_nearest of 16 values (round to nearest even; NaN quieted as bf16_nearest does), as bf16 patterns.
inline __m256i bf16_nearest16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);
}

// bf16_nearest(bf16_stochastic(x)) of 16 values with their draws, as bf16 patterns: the upper 16 random bits added to
// the fp32 pattern of a value up to kBf16Max (0x8000 past it), the upper half kept (the low half cleared: nearest is
// then exact); inf/NaN as bf16_nearest16 has them.
inline __m256i bf16_stochastic16(__m512 x, __m512i random) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512 magnitude = _mm512_abs_ps(x);
  const __mmask16 finite = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
  const __mmask16 in_range = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(kBf16Max), _CMP_LE_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i addend = _mm512_mask_blend_epi32(in_range, _mm512_set1_epi32(0x8000), _mm512_srli_epi32(random, 16));
  __m512i upper = _mm512_srli_epi32(_mm512_mask_add_epi32(bits, finite, bits, addend), 16);
  upper = _mm512_mask_or_epi32(upper, nan, upper, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(upper);
}

// A zero-free cast's 16 stored patterns: a positive value stored as 0 becomes pattern 1, the smallest subnormal
// (CastFormat.lift_flushed).
inline __m256i lift_flushed16(__m512 value, __m256i stored) {
  const __mmask16 flushed =
      _mm512_cmp_ps_mask(value, _mm512_setzero_ps(), _CMP_GT_OQ) & _mm256_cmpeq_epi16_mask(stored, _mm256_setzero_si256());
  return _mm256_mask_mov_epi16(stored, flushed, _mm256_set1_epi16(1));
}

// fp16_bits(fp16_nearest(x)) of 16 values: the hardware's round-to-nearest-even conversion (subnormals, overflow to
// inf), NaN as fp16_bits writes it (the quiet NaN 0x7E00 with x's sign).
inline __m256i fp16_nearest16(__m512 x) {
  const __m256i converted = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m256i sign = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)), 16));
  return _mm256_mask_mov_epi16(converted, nan, _mm256_or_si256(sign, _mm256_set1_epi16(0x7E00)));
}

// fp16_bits(fp16_stochastic(x)) of 16 values with their draws, the same integer sum lane by lane, rebased from fp32's
// exponent bias to fp16's (less the lift's own 2^-14 below 2^-14); |x| > 65504 and inf/NaN: fp16_nearest16.
inline __m256i fp16_stochastic16(__m512 x, __m512i random) {
  const __m512 magnitude = _mm512_abs_ps(x);
  const __mmask16 small = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(0x1p-14f), _CMP_LT_OQ);
  const __m512i lifted = _mm512_castps_si512(_mm512_mask_add_ps(magnitude, small, magnitude, _mm512_set1_ps(0x1p-14f)));
  const __m512i noise = _mm512_srli_epi32(_mm512_xor_si512(random, _mm512_set1_epi32(-1)), 19);
  const __m512i rebase = _mm512_mask_blend_epi32(small, _mm512_set1_epi32(112 << 10), _mm512_set1_epi32(113 << 10));
  const __m512i pattern = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(lifted, noise), 13), rebase);
  const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)), 16);
  const __m256i stored = _mm512_cvtepi32_epi16(_mm512_or_si512(pattern, sign));
  const __mmask16 in_range = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(65504.0f), _CMP_LE_OQ);
  return in_range == 0xFFFF ? stored : _mm256_mask_mov_epi16(fp16_nearest16(x), in_range, stored);
}

// 16 bf16 patterns as fp32 (exact).
inline __m512 bf16_value16(__m256i patterns) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(patterns), 16)); }

// 16 parameter values or gradients of element type T as fp32 (exact), and 16 fp32 values on T's grid stored in T
// (from_float: exact for them, NaN as it writes it).
QSTATE_INLINE __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
QSTATE_INLINE __m512 load16(const BFloat16* x) { return bf16_value16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); }
QSTATE_INLINE __m512 load16(const Float16* x) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); }
QSTATE_INLINE void store16(float* x, __m512 value) { _mm512_storeu_ps(x, value); }
QSTATE_INLINE void store16(BFloat16* x, __m512 value) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), bf16_nearest16(value)); }
QSTATE_INLINE void store16(Float16* x, __m512 value) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), fp16_nearest16(value)); }

// Rounding::round of 16 values (elements index .. index + 15 of their parameter: their SR draws) as bf16 or fp16
// patterns (bf16_nearest16 / fp16_nearest16 have NaN's).
QSTATE_INLINE __m256i patterns16(Bf16Nearest, __m512 x, uint64_t, int64_t) { return bf16_nearest16(x); }
QSTATE_INLINE __m256i patterns16(Bf16Stochastic, __m512 x, uint64_t seed, int64_t index) {
  return bf16_stochastic16(x, cast_random16(seed, index));
}
QSTATE_INLINE __m256i patterns16(Fp16Nearest, __m512 x, uint64_t, int64_t) { return fp16_nearest16(x); }
QSTATE_INLINE __m256i patterns16(Fp16Stochastic, __m512 x, uint64_t seed, int64_t index) {
  return fp16_stochastic16(x, cast_random16(seed, index));
}

// 16 new parameter values x rounded to the weight grid by Rounding, saturating (elements index .. index + 15: their SR draws of
// ``seed``) and stored in T at p (a parameter of the grid's own dtype: the rounding's patterns as they are, which
// store16 of their values would give again; round_store8's form); returns the rounded values (a NaN stays a NaN).
template <typename T>
QSTATE_INLINE __m512 round_store16(KeepFp32, T* p, __m512 x, uint64_t, int64_t) {
  store16(p, x);
  return x;
}
template <typename T, typename Rounding>
QSTATE_INLINE __m512 round_store16(Rounding rounding, T* p, __m512 x, uint64_t seed, int64_t index) {
  using Element = typename Rounding::Element;
  // saturated (min/max give their second operand where one is NaN: a NaN x stays)
  const __m512 largest = _mm512_set1_ps(Rounding::kLargest), lowest = _mm512_set1_ps(-Rounding::kLargest);
  const __m256i patterns = patterns16(rounding, _mm512_max_ps(lowest, _mm512_min_ps(largest, x)), seed, index);
  const __m512 rounded = std::is_same_v<Element, BFloat16> ? bf16_value16(patterns) : _mm512_cvtph_ps(patterns);
  if constexpr (std::is_same_v<T, Element>)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), patterns);
  else
    store16(p, rounded);
  return rounded;
}

// The running absmax and non-finite flag of fp32 values in one: the lane-wise max of ``top`` and the magnitudes' bit
// patterns (the patterns of |x| order as the values do; inf's and NaN's are above every finite one's). Reduced by
// top_of.
QSTATE_INLINE __m512i max_magnitude_bits(__m512i top, __m512 x) {
  return _mm512_max_epu32(top, _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
}

// The absmax of the values max_magnitude_bits ran over (``top``), and whether all were finite (else 0).
QSTATE_INLINE float top_of(__m512i top, bool& finite) {
  const uint32_t bits = _mm512_reduce_max_epu32(top);
  finite = bits < 0x7F800000u;
  return finite ? float_of(bits) : 0.0f;
}

// The AVX-512 form of adam_lane and the block's running absmaxes / non-finite flags, for 16 values.
struct Update16 {
  __m512 sign, l2, decay, lerp_coeff, b2, one_minus_b2, step, eps, m_bound, bc2, eco;
  bool lerp_from_end, decoupled;
  __m512i m_top = _mm512_setzero_si512(), v_top = _mm512_setzero_si512();  // running max_magnitude_bits

  explicit Update16(const Hyper& h)
      : sign(_mm512_set1_ps(h.sign)),
        l2(_mm512_set1_ps(h.l2)),
        decay(_mm512_set1_ps(h.decay)),
        lerp_coeff(_mm512_set1_ps(h.lerp_coeff)),
        b2(_mm512_set1_ps(h.b2)),
        one_minus_b2(_mm512_set1_ps(h.one_minus_b2)),
        step(_mm512_set1_ps(h.step)),
        eps(_mm512_set1_ps(h.eps)),
        m_bound(_mm512_set1_ps(h.m_bound)),
        bc2(_mm512_set1_ps(h.bc2)),
        eco(_mm512_set1_ps(h.eco)),
        lerp_from_end(h.lerp_from_end),
        decoupled(h.decoupled) {}

  // adam_lane's hold of the updated mi by the updated v's root: max(floor, root) is root < floor ? floor : root (a NaN
  // root kept), min(limit, m) is m > limit ? limit : m, max(-limit, m) is m < -limit ? -limit : m (a NaN m or limit
  // keeps m, as there); -limit by flipping the sign bit, as the scalar negation does (also for 0).
  QSTATE_INLINE __m512 held(__m512 mi, __m512 root) const {
    const __m512 limit = _mm512_mul_ps(_mm512_max_ps(_mm512_set1_ps(kRootFloor), root), m_bound);
    const __m512 negative =
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(limit), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
    return _mm512_max_ps(negative, _mm512_min_ps(limit, mi));
  }

  // p[0:16] updated in place; the new moments (from decoded mi, vi) to m[0:16], v[0:16], and their absmaxes and flags.
  inline void operator()(float* p, const float* g, __m512 mi, __m512 vi, float* m, float* v) {
    advance(p, g, mi, vi);
    record(mi, vi, m, v);
  }

  // The new moments mi, vi to m[0:16], v[0:16], and their running absmaxes and non-finite flags (max_magnitude_bits).
  QSTATE_INLINE void record(__m512 mi, __m512 vi, float* m, float* v) {
    _mm512_storeu_ps(m, mi);
    _mm512_storeu_ps(v, vi);
    m_top = max_magnitude_bits(m_top, mi), v_top = max_magnitude_bits(v_top, vi);
  }

  // adam_lane of 16 values p[0:16] (element type T, from element ``index`` of the parameter: the SR draws of ``seed``),
  // operation for operation, the new value rounded to the weight grid and stored (round_store16; KeepFp32: as it is); ECO's
  // feedback into mi where Eco; the decoded moments mi, vi updated in their registers.
  template <typename T = float, typename Rounding = KeepFp32, bool Eco = false>
  QSTATE_INLINE void advance(T* p, const T* g, __m512& mi, __m512& vi, uint64_t seed = 0, int64_t index = 0) const {
    __builtin_prefetch(p + PREFETCH_AHEAD);
    __builtin_prefetch(g + PREFETCH_AHEAD);
    const __m512 pi = load16(p), signed_g = _mm512_mul_ps(sign, load16(g));
    const __m512 gi = decoupled ? signed_g : _mm512_fmadd_ps(pi, l2, signed_g);
    const __m512 decayed = decoupled ? _mm512_mul_ps(pi, decay) : pi;
    mi = _mm512_fmadd_ps(lerp_coeff, _mm512_sub_ps(gi, mi), lerp_from_end ? gi : mi);
    vi = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_b2, gi), gi, _mm512_mul_ps(vi, b2));
    const __m512 root = _mm512_sqrt_ps(vi);
    mi = held(mi, root);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(root, bc2), eps);
    const __m512 updated = _mm512_sub_ps(decayed, _mm512_div_ps(_mm512_mul_ps(step, mi), denom));
    const __m512 rounded = round_store16(Rounding{}, p, updated, seed, index);
    if constexpr (Eco) mi = _mm512_fmadd_ps(_mm512_mul_ps(eco, denom), _mm512_sub_ps(updated, rounded), mi);
  }
};

// sgd_lane of 16 values (sgd8's form): buf (decoded; ignored where h.created) in place; returns the new param values.
QSTATE_INLINE __m512 sgd16(__m512 p, __m512 g, __m512& buf, const Momentum& h) {
  const __m512 signed_g = _mm512_mul_ps(_mm512_set1_ps(h.sign), g);
  const __m512 d = h.has_weight_decay ? _mm512_fmadd_ps(p, _mm512_set1_ps(h.weight_decay), signed_g) : signed_g;
  const __m512 momentum = _mm512_set1_ps(h.momentum);
  buf = h.created ? d : _mm512_fmadd_ps(d, _mm512_set1_ps(h.dampened), _mm512_mul_ps(buf, momentum));
  return _mm512_fmadd_ps(h.nesterov ? _mm512_fmadd_ps(buf, momentum, d) : buf, _mm512_set1_ps(h.neg_lr), p);
}
#endif

#ifdef QSTATE_AVX2
// ---- AVX2 (without AVX-512): the fp32 update 8 values at a time, bf16/fp16 casts, running absmaxes ----
// The same operations as the scalar lanes and the AVX-512 forms (Update16 and its helpers), lane by lane: the same bits.

// 8 bf16 patterns (in 16-bit lanes) as fp32, exact; 8 values of an element type T as fp32 (load16; fp16: the
// hardware's exact conversion).
QSTATE_INLINE __m256 bf16_value8(__m128i patterns) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(patterns), 16)); }
QSTATE_INLINE __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
QSTATE_INLINE __m256 load8(const BFloat16* x) { return bf16_value8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))); }
QSTATE_INLINE __m256 load8(const Float16* x) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))); }

// uniform_of of 8 draws.
QSTATE_INLINE __m256 uniform_of8(__m256i random) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(random, 8)), _mm256_set1_ps(0x1p-24f));
}

// The low 16 bits of 8 32-bit lanes (each < 2^16) as 8 16-bit lanes.
QSTATE_INLINE __m128i narrow8(__m256i lanes) { return _mm_packus_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1)); }

// A lane mask of 8 fp32 compares as 8 16-bit lane masks.
QSTATE_INLINE __m128i narrow_mask8(__m256 mask) {
  const __m256i lanes = _mm256_castps_si256(mask);
  return _mm_packs_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
}

// bf16_nearest of 8 values (round to nearest even; NaN quieted), as bf16 patterns.
QSTATE_INLINE __m128i bf16_nearest8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  return narrow8(_mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))));
}

// bf16_nearest(bf16_stochastic(x)) of 8 values with their draws (bf16_stochastic16).
QSTATE_INLINE __m128i bf16_stochastic8(__m256 x, __m256i random) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256i finite = _mm256_castps_si256(_mm256_cmp_ps(magnitude, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));
  const __m256i in_range = _mm256_castps_si256(_mm256_cmp_ps(magnitude, _mm256_set1_ps(kBf16Max), _CMP_LE_OQ));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i addend = _mm256_blendv_epi8(_mm256_set1_epi32(0x8000), _mm256_srli_epi32(random, 16), in_range);
  const __m256i upper = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_and_si256(finite, addend)), 16);
  return narrow8(_mm256_or_si256(upper, _mm256_and_si256(nan, _mm256_set1_epi32(0x40))));
}

// fp16_bits(fp16_nearest(x)) of 8 values (fp16_nearest16): the hardware's conversion, NaN as the quiet 0x7E00 with x's sign.
QSTATE_INLINE __m128i fp16_nearest8(__m256 x) {
  const __m128i converted = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m128i sign = narrow8(_mm256_srli_epi32(_mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(INT32_MIN)), 16));
  return _mm_blendv_epi8(converted, _mm_or_si128(sign, _mm_set1_epi16(0x7E00)), narrow_mask8(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

// fp16_bits(fp16_stochastic(x)) of 8 values with their draws (fp16_stochastic16).
QSTATE_INLINE __m128i fp16_stochastic8(__m256 x, __m256i random) {
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 small = _mm256_cmp_ps(magnitude, _mm256_set1_ps(0x1p-14f), _CMP_LT_OQ);
  const __m256i lifted = _mm256_castps_si256(_mm256_add_ps(magnitude, _mm256_and_ps(small, _mm256_set1_ps(0x1p-14f))));
  const __m256i noise = _mm256_srli_epi32(_mm256_xor_si256(random, _mm256_set1_epi32(-1)), 19);
  const __m256i rebase =
      _mm256_add_epi32(_mm256_set1_epi32(112 << 10), _mm256_and_si256(_mm256_castps_si256(small), _mm256_set1_epi32(1 << 10)));
  const __m256i pattern = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(lifted, noise), 13), rebase);
  const __m256i sign = _mm256_srli_epi32(_mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(INT32_MIN)), 16);
  const __m128i stored = narrow8(_mm256_or_si256(pattern, sign));
  const __m256 in_range = _mm256_cmp_ps(magnitude, _mm256_set1_ps(65504.0f), _CMP_LE_OQ);
  return _mm256_movemask_ps(in_range) == 0xFF ? stored : _mm_blendv_epi8(fp16_nearest8(x), stored, narrow_mask8(in_range));
}

// The bf16 / fp16 patterns of 8 values x by a Rounding (random: their draws under SR; patterns16).
QSTATE_INLINE __m128i patterns8(Bf16Nearest, __m256 x, __m256i) { return bf16_nearest8(x); }
QSTATE_INLINE __m128i patterns8(Bf16Stochastic, __m256 x, __m256i random) { return bf16_stochastic8(x, random); }
QSTATE_INLINE __m128i patterns8(Fp16Nearest, __m256 x, __m256i) { return fp16_nearest8(x); }
QSTATE_INLINE __m128i patterns8(Fp16Stochastic, __m256 x, __m256i random) { return fp16_stochastic8(x, random); }

// patterns8 of x by Rounding with the draws draws[at:at + 8] (read only where Rounding draws).
template <typename Rounding>
QSTATE_INLINE __m128i drawn_patterns8(__m256 x, const uint32_t* draws, int64_t at) {
  __m256i random = _mm256_setzero_si256();
  if constexpr (Rounding::kStochastic) random = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(draws + at));
  return patterns8(Rounding{}, x, random);
}

// 8 fp32 values stored in an element type T (store16).
QSTATE_INLINE void store8(float* x, __m256 value) { _mm256_storeu_ps(x, value); }
QSTATE_INLINE void store8(BFloat16* x, __m256 value) { _mm_storeu_si128(reinterpret_cast<__m128i*>(x), bf16_nearest8(value)); }
QSTATE_INLINE void store8(Float16* x, __m256 value) { _mm_storeu_si128(reinterpret_cast<__m128i*>(x), fp16_nearest8(value)); }

// 8 new parameter values x rounded to the weight grid (round_store16; draws[0:8]: their cast_bits under SR) and stored in T
// at p (a parameter of the grid's own dtype: the rounding's patterns as they are, which store8 of their values would
// give again); returns the rounded values.
template <typename T>
QSTATE_INLINE __m256 round_store8(KeepFp32, T* p, __m256 x, const uint32_t*) {
  store8(p, x);
  return x;
}
template <typename T, typename Rounding>
QSTATE_INLINE __m256 round_store8(Rounding, T* p, __m256 x, const uint32_t* draws) {
  using Element = typename Rounding::Element;
  // saturated (min/max give their second operand where one is NaN: a NaN x stays)
  const __m256 largest = _mm256_set1_ps(Rounding::kLargest), lowest = _mm256_set1_ps(-Rounding::kLargest);
  const __m128i patterns = drawn_patterns8<Rounding>(_mm256_max_ps(lowest, _mm256_min_ps(largest, x)), draws, 0);
  const __m256 rounded = std::is_same_v<Element, BFloat16> ? bf16_value8(patterns) : _mm256_cvtph_ps(patterns);
  if constexpr (std::is_same_v<T, Element>)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), patterns);
  else
    store8(p, rounded);
  return rounded;
}

// A cast's 8 stored patterns of x by its Rounding (draws[at:at + 8]: their cast_bits under SR); zero_free: a positive
// value stored as 0 becomes pattern 1, the smallest subnormal (CastFormat.lift_flushed). Returns the patterns.
template <typename Rounding>
QSTATE_INLINE __m128i store_cast8(typename Rounding::Element* out, __m256 x, const uint32_t* draws, int64_t at, bool zero_free) {
  __m128i stored = drawn_patterns8<Rounding>(x, draws, at);
  if (zero_free) {
    const __m128i flushed =
        _mm_and_si128(narrow_mask8(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ)), _mm_cmpeq_epi16(stored, _mm_setzero_si128()));
    stored = _mm_blendv_epi8(stored, _mm_set1_epi16(1), flushed);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), stored);
  return stored;
}

// max_magnitude_bits and top_of on 8 lanes.
QSTATE_INLINE __m256i max_magnitude_bits8(__m256i top, __m256 x) {
  return _mm256_max_epu32(top, _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF)));
}
QSTATE_INLINE float top_of(__m256i top, bool& finite) {
  __m128i half = _mm_max_epu32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  half = _mm_max_epu32(half, _mm_shuffle_epi32(half, 0x4E));
  half = _mm_max_epu32(half, _mm_shuffle_epi32(half, 0xB1));
  const uint32_t bits = static_cast<uint32_t>(_mm_cvtsi128_si32(half));
  finite = bits < 0x7F800000u;
  return finite ? float_of(bits) : 0.0f;
}

// The SR draws of 8 elements from ``index`` (random_bits(seed, index + k), k < 8): four splitmix64 outputs for an even
// index (splitmix64x4, each one's upper half, then its lower half), else element by element.
QSTATE_INLINE __m256i random8(uint64_t seed, int64_t index) {
  if (index % 2 == 0) return _mm256_shuffle_epi32(splitmix64x4(seed, static_cast<uint64_t>(index) / 2 + 1), 0xB1);
  alignas(32) uint32_t random[8];
  for (int k = 0; k < 8; ++k) random[k] = random_bits(seed, index + k);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(random));
}

// uniform_of of the 8 draws from ``index``.
QSTATE_INLINE __m256 uniform8(uint64_t seed, int64_t index) { return uniform_of8(random8(seed, index)); }

// The 8 lanes of ``index`` (non-negative int32) in general registers, two per 64-bit word; at(k): lane k.
struct Lanes8 {
  uint64_t pairs[4];
  explicit Lanes8(__m256i index) {
    const __m128i low = _mm256_castsi256_si128(index), high = _mm256_extracti128_si256(index, 1);
    pairs[0] = _mm_cvtsi128_si64(low), pairs[1] = _mm_extract_epi64(low, 1);
    pairs[2] = _mm_cvtsi128_si64(high), pairs[3] = _mm_extract_epi64(high, 1);
  }
  uint32_t at(int k) const { return static_cast<uint32_t>(pairs[k / 2] >> (32 * (k % 2))); }
};

// table[index] of 8 lanes without a gather instruction: each index in a general register, its value loaded and
// inserted. An AMD Zen 3 runs vpgatherdd of 8 lanes at about half the rate of these loads and inserts (8-bit codes
// decoded from a 256-value table: 0.63 vs 0.31 ns per value, one thread); gather8 takes the indices from a register
// (Lanes8), gather_bytes8 reads 8 byte indices from memory. An int32 table's values are inserted as integers: through
// the float inserts int8's encoder was 2-3 % slower (measured).
QSTATE_INLINE __m256 table8(const float* table, uint32_t i0, uint32_t i1, uint32_t i2, uint32_t i3, uint32_t i4, uint32_t i5, uint32_t i6,
                            uint32_t i7) {
  __m128 low = _mm_load_ss(table + i0), high = _mm_load_ss(table + i4);
  low = _mm_insert_ps(low, _mm_load_ss(table + i1), 0x10), high = _mm_insert_ps(high, _mm_load_ss(table + i5), 0x10);
  low = _mm_insert_ps(low, _mm_load_ss(table + i2), 0x20), high = _mm_insert_ps(high, _mm_load_ss(table + i6), 0x20);
  low = _mm_insert_ps(low, _mm_load_ss(table + i3), 0x30), high = _mm_insert_ps(high, _mm_load_ss(table + i7), 0x30);
  return _mm256_set_m128(high, low);
}
QSTATE_INLINE __m256 gather_bytes8(const float* table, const uint8_t* codes) {
  return table8(table, codes[0], codes[1], codes[2], codes[3], codes[4], codes[5], codes[6], codes[7]);
}
QSTATE_INLINE __m256 gather8(const float* table, __m256i index) {
  const Lanes8 lanes(index);
  return table8(table, lanes.at(0), lanes.at(1), lanes.at(2), lanes.at(3), lanes.at(4), lanes.at(5), lanes.at(6), lanes.at(7));
}
QSTATE_INLINE __m256i gather8(const int32_t* table, __m256i index) {
  const Lanes8 lanes(index);
  __m128i low = _mm_cvtsi32_si128(table[lanes.at(0)]), high = _mm_cvtsi32_si128(table[lanes.at(4)]);
  low = _mm_insert_epi32(low, table[lanes.at(1)], 1), high = _mm_insert_epi32(high, table[lanes.at(5)], 1);
  low = _mm_insert_epi32(low, table[lanes.at(2)], 2), high = _mm_insert_epi32(high, table[lanes.at(6)], 2);
  low = _mm_insert_epi32(low, table[lanes.at(3)], 3), high = _mm_insert_epi32(high, table[lanes.at(7)], 3);
  return _mm256_set_m128i(high, low);
}

// A 16-entry table held in two registers (entries 0-7, 8-15) at 8 indices in [0, 16): two permutes and a blend.
QSTATE_INLINE __m256 lookup16(__m256 low, __m256 high, __m256i index) {
  const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(index, 28));  // bit 3 as the sign: blendv's selector
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, index), _mm256_permutevar8x32_ps(high, index), upper);
}

// table[index] of 8 indices in [0, 2^Log2), Log2 <= 4: a broadcast for one entry, a register permute up to 8, two and
// a blend for 16 (lookup16). Reads at least 8 values from ``table`` (one, for a broadcast).
template <int Log2>
QSTATE_INLINE __m256 lookup8(const float* table, __m256i index) {
  static_assert(Log2 >= 0 && Log2 <= 4);
  if constexpr (Log2 == 0)
    return _mm256_set1_ps(table[0]);
  else if constexpr (Log2 <= 3)
    return _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), index);
  else
    return lookup16(_mm256_loadu_ps(table), _mm256_loadu_ps(table + 8), index);
}

// search16 on 8 values (codes < 2^Depth, Depth <= 4: every level's thresholds in one register).
template <int Depth, int L = 0>
QSTATE_INLINE __m256i search8(__m256 value, const float* levels, __m256i code = _mm256_setzero_si256()) {
  if constexpr (L == Depth) {
    return code;
  } else {
    const __m256 threshold = lookup8<L>(levels + (1 << L) - 1, _mm256_srli_epi32(code, Depth - L));
    const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(threshold, value, _CMP_LE_OQ));
    return search8<Depth, L + 1>(value, levels, _mm256_add_epi32(code, _mm256_and_si256(up, _mm256_set1_epi32(1 << (Depth - 1 - L)))));
  }
}

// grid_codes16 on 8 values.
QSTATE_INLINE __m256i grid_codes8(__m256 value, float grid, float offset) {
  const __m256 below = _mm256_fmsub_ps(value, _mm256_set1_ps(grid), _mm256_set1_ps(offset));
  const __m256 held = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(below, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), _mm256_setzero_ps()),
                                    _mm256_set1_ps(grid - 1.0f));
  return _mm256_cvttps_epi32(held);
}

// codebook_codes16 on 8 values of a codebook of codes < 2^Depth, Depth <= 4: arithmetic on a grid, else the search of
// its thresholds (one register per level). (Deeper codebooks: bucket_codes8 and bucket_stochastic8; minifloats:
// encode_minifloat8; both in code_lanes' lanes8_loop.)
template <int Depth>
QSTATE_INLINE __m256i codebook_codes8(__m256 value, const Codebook& cb) {
  return cb.grid != 0.0f ? grid_codes8(value, cb.grid, 0.5f) : search8<Depth>(value, cb.levels);
}

// codebook_stochastic16 on 8 values of a codebook of codes < 2^Depth, Depth <= 4.
template <int Depth>
QSTATE_INLINE __m256i codebook_stochastic8(__m256 value, const Codebook& cb, int32_t last, int32_t min_code, __m256 uniform) {
  const __m256i floor = cb.grid != 0.0f ? grid_codes8(value, cb.grid, 1.0f) : search8<Depth>(value, cb.levels + kFloorLevels);
  const __m256i low = _mm256_min_epi32(floor, _mm256_set1_epi32(last - 1));
  const __m256 low_value = lookup8<Depth>(cb.decode, low),
               high_value = lookup8<Depth>(cb.decode, _mm256_add_epi32(low, _mm256_set1_epi32(1)));
  const __m256i up = _mm256_castps_si256(
      _mm256_cmp_ps(_mm256_mul_ps(uniform, _mm256_sub_ps(high_value, low_value)), _mm256_sub_ps(value, low_value), _CMP_LT_OQ));
  return _mm256_max_epi32(_mm256_sub_epi32(low, up), _mm256_set1_epi32(min_code));
}

// encode_minifloat16 on 8 values: Minifloat::encode's codes as int32 lanes.
template <bool Stochastic>
QSTATE_INLINE __m256i encode_minifloat8(__m256 value, const Minifloat& mf, __m256 uniform) {
  const __m256 magnitude = mf.has_sign ? _mm256_andnot_ps(_mm256_set1_ps(-0.0f), value) : _mm256_max_ps(value, _mm256_setzero_ps());
  const __m256 scaled = _mm256_mul_ps(magnitude, _mm256_set1_ps(mf.max_value));
  const __m256i field = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(scaled), 23), _mm256_set1_epi32(0xFF));
  const __m256i exponent = _mm256_max_epi32(_mm256_sub_epi32(field, _mm256_set1_epi32(127)), _mm256_set1_epi32(1 - mf.bias));
  const __m256i power = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(mf.mantissa_bits + 127), exponent), 23);  // pow2(M - e)
  const __m256 mantissa = _mm256_mul_ps(scaled, _mm256_castsi256_ps(power));
  __m256 rounded;
  if constexpr (Stochastic) {
    const __m256 low = _mm256_round_ps(mantissa, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(uniform, _mm256_sub_ps(mantissa, low), _CMP_LT_OQ);
    rounded = _mm256_add_ps(low, _mm256_and_ps(up, _mm256_set1_ps(1.0f)));
  } else {
    const __m256 magic = _mm256_set1_ps(0x1p23f);
    rounded = _mm256_sub_ps(_mm256_add_ps(mantissa, magic), magic);
  }
  const __m256i binade = _mm256_sll_epi32(_mm256_add_epi32(exponent, _mm256_set1_epi32(mf.bias - 1)), _mm_cvtsi32_si128(mf.mantissa_bits));
  __m256i code = _mm256_add_epi32(binade, _mm256_cvttps_epi32(rounded));
  code = _mm256_max_epi32(_mm256_min_epi32(code, _mm256_set1_epi32(mf.max_code)), _mm256_set1_epi32(mf.min_code));
  if (!mf.has_sign) return code;
  const __m256i negative = _mm256_castps_si256(_mm256_cmp_ps(value, _mm256_setzero_ps(), _CMP_LT_OQ));
  return _mm256_or_si256(code, _mm256_and_si256(negative, _mm256_set1_epi32(1 << mf.sign_shift)));
}

// The buckets of 8 values (encode_lane's: half + key, or half - 1 - key for a negative value) and what the compare with
// their entries' thresholds reads.
struct Buckets8 {
  __m256i bits, key, negative, index;  // |value|'s pattern, the key, value < 0 (a lane mask), the bucket
  Buckets8(__m256 value, const Codebook& cb)
      : bits(_mm256_castps_si256(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), value))),
        key(_mm256_min_epi32(
            _mm256_max_epi32(_mm256_sra_epi32(_mm256_sub_epi32(bits, _mm256_set1_epi32(cb.key_base)), _mm_cvtsi32_si128(cb.key_shift)),
                             _mm256_setzero_si256()),
            _mm256_set1_epi32(cb.half - 1))),
        negative(_mm256_castps_si256(_mm256_cmp_ps(value, _mm256_setzero_ps(), _CMP_LT_OQ))),
        index(_mm256_add_epi32(_mm256_set1_epi32(cb.half), _mm256_xor_si256(key, negative))) {}

  // A lane mask of the values past the threshold inside their bucket (entry: first | inside << 8 | offset << 9;
  // negative: |value| <= threshold, else |value| >= threshold); encode_lane's code: first, plus one there.
  QSTATE_INLINE __m256i past(__m256i entry, const Codebook& cb) const {
    const __m256i start = _mm256_add_epi32(_mm256_set1_epi32(cb.key_base), _mm256_sll_epi32(key, _mm_cvtsi32_si128(cb.key_shift)));
    const __m256i threshold = _mm256_add_epi32(start, _mm256_srai_epi32(entry, 9));
    const __m256i beyond = _mm256_blendv_epi8(_mm256_cmpgt_epi32(threshold, bits), _mm256_cmpgt_epi32(bits, threshold), negative);
    const __m256i inside = _mm256_cmpeq_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0x100)), _mm256_set1_epi32(0x100));
    return _mm256_andnot_si256(beyond, inside);
  }
  QSTATE_INLINE __m256i code(__m256i entry, const Codebook& cb) const {
    return _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xFF)), past(entry, cb));
  }
};

// encode_lane on 8 values: the bucket entries by gather8.
QSTATE_INLINE __m256i bucket_codes8(__m256 value, const Codebook& cb) {
  const Buckets8 buckets(value, cb);
  return buckets.code(gather8(cb.entries, buckets.index), cb);
}

// codebook_stochastic on 8 values (uniform: their draws' uniform_of) from their buckets' floor windows
// (NearestCodeIndex.floor_windows): each lane's 16 bytes read at once and transposed into columns, the floor entry and
// the values of codes first, first + 1 and first + 2; the floor (held to [0, last - 1] by the table) is first, or first + 1
// past the entry's threshold, and its value and the next one's are picked from the columns by that compare. One load
// per value, where the nearest code's entry and then its neighbours' values took two dependent reads.
QSTATE_INLINE __m256i bucket_stochastic8(__m256 value, const Codebook& cb, int32_t min_code, __m256 uniform) {
  const Buckets8 buckets(value, cb);
  const Lanes8 lanes(buckets.index);
  const auto row = [&lanes, windows = reinterpret_cast<const float*>(cb.windows)](int k) {  // lanes k and k + 4
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(windows + 4 * static_cast<int64_t>(lanes.at(k)))),
                                _mm_loadu_ps(windows + 4 * static_cast<int64_t>(lanes.at(k + 4))), 1);
  };
  const __m256 r0 = row(0), r1 = row(1), r2 = row(2), r3 = row(3);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
               t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256i entry = _mm256_castps_si256(_mm256_shuffle_ps(t0, t2, 0x44));
  const __m256 first_value = _mm256_shuffle_ps(t0, t2, 0xEE), second_value = _mm256_shuffle_ps(t1, t3, 0x44),
               third_value = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256i past = buckets.past(entry, cb);
  const __m256i floor = _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xFF)), past);
  const __m256 second = _mm256_castsi256_ps(past);  // the floor is first + 1
  const __m256 low_value = _mm256_blendv_ps(first_value, second_value, second),
               high_value = _mm256_blendv_ps(second_value, third_value, second);
  const __m256i up = _mm256_castps_si256(
      _mm256_cmp_ps(_mm256_mul_ps(uniform, _mm256_sub_ps(high_value, low_value)), _mm256_sub_ps(value, low_value), _CMP_LT_OQ));
  return _mm256_max_epi32(_mm256_sub_epi32(floor, up), _mm256_set1_epi32(min_code));
}

// 8 codes (int32 lanes, each < 256) stored as bytes, or (Nibbles: each < 16) two per byte, code 2i in the low nibble.
template <bool Nibbles>
QSTATE_INLINE void store_codes8(__m256i codes, uint8_t* out) {
  __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));  // 8 x 16 bits
  if constexpr (Nibbles) {
    // each 32-bit lane holds codes 2i (low half) and 2i + 1 (high half): the pair's byte in its low 8 bits
    words = _mm_or_si128(_mm_and_si128(words, _mm_set1_epi32(0xFF)), _mm_and_si128(_mm_srli_epi32(words, 12), _mm_set1_epi32(0xF0)));
    const int32_t pairs = _mm_cvtsi128_si32(_mm_packus_epi16(_mm_packus_epi32(words, words), words));
    std::memcpy(out, &pairs, 4);
  } else {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(words, words));
  }
}

// sgd_lane of 8 values: buf (decoded; ignored where h.created) in place; returns the new param values.
QSTATE_INLINE __m256 sgd8(__m256 p, __m256 g, __m256& buf, const Momentum& h) {
  const __m256 signed_g = _mm256_mul_ps(_mm256_set1_ps(h.sign), g);
  const __m256 d = h.has_weight_decay ? _mm256_fmadd_ps(p, _mm256_set1_ps(h.weight_decay), signed_g) : signed_g;
  const __m256 momentum = _mm256_set1_ps(h.momentum);
  buf = h.created ? d : _mm256_fmadd_ps(d, _mm256_set1_ps(h.dampened), _mm256_mul_ps(buf, momentum));
  return _mm256_fmadd_ps(h.nesterov ? _mm256_fmadd_ps(buf, momentum, d) : buf, _mm256_set1_ps(h.neg_lr), p);
}

// Update16 on 8 lanes.
struct Update8 {
  __m256 sign, l2, decay, lerp_coeff, b2, one_minus_b2, step, eps, m_bound, bc2, eco;
  bool lerp_from_end, decoupled;
  __m256i m_top = _mm256_setzero_si256(), v_top = _mm256_setzero_si256();  // running max_magnitude_bits8

  explicit Update8(const Hyper& h)
      : sign(_mm256_set1_ps(h.sign)),
        l2(_mm256_set1_ps(h.l2)),
        decay(_mm256_set1_ps(h.decay)),
        lerp_coeff(_mm256_set1_ps(h.lerp_coeff)),
        b2(_mm256_set1_ps(h.b2)),
        one_minus_b2(_mm256_set1_ps(h.one_minus_b2)),
        step(_mm256_set1_ps(h.step)),
        eps(_mm256_set1_ps(h.eps)),
        m_bound(_mm256_set1_ps(h.m_bound)),
        bc2(_mm256_set1_ps(h.bc2)),
        eco(_mm256_set1_ps(h.eco)),
        lerp_from_end(h.lerp_from_end),
        decoupled(h.decoupled) {}

  // Update16::held on 8 values.
  QSTATE_INLINE __m256 held(__m256 mi, __m256 root) const {
    const __m256 limit = _mm256_mul_ps(_mm256_max_ps(_mm256_set1_ps(kRootFloor), root), m_bound);
    return _mm256_max_ps(_mm256_xor_ps(limit, _mm256_set1_ps(-0.0f)), _mm256_min_ps(limit, mi));
  }

  // Update16::advance on 8 values p[0:8] (element type T; draws[0:8]: their SR draws where Rounding draws).
  template <typename T = float, typename Rounding = KeepFp32, bool Eco = false>
  QSTATE_INLINE void advance(T* p, const T* g, __m256& mi, __m256& vi, const uint32_t* draws = nullptr) const {
    __builtin_prefetch(p + PREFETCH_AHEAD);
    __builtin_prefetch(g + PREFETCH_AHEAD);
    const __m256 pi = load8(p), signed_g = _mm256_mul_ps(sign, load8(g));
    const __m256 gi = decoupled ? signed_g : _mm256_fmadd_ps(pi, l2, signed_g);
    const __m256 decayed = decoupled ? _mm256_mul_ps(pi, decay) : pi;
    mi = _mm256_fmadd_ps(lerp_coeff, _mm256_sub_ps(gi, mi), lerp_from_end ? gi : mi);
    vi = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_b2, gi), gi, _mm256_mul_ps(vi, b2));
    const __m256 root = _mm256_sqrt_ps(vi);
    mi = held(mi, root);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(root, bc2), eps);
    const __m256 updated = _mm256_sub_ps(decayed, _mm256_div_ps(_mm256_mul_ps(step, mi), denom));
    const __m256 rounded = round_store8(Rounding{}, p, updated, draws);
    if constexpr (Eco) mi = _mm256_fmadd_ps(_mm256_mul_ps(eco, denom), _mm256_sub_ps(updated, rounded), mi);
  }

  // The new moments mi, vi to m[0:8], v[0:8], and their running absmaxes and non-finite flags.
  QSTATE_INLINE void record(__m256 mi, __m256 vi, float* m, float* v) {
    _mm256_storeu_ps(m, mi);
    _mm256_storeu_ps(v, vi);
    m_top = max_magnitude_bits8(m_top, mi), v_top = max_magnitude_bits8(v_top, vi);
  }
  QSTATE_INLINE void operator()(float* p, const float* g, __m256 mi, __m256 vi, float* m, float* v) {
    advance(p, g, mi, vi);
    record(mi, vi, m, v);
  }
};
#endif  // QSTATE_AVX2

}  // namespace lightning_qstate
