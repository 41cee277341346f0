// The C++ CPU Adam(W) kernel for 8-bit codebook states (round-to-nearest), with optional stall counts, and parameters
// kept on a weight grid without master weights (fp32/bf16/fp16 values, RN or SR, ECO's feedback into m): adam_steps_u8
// steps every parameter of a param group in one call. What it computes and how it matches the torch reference
// (kernels/adam_reference.py) bit for bit: kernels/native.py. The value-level pieces (codebooks, Adam's update of one
// value, block scales, parameter dtypes and weight grids, the AVX-512 forms): adam_cpu.h.
#include "adam_cpu.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <array>
#include <atomic>
#include <vector>

namespace lightning_qstate {
namespace {

// ---- One block of one parameter ----

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

// Adam on values [0, n) of a block of a parameter on a weight grid, param and gradient of type T (read as fp32), moments
// decoded in m, v (updated in place), as adam_reference.adam_step_quantized: adam_lane_exact's new value rounded to the
// grid with Rounding (element ``first + i`` of the parameter: its SR draw) and stored in T (round to nearest, as torch's
// copy_), and with Eco m = fma(eco * denom, updated - rounded, m) (the product rounded first, as eco_feedback). No
// branches: the compiler vectorizes the loop (-fno-math-errno: sqrt without its errno check) for the CPU it is built
// for (AVX2 included); with AVX-512 too, rather than an intrinsics body as update_block's (fp32 without a grid only).
template <typename T, typename Rounding, bool Eco>
QSTATE_FLATTEN void grid_lanes(T* __restrict__ p, const T* __restrict__ g, int64_t first, const Hyper h, uint64_t seed, int64_t n,
                               float* __restrict__ m, float* __restrict__ v) {
  for (int64_t i = 0; i < n; ++i) {
    float mi = m[i], vi = v[i], denom;
    const float updated = adam_lane_exact(to_float(p[i]), to_float(g[i]), mi, vi, h, denom);
    const float rounded = Rounding::round(updated, seed, first + i);
    if constexpr (Eco) mi = std::fma(h.eco * denom, updated - rounded, mi);
    p[i] = from_float<T>(rounded);
    m[i] = mi, v[i] = vi;
  }
}

// The absmaxes of m[0:n], v[0:n] (a NaN value is passed over, as update_block's compare does) and whether all are finite.
void block_stats(const float* __restrict__ m, const float* __restrict__ v, int64_t n, float& m_max, float& v_max, bool& m_ok, bool& v_ok) {
  m_max = 0.0f, v_max = 0.0f;
  bool m_bad = false, v_bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const float am = std::fabs(m[i]), av = std::fabs(v[i]);
    m_max = am > m_max ? am : m_max;
    v_max = av > v_max ? av : v_max;
    m_bad |= std::isnan(m[i] - m[i]);
    v_bad |= std::isnan(v[i] - v[i]);
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

// all_finite of bf16 or fp16 patterns: no exponent field (``exponent``: its mask) all ones.
bool all_finite16(const uint16_t* __restrict__ x, int64_t n, uint16_t exponent) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) bad |= (x[i] & exponent) == exponent;
  return !bad;
}

// ---- The group's hyperparameters and step counters ----

// The group's hyperparameters: those of every step, and what the per-step ones (at) are computed from.
struct Schedule {
  Hyper constants;  // every field but step, inv_bc2, bc2, m_bound, hold_m and eco
  double lr, beta1, beta2;

