"""The examples/ scripts run as a user runs them, and say what they should."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsl

ROOT = Path(__file__).resolve().parent.parent


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_quickstart_runs():
    r = _run("examples/quickstart.py")
    assert r.returncode == 0, r.stderr
    loss = float(re.search(r"loss ([0-9.]+) nats/byte", r.stdout).group(1))
    assert abs(loss - 5.545) < 0.3                  # untrained: near ln 256
    gpu_loads = re.search(r"GPU loads \[([0-9, ]+)\]", r.stdout).group(1)
    loads = [int(x) for x in gpu_loads.split(",")]
    # 512 tokens x top-4 over 4 GPUs (each printed load is rounded: a replicated expert's tokens split in halves)
    assert abs(sum(loads) - 512 * 4) <= len(loads) / 2 and max(loads) <= 1.05 * 512
    assert "routed experts (7 per MoE layer x 92 layers, EP 128)" in r.stdout


def test_hybrid_spec_compiles_and_runs():
    g = dsl.load(ROOT / "examples" / "hybrid_tiny.mtc")
    m = dsl.compile(g).eval()
    ops = {n.op for n in m.graph.nodes}
    assert {"kda_chunk", "mla_attention", "qb_route", "attn_residual_phase1"} <= ops
    with torch.no_grad():
        y = m(torch.randint(0, 512, (2, 33)))
    assert y.shape == (2, 33, 512) and torch.isfinite(y).all()


def test_compare_targets_triton_matches():
    r = _run("examples/compare_targets.py", "--targets", "triton", "--tokens", "9", "--batch", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("triton"))
    err, same = row.split()[2], row.split()[3]
    assert float(err) < 1e-4 and same == "True"


# ---------------------------------------------------------------------------------------------
# examples/compare_targets.py: flags, specs it cannot feed, exit status (in this process: fast)
def _compare_targets():
    import importlib.util
    spec = importlib.util.spec_from_file_location("compare_targets", ROOT / "examples" / "compare_targets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SMALL = ("model small {\n  forward(input_ids: i64[B, T]) {\n    x = embedding(input_ids, vocab=VOCAB, dim=32)\n"
         "    return lm_head(rmsnorm(x), vocab=VOCAB)\n  }\n}\n")


def _small_spec(tmp_path, vocab):
    p = tmp_path / f"small{vocab}.mtc"
    p.write_text(SMALL.replace("VOCAB", str(vocab)))
    return str(p)


@pytest.mark.parametrize("flags,needle", [
    (["-T", "0"], "argument --tokens/-T: must be >= 1, got 0"),
    (["-B", "0"], "argument --batch/-B: must be >= 1, got 0"),
    (["-T", "-3"], "argument --tokens/-T: must be >= 1, got -3"),
    (["--tokens", "x"], "expected a positive integer, got 'x'"),
    (["--dtype", "float64"], "'float64' is not one of f32/float32/fp32, f16/float16/fp16, bf16/bfloat16"),
    (["--seed", "-1"], "argument --seed: must be in [0, 2^63)"),
])
def test_compare_targets_bad_flags_are_usage_errors(flags, needle, capsys):
    with pytest.raises(SystemExit) as e:
        _compare_targets().main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err, err


def test_compare_targets_dtype_aliases():
    ct = _compare_targets()
    for names, want in ((("f32", "float32", "FP32"), "f32"), (("f16", "Float16", "fp16"), "f16"),
                        (("bf16", "bfloat16", "BF16"), "bf16")):
        assert [ct._dtype(n) for n in names] == [want] * 3


def test_compare_targets_refuses_a_spec_it_cannot_feed(tmp_path, capsys):
    p = tmp_path / "x.mtc"
    p.write_text("model m {\n  forward(x: f32[B, T, 64]) {\n    y = silu(x)\n    return y\n  }\n}\n")
    assert _compare_targets().main([str(p), "--targets", ""]) == 2
    err = capsys.readouterr().err
    assert "model 'm' takes (x: f32[B, T, 64]); this script feeds one input, integer token ids [B, T]" in err
    p.write_text(SMALL.replace("VOCAB", "64").replace("[B, T]", "[2, 16]"))
    assert _compare_targets().main([str(p), "--targets", "", "-T", "5"]) == 2
    assert "-T 5: model 'small' fixes its input to input_ids: i64[2, 16]" in capsys.readouterr().err


def test_compare_targets_vocab_from_the_model_and_no_moe_dash(tmp_path, capsys):
    """vocab 40 (no config key): ids drawn past 40 would fail the embedding; no MoE layer -> '-'."""
    ct = _compare_targets()
    import dsl
    assert ct.token_input(dsl.load(_small_spec(tmp_path, 40)), None, None) == (2, 77, 40)
    assert ct.main([_small_spec(tmp_path, 40), "--targets", "reference", "-T", "300", "-B", "3"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("reference"))
    assert row.split()[3] == "-", row
    assert "B=3 T=300" in out


def test_compare_targets_explicit_skipped_target_fails(tmp_path, capsys):
    assert _compare_targets().main([_small_spec(tmp_path, 64), "--targets", "reference,nosuch", "-T", "3"]) == 1
    out = capsys.readouterr().out
    assert "nosuch     skipped: unknown target 'nosuch'" in out and "exit status 1" in out


def test_compare_targets_seed_reproduces(tmp_path, capsys):
    ct = _compare_targets()
    spec = _small_spec(tmp_path, 64)
    rms = []
    for seed in ("5", "5", "6"):
        assert ct.main([spec, "--targets", "", "-T", "7", "--seed", seed]) == 0
        rms.append(re.search(r"logits RMS ([0-9.]+)", capsys.readouterr().out).group(1))
    assert rms[0] == rms[1] != rms[2]


def test_compare_targets_variant_alias_and_help(capsys):
    assert _compare_targets().main(["models/kimi_k3.mtc", "-v", "nosuch", "--targets", ""]) == 2
    assert "nosuch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _compare_targets().main(["--help"])
    h = " ".join(capsys.readouterr().out.split())
    for needle in ("--seed", "-v VARIANT", "exit status:", "near-tied", "not an error by itself",
                   "named in --targets", "f32/float32/fp32"):
        assert needle in h, needle
