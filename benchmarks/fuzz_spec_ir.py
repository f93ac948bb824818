"""A long fuzz run of the spec and IR front ends (CPU; outside CI): N random mutants of tests/data/toy.mtc and
of its printed graph IR, made and judged by tests/test_fuzz_spec_ir.py (mutate, outcome), counted by outcome:
parsed, MtcError located, MtcError without a location, timeout, other exception. The first few mutants of each
outcome other than parsed / located are printed (with their mutation list, to reproduce them).

    PYTHONPATH=. python benchmarks/fuzz_spec_ir.py --mutants 5000 --seed 0
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("fuzz_spec_ir", ROOT / "tests" / "test_fuzz_spec_ir.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutants", type=int, default=5000, help="mutants per text (spec, IR); default 5000")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=5, help="bad mutants shown per outcome")
    args = ap.parse_args(argv)
    fz = _fuzz_module()
    rng = random.Random(args.seed)
    rows = []
    bad = 0
    for kind, text in fz.seeds().items():
        counts, shown, t0 = Counter(), Counter(), time.time()
        for _ in range(args.mutants):
            ops = [(rng.choice(fz.KINDS), rng.randrange(2**20), rng.randrange(2**20))
                   for _ in range(rng.randint(1, 4))]
            got, detail = fz.outcome(kind, fz.mutate(text, ops))
            counts[got] += 1
            if got not in ("parsed", "located"):
                bad += 1
                if shown[got] < args.show:
                    shown[got] += 1
                    print(f"{kind} {got}: {detail}\n    ops = {ops!r}", file=sys.stderr)
        rows.append((kind, counts, time.time() - t0))
    print("| text | mutants | parsed | MtcError located | MtcError without location | timeout | other | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, c, secs in rows:
        print(f"| {kind} | {sum(c.values())} | {c['parsed']} | {c['located']} | {c['unlocated']} | {c['timeout']} "
              f"| {c['other']} | {secs:.0f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
