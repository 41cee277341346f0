"""A hand-written C++ Adam(W) step for 8-bit codebook states on the CPU (round-to-nearest), with optional stall counts.

One pass per block of ``block_size`` values, threaded with ``at::parallel_for``: decode both moments
(table lookup times the block scale), torch's Adam(W) update, per-block absmax, and the encoder of
``formats.rounding.encode_codebook`` (bucket lookup, one compare, nearest of two neighbours), writing
param, codes and scales in place. The codes are the reference's, computed with the same float
operations in the same order (compiled with ``-ffp-contract=off``).

It is built on first use with ``torch.utils.cpp_extension.load_inline`` (needs a C++ compiler and
ninja); where that fails, ``kernel()`` returns ``None`` and the optimizer uses the ``torch.compile``
path instead.
"""

from __future__ import annotations

import functools
import warnings

import torch

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

namespace {

struct Codebook {
  const float* decode;      // value of every code
  const int32_t* floor;     // bucket -> floor code
  const float* values;      // sorted codebook
  int32_t key_shift, half, last;
};

Codebook codebook(const torch::Tensor& decode, const torch::Tensor& floor, const torch::Tensor& values, int64_t key_shift, int64_t half) {
  return Codebook{decode.data_ptr<float>(), floor.data_ptr<int32_t>(), values.data_ptr<float>(),
                  static_cast<int32_t>(key_shift), static_cast<int32_t>(half), static_cast<int32_t>(values.numel() - 1)};
}

// formats.rounding.encode_codebook for one block: same operations, same order, vectorizable.
void encode_block(const float* __restrict__ x, float divisor, bool finite, const Codebook& cb, uint8_t* __restrict__ out, int64_t n) {
  const float scale_ok = finite ? 1.0f : 0.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float value = (x[i] * scale_ok) / divisor;
    const float magnitude = std::fabs(value);
    int32_t bits;
    std::memcpy(&bits, &magnitude, 4);
    const int32_t key = bits >> cb.key_shift;
    const int32_t bucket = value < 0.0f ? cb.half - 1 - key : cb.half + key;
    int32_t floor = cb.floor[bucket];
    const int32_t next = floor + 1 < cb.last ? floor + 1 : cb.last;
    floor += cb.values[next] <= value ? 1 : 0;
    const int32_t low = floor < 0 ? 0 : (floor > cb.last - 1 ? cb.last - 1 : floor);
    const float low_value = cb.values[low];
    const float high_value = cb.values[low + 1];
    out[i] = static_cast<uint8_t>(low + ((value - low_value) * 2.0f >= (high_value - low_value) ? 1 : 0));
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

}  // namespace

void adam_step_u8(torch::Tensor param, torch::Tensor grad,
                  torch::Tensor m_codes, torch::Tensor m_scales, torch::Tensor v_codes, torch::Tensor v_scales,
                  torch::Tensor m_decode, torch::Tensor m_floor, torch::Tensor m_values, int64_t m_shift, int64_t m_half,
                  torch::Tensor v_decode, torch::Tensor v_floor, torch::Tensor v_values, int64_t v_shift, int64_t v_half,
                  int64_t block, double lr, double weight_decay, double beta1, double beta2, double eps,
                  double step_size, double bias_correction2_sqrt, bool decoupled, bool maximize, torch::Tensor counts) {
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  uint8_t* mc = m_codes.data_ptr<uint8_t>();
  uint8_t* vc = v_codes.data_ptr<uint8_t>();
  float* ms = m_scales.data_ptr<float>();
  float* vs = v_scales.data_ptr<float>();
  const Codebook mcb = codebook(m_decode, m_floor, m_values, m_shift, m_half);
  const Codebook vcb = codebook(v_decode, v_floor, v_values, v_shift, v_half);
  const float f_lr = lr, f_wd = weight_decay, f_b1 = beta1, f_b2 = beta2, f_eps = eps;
  const float sign = maximize ? -1.0f : 1.0f;
  const float decay = decoupled ? 1.0f - f_lr * f_wd : 1.0f;
  const float l2 = decoupled ? 0.0f : f_wd;
  const float one_minus_b1 = 1.0f - f_b1, one_minus_b2 = 1.0f - f_b2;
  const float f_step = step_size, f_bc2 = bias_correction2_sqrt;
  const int64_t blocks = param.numel() / block;
  const bool track = counts.numel() == 4;  // int64 [stalled_m, moved_m, stalled_v, moved_v], added to
  std::mutex counts_mutex;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> m_buffer(block), v_buffer(block);
    std::vector<uint8_t> old_m(track ? block : 0), old_v(track ? block : 0);
    int64_t local[4] = {0, 0, 0, 0};
    float* __restrict__ m = m_buffer.data();
    float* __restrict__ v = v_buffer.data();
    for (int64_t b = begin; b < end; ++b) {
      const int64_t base = b * block;
      const float m_scale = ms[b], v_scale = vs[b];
      float* __restrict__ pb = p + base;
      const float* __restrict__ gb = g + base;
      const uint8_t* __restrict__ mcb_in = mc + base;
      const uint8_t* __restrict__ vcb_in = vc + base;
      float m_max = 0.0f, v_max = 0.0f;
      int32_t bad = 0;
#pragma omp simd reduction(max : m_max, v_max) reduction(| : bad)
      for (int64_t i = 0; i < block; ++i) {
        const float pi = pb[i];
        const float gi = sign * gb[i] + pi * l2;
        float mi = mcb.decode[mcb_in[i]] * m_scale;
        float vi = vcb.decode[vcb_in[i]] * v_scale;
        mi = mi + one_minus_b1 * (gi - mi);
        vi = vi * f_b2 + one_minus_b2 * (gi * gi);
        const float denom = std::sqrt(vi) / f_bc2 + f_eps;
        pb[i] = pi * decay - f_step * (mi / denom);
        m[i] = mi;
        v[i] = vi;
        const float am = std::fabs(mi), av = std::fabs(vi);
        m_max = am > m_max ? am : m_max;
        v_max = av > v_max ? av : v_max;
        bad |= ((mi - mi) != (mi - mi)) ? 1 : 0;
        bad |= ((vi - vi) != (vi - vi)) ? 2 : 0;
      }
      const bool m_ok = !(bad & 1), v_ok = !(bad & 2);
      if (track) {
        std::memcpy(old_m.data(), mcb_in, block);
        std::memcpy(old_v.data(), vcb_in, block);
      }
      encode_block(m, (m_ok && m_max > 0.0f) ? m_max : 1.0f, m_ok, mcb, mc + base, block);
      encode_block(v, (v_ok && v_max > 0.0f) ? v_max : 1.0f, v_ok, vcb, vc + base, block);
      ms[b] = m_ok ? m_max : NAN;
      vs[b] = v_ok ? v_max : NAN;
      if (track) {
        count_block(old_m.data(), m_scale, mc + base, ms[b], m, mcb.decode, block, local);
        count_block(old_v.data(), v_scale, vc + base, vs[b], v, vcb.decode, block, local + 2);
      }
    }
    if (track) {
      std::lock_guard<std::mutex> guard(counts_mutex);
      int64_t* total = counts.data_ptr<int64_t>();
      for (int k = 0; k < 4; ++k) total[k] += local[k];
    }
  });
}
"""


@functools.lru_cache(maxsize=None)
def kernel():
    """The compiled extension's ``adam_step_u8``, or ``None`` when it cannot be built here (warns once)."""
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            name="lightning_qstate_cpu_adam_v4",
            cpp_sources=SOURCE,
            functions=["adam_step_u8"],
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # no compiler or ninja: the torch.compile path takes over
        warnings.warn(f"building the C++ CPU Adam kernel failed ({error!r}); using the torch.compile path", RuntimeWarning, stacklevel=2)
        return None
    return module.adam_step_u8
