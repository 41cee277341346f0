"""A hand-written C++ Adam(W) step for 8-bit codebook states on the CPU (round-to-nearest), with optional stall counts.

``adam_steps_u8`` steps every parameter of a param group in one call, threaded with ``at::parallel_for``
over all their blocks: first a check of every gradient (a parameter with an inf/NaN gradient is left
untouched), then one pass per block (data prefetched a few blocks ahead): decode both moments (table lookup
times the block scale), torch's Adam(W) update, per-block absmax, and round-to-nearest encoding with
``formats.NearestCodeIndex`` (one table lookup and integer compares; the table of a zero-free ``v`` format also
clamps codes up to its ``min_code``, so ``v`` is never stored as 0), writing param, codes and scales (bf16 or
fp32, per state) in place.
The group's parameters with fp32 moments (those ``min_quant_size`` keeps fp32) step in the same call, and the
kernel increments every step counter, so a whole group costs one call and no per-parameter torch ops.

The codes and scales are those of the torch reference ``fused.adam_step_quantized`` bit for bit: the
hyperparameters are rounded to fp32 from double as ``fused.adam_hyper`` (and torch's AdamW) round them, the
moments use the float operations of torch's vectorized CPU kernels in the same order (explicit FMAs where
torch's ``add(alpha=)``/``lerp_``/``addcmul_`` use them, no other contraction: ``-ffp-contract=off``), the
division by the block's stored scale is correctly rounded (Markstein's reciprocal-and-remainder form), and the
encoder reproduces the format's ``encode`` (``encode_codebook`` clamped up to ``min_code``) exactly. The param
update multiplies by reciprocals where the reference divides, so params are within a few ulps of the update of
the reference's. With AVX-512 the body of each
block runs 16 lanes at a time (table lookups by register permutes, not gathers; with VBMI, 64 codes at a
time from byte planes of the table); the scalar code runs the rest and is the whole kernel on other CPUs.

It is built on first use with ``torch.utils.cpp_extension.load_inline`` (needs a C++ compiler and
ninja); where that fails, ``kernel()`` returns ``None`` and the optimizer uses the ``torch.compile``
path instead.
"""

from __future__ import annotations

import functools
import warnings

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <array>
#include <atomic>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QSTATE_AVX512 1
#if defined(__AVX512VBMI__)
#define QSTATE_VBMI 1
#endif
#endif

