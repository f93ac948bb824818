"""mtc from Python in one page: load a spec, compile it, run it, read the IR, plan experts and memory.

    python examples/quickstart.py

Uses the `tiny` variant of models/kimi_k3.mtc (same structure as the 2.8T Kimi K3, shrunk) and the text
shipped in examples/data; about ten seconds on two CPU cores, no GPU needed (the reference target).
"""
import sys
from pathlib import Path

if any(a in ("-h", "--help") for a in sys.argv[1:]):    # the script takes no options: its docstring is the help
    print(__doc__)
    sys.exit(0)

import torch  # noqa: E402

import dsl  # noqa: E402
from passes.place_experts import load_from_routing_stats, plan, routing_layers  # noqa: E402
from passes.plan_memory import plan_memory  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# 1. the spec -> graph IR (symbolic shapes B, T) -> a runnable torch.nn.Module
g = dsl.load(ROOT / "models" / "kimi_k3.mtc", variant="tiny")
model = dsl.compile(g, target="reference", seed=0).eval()
n_params = sum(p.numel() for p in model.parameters())
n_ops = sum(1 for n in model.graph.nodes if n.op not in ("input", "param", "buffer"))
print(f"{g.name}: {n_params / 1e6:.2f} M parameters, {n_ops} ops after the passes "
      f"({len(model.graph.nodes)} graph nodes with the inputs and parameters)")

# 2. next-byte prediction on a real text (vocab 256 = bytes): loss of the untrained model ~ ln 256 = 5.55
text = (ROOT / "examples" / "data" / "python_reference_excerpt.txt").read_bytes()[:513]
ids = torch.tensor(list(text), dtype=torch.int64)[None]            # [B=1, T=513]
with torch.no_grad():
    logits = model(ids[:, :-1])                                     # [1, 512, 256]
loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:])
print(f"loss {loss.item():.3f} nats/byte (ln 256 = {torch.tensor(256.).log():.3f})")

# 3. the IR at each stage: canonical (layers expanded to primitive ops), fused (kernel groups + tiles)
for stage in ("canonical", "fused"):
    text_ir = model.ir(stage)
    ops = [line for line in text_ir.splitlines() if " = " in line and not any(
        f" = {src} " in line for src in ("param", "buffer", "input", "const"))]
    print(f"--- {stage}: {len(text_ir.splitlines())} lines; ops 1-3 of {len(ops)}:")
    print("\n".join(ops[:3]))
assert dsl.parse_ir(model.ir("canonical")) == model.stages["canonical"]     # printed IR parses back

# 4. the QB router's expert load of that forward -> an expert-parallel placement with replicas
load = load_from_routing_stats(model.routing_stats)                # [MoE layers, experts]
p = plan(load[0], num_gpus=4, num_slots=20)                         # 16 experts + 4 replicas on 4 GPUs
print(f"{routing_layers(model.routing_stats)[0]}: tokens per expert {[int(x) for x in load[0].tolist()]}")
print(f"placement: GPU loads {[round(x) for x in p.gpu_load.tolist()]} "
      f"(mean {load[0].sum().item() / 4:.0f}), replicas {p.replica_count.tolist()}")

# 5. the full 2.8T model on the meta device (no weights allocated): the per-GPU memory at 1M tokens
full = dsl.load(ROOT / "models" / "kimi_k3.mtc")
mp = plan_memory(full, seq_len=1 << 20, gpus=128)
print("\n".join(mp.summary().splitlines()[:6]))
