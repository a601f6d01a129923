// All op schemas of torch.ops.moe_fp8, one section per kernel family; and the Python
// module `_C` that reports build info. Implementations are registered per device where
// the code lives (TORCH_LIBRARY_IMPL in each family's CPU file and .cu file).
#define Py_LIMITED_API 0x030A0000  // CPython's stable ABI as of 3.10 (pyproject.toml)
#include <Python.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>
#include <torch/version.h>

#include <climits>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "core/tuning.h"
#include "quant/engine.h"

// Set by CMakeLists.txt: the GPU backend ("cuda", "hip" or "" for CPU only), its
// compiler version and the architectures built.
#ifndef MOE_FP8_GPU_BACKEND
#define MOE_FP8_GPU_BACKEND ""
#define MOE_FP8_GPU_VERSION_STR ""
#define MOE_FP8_GPU_ARCHS_STR ""
#endif

TORCH_LIBRARY(moe_fp8, m) {
  // ---- FP8 rowwise recipe (DESIGN §5): decode scales, pow2 by default -------------
  // Implementations: rowwise/rowwise_cpu.cpp (CPU) and rowwise/rowwise.cu (CUDA).
  m.def("quantize_rowwise(Tensor x, ScalarType fp8_dtype, bool pow2_scale=True) -> (Tensor, Tensor)");

  m.def("quantize_experts_fwd(Tensor b_t, ScalarType fp8_dtype, bool pow2_scale=True, bool as_bf16=False)"
        " -> (Tensor, Tensor)");
  m.def("quantize_experts_fwd_cat(Tensor[] b_ts, ScalarType fp8_dtype, bool pow2_scale=True, bool as_bf16=False)"
        " -> (Tensor, Tensor)");

  m.def("quantize_experts_bwd(Tensor b_t, ScalarType fp8_dtype, bool pow2_scale=True, bool as_bf16=False)"
        " -> (Tensor, Tensor)");
  m.def("quantize_experts_bwd_cat(Tensor[] b_ts, ScalarType fp8_dtype, bool pow2_scale=True, bool as_bf16=False)"
        " -> (Tensor, Tensor)");
  m.def("quantize_experts_dual_cat(Tensor[] b_ts, ScalarType fp8_dtype, bool pow2_scale=True) -> (Tensor, Tensor, Tensor, Tensor)");

  m.def(
      "quantize_jagged_colwise(Tensor x, Tensor offs, ScalarType fp8_dtype, bool pow2_scale=True,"
      " Tensor? padded_starts=None, int alignment=16) -> (Tensor, Tensor)");

  m.def(
      "quantize_jagged_colwise_dual(Tensor x1, Tensor x2, Tensor offs, ScalarType fp8_dtype,"
      " bool pow2_scale=True, Tensor? padded_starts=None, int alignment=16) -> (Tensor, Tensor, Tensor, Tensor)");

  m.def(
      "quantize_rowwise_jagged_dual(Tensor x, Tensor offs, ScalarType fp8_dtype, bool pow2_scale=True,"
      " Tensor? padded_starts=None, int alignment=16) -> (Tensor, Tensor, Tensor, Tensor)");

  // ---- MXFP8 recipe (DESIGN §7): e4m3fn data, E8M0 scales per 32 elements ---------
  // Implementations: mxfp8/mxfp8_cpu.cpp (CPU) and mxfp8/mxfp8.cu (CUDA).
  m.def("quantize_mxfp8_rowwise(Tensor x, str rounding=\"rceil\", bool blocked=False, Tensor? offs=None) -> (Tensor, Tensor)");
  m.def(
      "quantize_mxfp8_colwise(Tensor x, str rounding=\"rceil\", bool blocked=False, Tensor? offs=None,"
      " Tensor? padded_starts=None, int? alignment=None) -> (Tensor, Tensor)");
  m.def("quantize_mxfp8_experts(Tensor b, str rounding=\"rceil\", bool blocked=False) -> (Tensor, Tensor)");

  // ---- MXFP8 scale swizzles (DESIGN §7): any 1-byte scales to/from the blocked layout -
  // Implementations: mxfp8/swizzle_cpu.cpp (CPU) and mxfp8/swizzle.cu (CUDA).
  // s (R, C) -> (ceil128(R), ceil4(C)); s (E, R, C) -> (E, ceil128(R) * ceil4(C)).
  m.def("to_blocked_scales(Tensor s) -> Tensor");
  // s (M, C), token groups along the rows -> (M + 128 G, ceil4(C)).
  m.def("to_blocked_scales_m_groups(Tensor s, Tensor offs) -> Tensor");
  // s (R, C) block columns, offs in tokens (32 per column) -> (ceil128(R), ceil4(C) + 4 G).
  m.def("to_blocked_scales_k_groups(Tensor s, Tensor offs) -> Tensor");
  // The inverses, plain (rows, cols) (or (E, rows, cols)) with the padding dropped.
  m.def("from_blocked_scales(Tensor b, SymInt rows, SymInt cols) -> Tensor");
  m.def("from_blocked_scales_m_groups(Tensor b, Tensor offs, SymInt cols) -> Tensor");
  m.def("from_blocked_scales_k_groups(Tensor b, Tensor offs, SymInt rows, SymInt cols) -> Tensor");

  // ---- SwiGLU (DESIGN §10): h = silu(h1) * h3 of h13 = [h1 | h3], and its gradient ---------
  // Each optionally fused with the FP8 rowwise quantization of its result (q and (M, 1) scales exactly as
  // quantize_rowwise gives for the written values). Implementations: swiglu/swiglu_cpu.cpp, swiglu/swiglu.cu.
  m.def("swiglu(Tensor h13) -> Tensor");
  m.def("swiglu_quantize_rowwise(Tensor h13, ScalarType fp8_dtype, bool pow2_scale=True) -> (Tensor, Tensor)");
  m.def("swiglu_backward(Tensor grad_h, Tensor h13) -> Tensor");
  m.def(
      "swiglu_backward_quantize_rowwise(Tensor grad_h, Tensor h13, ScalarType fp8_dtype, bool pow2_scale=True)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // swiglu_backward, the rowwise fp8 of grad_h13 as a whole (= quantize_rowwise(grad_h13))
  // and h = swiglu(h13) (the W2 weight gradient's operand) from one read of h13.
  m.def(
      "swiglu_backward_with_h_quantize_rowwise(Tensor grad_h, Tensor h13, ScalarType fp8_dtype, "
      "bool pow2_scale=True) -> (Tensor, Tensor, Tensor, Tensor)");

  // ---- FP8 blockwise recipe (DESIGN §6): fp32 decode scales per 1x128 / 128x1 block ----
  // Implementations: blockwise/blockwise_cpu.cpp (CPU) and blockwise/blockwise.cu (CUDA).
  // act_lhs: q (M, K) row-major, scale (M, ceil(K/128)) column-major.
  m.def("quantize_blockwise_act_lhs(Tensor x, ScalarType fp8_dtype) -> (Tensor, Tensor)");
  // act_rhs: q (M, K) column-major, scale (ceil(M/128), K) row-major. act_transposed_lhs: q (K, M) row-major, scale
  // (K, ceil(M/128)) column-major (act_rhs's bytes, transposed). With offs (and padded_starts + alignment) blocks
  // restart at each token group.
  m.def(
      "quantize_blockwise_act_rhs(Tensor x, ScalarType fp8_dtype, Tensor? offs=None, Tensor? padded_starts=None,"
      " int? alignment=None) -> (Tensor, Tensor)");
  m.def(
      "quantize_blockwise_act_transposed_lhs(Tensor x, ScalarType fp8_dtype, Tensor? offs=None,"
      " Tensor? padded_starts=None, int? alignment=None) -> (Tensor, Tensor)");
  // act_dual: act_lhs's (q, scale) and act_rhs's with the same token groups, from one
  // read of x where the device has the kernel (the padded layout, 2-byte x).
  m.def(
      "quantize_blockwise_act_dual(Tensor x, ScalarType fp8_dtype, Tensor offs, Tensor? padded_starts=None,"
      " int? alignment=None) -> (Tensor, Tensor, Tensor, Tensor)");
  // Weights, 128x128 tiles of w (M, N) or (E, M, N): weight_rhs q (M, N) column-major, scale (ceil(M/128),
  // ceil(N/128)) column-major; weight_transposed_rhs q (N, M), scale (ceil(N/128), ceil(M/128)), both column-major;
  // weight_dual both. as_bf16 (here and in the rowwise experts ops): w fp32, read as w.to(torch.bfloat16).
  m.def("quantize_blockwise_weight_rhs(Tensor w, ScalarType fp8_dtype, bool as_bf16=False) -> (Tensor, Tensor)");
  m.def("quantize_blockwise_weight_transposed_rhs(Tensor w, ScalarType fp8_dtype, bool as_bf16=False)"
        " -> (Tensor, Tensor)");
  m.def("quantize_blockwise_weight_dual(Tensor w, ScalarType fp8_dtype) -> (Tensor, Tensor, Tensor, Tensor)");
  // _cat: the same of ws concatenated along N (every part but the last a multiple of 128
  // columns), without a copy of the weights.
  m.def("quantize_blockwise_weight_rhs_cat(Tensor[] ws, ScalarType fp8_dtype, bool interleave=False,"
        " bool as_bf16=False) -> (Tensor, Tensor)");
  m.def("quantize_blockwise_weight_transposed_rhs_cat(Tensor[] ws, ScalarType fp8_dtype, bool as_bf16=False)"
        " -> (Tensor, Tensor)");
  m.def("quantize_blockwise_weight_dual_cat(Tensor[] ws, ScalarType fp8_dtype, bool interleave=False) -> (Tensor, Tensor, Tensor, Tensor)");

  // ---- FP8 blockwise grouped GEMMs (DESIGN §6), Hopper: gemm/blockwise_grouped_sm90.cu (CUDA only) -
  m.def("blockwise_grouped_mm_2d3d(Tensor a, Tensor scale_a, Tensor b, Tensor scale_b, Tensor offs, ScalarType out_dtype, int config=-1) -> Tensor");
  m.def("blockwise_grouped_mm_2d2d(Tensor a, Tensor scale_a, Tensor b, Tensor scale_b, Tensor offs, ScalarType out_dtype, int config=-1) -> Tensor");
  m.def("blockwise_grouped_mm_2d2d_add_(Tensor(a!) out, Tensor a, Tensor scale_a, Tensor b, Tensor scale_b, Tensor offs, int config=-1) -> ()");
  m.def("blockwise_grouped_mm_swiglu(Tensor a, Tensor scale_a, Tensor b, Tensor scale_b, Tensor offs, Tensor padded_starts) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("blockwise_grouped_mm_dswiglu(Tensor a, Tensor scale_a, Tensor b, Tensor scale_b, Tensor offs, Tensor h13, Tensor padded_starts) -> (Tensor, Tensor, Tensor, Tensor)");

  // ---- FP8 rowwise grouped GEMMs (DESIGN §5), Hopper: gemm/rowwise_grouped_sm90*.cu (CUDA only) -----
  // config: -1 picks by shape; 0.. forces one (rowwise_grouped_sm90.cuh), for sweeps.
  m.def("rowwise_grouped_mm_2d3d(Tensor a, Tensor scale_a, Tensor b, Tensor scale_b, Tensor offs, ScalarType out_dtype, int config=-1) -> Tensor");
  m.def("rowwise_grouped_mm_2d2d(Tensor a, Tensor scale_a, Tensor b, Tensor scale_b, Tensor offs, ScalarType out_dtype, int config=-1) -> Tensor");
  m.def("rowwise_grouped_mm_2d2d_add_(Tensor(a!) out, Tensor a, Tensor scale_a, Tensor b, Tensor scale_b, Tensor offs) -> ()");

  // ---- token groups (DESIGN §8): sync-free padding and expert-parallel permutation -
  // impls: grouping/grouping_cpu.cpp (CPU) and grouping/grouping.cu (CUDA).
  m.def("pad_token_groups(Tensor x, Tensor offs, int alignment) -> (Tensor, Tensor, Tensor)");
  m.def("pad_token_groups_at(Tensor x, Tensor offs, Tensor padded_starts, SymInt num_padded_rows) -> Tensor");
  m.def("unpad_token_groups(Tensor x_padded, Tensor offs, Tensor padded_starts, SymInt num_tokens) -> Tensor");
  m.def("padded_group_offsets(Tensor offs, SymInt num_tokens, int alignment) -> (Tensor, Tensor)");
  m.def(
      "permute_indices(Tensor tokens_per_expert_group, int experts_per_rank, int num_ranks, int alignment,"
      " SymInt max_len) -> (Tensor, Tensor, Tensor)");
  m.def("zero_rows_past_groups_(Tensor(a!) x, Tensor offs) -> ()");
  m.def("gather_rows(Tensor x, Tensor indices) -> Tensor");
  m.def("scatter_rows(Tensor y, Tensor indices, SymInt num_rows) -> Tensor");
  // q (R, D) fp8 codes, scale (R, ceil(D / block)) fp32: q * scale in fp32, rounded once
  // to out_dtype (bf16, fp16 or fp32): token rows dispatched in fp8, as values.
  m.def("dequantize_rows(Tensor q, Tensor scale, int block, ScalarType out_dtype) -> Tensor");
  m.def("sum_rows(Tensor x, Tensor indices, Tensor offs) -> Tensor");
  m.def("combine_rows(Tensor x, Tensor scores, Tensor indices, Tensor offs) -> Tensor");
  m.def("combine_rows_backward(Tensor grad, Tensor x, Tensor scores, Tensor token) -> (Tensor, Tensor)");
}

// The raw ops have no derivative (moe_fp8_ext's autograd Functions differentiate the
// layers): a backward through one raises instead of dropping the gradient. Every op that
// writes no input (tests/test_op_coverage.py checks the list).
TORCH_LIBRARY_IMPL(moe_fp8, Autograd, m) {
  static const char* const kFunctionalOps[] = {
    "blockwise_grouped_mm_2d2d", "blockwise_grouped_mm_2d3d", "blockwise_grouped_mm_dswiglu",
    "blockwise_grouped_mm_swiglu", "combine_rows", "combine_rows_backward", "dequantize_rows", "from_blocked_scales",
    "from_blocked_scales_k_groups", "from_blocked_scales_m_groups", "gather_rows", "pad_token_groups",
    "pad_token_groups_at", "padded_group_offsets", "permute_indices", "quantize_blockwise_act_dual",
    "quantize_blockwise_act_lhs", "quantize_blockwise_act_rhs", "quantize_blockwise_act_transposed_lhs",
    "quantize_blockwise_weight_dual", "quantize_blockwise_weight_dual_cat", "quantize_blockwise_weight_rhs",
    "quantize_blockwise_weight_rhs_cat", "quantize_blockwise_weight_transposed_rhs",
    "quantize_blockwise_weight_transposed_rhs_cat", "quantize_experts_bwd", "quantize_experts_bwd_cat",
    "quantize_experts_dual_cat", "quantize_experts_fwd", "quantize_experts_fwd_cat", "quantize_jagged_colwise",
    "quantize_jagged_colwise_dual", "quantize_mxfp8_colwise", "quantize_mxfp8_experts", "quantize_mxfp8_rowwise",
    "quantize_rowwise", "quantize_rowwise_jagged_dual", "rowwise_grouped_mm_2d2d", "rowwise_grouped_mm_2d3d",
    "scatter_rows", "sum_rows", "swiglu", "swiglu_backward", "swiglu_backward_quantize_rowwise",
    "swiglu_backward_with_h_quantize_rowwise", "swiglu_quantize_rowwise", "to_blocked_scales",
    "to_blocked_scales_k_groups", "to_blocked_scales_m_groups", "unpad_token_groups"};
  for (const char* name : kFunctionalOps) m.impl(name, torch::autograd::autogradNotImplementedFallback());
}

namespace {

// The ops that write an input bump its version counter, as torch's in-place ops do, so
// that autograd sees the write (a saved tensor written after it was saved raises).
void bump_written_inputs(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    if (alias != nullptr && alias->isWrite()) written.push_back((*stack)[first + i].toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const auto& t : written) torch::autograd::impl::bump_version(t);
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_fp8, ADInplaceOrView, m) {
  static const char* const kInPlaceOps[] = {"blockwise_grouped_mm_2d2d_add_", "rowwise_grouped_mm_2d2d_add_",
                                            "zero_rows_past_groups_"};
  for (const char* name : kInPlaceOps) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&bump_written_inputs>());
}

#if defined(MOE_FP8_WITH_CUDA)
namespace moe_fp8 {
extern const QuantKernels kRowwiseCuda;  // rowwise/rowwise.cu
}  // namespace moe_fp8
#endif

namespace {

// The L2 budget of quantize_experts_dual_cat's one-read kernel on GPU `device` (0: never,
// and always 0 without GPU kernels): what the op decides with, so that Python code
// (ops.dual_cat_reads_once) asks rather than repeats the rule.
int64_t dual_l2_budget(int device) {
#if defined(MOE_FP8_WITH_CUDA)
  return moe_fp8::kRowwiseCuda.dual_budget(device);
#else
  (void)device;
  return 0;
#endif
}

// The module's functions, in CPython's stable ABI (Py_LIMITED_API above): the one
// module file serves every Python from 3.10 on (a cp310-abi3 wheel), and a module built
// on one machine loads under another machine's Python if its torch is the same.

// build_info() -> dict: what platform.build_info documents.
PyObject* build_info(PyObject*, PyObject*) {
  PyObject* info = PyDict_New();
  if (info == nullptr) return nullptr;
  // Steals `value` (nullptr: an error is set); false on failure.
  auto put = [info](const char* key, PyObject* value) {
    const bool ok = value != nullptr && PyDict_SetItemString(info, key, value) == 0;
    Py_XDECREF(value);
    return ok;
  };
  auto str = [](const char* v) { return PyUnicode_FromString(v); };
  auto none = [] {
    Py_INCREF(Py_None);
    return Py_None;
  };
  const bool cuda = std::strcmp(MOE_FP8_GPU_BACKEND, "cuda") == 0;
  const bool hip = std::strcmp(MOE_FP8_GPU_BACKEND, "hip") == 0;
  const bool ok = put("torch_version", str(TORCH_VERSION)) &&  //
                  put("cuda", PyBool_FromLong(cuda)) &&
                  put("cuda_version", cuda ? str(MOE_FP8_GPU_VERSION_STR) : none()) &&
                  put("cuda_archs", str(cuda ? MOE_FP8_GPU_ARCHS_STR : "")) &&  //
                  put("hip", PyBool_FromLong(hip)) &&
                  put("hip_version", hip ? str(MOE_FP8_GPU_VERSION_STR) : none()) &&
                  put("hip_archs", str(hip ? MOE_FP8_GPU_ARCHS_STR : ""));
  if (!ok) {
    Py_DECREF(info);
    return nullptr;
  }
  return info;
}

// dual_l2_budget(device: int) -> int. No C++ exception may cross into CPython.
PyObject* dual_l2_budget_py(PyObject*, PyObject* arg) {
  const long device = PyLong_AsLong(arg);
  if (device == -1 && PyErr_Occurred()) return nullptr;
  if (device < INT_MIN || device > INT_MAX) {
    PyErr_SetString(PyExc_OverflowError, "dual_l2_budget: the device index does not fit an int");
    return nullptr;
  }
  try {
    return PyLong_FromLongLong(dual_l2_budget(static_cast<int>(device)));
  } catch (const std::exception& e) {  // c10::Error included: a RuntimeError, as torch raises
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "dual_l2_budget: unknown C++ exception");
  }
  return nullptr;
}

// A str or None argument as an optional string; false (an error set) for anything else.
bool optional_str(PyObject* arg, const char* what, std::optional<std::string>* out) {
  if (arg == Py_None) {
    out->reset();
    return true;
  }
  if (!PyUnicode_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "%s: expected a str or None", what);
    return false;
  }
  const char* v = PyUnicode_AsUTF8AndSize(arg, nullptr);
  if (v == nullptr) return false;
  *out = std::string(v);
  return true;
}

PyObject* optional_str_py(const std::optional<std::string>& v) {
  if (!v) Py_RETURN_NONE;
  return PyUnicode_FromStringAndSize(v->data(), static_cast<Py_ssize_t>(v->size()));
}

// _set_tuning(name: str, value: str | None) -> str | None (the previous value), and
// _get_tuning(name: str) -> str | None: the private tuning table (core/tuning.h).
template <bool kSet>
PyObject* tuning_py(PyObject*, PyObject* args) {
  const char* what = kSet ? "_set_tuning" : "_get_tuning";
  PyObject* name = nullptr;
  PyObject* value = Py_None;
  if (kSet ? !PyArg_UnpackTuple(args, what, 2, 2, &name, &value) : !PyArg_UnpackTuple(args, what, 1, 1, &name)) {
    return nullptr;
  }
  std::optional<std::string> n, v;
  if (!optional_str(name, what, &n) || !optional_str(value, what, &v)) return nullptr;
  if (!n) {
    PyErr_Format(PyExc_TypeError, "%s: expected a str name", what);
    return nullptr;
  }
  try {
    return optional_str_py(kSet ? moe_fp8::set_tuning(*n, v) : moe_fp8::get_tuning(*n));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "tuning: unknown C++ exception");
  }
  return nullptr;
}

// The "name($module, ...)\n--\n\n" head gives inspect.signature the parameters.
PyMethodDef kMethods[] = {
    {"build_info", build_info, METH_NOARGS,
     "build_info($module, /)\n--\n\nBuild configuration: torch version, GPU backend version and compiled archs"},
    {"dual_l2_budget", dual_l2_budget_py, METH_O,
     "dual_l2_budget($module, device, /)\n--\n\n"
     "L2 bytes the one-read dual weight kernel may use on a GPU (0: never)"},
    {"_set_tuning", tuning_py<true>, METH_VARARGS,
     "_set_tuning($module, name, value, /)\n--\n\n"
     "Private: set a tuning knob (None: unset); returns its previous value (moe_fp8_ext._tuning)"},
    {"_get_tuning", tuning_py<false>, METH_VARARGS,
     "_get_tuning($module, name, /)\n--\n\nPrivate: a tuning knob's value (None: unset)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C", "moe_fp8_ext compiled kernels; the ops live in torch.ops.moe_fp8",
                       -1, kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

// Importing the module loads this file, whose static initializers register the ops.
PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&kModule); }
