#!/usr/bin/python3
"""A PyTorch model before and after c2f.torch.accelerate: the same outputs, in less time.

    PYTHONPATH=build/release-native/python /usr/bin/python3 examples/python/accelerate.py [--length 4096]

The model reads a long sequence of 64 features: a linear embedding to d = 512, a
torch.nn.TransformerEncoderLayer (8 heads: its self_attn is an nn.MultiheadAttention), the coarse-to-fine
attention article's C2FAttention (chunk 32, tests/reference/c2f_reference.py) with a residual and a
LayerNorm, and a linear head. accelerate() swaps c2f's layers in for the two attention modules (on the same
weights); everything else stays PyTorch. Both run float32 on C2F_BENCH_THREADS threads (default 2),
batch 1, under torch.inference_mode(); the times are medians of --reps runs after a warm-up.
"""

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "reference"))
try:
    import c2f  # noqa: F401  (PYTHONPATH, or an installed module)
except ImportError:  # a build of this checkout
    for preset in ("release-native", "release", "dev"):
        if (REPO / "build" / preset / "python" / "c2f").is_dir():
            sys.path.insert(0, str(REPO / "build" / preset / "python"))
            break

try:
    import torch
    import torch.nn as nn
except ImportError:
    print("accelerate.py needs PyTorch (Debian: python3-torch); skipped")
    sys.exit(77)

import c2f.torch  # noqa: E402
from c2f_reference import C2FAttention  # noqa: E402


class LongSequenceModel(nn.Module):
    def __init__(self, features=64, d=512, heads=8, chunk=32):
        super().__init__()
        self.embed = nn.Linear(features, d)
        self.encoder = nn.TransformerEncoderLayer(d, heads, dim_feedforward=1024, batch_first=True)
        self.c2f = C2FAttention(d, heads, chunk_size=chunk)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        h = self.encoder(self.embed(x))
        return self.head(self.norm(h + self.c2f(h)))


def median_seconds(model, x, reps):
    model(x)  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=4096, help="sequence length")
    p.add_argument("--reps", type=int, default=5, help="timed runs (median)")
    args = p.parse_args()
    threads = int(os.environ.get("C2F_BENCH_THREADS", "2"))
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LongSequenceModel().eval()
    fast = c2f.torch.accelerate(copy.deepcopy(model), num_threads=threads)
    x = torch.randn(1, args.length, 64)
    print(f"c2f {c2f.__file__}; torch {torch.__version__}; {threads} threads; x {tuple(x.shape)}")
    print("replaced by c2f: " + ", ".join(f"{name} ({type(fast.get_submodule(name)).__name__})"
                                          for name in c2f.torch.accelerated(fast)))
    with torch.inference_mode():
        before, after = model(x), fast(x)
        delta = (after - before).abs().max().item()
        t_before, t_after = median_seconds(model, x, args.reps), median_seconds(fast, x, args.reps)
    print(f"max |after - before| = {delta:.3g} (outputs up to {before.abs().max().item():.3g})")
    print(f"PyTorch: {1e3 * t_before:.1f} ms, accelerated: {1e3 * t_after:.1f} ms, speed-up {t_before / t_after:.2f}x")
    if delta > 1e-5:
        sys.exit("accelerate.py: the outputs differ by more than 1e-5")


if __name__ == "__main__":
    main()