namespace {

// One state's formats.codebooks.NearestCodeIndex (the format's min_code built into its entries).
struct Codebook {
  const float* decode;       // (256,) value of every code
  const int32_t* entries;    // bucket -> first | inside << 8 | offset << 9
  int32_t key_base, key_shift, half;
  const uint8_t* planes;     // (4, 256): byte j of decode[c] at [j][c] (the VBMI decoder's tables)
};

Codebook codebook(const torch::Tensor& decode, const torch::Tensor& entries, const torch::Tensor& planes, int64_t key_base, int64_t key_shift, int64_t half) {
  TORCH_CHECK(decode.numel() == 256 && entries.numel() == 2 * half && planes.numel() == 1024 && planes.scalar_type() == torch::kUInt8,
              "a NearestCodeIndex: 256 decode values, 2 * half bucket entries, (4, 256) uint8 byte planes");
  return Codebook{decode.data_ptr<float>(), entries.data_ptr<int32_t>(),
                  static_cast<int32_t>(key_base), static_cast<int32_t>(key_shift), static_cast<int32_t>(half), planes.data_ptr<uint8_t>()};
}

// Adam(W) hyperparameters as fp32. The moments follow fused.adam_math as torch's vectorized CPU kernels compute them:
// add(alpha=) is fma(other, alpha, self), lerp_ is fma(coeff, end - self, base) (coeff = w, base = self if |w| < 0.5,
// else w - 1 and end), addcmul_ is fma(value * t1, t2, self). The param update multiplies by reciprocals instead of
// dividing (by bias_correction2_sqrt, and by the denominator: its reciprocal to about an ulp), so it is within a few
// ulps of the reference's update.
// m_bound: the decoded m of a coded parameter is first held to |m| <= m_bound * sqrt(v) (fused.hold_moment; hold_m).
struct Hyper {
  float sign, l2, decay, lerp_coeff, b2, one_minus_b2, step, inv_bc2, eps, m_bound;
  bool lerp_from_end, hold_m;
};

// One value of the Adam(W) update: param p and moments m, v (decoded) in place.
inline void adam_lane(float& p, float g, float& m, float& v, const Hyper& h) {
  if (h.hold_m) {
    const float limit = std::sqrt(v) * h.m_bound;
    m = m > limit ? limit : (m < -limit ? -limit : m);
  }
  const float gi = std::fma(p, h.l2, h.sign * g);
  m = std::fma(h.lerp_coeff, gi - m, h.lerp_from_end ? gi : m);
  v = std::fma(h.one_minus_b2 * gi, gi, v * h.b2);
  const float denom = std::sqrt(v) * h.inv_bc2 + h.eps;
  p = p * h.decay - (h.step * m) * (1.0f / denom);
}

inline uint8_t encode_lane(float value, const Codebook& cb) {
  const float magnitude = std::fabs(value);
  int32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  int32_t key = (bits - cb.key_base) >> cb.key_shift;
  key = key < 0 ? 0 : (key > cb.half - 1 ? cb.half - 1 : key);
  const bool negative = value < 0.0f;
  const int32_t entry = cb.entries[negative ? cb.half - 1 - key : cb.half + key];
  const int32_t threshold = cb.key_base + (key << cb.key_shift) + (entry >> 9);
  const bool up = (entry & 0x100) && (negative ? bits <= threshold : bits >= threshold);
  return static_cast<uint8_t>((entry & 0xFF) + (up ? 1 : 0));
}

#ifdef QSTATE_AVX512
// table[index] for a 256-entry fp32 table and 16 indices in [0, 256): eight two-register permutes and a blend tree
// (no gathers, which are slow on recent Intel cores).
inline __m512 lookup256(const float* table, __m512i index) {
  __m512 part[8];
  for (int k = 0; k < 8; ++k)
    part[k] = _mm512_permutex2var_ps(_mm512_loadu_ps(table + 32 * k), index, _mm512_loadu_ps(table + 32 * k + 16));
  const __mmask16 bit5 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(32));
  const __mmask16 bit6 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(64));
  const __mmask16 bit7 = _mm512_test_epi32_mask(index, _mm512_set1_epi32(128));
  for (int k = 0; k < 4; ++k) part[k] = _mm512_mask_blend_ps(bit5, part[2 * k], part[2 * k + 1]);
  for (int k = 0; k < 2; ++k) part[k] = _mm512_mask_blend_ps(bit6, part[2 * k], part[2 * k + 1]);
  return _mm512_mask_blend_ps(bit7, part[0], part[1]);
}

inline __m512 decode16(const uint8_t* codes, const float* decode, float scale) {
  const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  return _mm512_mul_ps(lookup256(decode, index), _mm512_set1_ps(scale));
}

#ifdef QSTATE_VBMI
// decode16 of 64 codes: out[r] holds values 16r .. 16r + 15. Each byte plane of the table is looked up with two
// 128-entry byte permutes (bit 7 of the code picks one), then bytes are interleaved into fp32 lanes. The interleave
// leaves value 16L + 4r + t in lane 4L + t of out[r] (L: 128-bit lane); the codes are permuted first so that this is
// value 16r + 4L + t.
inline void decode64(const uint8_t* codes, const uint8_t* planes, float scale, __m512 out[4]) {
  alignas(64) static const uint8_t order[64] = {
      0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
      8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
  const __m512i index = _mm512_permutexvar_epi8(_mm512_load_si512(order), _mm512_loadu_si512(codes));
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
  const __m512 factor = _mm512_set1_ps(scale);
  out[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(low01, low23)), factor);
  out[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(low01, low23)), factor);
  out[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(high01, high23)), factor);
  out[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(high01, high23)), factor);
}
#endif

