// The Python module of the kernel: its entry points (steps.h) with keyword-only arguments. Only this file includes
// torch's Python headers.
#include <torch/csrc/utils/pybind.h>

#include "steps.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  module.def("adam_steps_u8", &lightning_qstate::adam_steps_u8, "Adam(W) step of one param group (coded and fp32 moments)", py::kw_only(),
             py::arg("params"), py::arg("grads"), py::arg("m_codes"), py::arg("m_scales"), py::arg("v_codes"), py::arg("v_scales"),
             py::arg("tables"), py::arg("ints"), py::arg("floats"), py::arg("bounds"), py::arg("grids"), py::arg("seeds"), py::arg("eco"),
             py::arg("plain"), py::arg("steps"), py::arg("lr"), py::arg("weight_decay"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
             py::arg("decoupled"), py::arg("maximize"), py::arg("track"), py::arg("lr_fp32") = false);
  module.def("momentum_steps", &lightning_qstate::momentum_steps, "SGD's step or Muon's momentum of one param group (coded buffers)",
             py::kw_only(), py::arg("params"), py::arg("grads"), py::arg("codes"), py::arg("scales"), py::arg("tables"), py::arg("ints"),
             py::arg("floats"), py::arg("grids"), py::arg("seeds"), py::arg("eco"), py::arg("created"), py::arg("updates"), py::arg("lr"),
             py::arg("weight_decay"), py::arg("momentum"), py::arg("dampening"), py::arg("nesterov"), py::arg("maximize"),
             py::arg("track"));
  module.def("round_to_grid", &lightning_qstate::round_to_grid, "The kernel's rounding of fp32 values to a weight grid", py::kw_only(),
             py::arg("values"), py::arg("grid"), py::arg("stochastic"), py::arg("seed"));
}