  // The hyperparameters of a parameter at its next step t = steps_done + 1: step size lr / (1 - beta1^t) and
  // sqrt(1 - beta2^t) in double, rounded to fp32, as torch's AdamW and adam_reference.adam_hyper have them.
  // m_bound: its moment bound when hold_m (coded moments only: fp32 ones are exact).
  Hyper at(double steps_done, bool hold_m, float m_bound) const {
    const double t = steps_done + 1;
    Hyper h = constants;
    h.step = static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
    h.bc2 = static_cast<float>(std::pow(1.0 - std::pow(beta2, t), 0.5));
    h.inv_bc2 = 1.0f / h.bc2;
    h.hold_m = hold_m;
    h.m_bound = hold_m ? m_bound : 0.0f;
    return h;
  }
};

// The constants as torch's AdamW computes them, and adam_reference.adam_hyper for coded parameters: in double, rounded
// to fp32 once, where they meet a tensor (1.0f - 0.999f would be ~110 ulps below fp32(1 - 0.999)).
Schedule schedule(double lr, double weight_decay, double beta1, double beta2, double eps, bool decoupled, bool maximize) {
  Hyper c{};
  c.sign = maximize ? -1.0f : 1.0f;
  c.decoupled = decoupled;
  c.decay = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.l2 = decoupled ? 0.0f : static_cast<float>(weight_decay);
  const float lerp_weight = static_cast<float>(1.0 - beta1);
  c.lerp_from_end = !(std::fabs(lerp_weight) < 0.5f);
  c.lerp_coeff = c.lerp_from_end ? lerp_weight - 1.0f : lerp_weight;
  c.b2 = static_cast<float>(beta2), c.one_minus_b2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  return Schedule{c, lr, beta1, beta2};
}

// A step counter: a 0-d fp32 or fp64 CPU tensor.
double steps_done(const torch::Tensor& step) {
  return step.scalar_type() == torch::kFloat ? static_cast<double>(*step.data_ptr<float>()) : *step.data_ptr<double>();
}

void count_step(const torch::Tensor& step) {
  if (step.scalar_type() == torch::kFloat)
    *step.data_ptr<float>() += 1.0f;
  else
    *step.data_ptr<double>() += 1.0;
}

// ---- The coded parameters ----

// One coded parameter of the multi-tensor step. p, g: fp32 values, or (on a weight grid) of ``dtype``.
struct Param {
  void* p;
  const void* g;
  Dtype dtype;
  Grid grid;
  uint8_t *mc, *vc;
  Scales ms, vs;
  Codebook mcb, vcb;
  Hyper h;
  int64_t numel, block, blocks;
};

// What the threads stepping one coded parameter's blocks report.
struct Outcome {
  std::atomic<int> grad_bad{0}, moments_bad{0};
  std::array<std::atomic<int64_t>, 4> stalls{};  // stalled_m, moved_m, stalled_v, moved_v
};

Codebook codebook(const torch::Tensor& decode, const torch::Tensor& entries, const torch::Tensor& planes, int64_t key_base,
                  int64_t key_shift, int64_t half) {
  TORCH_CHECK(decode.numel() == 256 && entries.numel() == 2 * half && planes.numel() == 1024 && planes.scalar_type() == torch::kUInt8,
              "a NearestCodeIndex: 256 decode values, 2 * half bucket entries, (4, 256) uint8 byte planes");
  return Codebook{decode.data_ptr<float>(),        entries.data_ptr<int32_t>(), static_cast<int32_t>(key_base),
                  static_cast<int32_t>(key_shift), static_cast<int32_t>(half),  planes.data_ptr<uint8_t>()};
}

Scales scales_of(const torch::Tensor& t, int64_t k) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16, "parameter ", k, ": scales must be fp32 or bf16");
  return Scales{t.data_ptr(), t.scalar_type() == torch::kBFloat16};
}

// The Dtype of an fp32, bf16 or fp16 tensor (kNone for any other).
Dtype dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat:
      return Dtype::kFloat32;
    case torch::kBFloat16:
      return Dtype::kBFloat16;
    case torch::kHalf:
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