// encode_lane on 16 values; ``value`` already normalized (``Nonnegative``: no value is < 0, as for Adam's v). Magnitude
// patterns and thresholds are compared relative to key_base.
template <bool Nonnegative>
inline void encode16(__m512 value, const Codebook& cb, uint8_t* out) {
  const __m512i shift = _mm512_set1_epi32(cb.key_shift);
  const __m512i bits = _mm512_sub_epi32(_mm512_castps_si512(_mm512_abs_ps(value)), _mm512_set1_epi32(cb.key_base));
  __m512i key = _mm512_srav_epi32(bits, shift);
  key = _mm512_min_epi32(_mm512_max_epi32(key, _mm512_setzero_si512()), _mm512_set1_epi32(cb.half - 1));
  const __mmask16 negative = Nonnegative ? 0 : _mm512_cmp_ps_mask(value, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512i bucket = _mm512_mask_sub_epi32(_mm512_add_epi32(_mm512_set1_epi32(cb.half), key), negative, _mm512_set1_epi32(cb.half - 1), key);
  const __m512i entry = _mm512_i32gather_epi32(bucket, cb.entries, 4);
  const __m512i threshold = _mm512_add_epi32(_mm512_sllv_epi32(key, shift), _mm512_srai_epi32(entry, 9));
  const __mmask16 inside = _mm512_test_epi32_mask(entry, _mm512_set1_epi32(0x100));
  const __mmask16 up = inside & ((negative & _mm512_cmple_epi32_mask(bits, threshold)) | (~negative & _mm512_cmpge_epi32_mask(bits, threshold)));
  const __m512i first = _mm512_and_si512(entry, _mm512_set1_epi32(0xFF));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(first, up, first, _mm512_set1_epi32(1))));
}
#endif

// How far ahead (in values) the vector loops prefetch param, gradient and codes: a cold step waits on memory otherwise.
constexpr int64_t PREFETCH_AHEAD = 512;

#ifdef QSTATE_AVX512
// The AVX-512 form of adam_lane and the block's running absmaxes / non-finite flags, for 16 values.
struct Update16 {
  __m512 sign, l2, decay, lerp_coeff, b2, one_minus_b2, step, inv_bc2, eps, m_bound;
  bool lerp_from_end, hold_m;
  __m512 m_top = _mm512_setzero_ps(), v_top = _mm512_setzero_ps();
  __mmask16 m_nonfinite = 0, v_nonfinite = 0;

  explicit Update16(const Hyper& h)
      : sign(_mm512_set1_ps(h.sign)), l2(_mm512_set1_ps(h.l2)), decay(_mm512_set1_ps(h.decay)), lerp_coeff(_mm512_set1_ps(h.lerp_coeff)),
        b2(_mm512_set1_ps(h.b2)), one_minus_b2(_mm512_set1_ps(h.one_minus_b2)), step(_mm512_set1_ps(h.step)),
        inv_bc2(_mm512_set1_ps(h.inv_bc2)), eps(_mm512_set1_ps(h.eps)), m_bound(_mm512_set1_ps(h.m_bound)), lerp_from_end(h.lerp_from_end),
        hold_m(h.hold_m) {}

