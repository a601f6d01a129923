#!/usr/bin/env bash
# Toolchain check after a build: the module must link libstdc++ dynamically (a
# statically linked copy crashes on the first exception) and a throwing op must
# raise a Python RuntimeError.
set -euo pipefail
so=$(ls moe_fp8_ext/_C*.so)
if nm -C --defined-only "$so" | grep -q "std::locale::classic()"; then
  echo "diag_toolchain: $so carries a static libstdc++ (host compiler mismatch); set MOE_FP8_CXX" >&2
  exit 1
fi
python3 -c "
import torch, moe_fp8_ext
try:
    moe_fp8_ext.quantize_rowwise(torch.randn(2, 3, 4), torch.float8_e4m3fn)
    raise SystemExit('diag_toolchain: expected an error')
except RuntimeError as e:
    print('diag_toolchain: ok, errors propagate:', str(e).splitlines()[0][:80])
"
