"""python -m moe_fp8_ext: train an MoE expert layer in bf16 and in fp8.

Trains a ``moe_fp8_ext.GroupedExperts`` layer (the SwiGLU experts, torchtitan's layout
and forward) on a regression task in bf16 and with one fp8 recipe, on the GPU if there is one at a
DeepSeek-V3 expert shape per GPU (32768 routed tokens, dim 7168, hidden 2048, 8 local
experts; else on the CPU at a small size, with an fp32 baseline), with a router's
unaligned token groups, ``loss.backward()`` into fresh gradients and an AdamW step, and
prints the step time and peak memory of each, the speedup, the final losses and the
SQNR of one fp8 forward against the baseline. ``--recipe`` picks the fp8 recipe (fp8_rowwise, fp8_blockwise, mxfp8).
`--check` instead runs the quantization, SwiGLU and token-group ops of every recipe
at that shape and verifies them bit for bit against moe_fp8_ext.reference, with
timings.
"""

import argparse
import sys
import time

import torch

import moe_fp8_ext
from moe_fp8_ext import reference as ref
from moe_fp8_ext.token_groups import router_counts


def _time_ms(fn, device, iters):
    fn()
    if device == "cuda":
        torch.cuda.synchronize()  # host-sync-ok: the demo times and prints
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()  # host-sync-ok: the demo times and prints
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1000 / iters


def _same(out, want):
    for o, w in zip(out, want):
        if o.dtype == torch.float32:
            if not torch.equal(o.cpu(), w.cpu()):  # host-sync-ok: the demo times and prints
                return False
        elif o.stride() != w.stride() or not torch.equal(o.view(torch.uint8).cpu(), w.view(torch.uint8).cpu()):  # host-sync-ok: the demo times and prints
            return False
    return True