  // p[0:16] updated in place; the new moments (from decoded mi, vi) to m[0:16], v[0:16].
  inline void operator()(float* p, const float* g, __m512 mi, __m512 vi, float* m, float* v) {
    __builtin_prefetch(p + PREFETCH_AHEAD);
    __builtin_prefetch(g + PREFETCH_AHEAD);
    if (hold_m) {  // adam_lane's hold: -limit by flipping the sign bit, as the scalar negation does (also for 0)
      const __m512 limit = _mm512_mul_ps(_mm512_sqrt_ps(vi), m_bound);
      const __m512 negative = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(limit), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
      mi = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mi, limit, _CMP_GT_OQ), mi, limit);
      mi = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mi, negative, _CMP_LT_OQ), mi, negative);
    }
    const __m512 pi = _mm512_loadu_ps(p);
    const __m512 gi = _mm512_fmadd_ps(pi, l2, _mm512_mul_ps(sign, _mm512_loadu_ps(g)));
    mi = _mm512_fmadd_ps(lerp_coeff, _mm512_sub_ps(gi, mi), lerp_from_end ? gi : mi);
    vi = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_b2, gi), gi, _mm512_mul_ps(vi, b2));
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), inv_bc2), eps);
    const __m512 estimate = _mm512_rcp14_ps(denom);  // one Newton step: about an ulp
    const __m512 reciprocal = _mm512_fmadd_ps(estimate, _mm512_fnmadd_ps(denom, estimate, _mm512_set1_ps(1.0f)), estimate);
    _mm512_storeu_ps(p, _mm512_sub_ps(_mm512_mul_ps(pi, decay), _mm512_mul_ps(_mm512_mul_ps(step, mi), reciprocal)));
    _mm512_storeu_ps(m, mi);
    _mm512_storeu_ps(v, vi);
    m_top = _mm512_max_ps(_mm512_abs_ps(mi), m_top);  // a NaN lane keeps the running max, as the scalar compare does
    v_top = _mm512_max_ps(_mm512_abs_ps(vi), v_top);
    m_nonfinite |= _mm512_cmp_ps_mask(_mm512_sub_ps(mi, mi), _mm512_setzero_ps(), _CMP_UNORD_Q);
    v_nonfinite |= _mm512_cmp_ps_mask(_mm512_sub_ps(vi, vi), _mm512_setzero_ps(), _CMP_UNORD_Q);
  }
};
#endif

// Decode both moments, Adam update of param (in place), moments to m / v; returns the absmaxes and NaN/inf flags.
void update_block(float* __restrict__ p, const float* __restrict__ g, const uint8_t* mc, float m_scale, const uint8_t* vc, float v_scale,
                  const Codebook& mcb, const Codebook& vcb, const Hyper& h, int64_t n, float* __restrict__ m, float* __restrict__ v,
                  float& m_max, float& v_max, bool& m_ok, bool& v_ok) {
  int64_t i = 0;
  m_max = 0.0f, v_max = 0.0f;
  bool m_bad = false, v_bad = false;
#ifdef QSTATE_AVX512
  Update16 update(h);
#ifdef QSTATE_VBMI
  for (; i + 64 <= n; i += 64) {
    __m512 mi[4], vi[4];
    __builtin_prefetch(mc + i + PREFETCH_AHEAD);
    __builtin_prefetch(vc + i + PREFETCH_AHEAD);
    decode64(mc + i, mcb.planes, m_scale, mi);
    decode64(vc + i, vcb.planes, v_scale, vi);
    for (int r = 0; r < 4; ++r) update(p + i + 16 * r, g + i + 16 * r, mi[r], vi[r], m + i + 16 * r, v + i + 16 * r);
  }
#endif
  for (; i + 16 <= n; i += 16) {
    __builtin_prefetch(mc + i + PREFETCH_AHEAD);
    __builtin_prefetch(vc + i + PREFETCH_AHEAD);
    update(p + i, g + i, decode16(mc + i, mcb.decode, m_scale), decode16(vc + i, vcb.decode, v_scale), m + i, v + i);
  }
  m_max = _mm512_reduce_max_ps(update.m_top), v_max = _mm512_reduce_max_ps(update.v_top);
  m_bad = update.m_nonfinite != 0, v_bad = update.v_nonfinite != 0;
#endif
  for (; i < n; ++i) {
    float mi = mcb.decode[mc[i]] * m_scale, vi = vcb.decode[vc[i]] * v_scale;
    adam_lane(p[i], g[i], mi, vi, h);
    m[i] = mi, v[i] = vi;
    const float am = std::fabs(mi), av = std::fabs(vi);
    m_max = am > m_max ? am : m_max;
    v_max = av > v_max ? av : v_max;
    m_bad |= std::isnan(mi - mi);
    v_bad |= std::isnan(vi - vi);
  }
  m_ok = !m_bad, v_ok = !v_bad;
}