// The coded parameters' pointers, codebooks and hyperparameters, their sizes checked (arguments as adam_steps_u8's).
std::vector<Param> coded_params(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                                const std::vector<torch::Tensor>& m_codes, const std::vector<torch::Tensor>& m_scales,
                                const std::vector<torch::Tensor>& v_codes, const std::vector<torch::Tensor>& v_scales,
                                const std::vector<torch::Tensor>& tables, const torch::Tensor& ints, const torch::Tensor& bounds,
                                const torch::Tensor& grids, const torch::Tensor& seeds, const torch::Tensor& eco,
                                const std::vector<torch::Tensor>& steps, const Schedule& group) {
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(grads.size() == params.size() && m_codes.size() == params.size() && m_scales.size() == params.size() &&
                  v_codes.size() == params.size() && v_scales.size() == params.size(),
              "grads, codes and scales: one per coded parameter");
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == 6 * n, "tables: six per coded parameter");
  TORCH_CHECK(ints.dim() == 2 && ints.size(0) == n && ints.size(1) == 7, "ints: (n, 7) int64");
  TORCH_CHECK(bounds.scalar_type() == torch::kFloat && bounds.numel() == n, "bounds: one fp32 moment bound per coded parameter");
  TORCH_CHECK(grids.scalar_type() == torch::kLong && grids.dim() == 2 && grids.size(0) == n && grids.size(1) == 3,
              "grids: (n, 3) int64 [grid dtype code, stochastic, eco]");
  TORCH_CHECK(seeds.scalar_type() == torch::kLong && seeds.numel() == n, "seeds: one int64 per coded parameter");
  TORCH_CHECK(eco.scalar_type() == torch::kFloat && eco.numel() == n, "eco: one fp32 ECO coefficient per coded parameter");
  const auto ints_a = ints.accessor<int64_t, 2>(), grids_a = grids.accessor<int64_t, 2>();
  const auto bounds_a = bounds.accessor<float, 1>(), eco_a = eco.accessor<float, 1>();
  const auto seeds_a = seeds.accessor<int64_t, 1>();
  std::vector<Param> work(n);
  for (int64_t k = 0; k < n; ++k) {
    Param& w = work[k];
    w.grid = grid_of(grids_a[k][0], grids_a[k][1], grids_a[k][2], seeds_a[k], k);
    w.dtype = dtype_of(params[k]);
    TORCH_CHECK(w.dtype == Dtype::kFloat32 || (w.dtype != Dtype::kNone && w.grid.active()), "parameter ", k,
                ": fp32, or fp32/bf16/fp16 on a weight grid");
    TORCH_CHECK(grads[k].scalar_type() == params[k].scalar_type(), "parameter ", k, ": the gradient must have the parameter's dtype");
    w.p = params[k].data_ptr(), w.g = grads[k].data_ptr();
    w.mc = m_codes[k].data_ptr<uint8_t>(), w.vc = v_codes[k].data_ptr<uint8_t>();
    w.ms = scales_of(m_scales[k], k), w.vs = scales_of(v_scales[k], k);
    w.mcb = codebook(tables[6 * k], tables[6 * k + 1], tables[6 * k + 2], ints_a[k][1], ints_a[k][2], ints_a[k][3]);
    w.vcb = codebook(tables[6 * k + 3], tables[6 * k + 4], tables[6 * k + 5], ints_a[k][4], ints_a[k][5], ints_a[k][6]);
    w.h = group.at(steps_done(steps[k]), true, bounds_a[k]);
    w.h.eco = eco_a[k];
    w.numel = params[k].numel(), w.block = ints_a[k][0];
    const int64_t blocks = w.blocks = (w.numel + w.block - 1) / w.block;
    TORCH_CHECK(grads[k].numel() == w.numel && m_codes[k].numel() == w.numel && v_codes[k].numel() == w.numel &&
                    m_scales[k].numel() == blocks && v_scales[k].numel() == blocks,
                "parameter ", k, ": grad, codes or scales of the wrong size");
    for (const torch::Tensor* t : {&params[k], &grads[k], &m_codes[k], &v_codes[k], &m_scales[k], &v_scales[k]})
      TORCH_CHECK(t->is_contiguous(), "parameter ", k, ": every tensor must be contiguous");
  }
  return work;
}

// Every block of the coded parameters, in one global order: parameter 0's blocks, then parameter 1's, ...
struct BlockOrder {
  std::vector<int64_t> first;  // (n + 1,): index of each parameter's first block; first[n]: the total

