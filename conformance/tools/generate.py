#!/usr/bin/env python3
"""Generates conformance vectors for world sizes 3 and 4 from the collectives' math (no PyTorch
needed): every function, every differentiable op, ties, uneven splits, subgroups with renumbered
ranks. Independent of the Rust implementation, so it cross-checks it.

    python3 conformance/tools/generate.py conformance/

writes functional-w3.json and functional-w4.json (format: conformance/README.md).
"""
import json
import sys
from functools import reduce as fold


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def weight(rank, shape, k):
    return [((i % 7) + 1) * (rank + 1) + 0.25 * k for i in range(numel(shape))]


def T(shape, data):
    assert len(data) == numel(shape)
    return {"shape": list(shape), "data": [float(v) for v in data]}


def zeros(shape):
    return T(shape, [0.0] * numel(shape))


def op_apply(op, cols):
    if op == "sum":
        return sum(cols)
    if op == "avg":
        return sum(cols) / len(cols)
    if op == "max":
        return max(cols)
    if op == "min":
        return min(cols)
    if op == "product":
        return fold(lambda a, b: a * b, cols, 1.0)
    raise ValueError(op)


def route(op, g, xs, r, i):
    """Adjoint for element i of member index r: g = summed upstream gradient there."""
    W = len(xs)
    cols = [x[i] for x in xs]
    if op == "sum":
        return g
    if op == "avg":
        return g / W
    if op in ("max", "min"):
        y = op_apply(op, cols)
        holders = [c == y for c in cols]
        return g / sum(holders) if holders[r] else 0.0
    if op == "product":
        return g * fold(lambda a, b: a * b, [c for k, c in enumerate(cols) if k != r], 1.0)
    raise ValueError(op)


class Gen:
    def __init__(self, world):
        self.world = world
        self.records = []

    def add(self, case, fn, members, params_of, inputs, outputs, grads, compare=None, group=True):
        for gi, rank in enumerate(members):
            rec = {
                "case": case,
                "fn": fn,
                "world": self.world,
                "rank": rank,
                "params": params_of(gi),
                "inputs": inputs[gi],
                "outputs": outputs[gi],
                "grads": grads[gi],
                "compare_outputs": True if compare is None else compare(gi),
            }
            if members != list(range(self.world)):
                rec["group"] = members
            self.records.append(rec)


def data(rank, n, salt=0, tie=False):
    # distinct values across ranks (no ties) unless tie: then element 0 is the same everywhere
    v = [(rank + 1) * 1.5 + i * 0.25 + salt - (i % 3) * (rank + 1) * 0.75 for i in range(n)]
    if tie:
        v[0] = 4.0
        if n > 2:
            v[2] = -1.0
    return v