// formats.rounding.encode_codebook (RN) of x / divisor for one block; a non-finite block encodes 0.0 everywhere. The
// quotient is Markstein's: q = fma(x - q0 * divisor, r, q0) with q0 = x * r and r = 1 / divisor correctly rounded,
// which is the correctly rounded x / divisor (|x| <= divisor here) down to quotients of about 2^-100, far below
// any code's rounding threshold.
template <bool Nonnegative>
void encode_block(const float* __restrict__ x, float divisor, bool finite, const Codebook& cb, uint8_t* __restrict__ out, int64_t n) {
  if (!finite) {
    std::memset(out, encode_lane(0.0f, cb), n);
    return;
  }
  const float reciprocal = 1.0f / divisor;
  int64_t i = 0;
#ifdef QSTATE_AVX512
  const __m512 d = _mm512_set1_ps(divisor), r = _mm512_set1_ps(reciprocal);
  for (; i + 16 <= n; i += 16) {
    const __m512 value = _mm512_loadu_ps(x + i), estimate = _mm512_mul_ps(value, r);
    encode16<Nonnegative>(_mm512_fmadd_ps(_mm512_fnmadd_ps(estimate, d, value), r, estimate), cb, out + i);
  }
#endif
  for (; i < n; ++i) {
    const float estimate = x[i] * reciprocal;
    out[i] = encode_lane(std::fma(std::fma(-estimate, divisor, x[i]), reciprocal, estimate), cb);
  }
}

// formats.count_stalls for one block: [stalled, moved] added to counts. ``old``: codes before the step.
void count_block(const uint8_t* __restrict__ old, float old_scale, const uint8_t* __restrict__ codes, float scale,
                 const float* __restrict__ updated, const float* __restrict__ decode, int64_t n, int64_t* counts) {
  int64_t stalled = 0, moved = 0;
#pragma omp simd reduction(+ : stalled, moved)
  for (int64_t i = 0; i < n; ++i) {
    const bool move = updated[i] != decode[old[i]] * old_scale;
    moved += move ? 1 : 0;
    stalled += (move && codes[i] == old[i] && decode[codes[i]] * scale != updated[i]) ? 1 : 0;
  }
  counts[0] += stalled;
  counts[1] += moved;
}

// Whether every value of x[0:n] is finite (x - x is 0, not NaN). The vector loop reads eight far-apart parts of x
// side by side: a single stream leaves the memory system idle between cache misses.
bool all_finite(const float* __restrict__ x, int64_t n) {
  int64_t done = 0;
  bool bad = false;
#ifdef QSTATE_AVX512
  constexpr int parts = 8;
  const int64_t part = n / parts / 16 * 16;
  __mmask16 nonfinite = 0;
  for (int64_t i = 0; i < part; i += 16)
    for (int k = 0; k < parts; ++k) {
      const __m512 value = _mm512_loadu_ps(x + k * part + i);
      nonfinite |= _mm512_cmp_ps_mask(_mm512_sub_ps(value, value), _mm512_setzero_ps(), _CMP_UNORD_Q);
    }
  bad = nonfinite != 0;
  done = parts * part;
#endif
  for (int64_t i = done; i < n; ++i) bad |= std::isnan(x[i] - x[i]);
  return !bad;
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
    return std::min(rounded, 3.38953139e38f);  // bf16's largest finite value
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

Scales scales_of(const torch::Tensor& t, int64_t k) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16, "parameter ", k, ": scales must be fp32 or bf16");
  return Scales{t.data_ptr(), t.scalar_type() == torch::kBFloat16};
}

// One parameter of the multi-tensor step.
struct Param {
  float* p;
  const float* g;
  uint8_t *mc, *vc;
  Scales ms, vs;
  Codebook mcb, vcb;
  Hyper h;
  int64_t numel, block, blocks;
};

}  // namespace