  explicit BlockOrder(const std::vector<Param>& work) : first(work.size() + 1, 0) {
    for (size_t k = 0; k < work.size(); ++k) first[k + 1] = first[k] + work[k].blocks;
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
bool grad_finite(const Param& w, int64_t first, int64_t n) {
  switch (w.dtype) {
    case Dtype::kBFloat16:
      return all_finite16(static_cast<const uint16_t*>(w.g) + first, n, 0x7F80u);
    case Dtype::kFloat16:
      return all_finite16(static_cast<const uint16_t*>(w.g) + first, n, 0x7C00u);
    default:
      return all_finite(static_cast<const float*>(w.g) + first, n);
  }
}

// The gradient check pass: flags each coded parameter whose gradient holds inf/NaN (it is left untouched).
void check_gradients(const std::vector<Param>& work, const BlockOrder& order, std::vector<Outcome>& outcomes) {
  const int64_t n = order.params();
  at::parallel_for(0, order.total(), 64, [&](int64_t begin, int64_t end) {  // each parameter's part of blocks [begin, end)
    for (int64_t k = order.owner(begin); k < n && order.first[k] < end; ++k) {
      const Param& w = work[k];
      const int64_t first = std::max<int64_t>(begin - order.first[k], 0) * w.block;
      const int64_t last = std::min((end - order.first[k]) * w.block, w.numel);
      if (first < last && !grad_finite(w, first, last - first)) outcomes[k].grad_bad.store(1, std::memory_order_relaxed);
    }
  });
}

// A thread's buffers for one block: decoded new moments, and the codes before the step (stall counts only).
struct Scratch {
  std::vector<float> m, v;
  std::vector<uint8_t> old_m, old_v;
};

// Values [base, base + size) of parameter w updated in place, the new moments to m / v (update_block; on a weight grid:
// both moments decoded, grid_lanes for w's element type, rounding and feedback, block_stats).
void update_param_block(const Param& w, int64_t base, int64_t size, float m_scale, float v_scale, float* m, float* v, float& m_max,
                        float& v_max, bool& m_ok, bool& v_ok) {
  const uint8_t *mc = w.mc + base, *vc = w.vc + base;
  if (!w.grid.active()) {  // fp32 values
    update_block(static_cast<float*>(w.p) + base, static_cast<const float*>(w.g) + base, mc, m_scale, vc, v_scale, w.mcb, w.vcb, w.h, size,
                 m, v, m_max, v_max, m_ok, v_ok);
    return;
  }
  for (int64_t i = 0; i < size; ++i) m[i] = w.mcb.decode[mc[i]] * m_scale, v[i] = w.vcb.decode[vc[i]] * v_scale;
  with_element(w.dtype, [&]<typename T>(T) {
    T* p = static_cast<T*>(w.p) + base;
    const T* g = static_cast<const T*>(w.g) + base;
    with_rounding(w.grid, [&]<typename Rounding>(Rounding) {
      if (w.grid.eco)
        grid_lanes<T, Rounding, true>(p, g, base, w.h, w.grid.seed, size, m, v);
      else
        grid_lanes<T, Rounding, false>(p, g, base, w.h, w.grid.seed, size, m, v);
    });
  });
  block_stats(m, v, size, m_max, v_max, m_ok, v_ok);
}

// The per-block step: block ``index`` of parameter w decoded, updated and encoded in place (and its stall counts).
void step_block(const Param& w, int64_t index, bool track, Scratch& scratch, Outcome& outcome) {
  const int64_t base = index * w.block, size = std::min(w.block, w.numel - base);
  scratch.m.resize(size), scratch.v.resize(size);
  const float m_scale = w.ms.load(index), v_scale = w.vs.load(index);
  if (track) {
    scratch.old_m.assign(w.mc + base, w.mc + base + size);
    scratch.old_v.assign(w.vc + base, w.vc + base + size);
  }
  float m_max, v_max;
  bool m_ok, v_ok;
  update_param_block(w, base, size, m_scale, v_scale, scratch.m.data(), scratch.v.data(), m_max, v_max, m_ok, v_ok);
  const float m_new = m_ok ? w.ms.representable(m_max) : NAN, v_new = v_ok ? w.vs.representable(v_max) : NAN;
  encode_block<false>(scratch.m.data(), (m_ok && m_new > 0.0f) ? m_new : 1.0f, m_ok, w.mcb, w.mc + base, size);
  encode_block<true>(scratch.v.data(), (v_ok && v_new > 0.0f) ? v_new : 1.0f, v_ok, w.vcb, w.vc + base, size);
  w.ms.store(index, m_new);
  w.vs.store(index, v_new);
  if (!(m_ok && v_ok)) outcome.moments_bad.store(1, std::memory_order_relaxed);
  if (track) {
    int64_t local[4] = {0, 0, 0, 0};
    count_block(scratch.old_m.data(), m_scale, w.mc + base, m_new, scratch.m.data(), w.mcb.decode, size, local);
    count_block(scratch.old_v.data(), v_scale, w.vc + base, v_new, scratch.v.data(), w.vcb.decode, size, local + 2);
    for (int c = 0; c < 4; ++c) outcome.stalls[c].fetch_add(local[c], std::memory_order_relaxed);
  }
}

// Every block of every coded parameter whose gradient is finite, threaded over the global block order.
void step_blocks(const std::vector<Param>& work, const BlockOrder& order, bool track, std::vector<Outcome>& outcomes) {
  const int64_t n = order.params();
  at::parallel_for(0, order.total(), 16, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t b = begin, k = order.owner(begin); b < end; ++b) {
      while (k + 1 < n && order.first[k + 1] <= b) ++k;
      if (outcomes[k].grad_bad.load(std::memory_order_relaxed)) continue;
      step_block(work[k], b - order.first[k], track, scratch, outcomes[k]);
    }
  });
}

