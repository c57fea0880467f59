"""The batch offsets of `gpt_distributed`, written from the rule in docs/models.md ("Batches"),
standard library only. `torch_gpt.py` draws its batches with `offset`; `.ci/run` runs

    python3 benchmarks/gpt_batches.py --check crates/tensorplay-examples/data/gpt_batch_offsets.json

which recomputes the committed fixture (the first 64 training offsets at seed 0) from the text
and exits 1 naming the first offset that differs. The Rust job's test
`gpt_batch_offsets_match_the_fixture` reads the same fixture, so both sides draw the same batches.
`--write PATH` makes the fixture anew.
"""
import json, os, sys

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
CONTEXT = 64
BATCH = 16
# the streams of the rule: training batches and validation batches
TRAIN, VALIDATION = 0, 1


def mix(z):
    """splitmix64's finaliser: a bijection of 64-bit words."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def word(seed, stream, step, row, attempt):
    """The 64-bit word for (seed, stream, step, row, attempt): each field absorbed in turn."""
    h = 0
    for x in (seed, stream, step, row, attempt):
        h = mix(((h ^ x) + GOLDEN) & MASK)
    return h


def offset(n, seed, stream, step, row):
    """The offset in 0..n of row `row` of batch `step` of `stream`, without modulo bias."""
    if not 0 < n < (1 << 64):
        raise ValueError(f"n must be in 1..2^64, got {n}")
    zone = (1 << 64) - ((1 << 64) % n)
    attempt = 0
    while True:
        w = word(seed, stream, step, row, attempt)
        if w < zone:
            return w % n
        attempt += 1


def train_positions(text_len):
    """The number of valid offsets in the training split of a text of `text_len` bytes."""
    return text_len * 9 // 10 - CONTEXT


def fixture(text_len, seed=0, count=64):
    n = train_positions(text_len)
    offsets = [offset(n, seed, TRAIN, i // BATCH, i % BATCH) for i in range(count)]
    return {
        "rule": "docs/models.md, Batches",
        "seed": seed,
        "stream": TRAIN,
        "rows_per_step": BATCH,
        "positions": n,
        "offsets": offsets,
    }


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    text = os.path.join(here, "..", "crates", "tensorplay-models", "data", "tinyshakespeare.txt")
    text_len = os.path.getsize(text)
    if len(sys.argv) != 3 or sys.argv[1] not in ("--check", "--write"):
        sys.exit("usage: gpt_batches.py --check FIXTURE | --write FIXTURE")
    want = fixture(text_len)
    if sys.argv[1] == "--write":
        with open(sys.argv[2], "w") as f:
            json.dump(want, f, indent=1)
            f.write("\n")
        return
    try:
        with open(sys.argv[2]) as f:
            got = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"gpt_batches: cannot read the fixture {sys.argv[2]}: {e}")
    if not isinstance(got, dict):
        sys.exit(f"gpt_batches: the fixture is a JSON {type(got).__name__}, expected an object")

    def whole(v):
        # a JSON whole number: not a float, not a bool (True == 1 in Python)
        return isinstance(v, int) and not isinstance(v, bool)

    for key in ("seed", "stream", "rows_per_step", "positions"):
        if key not in got:
            sys.exit(f"gpt_batches: the fixture has no {key!r}")
        if not whole(got[key]) or got[key] != want[key]:
            sys.exit(f"gpt_batches: fixture {key} is {got[key]!r}, the rule gives {want[key]}")
    offsets = got.get("offsets")
    if not isinstance(offsets, list):
        sys.exit(f"gpt_batches: fixture offsets is {offsets!r}, expected a list of 64 offsets")
    if len(offsets) != len(want["offsets"]):
        sys.exit(f"gpt_batches: fixture has {len(offsets)} offsets, expected 64")
    for i, (g, w) in enumerate(zip(offsets, want["offsets"])):
        if not whole(g) or g != w:
            sys.exit(f"gpt_batches: offset {i} (step {i // BATCH}, row {i % BATCH}) is {g!r} "
                     f"in the fixture, the rule gives {w}")
    print(f"gpt_batches: the {len(offsets)} fixture offsets match the rule")


if __name__ == "__main__":
    main()