// Adam(W) step of every parameter of one param group: n with 8-bit codebook moments, then ``plain`` ones with fp32
// moments. ``tables``: per coded parameter [m_decode, m_entries, m_planes, v_decode, v_entries, v_planes]; ``ints``: (n, 7) int64 [block,
// m_base, m_shift, m_half, v_base, v_shift, v_half]; ``plain``: per fp32-state parameter [param, grad, exp_avg,
// exp_avg_sq]; ``steps``: per parameter (coded first) its 0-d fp32/fp64 step count, incremented here unless its
// gradient holds inf/NaN (then the parameter is left untouched). Returns (n + plain, 6) int64 [grad_finite,
// moments_finite, stalled_m, moved_m, stalled_v, moved_v] (stall columns 0 unless ``track``; moments_finite 1 for fp32
// states).
torch::Tensor adam_steps_u8(std::vector<torch::Tensor> params, std::vector<torch::Tensor> grads,
                            std::vector<torch::Tensor> m_codes, std::vector<torch::Tensor> m_scales,
                            std::vector<torch::Tensor> v_codes, std::vector<torch::Tensor> v_scales,
                            std::vector<torch::Tensor> tables, torch::Tensor ints, torch::Tensor bounds, std::vector<torch::Tensor> plain,
                            std::vector<torch::Tensor> steps, double lr, double weight_decay, double beta1, double beta2, double eps,
                            bool decoupled, bool maximize, bool track) {
  const int64_t n = static_cast<int64_t>(params.size()), n_plain = static_cast<int64_t>(plain.size()) / 4;
  // The constants as torch's AdamW computes them, and fused.adam_hyper for coded parameters: in double, rounded to fp32
  // once, where they meet a tensor (1.0f - 0.999f would be ~110 ulps below fp32(1 - 0.999)).
  Hyper constants;
  constants.sign = maximize ? -1.0f : 1.0f;
  constants.decay = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  constants.l2 = decoupled ? 0.0f : static_cast<float>(weight_decay);
  const float lerp_weight = static_cast<float>(1.0 - beta1);
  constants.lerp_from_end = !(std::fabs(lerp_weight) < 0.5f);
  constants.lerp_coeff = constants.lerp_from_end ? lerp_weight - 1.0f : lerp_weight;
  constants.b2 = static_cast<float>(beta2), constants.one_minus_b2 = static_cast<float>(1.0 - beta2);
  constants.eps = static_cast<float>(eps);
  const auto ints_a = ints.accessor<int64_t, 2>();
  TORCH_CHECK(bounds.scalar_type() == torch::kFloat && bounds.numel() == n, "bounds: one fp32 moment bound per coded parameter");
  const auto bounds_a = bounds.accessor<float, 1>();
  TORCH_CHECK(static_cast<int64_t>(plain.size()) == 4 * n_plain && static_cast<int64_t>(steps.size()) == n + n_plain, "steps: one per parameter");
  for (const torch::Tensor& step : steps)
    TORCH_CHECK(step.numel() == 1 && step.device().is_cpu() && (step.scalar_type() == torch::kFloat || step.scalar_type() == torch::kDouble), "steps: 0-d fp32/fp64 CPU tensors");
  auto step_count = [&](int64_t row) {
    const torch::Tensor& step = steps[row];
    return step.scalar_type() == torch::kFloat ? static_cast<double>(*step.data_ptr<float>()) : *step.data_ptr<double>();
  };
  // The hyperparameters of parameter ``row`` at its next step t: step size lr / (1 - beta1^t) and sqrt(1 - beta2^t)
  // in double, rounded to fp32, as torch's AdamW and fused.adam_hyper have them.
  auto hyper = [&](int64_t row) {
    const double t = step_count(row) + 1;
    Hyper h = constants;
    h.step = static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
    h.inv_bc2 = 1.0f / static_cast<float>(std::pow(1.0 - std::pow(beta2, t), 0.5));
    h.hold_m = row < n;  // coded moments only: fp32 ones are exact
    h.m_bound = h.hold_m ? bounds_a[row] : 0.0f;
    return h;
  };
  std::vector<Param> work(n);
  for (int64_t k = 0; k < n; ++k) {
    Param& w = work[k];
    w.p = params[k].data_ptr<float>(), w.g = grads[k].data_ptr<float>();
    w.mc = m_codes[k].data_ptr<uint8_t>(), w.vc = v_codes[k].data_ptr<uint8_t>();
    w.ms = scales_of(m_scales[k], k), w.vs = scales_of(v_scales[k], k);
    w.mcb = codebook(tables[6 * k], tables[6 * k + 1], tables[6 * k + 2], ints_a[k][1], ints_a[k][2], ints_a[k][3]);
    w.vcb = codebook(tables[6 * k + 3], tables[6 * k + 4], tables[6 * k + 5], ints_a[k][4], ints_a[k][5], ints_a[k][6]);
    w.h = hyper(k);
    w.numel = params[k].numel(), w.block = ints_a[k][0];
    const int64_t blocks = w.blocks = (w.numel + w.block - 1) / w.block;
    TORCH_CHECK(grads[k].numel() == w.numel && m_codes[k].numel() == w.numel && v_codes[k].numel() == w.numel &&
                m_scales[k].numel() == blocks && v_scales[k].numel() == blocks, "parameter ", k, ": grad, codes or scales of the wrong size");
    for (const torch::Tensor* t : {&params[k], &grads[k], &m_codes[k], &v_codes[k], &m_scales[k], &v_scales[k]})
      TORCH_CHECK(t->is_contiguous(), "parameter ", k, ": every tensor must be contiguous");
  }
  for (int64_t j = 0; j < n_plain; ++j)
    for (int c = 0; c < 4; ++c)
      TORCH_CHECK(plain[4 * j + c].is_contiguous() && plain[4 * j + c].scalar_type() == torch::kFloat && plain[4 * j + c].numel() == plain[4 * j].numel(),
                  "fp32-state parameter ", j, ": param, grad and moments must be contiguous fp32 tensors of one size");
  auto result = torch::zeros({n + n_plain, 6}, torch::kInt64);
  auto out = result.accessor<int64_t, 2>();
  std::vector<std::atomic<int>> grad_bad(n), moments_bad(n);
  std::vector<std::array<std::atomic<int64_t>, 4>> stalls(n);
  // One block of parameter k: decode, update, encode in place (and its stall counts).
  auto step_block = [&](int64_t k, int64_t index, std::vector<float>& m_buffer, std::vector<float>& v_buffer,
                        std::vector<uint8_t>& old_m, std::vector<uint8_t>& old_v) {
    const Param& w = work[k];
    const int64_t base = index * w.block, size = std::min(w.block, w.numel - base);
    m_buffer.resize(size), v_buffer.resize(size);
    const float m_scale = w.ms.load(index), v_scale = w.vs.load(index);
    if (track) {
      old_m.assign(w.mc + base, w.mc + base + size);
      old_v.assign(w.vc + base, w.vc + base + size);
    }
    float m_max, v_max;
    bool m_ok, v_ok;
    update_block(w.p + base, w.g + base, w.mc + base, m_scale, w.vc + base, v_scale, w.mcb, w.vcb, w.h, size,
                 m_buffer.data(), v_buffer.data(), m_max, v_max, m_ok, v_ok);
    const float m_new = m_ok ? w.ms.representable(m_max) : NAN, v_new = v_ok ? w.vs.representable(v_max) : NAN;
    encode_block<false>(m_buffer.data(), (m_ok && m_new > 0.0f) ? m_new : 1.0f, m_ok, w.mcb, w.mc + base, size);
    encode_block<true>(v_buffer.data(), (v_ok && v_new > 0.0f) ? v_new : 1.0f, v_ok, w.vcb, w.vc + base, size);
    w.ms.store(index, m_new);
    w.vs.store(index, v_new);
    if (!(m_ok && v_ok)) moments_bad[k].store(1, std::memory_order_relaxed);
    if (track) {
      int64_t local[4] = {0, 0, 0, 0};
      count_block(old_m.data(), m_scale, w.mc + base, m_new, m_buffer.data(), w.mcb.decode, size, local);
      count_block(old_v.data(), v_scale, w.vc + base, v_new, v_buffer.data(), w.vcb.decode, size, local + 2);
      for (int c = 0; c < 4; ++c) stalls[k][c].fetch_add(local[c], std::memory_order_relaxed);
    }
  };
  std::vector<int64_t> first_blocks(n + 1, 0);  // index of each parameter's first block in the global block order
  for (int64_t k = 0; k < n; ++k) first_blocks[k + 1] = first_blocks[k] + work[k].blocks;
  const int64_t total_blocks = first_blocks[n];
  auto owner = [&](int64_t global_block) {  // the parameter holding a global block index
    int64_t low = 0, high = n - 1;
    while (low < high) {
      const int64_t mid = (low + high + 1) / 2;
      if (first_blocks[mid] <= global_block) low = mid; else high = mid - 1;
    }
    return low;
  };
  // First every gradient is checked (a parameter with inf/NaN is left untouched), then every block is stepped.
  at::parallel_for(0, total_blocks, 64, [&](int64_t begin, int64_t end) {  // each parameter's part of blocks [begin, end)
    for (int64_t k = owner(begin); k < n && first_blocks[k] < end; ++k) {
      const Param& w = work[k];
      const int64_t first = std::max<int64_t>(begin - first_blocks[k], 0) * w.block, last = std::min((end - first_blocks[k]) * w.block, w.numel);
      if (first < last && !all_finite(w.g + first, last - first)) grad_bad[k].store(1, std::memory_order_relaxed);
    }
  });
  at::parallel_for(0, total_blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> m_buffer, v_buffer;
    std::vector<uint8_t> old_m, old_v;
    for (int64_t b = begin, k = owner(begin); b < end; ++b) {
      while (k + 1 < n && first_blocks[k + 1] <= b) ++k;
      if (grad_bad[k].load(std::memory_order_relaxed)) continue;
      step_block(k, b - first_blocks[k], m_buffer, v_buffer, old_m, old_v);
    }
  });
  // fp32-state parameters (small ones, as a rule): the same checks and update, moments stored as they are.
  for (int64_t j = 0; j < n_plain; ++j) {
    float* p = plain[4 * j].data_ptr<float>();
    const float* g = plain[4 * j + 1].data_ptr<float>();
    float *m = plain[4 * j + 2].data_ptr<float>(), *v = plain[4 * j + 3].data_ptr<float>();
    const Hyper h = hyper(n + j);
    std::atomic<int> bad{0};
    const int64_t numel = plain[4 * j].numel();
    at::parallel_for(0, numel, 1 << 16, [&](int64_t begin, int64_t end) {
      if (!all_finite(g + begin, end - begin)) bad.store(1, std::memory_order_relaxed);
    });
    out[n + j][0] = bad.load() ? 0 : 1;
    out[n + j][1] = 1;
    if (bad.load()) continue;
    at::parallel_for(0, numel, 1 << 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) adam_lane(p[i], g[i], m[i], v[i], h);
    });
  }
  for (int64_t k = 0; k < n; ++k) {
    out[k][0] = grad_bad[k].load() ? 0 : 1;
    out[k][1] = moments_bad[k].load() ? 0 : 1;
    for (int c = 0; c < 4; ++c) out[k][2 + c] = stalls[k][c].load();
  }
  for (int64_t row = 0; row < n + n_plain; ++row) {
    if (!out[row][0]) continue;
    if (steps[row].scalar_type() == torch::kFloat) *steps[row].data_ptr<float>() += 1.0f;
    else *steps[row].data_ptr<double>() += 1.0;
  }
  return result;
}
"""  # noqa: E501 - the C++ source: its long lines are compiled as they are (csrc formatting comes with the csrc move)


@functools.cache
def kernel():
    """The compiled extension's ``adam_steps_u8``, or ``None`` when it cannot be built here (warns once)."""
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            name="lightning_qstate_cpu_adam_v20",
            cpp_sources=SOURCE,
            functions=["adam_steps_u8"],
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # no compiler or ninja: the torch.compile path takes over
        warnings.warn(f"building the C++ CPU Adam kernel failed ({error!r}); using the torch.compile path", RuntimeWarning, stacklevel=2)
        return None
    return module.adam_steps_u8
