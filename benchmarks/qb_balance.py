"""Load balance of Quantile Balancing vs the fixed-step bias rule, on a strongly skewed router.

Setting (the K3 router): E = 896 experts, top-16, sigmoid router. Router logits of a token are
z @ W^T + skew with z ~ N(0, I_64), W ~ N(0, 1/64) per entry, and a strong per-expert skew
skew_j ~ N(0, 1.5^2) (fixed for the run): without balancing a few experts take most tokens.
Each step t draws a fresh batch of the same distribution, routes it with the current bias
(top-k of scores + bias; the load statistic), and then computes the next bias from batch t:
  QB        new_bias = qb_update(scores_t, bias, top_k=16, ema=0)   (spec/OPS.md)
  QB ema    the same with ema = 0.5
  QB warm   ema = 0 for the first 3 steps (converge from the skew), then ema = 0.5 (average out the
            sampling noise of one batch's quantile: with ema = 0 each step's bias carries one batch's
            quantile error, which alone leaves the load about sqrt(2) x the floor's excess)
  fixed     DeepSeek-V3's rule: bias += 1e-3 * sign(mean_load - load)   (arXiv 2412.19437)
  none      bias = 0 throughout
The metric is max/mean expert load of the batch. The floor is what sampling noise alone gives:
max/mean of a uniformly random router (16 distinct experts per token) on a batch of the same size
(about 1.20 at 16384 tokens, 1.09 at 65536). Target: QB within 5% of the floor within 10 steps, read here
as: from some step s <= 10 on, the mean max/mean load of the remaining steps is within 5% of the mean floor
(a single step dipping under 1.05x is sampling noise, not balance).

Runs on the CPU with the reference qb_update (backends/reference/moe.py); routing for the load
statistic uses torch.topk (ties have probability zero with these continuous scores).

Usage: python benchmarks/qb_balance.py [--quick] [--tokens 16384 65536] [--steps 20] [--seed S] [--out DIR]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from backends.reference import moe as ref  # noqa: E402

E, K, DZ = 896, 16, 64


def max_over_mean(idx, n):
    load = ref.expert_load(idx, E)
    return float(load.max()) / (n * K / E)


def uniform_floor(n, gen):
    idx = torch.rand(n, E, generator=gen).topk(K, dim=1).indices  # 16 distinct uniform experts
    return max_over_mean(idx, n)


def settled_step(rows, m, floor, within=1.05):
    """The first step s such that the mean of method m over steps s..end (at least 3 steps) is within
    ``within`` x the mean floor; None if there is none."""
    for s in range(0, len(rows) - 2):
        tail = [r[m] for r in rows[s:]]
        if sum(tail) / len(tail) <= within * floor:
            return s
    return None


def run(n, steps, gen, log):
    w = torch.randn(E, DZ, generator=gen) / DZ ** 0.5
    skew = torch.randn(E, generator=gen) * 1.5
    methods = ["none", "QB", "QB ema=0.5", "QB warm-up 3, ema=0.5", "fixed u=1e-3"]
    bias = {m: torch.zeros(E) for m in methods}
    rows = []
    for t in range(steps):
        z = torch.randn(n, DZ, generator=gen)
        scores = torch.sigmoid(z @ w.t() + skew)
        row = {"step": t, "floor": uniform_floor(n, gen)}
        for m in methods:
            idx = torch.topk(scores + bias[m], K, dim=1).indices
            row[m] = max_over_mean(idx, n)
            if m == "QB":
                bias[m] = ref.qb_update(scores, bias[m], top_k=K)
            elif m == "QB ema=0.5":
                bias[m] = ref.qb_update(scores, bias[m], top_k=K, ema=0.5)
            elif m == "QB warm-up 3, ema=0.5":
                bias[m] = ref.qb_update(scores, bias[m], top_k=K, ema=0.0 if t < 3 else 0.5)
            elif m == "fixed u=1e-3":
                bias[m] = ref.fixed_step_update(bias[m], ref.expert_load(idx, E), step=1e-3)
        rows.append(row)
        log(f"  N={n} step {t:2d}: " + "  ".join(f"{k_}={v:.3f}" for k_, v in row.items() if k_ != "step"))
    return methods, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536], help="batch sizes in tokens (default "
                    "16384 65536)")
    ap.add_argument("--steps", type=int, default=20, help="balancing steps per run (default 20)")
    ap.add_argument("--quick", action="store_true", help="16384 tokens, 12 steps (replaces --tokens and --steps)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    ap.add_argument("--out", default=None, help="folder for qb_balance.md and qb_balance.png")
    args = ap.parse_args()
    if args.quick:
        if args.tokens != ap.get_default("tokens") or args.steps != ap.get_default("steps"):
            print("note: --quick runs 16384 tokens for 12 steps; --tokens / --steps are not used", flush=True)
        args.tokens, args.steps = [16384], 12
    if args.steps < 4:
        ap.error(f"--steps must be >= 4 (the verdict averages the steps after the first), got {args.steps}")
    if min(args.tokens) < E:
        ap.error(f"--tokens must be >= {E} (the number of experts; fewer tokens leave most experts idle whatever "
                 f"the router does), got {min(args.tokens)}")
    seed = int.from_bytes(os.urandom(4), "little") if args.seed is None else args.seed
    gen = torch.Generator().manual_seed(seed)
    t0 = time.time()
    out = [f"# Quantile Balancing vs fixed-step bias (E={E}, top-{K}, skewed sigmoid router)", "",
           f"max/mean expert load per step; each step's bias comes from the previous batch "
           f"(fresh batch every step). CPU, torch {torch.__version__}, seed {seed}.", ""]
    verdicts = []
    curves = {}
    for n in args.tokens:
        methods, rows = run(n, args.steps, gen, lambda s: print(s, flush=True))
        curves[n] = (methods, rows)
        out += [f"## N = {n} tokens per batch", "",
                "| step | floor (uniform router) | " + " | ".join(methods) + " |",
                "|---" * (len(methods) + 2) + "|"]
        for r in rows:
            out.append(f"| {r['step']} | {r['floor']:.3f} | " + " | ".join(f"{r[m]:.3f}" for m in methods) + " |")
        floor = sum(r["floor"] for r in rows) / len(rows)
        qb10 = [r["QB"] for r in rows[1:11]]
        tail = rows[len(rows) // 2:]
        mean_tail = {m: sum(r[m] for r in tail) / len(tail) for m in methods}
        settled = {m: settled_step(rows, m, floor) for m in methods}
        out += ["", f"- mean floor {floor:.3f}; steps {len(rows) // 2}..{len(rows) - 1} mean: "
                + ", ".join(f"{m} {v:.3f} ({v / floor:.3f}x floor)" for m, v in mean_tail.items()),
                "- first step from which the mean of the remaining steps is within 5% of the floor: "
                + ", ".join(f"{m} {settled[m] if settled[m] is not None else 'never'}" for m in methods),
                f"- QB over steps 1-{min(10, len(rows) - 1)}: max {max(qb10):.3f} = {max(qb10) / floor:.3f}x floor",
                ""]
        for m in ("QB", "QB ema=0.5", "QB warm-up 3, ema=0.5"):
            ok = settled[m] is not None and settled[m] <= 10
            when = f"from step {settled[m]} on" if settled[m] is not None else "at no step"
            verdicts.append(f"N={n}: {m}: within 5% of the floor {when} (mean of the remaining "
                            f"steps) -> {'target met' if ok else 'target MISSED'}; steps {len(rows) // 2}.. at "
                            f"{mean_tail[m] / floor:.3f}x floor")
        verdicts.append(f"N={n}: fixed u=1e-3: steps {len(rows) // 2}.. at "
                        f"{mean_tail['fixed u=1e-3'] / floor:.2f}x floor")
    out += [f"(ran {time.time() - t0:.0f} s)", "", *verdicts]
    text = "\n".join(out)
    print()
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "qb_balance.md"), "w") as fh:
            fh.write(text + "\n")
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot")
            return
        fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
        for ax, (n, (methods, rows)) in zip(axes[0], curves.items()):
            steps = [r["step"] for r in rows]
            ax.plot(steps, [r["floor"] for r in rows], "k--", label="floor (uniform)")
            for m in methods:
                ax.plot(steps, [r[m] for r in rows], label=m)
            ax.set_yscale("log")
            ax.set_title(f"N = {n}")
            ax.set_xlabel("step")
            ax.set_ylabel("max / mean load")
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "qb_balance.png"), dpi=100)


if __name__ == "__main__":
    main()