// ---- The fp32-state parameters ----

// One fp32-state parameter (a small one, as a rule): the same gradient check and update, moments stored as they are.
// Returns whether its gradient was finite (else nothing changed).
bool step_plain(const torch::Tensor& param, const torch::Tensor& grad, const torch::Tensor& exp_avg, const torch::Tensor& exp_avg_sq,
                const Hyper& h) {
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float *m = exp_avg.data_ptr<float>(), *v = exp_avg_sq.data_ptr<float>();
  const int64_t numel = param.numel();
  std::atomic<int> bad{0};
  at::parallel_for(0, numel, 1 << 16, [&](int64_t begin, int64_t end) {
    if (!all_finite(g + begin, end - begin)) bad.store(1, std::memory_order_relaxed);
  });
  if (bad.load()) return false;
  at::parallel_for(0, numel, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) adam_lane(p[i], g[i], m[i], v[i], h);
  });
  return true;
}

}  // namespace

// Adam(W) step of every parameter of one param group: n with 8-bit codebook moments, then ``plain`` ones with fp32
// moments. ``tables``: per coded parameter [m_decode, m_entries, m_planes, v_decode, v_entries, v_planes]; ``ints``:
// (n, 7) int64 [block, m_base, m_shift, m_half, v_base, v_shift, v_half]; ``bounds``: (n,) fp32 moment bounds;
// ``grids``: (n, 3) int64 [grid dtype code (0 none, 1 fp32, 2 bf16, 3 fp16), stochastic, eco] (a coded parameter and
// its gradient are fp32, or of one of fp32/bf16/fp16 with a grid), ``seeds``: (n,) int64 SR seeds of the weights,
// ``eco``: (n,) fp32 ECO coefficients (adam_reference.eco_coefficient of the step; used where eco);
// ``plain``: per fp32-state parameter [param, grad, exp_avg, exp_avg_sq]; ``steps``: per parameter (coded first) its
// 0-d fp32/fp64 step count, incremented here unless its gradient holds inf/NaN (then the parameter is left untouched).
// Returns (n + plain, 6) int64 [grad_finite, moments_finite, stalled_m, moved_m, stalled_v, moved_v] (stall columns 0
// unless ``track``; moments_finite 1 for fp32 states).
torch::Tensor adam_steps_u8(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                            const std::vector<torch::Tensor>& m_codes, const std::vector<torch::Tensor>& m_scales,
                            const std::vector<torch::Tensor>& v_codes, const std::vector<torch::Tensor>& v_scales,
                            const std::vector<torch::Tensor>& tables, const torch::Tensor& ints, const torch::Tensor& bounds,
                            const torch::Tensor& grids, const torch::Tensor& seeds, const torch::Tensor& eco,
                            const std::vector<torch::Tensor>& plain, const std::vector<torch::Tensor>& steps, double lr,
                            double weight_decay, double beta1, double beta2, double eps, bool decoupled, bool maximize, bool track) {
  const int64_t n = static_cast<int64_t>(params.size()), n_plain = static_cast<int64_t>(plain.size()) / 4;
  TORCH_CHECK(static_cast<int64_t>(plain.size()) == 4 * n_plain && static_cast<int64_t>(steps.size()) == n + n_plain,
              "steps: one per parameter");
  for (const torch::Tensor& step : steps)
    TORCH_CHECK(
        step.numel() == 1 && step.device().is_cpu() && (step.scalar_type() == torch::kFloat || step.scalar_type() == torch::kDouble),
        "steps: 0-d fp32/fp64 CPU tensors");
  for (int64_t j = 0; j < n_plain; ++j)
    for (int c = 0; c < 4; ++c)
      TORCH_CHECK(plain[4 * j + c].is_contiguous() && plain[4 * j + c].scalar_type() == torch::kFloat &&
                      plain[4 * j + c].numel() == plain[4 * j].numel(),
                  "fp32-state parameter ", j, ": param, grad and moments must be contiguous fp32 tensors of one size");
  const Schedule group = schedule(lr, weight_decay, beta1, beta2, eps, decoupled, maximize);
  const std::vector<Param> work =
      coded_params(params, grads, m_codes, m_scales, v_codes, v_scales, tables, ints, bounds, grids, seeds, eco, steps, group);

  // Coded parameters: first every gradient is checked, then every block of the finite ones is stepped.
  const BlockOrder order(work);
  std::vector<Outcome> outcomes(n);
  check_gradients(work, order, outcomes);
  step_blocks(work, order, track, outcomes);
  auto result = torch::zeros({n + n_plain, 6}, torch::kInt64);
  auto out = result.accessor<int64_t, 2>();
  for (int64_t k = 0; k < n; ++k) {
    out[k][0] = outcomes[k].grad_bad.load() ? 0 : 1;
    out[k][1] = outcomes[k].moments_bad.load() ? 0 : 1;
    for (int c = 0; c < 4; ++c) out[k][2 + c] = outcomes[k].stalls[c].load();
  }

  // fp32-state parameters, one after another (each threaded over its values).
  for (int64_t j = 0; j < n_plain; ++j) {
    const Hyper h = group.at(steps_done(steps[n + j]), false, 0.0f);
    out[n + j][0] = step_plain(plain[4 * j], plain[4 * j + 1], plain[4 * j + 2], plain[4 * j + 3], h) ? 1 : 0;
    out[n + j][1] = 1;
  }

  // Step counters: one more for every parameter that stepped.
  for (int64_t row = 0; row < n + n_plain; ++row)
    if (out[row][0]) count_step(steps[row]);
  return result;
}

