import torch, torch.utils.cpp_extension as ce
src = r'''
#include <torch/extension.h>
torch::Tensor f(torch::Tensor x) { TORCH_CHECK(x.dim() == 2, "f: expected 2-D, got ", x.dim(), "-D"); return x; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("f", &f); }
'''
m = ce.load_inline("inl", cpp_sources=[src], verbose=False, extra_cflags=["-O2"])
try:
    m.f(torch.randn(2, 3, 4))
except RuntimeError as e:
    print("inline ok:", str(e).splitlines()[0])
