#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pdserve's fused CPU operators (bf16)";
  m.def("rms_norm", &pdserve::rms_norm);
  m.def("add_rms_norm", &pdserve::add_rms_norm);
  m.def("silu_mul", &pdserve::silu_mul);
  m.def("rope_", &pdserve::rope_);
  m.def("store_kv_", &pdserve::store_kv_);
  m.def("decode_attention", &pdserve::decode_attention);
  m.def("argmax_rows", &pdserve::argmax_rows);
  m.def("amx_available", &pdserve::amx_available);
  m.def("amx_pack", &pdserve::amx_pack);
  m.def("amx_linear", &pdserve::amx_linear);
  m.def("dpbf16_available", &pdserve::dpbf16_available);
  m.def("dpbf16_pack", &pdserve::dpbf16_pack);
  m.def("dpbf16_linear", &pdserve::dpbf16_linear);
}