def gen_world(W):
    G = Gen(W)
    all_members = list(range(W))
    subs = [all_members]
    if W >= 3:
        subs.append(list(range(1, W)))  # renumbered: global 1 is group rank 0
    if W == 4:
        subs.append([0, 2])
        subs.append([3, 1])  # group rank order differs from global order
    shape = [2, 3]
    n = numel(shape)
    for members in subs:
        M = len(members)
        tag = "" if members == all_members else "_g" + "".join(map(str, members))
        xs = [data(r, n) for r in members]
        xin = [[T(shape, x)] for x in xs]
        # broadcast
        for si, src in enumerate(members):
            outs = [[T(shape, xs[si])] for _ in members]
            gsum = [sum(weight(m, shape, 0)[i] for m in members) for i in range(n)]
            grads = [[T(shape, gsum if gi == si else [0.0] * n)] for gi in range(M)]
            G.add(f"broadcast{tag}_src{src}", "broadcast", members, lambda gi, s=src: {"src": s}, xin, outs, grads)
        # all_reduce, reduce with every op (and ties)
        for op in ["sum", "avg", "max", "min", "product"]:
            for tie in ([False, True] if op in ("max", "min") else [False]):
                xt = [data(r, n, tie=tie) for r in members]
                xi = [[T(shape, x)] for x in xt]
                y = [op_apply(op, [x[i] for x in xt]) for i in range(n)]
                suffix = "_tied" if tie else ""
                gsum = [sum(weight(m, shape, 0)[i] for m in members) for i in range(n)]
                grads = [[T(shape, [route(op, gsum[i], xt, gi, i) for i in range(n)])] for gi in range(M)]
                G.add(f"all_reduce{tag}_{op}{suffix}", "all_reduce", members, lambda gi, o=op: {"op": o},
                      xi, [[T(shape, y)] for _ in members], grads)
                for di, dst in enumerate(members):
                    gd = weight(dst, shape, 0)
                    grads = [[T(shape, [route(op, gd[i], xt, gi, i) for i in range(n)])] for gi in range(M)]
                    outs = [[T(shape, y if gi == di else [0.0] * n)] for gi in range(M)]
                    G.add(f"reduce{tag}_{op}{suffix}_dst{dst}", "reduce", members,
                          lambda gi, o=op, d=dst: {"dst": d, "op": o}, xi, outs, grads,
                          compare=lambda gi, d=di: gi == d)
        # all_gather with uneven first dimensions
        shapes = [[gi + 1, 2] for gi in range(M)]
        xu = [data(r, numel(shapes[gi]), salt=1) for gi, r in enumerate(members)]
        outs = [[T(shapes[k], xu[k]) for k in range(M)] for _ in members]
        grads = [[T(shapes[gi], [sum(weight(m, shapes[gi], gi)[i] for m in members) for i in range(numel(shapes[gi]))])]
                 for gi in range(M)]
        G.add(f"all_gather_uneven{tag}", "all_gather", members, lambda gi: {},
              [[T(shapes[gi], xu[gi])] for gi in range(M)], outs, grads)
        # gather
        for di, dst in enumerate(members):
            outs = [[T(shape, xs[k]) if gi == di else zeros(shape) for k in range(M)] for gi in range(M)]
            grads = [[T(shape, weight(dst, shape, gi))] for gi in range(M)]
            G.add(f"gather{tag}_dst{dst}", "gather", members, lambda gi, d=dst: {"dst": d}, xin, outs, grads)
        # scatter: src holds M tensors, receivers pass placeholders
        for si, src in enumerate(members):
            lists = [[data(members[si], n, salt=10 * i) for i in range(M)] if gi == si else
                     [[0.5] * n for _ in range(M)] for gi in range(M)]
            inputs = [[T(shape, v) for v in lists[gi]] for gi in range(M)]
            outs = [[T(shape, lists[si][gi])] for gi in range(M)]
            grads = [[T(shape, weight(members[i], shape, 0)) if gi == si else zeros(shape) for i in range(M)]
                     for gi in range(M)]
            G.add(f"scatter{tag}_src{src}", "scatter", members, lambda gi, s=src: {"src": s}, inputs, outs, grads)
        # reduce_scatter with every op
        for op in ["sum", "avg", "max", "min", "product"]:
            for tie in ([False, True] if op in ("max", "min") else [False]):
                lists = [[data(r, n, salt=3 * i, tie=tie) for i in range(M)] for r in members]
                inputs = [[T(shape, v) for v in lists[gi]] for gi in range(M)]
                outs = [[T(shape, [op_apply(op, [lists[m][gi][e] for m in range(M)]) for e in range(n)])]
                        for gi in range(M)]
                grads = []
                for gi in range(M):
                    gl = []
                    for i in range(M):
                        g = weight(members[i], shape, 0)
                        col = [lists[m][i] for m in range(M)]
                        gl.append(T(shape, [route(op, g[e], col, gi, e) for e in range(n)]))
                    grads.append(gl)
                suffix = "_tied" if tie else ""
                G.add(f"reduce_scatter{tag}_{op}{suffix}", "reduce_scatter", members,
                      lambda gi, o=op: {"op": o}, inputs, outs, grads)
        # all_to_all with a shape per (sender, receiver) pair
        pshape = lambda s, d: [1 + (s + 2 * d) % 3]
        lists = [[data(members[s], numel(pshape(s, d)), salt=d) for d in range(M)] for s in range(M)]
        inputs = [[T(pshape(s, d), lists[s][d]) for d in range(M)] for s in range(M)]
        outs = [[T(pshape(j, r), lists[j][r]) for j in range(M)] for r in range(M)]
        grads = [[T(pshape(r, j), weight(members[j], pshape(r, j), r)) for j in range(M)] for r in range(M)]
        G.add(f"all_to_all_uneven{tag}", "all_to_all", members, lambda gi: {}, inputs, outs, grads)
        # all_to_all_single: equal splits (None) and uneven splits with zeros
        for kind in ["even", "uneven"]:
            if kind == "even":
                ins = [[2] * M for _ in range(M)]
                params = lambda gi: {}
            else:
                ins = [[(s + 2 * d) % 3 for d in range(M)] for s in range(M)]
                params = lambda gi, ins=ins: {"input_split_sizes": ins[gi],
                                               "output_split_sizes": [ins[j][gi] for j in range(M)]}
            cols = 2
            xrows = [data(members[s], sum(ins[s]) * cols, salt=7) for s in range(M)]
            def block(s, d):
                start = sum(ins[s][:d]) * cols
                return xrows[s][start:start + ins[s][d] * cols]
            outs, grads = [], []
            for r in range(M):
                y = sum((block(j, r) for j in range(M)), [])
                outs.append([T([len(y) // cols, cols], y)])
            for s in range(M):
                g = []
                for d in range(M):
                    # rows of s's block d sit in d's output after the blocks from ranks < s
                    yrows = sum(ins[j][d] for j in range(M))
                    w = weight(members[d], [yrows, cols], 0)
                    off = sum(ins[j][d] for j in range(s)) * cols
                    g += w[off:off + ins[s][d] * cols]
                grads.append([T([sum(ins[s]), cols], g)])
            G.add(f"all_to_all_single_{kind}{tag}", "all_to_all_single", members, params,
                  [[T([sum(ins[s]), cols], xrows[s])] for s in range(M)], outs, grads)
    return G.records


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    for W in (3, 4):
        recs = gen_world(W)
        with open(f"{out}/functional-w{W}.json", "w") as f:
            json.dump(recs, f)
        print(f"functional-w{W}.json: {len(recs)} records")