// fp32 ``values`` rounded to a weight grid (code 1 fp32, 2 bf16, 3 fp16; under SR element i takes draw i of ``seed``) and
// stored in its dtype: the kernel's rounding of new parameter values on its own (the Rounding types and from_float
// grid_lanes uses), threaded as the step is (tests).
torch::Tensor round_to_grid(const torch::Tensor& values, int64_t grid, bool stochastic, int64_t seed) {
  TORCH_CHECK(values.scalar_type() == torch::kFloat && values.is_contiguous() && values.device().is_cpu(),
              "values: a contiguous fp32 CPU tensor");
  const Grid g = grid_of(grid, stochastic, 0, seed, 0);
  TORCH_CHECK(g.active(), "grid: 1 fp32, 2 bf16 or 3 fp16");
  const auto dtype = g.dtype == Dtype::kFloat32 ? torch::kFloat : (g.dtype == Dtype::kBFloat16 ? torch::kBFloat16 : torch::kHalf);
  torch::Tensor out = torch::empty(values.sizes(), values.options().dtype(dtype));
  const float* x = values.data_ptr<float>();
  with_element(g.dtype, [&]<typename T>(T) {
    T* y = static_cast<T*>(out.data_ptr());
    with_rounding(g, [&]<typename Rounding>(Rounding) {
      at::parallel_for(0, values.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) y[i] = from_float<T>(Rounding::round(x[i], g.seed, i));
      });
    });
  });
  return out;
}

}  // namespace lightning_qstate

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  module.def("adam_steps_u8", &lightning_qstate::adam_steps_u8, "Adam(W) step of one param group (8-bit codebook and fp32 moments)",
             py::kw_only(), py::arg("params"), py::arg("grads"), py::arg("m_codes"), py::arg("m_scales"), py::arg("v_codes"),
             py::arg("v_scales"), py::arg("tables"), py::arg("ints"), py::arg("bounds"), py::arg("grids"), py::arg("seeds"), py::arg("eco"),
             py::arg("plain"), py::arg("steps"), py::arg("lr"), py::arg("weight_decay"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
             py::arg("decoupled"), py::arg("maximize"), py::arg("track"));
  module.def("round_to_grid", &lightning_qstate::round_to_grid, "The kernel's rounding of fp32 values to a weight grid", py::kw_only(),
             py::arg("values"), py::arg("grid"), py::arg("stochastic"), py::arg("seed"));
}
