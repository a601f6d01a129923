"""python -m moe_fp8_ext: check this install end to end.

Runs every quantization op on the best available device (CUDA GPU, else the CPU),
verifies each result bit for bit against moe_fp8_ext.reference, and prints a table
with the time and the bandwidth of each op.
"""

import argparse
import time

import torch

import moe_fp8_ext
from moe_fp8_ext import reference as ref


def _time_ms(fn, device, iters):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1000 / iters


def _same(out, want):
    for o, w in zip(out, want):
        if o.dtype == torch.float32:
            if not torch.equal(o.cpu(), w.cpu()):
                return False
        elif o.stride() != w.stride() or not torch.equal(o.view(torch.uint8).cpu(), w.view(torch.uint8).cpu()):
            return False
    return True


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m moe_fp8_ext", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=None, help="tokens M (default 16384 on a GPU, 1024 on the CPU)")
    p.add_argument("--hidden", type=int, default=None, help="model dim K (default 7168 on a GPU, 512 on the CPU)")
    p.add_argument("--ffn", type=int, default=None, help="expert dim N (default 2048 on a GPU, 256 on the CPU)")
    p.add_argument("--experts", type=int, default=8, help="experts E (default 8)")
    p.add_argument("--fp8-dtype", choices=["e4m3fn", "e4m3fnuz"], default=None, help="default: the platform's")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)

    device = args.device or ("cuda" if torch.cuda.is_available() and moe_fp8_ext.build_info()["cuda"] else "cpu")
    small = device == "cpu"
    m = args.tokens or (1024 if small else 16384)
    k = args.hidden or (512 if small else 7168)
    n = args.ffn or (256 if small else 2048)
    e = args.experts
    f8 = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}.get(args.fp8_dtype) or moe_fp8_ext.default_fp8_dtype()
    info = moe_fp8_ext.build_info()
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (no GPU found: small sizes)" if small else "CPU"
    built = f"CUDA {info['cuda_version']} for sm_{info['cuda_archs']}" if info["cuda"] else "CPU kernels only"
    print(f"moe_fp8_ext on {where}; build: {built}; torch {torch.__version__}")
    print(f"M={m} K={k} N={n} E={e} fp8={f8}\n")

    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    go = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    w_t = (torch.randn(e, n, k, device=device, dtype=torch.bfloat16) * 0.02).transpose(1, 2)
    sizes = torch.full((e,), m // e, dtype=torch.int32)
    sizes[-1] += m - int(sizes.sum())
    offs = torch.cumsum(sizes, 0).to(torch.int32).to(device)
    cases = [
        ("quantize_rowwise A", lambda: moe_fp8_ext.quantize_rowwise(a, f8), lambda: ref.quantize_rowwise(a, f8), m * k * 3),
        ("quantize_experts_fwd W", lambda: moe_fp8_ext.quantize_experts_fwd(w_t, f8), lambda: ref.quantize_experts_fwd(w_t, f8), e * k * n * 3),
        ("quantize_experts_bwd W", lambda: moe_fp8_ext.quantize_experts_bwd(w_t, f8), lambda: ref.quantize_experts_bwd(w_t, f8), e * k * n * 3),
        ("quantize_jagged_colwise_dual", lambda: moe_fp8_ext.quantize_jagged_colwise_dual(go, a, offs, f8),
         lambda: ref.quantize_jagged_colwise_dual(go, a, offs, f8), m * (k + n) * 3),
    ]
    print(f"{'op':<30} {'bit-exact':>9} {'ms':>9} {'GB/s':>8}")
    ok = True
    for name, fn, spec, nbytes in cases:
        same = _same(fn(), spec())
        ok &= same
        ms = _time_ms(fn, device, args.iters)
        print(f"{name:<30} {'yes' if same else 'NO':>9} {ms:9.3f} {nbytes / ms / 1e6:8.0f}")
    print("\nall ops match the reference" if ok else "\nMISMATCH against the reference: please report it")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
