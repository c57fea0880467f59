"""PyTorch's side of `cargo xtask bench-checkpoint` (issue 40): distributed checkpoint (DCP) save,
load and async save of a fully sharded GPT with its AdamW state, on CPU over gloo.

Usage: python torch_dcp.py DIR [world=2] [layers=8] [width=768] [rounds=3]

DIR must be a folder on a disk (not tmpfs): the checkpoints are written under it and removed at
the end. The model is the nanoGPT layout our GPT has (token and position embeddings, pre-norm
blocks of causal attention and a tanh-GELU MLP, final LayerNorm, head tied to the token
embedding; vocabulary 65, context 64, 4 heads), float32: 8 blocks of width 768 are about 57 M
parameters. Each block and then the root are wrapped with FSDP2's `fully_shard`; AdamW takes
one step so that its state exists (about 680 MB of weights and moments over the ranks). Then, per
round: `dcp.save` with the file-system writer (it fsyncs its files), `dcp.load` back into the same
state dict, and `dcp.async_save`, timing how long the call blocks the training thread and how
long until its future completes. One thread per rank. Rank 0 prints, per round:

  torch-dcp bytes B
  torch-dcp round R save_s S load_s L async_blocking_s A async_total_s T

B counts the tensors of the state dict across all ranks (each shard once).
"""
import math, os, shutil, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist, torch.multiprocessing as mp
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

VOCAB, CONTEXT, HEADS = 65, 64, 4


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(e, dim=2)
        split = lambda z: z.view(b, t, HEADS, e // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, e))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, layers, width):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(CONTEXT, width)
        self.h = nn.ModuleList(Block(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith("weight") and "ln_" not in name:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def local_bytes(sd):
    n = 0
    for v in sd.values():
        if isinstance(v, dict):
            n += local_bytes(v)
        elif torch.is_tensor(v):
            t = v.to_local() if isinstance(v, DTensor) else v
            n += t.numel() * t.element_size()
    return n


def run(rank, world, layers, width, rounds, root, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Gpt(layers, width)
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xy = torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=torch.Generator().manual_seed(rank))
    model(xy[:, :-1], xy[:, 1:]).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    mine = torch.tensor([local_bytes(msd) + local_bytes({"o": osd["state"]})], dtype=torch.int64)
    dist.all_reduce(mine)
    if rank == 0:
        print(f"torch-dcp bytes {mine.item()}", flush=True)
    for r in range(rounds):
        path = os.path.join(root, f"round{r}")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path)
        dist.barrier()
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=path)
        dist.barrier()
        load_s = time.perf_counter() - t0
        apath = path + "-async"
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=apath)
        blocking = time.perf_counter() - t0
        fut.result()
        dist.barrier()
        total = time.perf_counter() - t0
        if rank == 0:
            print(f"torch-dcp round {r} save_s {save_s:.3f} load_s {load_s:.3f} "
                  f"async_blocking_s {blocking:.3f} async_total_s {total:.3f}", flush=True)
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(apath, ignore_errors=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: torch_dcp.py DIR [world] [layers] [width] [rounds]")
    root = sys.argv[1]
    world, layers, width, rounds = ([int(a) for a in sys.argv[2:]] + [2, 8, 768, 3][len(sys.argv) - 2:])[:4]
    os.makedirs(root, exist_ok=True)
    port = 29500 + os.getpid() % 1000
    mp.spawn(run, args=(world, layers, width, rounds, root, port), nprocs=world)
