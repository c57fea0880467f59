"""The PyTorch twin of `gpt_distributed`'s model, data and recipe. `cargo xtask bench-core` runs
its `step` mode beside our `gpt_step` bench; `train` is the job's single-process run.

Usage:
  python benchmarks/torch_gpt.py step           # one thread: microseconds per training step
  python benchmarks/torch_gpt.py train [STEPS] [SEED]  # the single-process run: validation loss

The model is nanoGPT's layout (token + position embedding, pre-norm blocks of causal
self-attention and a tanh-GELU MLP, final LayerNorm, head tied to the token embedding) with
4 layers, width 128, 4 heads, context 64, float32, dropout 0, GPT-2's initialisation. The data
is crates/tensorplay-models/data/tinyshakespeare.txt, split 90/10, with the same batch offsets as the
Rust job (the rule of docs/models.md, "Batches", in gpt_batches.py); AdamW (lr 1e-3, betas 0.9/0.99, weight decay 0.01 on every
parameter), 100 warm-up steps, cosine decay to a tenth. The initial weights differ (PyTorch's
generator), so losses are compared as values, not step by step.
"""
import math, os, statistics, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt_batches import TRAIN, VALIDATION, offset

BATCH, CONTEXT, WARMUP, VAL_BATCHES = 16, 64, 100, 16
N_LAYER, N_HEAD, N_EMBD = 4, 4, 128


def batch(data, seed, stream, step, rows):
    """Batch `step` of `stream` (TRAIN or VALIDATION): the offsets of docs/models.md's rule."""
    at = [offset(len(data) - CONTEXT, seed, stream, step, r) for r in range(rows)]
    return (torch.stack([data[a:a + CONTEXT] for a in at]),
            torch.stack([data[a + 1:a + CONTEXT + 1] for a in at]))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.attn_proj = nn.Linear(N_EMBD, N_EMBD)
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.mlp_proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(e, dim=2)
        heads = lambda z: z.view(b, t, N_HEAD, e // N_HEAD).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, e))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, N_EMBD)
        self.wpe = nn.Embedding(CONTEXT, N_EMBD)
        self.h = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(N_EMBD)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * N_LAYER))
            elif name.endswith("weight") and "ln_" not in name:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def loss(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def load():
    here = os.path.dirname(os.path.abspath(__file__))
    raw = open(os.path.join(here, "..", "crates", "tensorplay-models", "data", "tinyshakespeare.txt"), "rb").read()
    vocab = sorted(set(raw))
    table = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([table[c] for c in raw], dtype=torch.long)
    split = len(ids) * 9 // 10
    return vocab, ids[:split], ids[split:]


def optimizer(model, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01)
    def factor(e):
        if e < WARMUP:
            return (e + 1) / WARMUP
        p = min((e - WARMUP) / (steps - WARMUP), 1.0)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * p))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def main():
    torch.manual_seed(0)
    mode = sys.argv[1] if len(sys.argv) > 1 else "step"
    vocab, train, val = load()
    model = Gpt(len(vocab))
    if mode == "step":
        torch.set_num_threads(1)
        opt, _ = optimizer(model, 1000)
        x, y = batch(train, 0, TRAIN, 0, BATCH)
        def step():
            opt.zero_grad()
            model.loss(x, y).backward()
            opt.step()
        for _ in range(5):
            step()
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(10):
                step()
            runs.append((time.perf_counter() - t) / 10)
        print(f"torch-core gpt_step batch16x64  {statistics.median(runs) * 1e6:8.1f} us/step")
    elif mode == "train":
        steps = int(sys.argv[2]) if len(sys.argv) > 2 else 600
        seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
        torch.manual_seed(seed)
        model = Gpt(len(vocab))
        opt, sched = optimizer(model, steps)
        t = time.perf_counter()
        for s in range(steps):
            x, y = batch(train, seed, TRAIN, s, BATCH)
            opt.zero_grad()
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            sched.step()
        wall = time.perf_counter() - t
        with torch.no_grad():
            v = sum(model.loss(*batch(val, seed, VALIDATION, b, BATCH)).item() for b in range(VAL_BATCHES))
        print(f"pytorch: validation loss {v / VAL_BATCHES:.4f} ({steps} steps, seed {seed}, {wall:.1f} s, "
              f"{torch.get_num_threads()} threads)")
    else:
        sys.exit(f"unknown mode {mode!r}: step or train")


if __name__ == "__main__":
    main()
