#!/usr/bin/python3
"""The PyTorch twin of examples/train_c2f.cpp: the same small model trained the same way, step for step.

    /usr/bin/python3 examples/train_c2f.py --out /tmp/train_c2f --cpp build/release/examples/train_c2f \
        [--steps 100] [--plot docs/train_c2f_loss.png]

1. Makes a synthetic long-range classification task (fixed seed, numpy): sequences of L = 64 tokens of 8
   features, N(0, 0.3²) noise; the first token carries a marker a = ±2 in features 0–3 and the last token a
   marker b = ±2 in the same features; the class is 1 when a = b, else 0 — a relation between the two ends
   of the sequence (chunks 0 and 7), which no per-token map followed by mean pooling can see (the classes
   are balanced and each marker alone says nothing). The coarse stage's scores between the two chunks'
   means carry a·b.
2. Builds the model Linear(8 → 32) → C2FAttention(32, 4 heads, chunk 8; the article's module from
   tests/reference/c2f_reference.py, dropout 0) → mean over the tokens → Linear(32 → 2), initialised by
   torch's defaults from a fixed seed, and writes the task and the initial parameters (float64) to
   <out>/train_c2f_init.safetensors.
3. Trains it in float64 and in float32 (the float64 initial values rounded): each step cross-entropy on the
   whole training set (128 sequences), loss.backward(), clip_grad_norm_(max_norm 1), AdamW(lr 1e-3,
   weight_decay 0.01); the loss of every step (before its update) and the accuracies after the last step
   go to <out>/train_c2f_torch.safetensors.
4. With --cpp, runs the C++ example on <out>: it trains c2f's layers from the same initial parameters on the
   same data, prints both loss curves side by side and exits non-zero unless they agree (float64: every step
   within 1e-8 relative; float32: the last step within 1e-3); it writes c2f's curves to
   <out>/train_c2f_c2f.safetensors. This script exits with its status (77, skipped, without torch).
5. With --plot, draws the four curves (torch and c2f, float64 and float32) into the given PNG (matplotlib).
"""
import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "reference"))
sys.dont_write_bytecode = True
import safetensors_io as st  # noqa: E402

SEED = 2025
LENGTH, FEATURES, WIDTH, HEADS, CHUNK, CLASSES = 64, 8, 32, 4, 8, 2
TRAIN, TEST = 128, 256
# lr 1e-3: the float32 and float64 runs stay within 2e-6 of each other over 100 steps; at 2e-3 the model learns
# faster but the loss falls through a region where a rounding difference grows to 1e-1 (PyTorch against itself).
LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.01, 1.0
NOISE, MARKER = 0.3, 2.0


def make_task(rs: np.random.RandomState, n: int):
    """x [n, L, 8] float64 and the classes y [n] int64 (see the module docstring)."""
    x = NOISE * rs.standard_normal(size=(n, LENGTH, FEATURES))
    a = rs.choice([-1.0, 1.0], size=n)
    b = rs.choice([-1.0, 1.0], size=n)
    x[:, 0, 0:4] += MARKER * a[:, None]
    x[:, LENGTH - 1, 0:4] += MARKER * b[:, None]
    return x, (a == b).astype(np.int64)


def build_model(torch):
    import c2f_reference

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(FEATURES, WIDTH)
            self.attn = c2f_reference.C2FAttention(WIDTH, HEADS, chunk_size=CHUNK, dropout=0.0)
            self.head = torch.nn.Linear(WIDTH, CLASSES)

        def forward(self, x):
            return self.head(self.attn(self.embed(x)).mean(dim=1))

    return Model()


def train(torch, init, x, y, x_test, y_test, dtype, steps):
    """Loss per step (before the step's update) and the train and test accuracies after the last step."""
    model = build_model(torch).to(dtype)
    model.load_state_dict({k: torch.from_numpy(v).to(dtype) for k, v in init.items()}, strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    xt, yt = torch.from_numpy(x).to(dtype), torch.from_numpy(y)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xt), yt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        accuracy = [float((model(torch.from_numpy(a).to(dtype)).argmax(dim=1) == torch.from_numpy(b)).double().mean())
                    for a, b in ((x, y), (x_test, y_test))]
    return np.array(losses), accuracy


def plot(out: Path, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    torch_t, _ = st.load_file(out / "train_c2f_torch.safetensors")
    c2f_t, _ = st.load_file(out / "train_c2f_c2f.safetensors")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, tag in zip(axes, ("f64", "f32")):
        a, b = st.to_numpy(torch_t[f"loss_{tag}"]), st.to_numpy(c2f_t[f"loss_{tag}"])
        steps = np.arange(1, len(a) + 1)
        ax.plot(steps, a, label="PyTorch", linewidth=3, alpha=0.5)
        ax.plot(steps, b, label="c2f", linewidth=1.2, linestyle="--")
        ax.set_title(f"{'float64' if tag == 'f64' else 'float32'}: max relative difference "
                     f"{np.max(np.abs(a - b) / np.abs(a)):.1e}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("cross-entropy loss (training set)")
    fig.suptitle("examples/train_c2f: Linear -> C2FAttention -> mean -> Linear, AdamW + clip_grad_norm")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the task, the parameters and the curves")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--cpp", type=Path, help="the C++ example (build/.../examples/train_c2f) to run on --out")
    ap.add_argument("--plot", type=Path, help="PNG to draw the loss curves into (needs --cpp)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"SKIPPED: torch is not importable by {sys.executable} ({e}); use Debian's /usr/bin/python3")
        return 77
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)

    rs = np.random.RandomState(SEED)
    x, y = make_task(rs, TRAIN)
    x_test, y_test = make_task(rs, TEST)
    torch.manual_seed(SEED)
    init = {k: v.detach().double().numpy().copy() for k, v in build_model(torch).state_dict().items()}
    tensors = {f"init.{k}": st.from_numpy(v) for k, v in init.items()}
    tensors.update({"x": st.from_numpy(x), "y": st.from_numpy(y), "x_test": st.from_numpy(x_test),
                    "y_test": st.from_numpy(y_test)})
    meta = {"length": str(LENGTH), "features": str(FEATURES), "width": str(WIDTH), "heads": str(HEADS),
            "chunk": str(CHUNK), "classes": str(CLASSES), "lr": repr(LR), "weight_decay": repr(WEIGHT_DECAY),
            "max_norm": repr(MAX_NORM), "steps": str(args.steps)}
    st.save_file(args.out / "train_c2f_init.safetensors", tensors, meta)

    curves = {}
    for tag, dtype in (("f64", torch.float64), ("f32", torch.float32)):
        losses, (acc_train, acc_test) = train(torch, init, x, y, x_test, y_test, dtype, args.steps)
        curves[f"loss_{tag}"] = st.from_numpy(losses)
        curves[f"accuracy_{tag}"] = st.from_numpy(np.array([acc_train, acc_test]))
        print(f"PyTorch {tag}: loss {losses[0]:.6f} -> {losses[-1]:.6f}, accuracy train {acc_train:.3f} "
              f"test {acc_test:.3f}")
    st.save_file(args.out / "train_c2f_torch.safetensors", curves, {"steps": str(args.steps)})

    if args.cpp is None:
        return 0
    status = subprocess.run([str(args.cpp), str(args.out)]).returncode
    if args.plot is not None and status == 0:
        plot(args.out, args.plot)
    return status


if __name__ == "__main__":
    sys.exit(main())
