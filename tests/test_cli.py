"""The mtc command line as a user drives it: bad input gets one clear `error:` line (exit 2, no
traceback), runs count every token, and dtype choices are honoured."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mtc(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "dsl.cli", *args], capture_output=True, text=True, cwd=cwd)


def _clean_error(r, needle):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert needle in r.stderr, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["ops", "nosuch"], "unknown op 'nosuch'"),
    (["run", "--max-tokens", "1"], "need at least 2"),
    (["run", "--device", "tpu"], "--device must be cpu or cuda"),
    (["run", "--dtype", "i64"], "--dtype must be one of"),
    (["run", "--json", "/nonexistent-dir/x.json"], "does not exist"),
    (["run", "--set", "norm_eps=0"], "'eps' must be a positive number"),
    (["run", "models/kimi_k3.mtc"], "of weights, more than this"),
    (["stats", "models/kimi_k3.mtc", "--set", "max_seq_len=0"], "must be >= 1"),
    (["stats", "models/kimi_k3.mtc", "--set", "expert_dtype=int3"], "unknown dtype 'int3'"),
    (["ir", "models/kimi_k3.mtc", "-v", "tiny", "-o", "/nonexistent-dir/x"], "cannot write --output"),
])
def test_bad_input_is_one_clean_error(args, needle):
    _clean_error(mtc(*args), needle)


def test_binary_spec(tmp_path):
    p = tmp_path / "bin.mtc"
    p.write_bytes(b"\xff\xfe\x00model")
    _clean_error(mtc("stats", str(p)), "is not UTF-8 text")


def test_string_where_an_int_is_expected(tmp_path):
    p = tmp_path / "s.mtc"
    p.write_text('model m {\n  forward(input_ids: i64[B, T]) {\n    x = embedding(input_ids, vocab=256, dim=32)\n'
                 '    y = kda_layer(x, heads=2, head_dim="wide", name="l0")\n    return lm_head(y, vocab=256)\n  }\n}\n')
    r = mtc("stats", str(p))
    _clean_error(r, "attribute 'head_dim' must be an integer, got 'wide'")
    assert f"{p}:4:9" in r.stderr


def test_run_predicts_every_token_and_honours_dtype(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 7)           # 665 bytes -> 664 predictions
    out = {}
    for dt in ("float32", "bfloat16"):
        j = tmp_path / f"{dt}.json"
        r = mtc("run", "--input", str(text), "--seq-len", "100", "--dtype", dt, "--set", "n_layers=7",
                "--json", str(j))
        assert r.returncode == 0, r.stderr
        out[dt] = json.loads(j.read_text())
        assert out[dt]["tokens"] == 664 and out[dt]["dtype"] == dt
    # same weights, different precision: close but not bit-identical
    assert out["float32"]["loss"] != out["bfloat16"]["loss"]
    assert abs(out["float32"]["loss"] - out["bfloat16"]["loss"]) < 0.05


def test_ir_dump_with_graph_stage(tmp_path):
    r = mtc("ir", "models/kimi_k3.mtc", "-v", "tiny", "--stage", "graph", "--dump-ir", str(tmp_path), "--timing")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "05-fuse_tiles.ir").exists() and "canonicalize" in r.stderr
    assert r.stdout.startswith("graph kimi_k3.tiny(B, T)")


def test_ir_dump_with_lowered_stage_includes_the_kernel_ir(tmp_path):
    r = mtc("ir", "models/kimi_k3.mtc", "-v", "tiny", "--stage", "lowered", "--dump-ir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "06-lowered.txt").read_text() == r.stdout


@pytest.mark.parametrize("args,needle", [
    (["ir", "models/kimi_k3.mtc", "--stage", "lowered", "--gpus", "128", "--slots", "1000"], "a multiple of ep_size = 128"),
    (["ir", "models/kimi_k3.mtc", "--stage", "lowered", "--checkpointing", "bogus"], "invalid choice"),
    (["ir", "models/kimi_k3.mtc", "-v", "tiny", "--stage", "tvm", "--tvm-schedule", "bogus"], "invalid choice"),
    (["ir", "models/kimi_k3.mtc", "-v", "tiny", "--dump-ir", "/etc/passwd"], "cannot write IR dumps"),
])
def test_bad_compiler_flags(args, needle):
    r = mtc(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr


def test_lowered_memory_plan_follows_slots():
    out8 = mtc("ir", "models/kimi_k3.mtc", "--stage", "lowered", "--gpus", "128", "--slots", "1024").stdout
    out7 = mtc("ir", "models/kimi_k3.mtc", "--stage", "lowered", "--gpus", "128").stdout
    assert "routed experts (8 per MoE layer" in out8 and "routed experts (7 per MoE layer" in out7


def test_compile_full_model_emits_kernels_without_weights(tmp_path):
    r = mtc("compile", "models/kimi_k3.mtc", "--emit", str(tmp_path))
    assert r.returncode == 0, r.stderr
    src = (tmp_path / "kernels.py").read_text()
    assert "@triton.jit" in src and "kernels kimi_k3(B, T)" in (tmp_path / "kernel_ir.txt").read_text()
