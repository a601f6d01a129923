"""What weight reuse buys per micro-batch (moe_fp8_ext.experts, fp8_rowwise): the wall
time of a forward + backward without a cache, of one that hits the cache for every
weight, of one that requantizes every weight (the first micro-batch after an optimizer
step), and of 4 micro-batches per weight update, on the issue-15 shapes.

  python scripts/reuse_experts.py [tokens dim hidden experts]
"""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/bench")
from bench_experts import SHAPES, bf16_layer, problem  # noqa: E402
from common import bench_us  # noqa: E402

from moe_fp8_ext.experts import WeightCache, experts  # noqa: E402


def main():
    shapes = [tuple(int(v) for v in sys.argv[1:5])] if len(sys.argv) >= 5 else SHAPES
    for shape in shapes:
        x, w1, w3, w2, offs, grad = problem(*shape)
        params = (x, w1, w3, w2)
        cache = WeightCache()

        def call(**kw):
            return lambda: torch.autograd.grad(experts(x, w1, w3, w2, offs, **kw), params, grad)

        def bump():  # what an optimizer step does to the version counters, without its kernels
            for w in (w1, w3, w2):
                torch.autograd.graph.increment_version(w)

        cached = call(weight_cache=cache)

        def miss():
            bump()
            cached()

        def four():
            bump()
            for _ in range(4):
                cached()

        t = {"bf16": bench_us(lambda: torch.autograd.grad(bf16_layer(x, w1, w3, w2, offs), params, grad)),
             "no cache": bench_us(call()), "all hits": bench_us(cached), "requantizing": bench_us(miss),
             "4 micro-batches, per call": bench_us(four) / 4}
        print(f"{shape} ({torch.cuda.get_device_name()}): " +
              ", ".join(f"{k} {v / 1000:.2f} ms ({t['bf16'] / v:.2f}x)" for k, v in t.items()))
        del x, w1, w3, w2, grad, cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
