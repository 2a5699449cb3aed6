#include <torch/csrc/utils/pybind.h>

#include "ops.h"

// Every operator on tensors releases the GIL while it runs, as PyTorch's own operators do: a
// worker's engine thread spends its steps in these, and its HTTP thread must be able to send
// the tokens of the step before meanwhile (else it waits out Python's 5 ms switch interval).
// Their arguments are C++ objects, held by the caller for the call.
const auto kFree = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pdserve's fused CPU operators (bf16)";
  m.def("rms_norm", &pdserve::rms_norm, kFree);
  m.def("add_rms_norm", &pdserve::add_rms_norm, kFree);
  m.def("silu_mul", &pdserve::silu_mul, kFree);
  m.def("rope_", &pdserve::rope_, kFree);
  m.def("mla_rope_", &pdserve::mla_rope_, kFree);
  m.def("store_kv_", &pdserve::store_kv_, kFree);
  m.def("decode_attention", &pdserve::decode_attention, kFree);
  m.def("prefill_attention_available", &pdserve::prefill_attention_available);
  m.def("prefill_attention_kernel", &pdserve::prefill_attention_kernel);
  m.def("prefill_attention", &pdserve::prefill_attention, kFree);
  m.def("prefill_attention_fma_available", &pdserve::prefill_attention_fma_available);
  m.def("prefill_attention_fma", &pdserve::prefill_attention_fma, kFree);
  m.def("prefill_attention_dpbf16", &pdserve::prefill_attention_dpbf16, kFree);
  m.def("prefill_attention_amx", &pdserve::prefill_attention_amx, kFree);
  m.def("argmax_rows", &pdserve::argmax_rows, kFree);
  m.def("sample_rows", &pdserve::sample_rows, kFree);
  m.def("amx_available", &pdserve::amx_available);
  m.def("amx_pack", &pdserve::amx_pack, kFree);
  m.def("amx_linear", &pdserve::amx_linear, kFree);
  m.def("dpbf16_available", &pdserve::dpbf16_available);
  m.def("dpbf16_pack", &pdserve::dpbf16_pack, kFree);
  m.def("dpbf16_linear", &pdserve::dpbf16_linear, kFree);
  m.def("avx2_available", &pdserve::avx2_available);
  m.def("avx2_pack", &pdserve::avx2_pack, kFree);
  m.def("avx2_linear", &pdserve::avx2_linear, kFree);
  using W = pdserve::LayerWeights;
  py::class_<W>(m, "LayerWeights")
      .def(py::init<>())
      .def_readwrite("input_norm", &W::input_norm)
      .def_readwrite("post_norm", &W::post_norm)
      .def_readwrite("qkv", &W::qkv)
      .def_readwrite("o_proj", &W::o_proj)
      .def_readwrite("gate_up", &W::gate_up)
      .def_readwrite("down", &W::down)
      .def_readwrite("qkv_bias", &W::qkv_bias)
      .def_readwrite("kernel", &W::kernel)
      .def_readwrite("heads", &W::heads)
      .def_readwrite("kv_heads", &W::kv_heads)
      .def_readwrite("head_dim", &W::head_dim)
      .def_readwrite("eps", &W::eps)
      .def_readwrite("scale", &W::scale);
  using S = pdserve::LayerStep;
  py::class_<S>(m, "LayerStep")
      .def(py::init<>())
      .def_readwrite("positions", &S::positions)
      .def_readwrite("cos", &S::cos)
      .def_readwrite("sin_signed", &S::sin_signed)
      .def_readwrite("slot_blocks", &S::slot_blocks)
      .def_readwrite("slot_offsets", &S::slot_offsets)
      .def_readwrite("prompt_tables", &S::prompt_tables)
      .def_readwrite("prompt_tokens", &S::prompt_tokens)
      .def_readwrite("prompt_context", &S::prompt_context)
      .def_readwrite("tables", &S::tables)
      .def_readwrite("lens", &S::lens);
  m.def("fused_layer", &pdserve::fused_layer, kFree);
  using X = pdserve::ExpertWeights;
  py::class_<X>(m, "ExpertWeights")
      .def(py::init<>())
      .def_readwrite("gate_up", &X::gate_up)
      .def_readwrite("down", &X::down)
      .def_readwrite("kernel", &X::kernel);
  m.def("moe_experts", &pdserve::moe_experts, kFree);
  m.def("mla_decode", &pdserve::mla_decode, kFree);
  m.def("noaux_tc_route", &pdserve::noaux_tc_route, kFree);
  m.def("softmax_topk_route", &pdserve::softmax_topk_route, kFree);
  m.def("router_logits", &pdserve::router_logits, kFree);
  m.def("mla_store_", &pdserve::mla_store_, kFree);
}
