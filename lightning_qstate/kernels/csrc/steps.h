// The kernel's entry points (defined, and documented, in adam_cpu.cpp; bound to Python in bindings.cpp). A header of
// its own so that the kernel is compiled without torch's Python headers and both files build in parallel.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace lightning_qstate {

at::Tensor adam_steps_u8(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& m_codes, const std::vector<at::Tensor>& m_scales,
                         const std::vector<at::Tensor>& v_codes, const std::vector<at::Tensor>& v_scales,
                         const std::vector<at::Tensor>& tables, const at::Tensor& ints, const at::Tensor& floats, const at::Tensor& bounds,
                         const at::Tensor& grids, const at::Tensor& seeds, const at::Tensor& eco, const std::vector<at::Tensor>& plain,
                         const std::vector<at::Tensor>& steps, double lr, double weight_decay, double beta1, double beta2, double eps,
                         bool decoupled, bool maximize, bool track, bool lr_fp32);

at::Tensor momentum_steps(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& codes,
                          const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& tables, const at::Tensor& ints,
                          const at::Tensor& floats, const at::Tensor& grids, const at::Tensor& seeds, const at::Tensor& eco,
                          const at::Tensor& created, const std::vector<at::Tensor>& updates, double lr, double weight_decay,
                          double momentum, double dampening, bool nesterov, bool maximize, bool track);

at::Tensor round_to_grid(const at::Tensor& values, int64_t grid, bool stochastic, int64_t seed);

}  // namespace lightning_qstate