def _train(recipe, device, dtype, tokens, dim, hidden, experts, steps, counts, label):
    torch.manual_seed(0)
    model = moe_fp8_ext.GroupedExperts(dim, hidden, experts, recipe=recipe, reuse_weights=False, dtype=dtype,
                                       device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator(device=device).manual_seed(1)
    teacher = torch.randn(dim, dim, device=device, generator=g) / dim**0.5
    times, loss = [], None
    tty = sys.stdout.isatty()
    if device == "cuda":
        torch.cuda.synchronize()  # host-sync-ok: the demo times and prints
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for step in range(steps):
        x = torch.randn(tokens, dim, device=device, generator=g)
        y = torch.tanh(x @ teacher)
        if device == "cuda":
            torch.cuda.synchronize()  # host-sync-ok: the data (an fp32 GEMM) is not part of the timed step
        t0 = time.perf_counter()
        out = model(x.to(dtype), counts)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()  # host-sync-ok: the demo times and prints
        times.append(time.perf_counter() - t0)
        # A terminal gets one progress line redrawn in place; a log (pipe, file, CI)
        # gets a plain line every tenth of the run instead of one "\r" line per step.
        if step % max(1, steps // (50 if tty else 10)) == 0 or step == steps - 1:
            done = (step + 1) * 30 // steps
            line = f"  {label:<14} [{'#' * done}{'.' * (30 - done)}] {step + 1}/{steps} loss {loss.item():.4f}"  # host-sync-ok: the demo times and prints
            print("\r" + line if tty else line, end="" if tty else "\n", flush=True)
    if tty:
        print()
    step_ms = 1000 * sorted(times[steps // 5:])[len(times[steps // 5:]) // 2]  # median after warm-up
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else None
    return model, step_ms, loss.item(), peak  # host-sync-ok: the demo times and prints


def train_demo(args):
    device = args.device or ("cuda" if torch.cuda.is_available() and moe_fp8_ext.build_info()["cuda"] else "cpu")
    gpu = device == "cuda"
    tokens, dim, hidden = args.tokens or (32768 if gpu else 512), args.hidden or (7168 if gpu else 64), args.ffn or (2048 if gpu else 128)
    experts, steps = args.experts, args.steps or (100 if gpu else 60)
    # bf16 on a GPU; on the CPU the baseline is fp32 (bf16 grouped GEMMs are not
    # available on every CPU) and the fp8 run quantizes the same fp32 activations.
    dtype = torch.bfloat16 if gpu else torch.float32
    where = torch.cuda.get_device_name() if gpu else "the CPU (no GPU found: small sizes, fp32 baseline)"
    print(f"moe_fp8_ext: training an MoE expert FFN on {where}")
    print(f"tokens={tokens} dim={dim} hidden={hidden} experts={experts} steps={steps}; "
          f"{args.recipe} GEMM path: {moe_fp8_ext.grouped_mm_backend(device, args.recipe)}\n")
    counts = router_counts(tokens, experts).to(device)  # tokens per expert, as a router gives them
    base_name = "bf16" if gpu else "fp32"
    fp8 = args.recipe
    m_base, t_base, l_base, p_base = _train("bf16", device, dtype, tokens, dim, hidden, experts, steps, counts, base_name)
    m_fp8, t_fp8, l_fp8, p_fp8 = _train(fp8, device, dtype, tokens, dim, hidden, experts, steps, counts, fp8)
    with torch.no_grad():
        x = torch.randn(tokens, dim, device=device).to(dtype)
        m_fp8.load_state_dict(m_base.state_dict())
        ref_out, fp8_out = m_base(x, counts).float(), m_fp8(x, counts).float()
        sqnr = (20 * torch.log10(ref_out.norm() / (ref_out - fp8_out).norm())).item()  # host-sync-ok: the demo times and prints

    def mib(p):
        return "n/a" if p is None else f"{p:.0f}"

    print(f"\n{'recipe':<14} {'step ms':>9} {'peak MiB':>9} {'final loss':>11}")
    print(f"{base_name:<14} {t_base:9.2f} {mib(p_base):>9} {l_base:11.4f}")
    print(f"{fp8:<14} {t_fp8:9.2f} {mib(p_fp8):>9} {l_fp8:11.4f}")
    print(f"\nspeedup {t_base / t_fp8:.2f}x; SQNR of one fp8 forward against {base_name}: {sqnr:.1f} dB"
          + ("" if gpu else " (peak memory is measured on a GPU only)"))
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m moe_fp8_ext", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="verify the ops of every recipe against the reference instead")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 100 on a GPU, 60 on the CPU)")
    p.add_argument("--tokens", type=int, default=None, help="routed tokens M (default 32768 training / 16384 --check on a GPU)")
    p.add_argument("--hidden", type=int, default=None, help="model dim (default 7168 on a GPU)")
    p.add_argument("--ffn", type=int, default=None, help="expert hidden dim (default 2048 on a GPU)")
    p.add_argument("--experts", type=int, default=8, help="experts E (default 8)")
    p.add_argument("--fp8-dtype", choices=["e4m3fn", "e4m3fnuz"], default=None, help="fp8 dtype of --check (default: the platform's)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--iters", type=int, default=20, help="timing iterations for --check")
    p.add_argument("--recipe", choices=["fp8_rowwise", "fp8_blockwise", "mxfp8"], default="fp8_rowwise",
                   help="the fp8 recipe trained against the baseline (default fp8_rowwise)")
    args = p.parse_args(argv)
    if not args.check:
        return train_demo(args)

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
    w = torch.randn(e, n, k, device=device, dtype=torch.bfloat16) * 0.02
    w_t = w.transpose(1, 2)
    h13 = torch.randn(m, 2 * n, device=device, dtype=torch.bfloat16)
    sizes = torch.full((e,), m // e, dtype=torch.int32)
    sizes[-1] += m - int(sizes.sum())
    offs = torch.cumsum(sizes, 0).to(torch.int32).to(device)
    starts = moe_fp8_ext.padded_group_offsets(offs, m, 128)[0]  # (any group sizes: the padded layouts)
    cases = [
        ("quantize_rowwise A", lambda: moe_fp8_ext.quantize_rowwise(a, f8), lambda: ref.quantize_rowwise(a, f8), m * k * 3),
        ("quantize_experts_fwd W", lambda: moe_fp8_ext.quantize_experts_fwd(w_t, f8), lambda: ref.quantize_experts_fwd(w_t, f8), e * k * n * 3),
        ("quantize_experts_bwd W", lambda: moe_fp8_ext.quantize_experts_bwd(w_t, f8), lambda: ref.quantize_experts_bwd(w_t, f8), e * k * n * 3),
        ("quantize_jagged_colwise_dual", lambda: moe_fp8_ext.quantize_jagged_colwise_dual(go, a, offs, f8),
         lambda: ref.quantize_jagged_colwise_dual(go, a, offs, f8), m * (k + n) * 3),
        ("blockwise_act_lhs A", lambda: moe_fp8_ext.quantize_blockwise_act_lhs(a, f8),
         lambda: ref.quantize_blockwise_act_lhs(a, f8), m * k * 3),
        ("blockwise_act_rhs A, groups", lambda: moe_fp8_ext.quantize_blockwise_act_rhs(a, f8, offs, starts, 128),
         lambda: ref.quantize_blockwise_act_rhs(a, f8, offs, 128), m * k * 3),
        ("blockwise_weight_rhs W", lambda: moe_fp8_ext.quantize_blockwise_weight_rhs(w, f8),
         lambda: ref.quantize_blockwise_weight_rhs(w, f8), e * k * n * 3),
        ("blockwise_weight_transposed W", lambda: moe_fp8_ext.quantize_blockwise_weight_transposed_rhs(w, f8),
         lambda: ref.quantize_blockwise_weight_transposed_rhs(w, f8), e * k * n * 3),
        ("mxfp8_rowwise A", lambda: moe_fp8_ext.quantize_mxfp8_rowwise(a),
         lambda: ref.quantize_mxfp8_rowwise(a), m * k * 3),
        ("mxfp8_colwise A, groups", lambda: moe_fp8_ext.quantize_mxfp8_colwise(a, "rceil", True, offs, starts, 128),
         lambda: ref.quantize_mxfp8_colwise_padded(a, offs, 128, "rceil", True), m * k * 3),
        ("mxfp8_experts W", lambda: moe_fp8_ext.quantize_mxfp8_experts(w_t, blocked=True),
         lambda: ref.quantize_mxfp8_experts(w_t, blocked=True), e * k * n * 3),
        ("swiglu_quantize_rowwise", lambda: moe_fp8_ext.swiglu_quantize_rowwise(h13, f8),
         lambda: ref.swiglu_quantize_rowwise(h13, f8), m * n * 5),
        ("swiglu_backward", lambda: (moe_fp8_ext.swiglu_backward(go, h13),),
         lambda: (ref.swiglu_backward(go, h13),), m * n * 10),
        ("pad_token_groups A", lambda: moe_fp8_ext.pad_token_groups(a, offs, 128),
         lambda: ref.pad_token_groups(a, offs, 128), m * k * 4),
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
