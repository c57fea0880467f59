"""gloo's bf16/f16 all_reduce error against the float64 sum (issue 39). Usage: gloo16.py world n"""
import os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

def inputs(r, n):
    i = torch.arange(n, dtype=torch.int64)
    h = (i * 2654435761 + (r + 1) * 40503 * 97 + 12345) % (1 << 32)
    return (h.double() / 2**32) * 2.0 - 1.0

def ulp(x, dt):
    # spacing of the 16-bit type at |x|
    m = 8 if dt == torch.bfloat16 else 11
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    e = e.clamp_min(-126 if dt == torch.bfloat16 else -14)
    return torch.pow(2.0, e - (m - 1))

def run(rank, world, n, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for dt in (torch.bfloat16, torch.float16):
        xs = [inputs(r, n).to(dt) for r in range(world)]
        exact = sum(x.double() for x in xs)
        t = xs[rank].clone()
        dist.all_reduce(t)
        once = exact.to(dt)
        mag = sum(x.double().abs() for x in xs)
        u = 2.0 ** (-8 if dt == torch.bfloat16 else -11)
        rel = (t.double() - exact).abs() / mag / u
        big = exact.abs() >= 0.25
        err = ((t.double() - exact).abs() / ulp(exact, dt))[big]
        if rank == 0:
            print(f"gloo {str(dt)[6:]:9s} world {world} n {n}: differs from round-once {((t != once).double().mean().item())*100:.2f}%  "
                  f"max |err|/(u*sum|x|) {rel.max().item():.2f}  mean err {err.mean().item():.3f} ulp (|sum|>=0.25)", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    world, n = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(run, args=(world, n, 29700 + os.getpid() % 200), nprocs=world)
