"""The mtc command line as a user drives it: bad input gets one clear `error:` line (exit 2, no
traceback), runs count every token, and dtype choices are honoured."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mtc(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "dsl.cli", *args], capture_output=True, text=True, cwd=cwd)


def in_process(*args):
    """dsl.cli.main(args) in this process (no interpreter start-up): a CompletedProcess-like result."""
    import contextlib
    import io
    from dsl.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:            # argparse's usage errors
            rc = e.code
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


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
    (["run", "--set", "norm_eps=0"], "kda_layer: attribute 'norm_eps' must be a positive number"),  # at the block
    (["run", "models/kimi_k3.mtc"], "of weights, more than this"),
    (["stats", "models/kimi_k3.mtc", "--set", "max_seq_len=0"], "must be >= 1"),
    (["stats", "models/kimi_k3.mtc", "--set", "expert_dtype=int3"], "int3"),
    # the model dtype's own choices, not every dtype of the IR (user trial: the list offered f64, then refused it)
    (["ir", "models/kimi_k3.mtc", "-v", "tiny", "--print-after", ""], "--print-after needs a pass name"),
    (["stats", "models/kimi_k3.mtc", "-v", "tiny", "--set", "dtype=int8"],
     "config field 'dtype' (the parameter and activation dtype) must be a floating type (f32, bf16, f16), got \"int8\""),
    (["ir", "models/kimi_k3.mtc", "-v", "tiny", "-o", "/nonexistent-dir/x"], "cannot write --output"),
    (["compile", "models/kimi_k3.mtc", "-v", "tiny", "--emit", ""], "--emit needs a directory name"),
    # at the block's definition (line 89), where the bad value is written
    (["stats", "models/kimi_k3.mtc", "-v", "tiny", "--set", "experts=0"],
     "kimi_k3.mtc:89:15: error: latent_moe: attribute 'experts' must be an integer >= 1, got 0"),
    # past 2**40 the plans' float sums no longer hold the integer (1e20 tokens printed as 100,000,...,000)
    (["ir", "models/kimi_k3.mtc", "-v", "tiny", "--stage", "lowered", "--seq-len", "99999999999999999999"],
     "--seq-len must be at most 2**40 (1,099,511,627,776), got 99,999,999,999,999,999,999"),
    (["stats", "models/kimi_k3.mtc", "--batch", str(2 ** 40 + 1)], "--batch must be at most 2**40"),
    # empty strings are errors, not the defaults or the current directory (user trial, 15th session)
    (["run", "--input", ""], "--input is empty"),
    (["run", "--variant", ""], "has no variant ''"),
    (["ir", ""], "cannot read spec '': the path is empty"),
    (["ops", ""], "unknown op ''; `mtc ops` lists them all"),
])
def test_bad_input_is_one_clean_error(args, needle):
    _clean_error(mtc(*args), needle)


_ONE_FFN = """model m {
  forward(input_ids: i64[B, T]) {
    x = embedding(input_ids, vocab=256, dim=DIM)
    y = glu_ffn(x, inter=64, name="f")
    return RET
  }
}
"""


@pytest.mark.parametrize("ret,dim,needle", [
    ("lm_head(y, vocab=256), y", 32, "from one output, the logits [batch, seq-len, vocab]; model 'm' returns 2: "
                                     "f32[B, T, 256] (lm_head), f32[B, T, 32] (glu_ffn)"),
    ("input_ids", 32, "must return the logits of an lm_head, [B, T, vocab]; model 'm' returns i64[B, T] (input)"),
    # a hidden state as wide as a vocabulary is not read as logits
    ("y", 300, "m.mtc:4:9: error: `mtc run` scores next-token prediction: the model must return the logits of an "
               "lm_head, [B, T, vocab]; model 'm' returns f32[B, T, 300] (glu_ffn)"),
])
def test_run_needs_the_logits_of_an_lm_head(tmp_path, ret, dim, needle):
    p = tmp_path / "m.mtc"
    p.write_text(_ONE_FFN.replace("RET", ret).replace("DIM", str(dim)))
    _clean_error(in_process("run", str(p), "--max-tokens", "64"), needle)


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
    (["ir", "models/kimi_k3.mtc", "--stage", "lowered", "--gpus", "128", "--slots", "1000"],
     "--slots 1000: needs at least the 896 experts of a MoE layer and a multiple of --gpus 128"),
    (["ir", "models/kimi_k3.mtc", "--stage", "lowered", "--checkpointing", "bogus"], "invalid choice"),
    (["ir", "models/kimi_k3.mtc", "-v", "tiny", "--stage", "tvm", "--tvm-schedule", "bogus"], "invalid choice"),
    (["ir", "models/kimi_k3.mtc", "-v", "tiny", "--dump-ir", "/etc/passwd"],
     "--dump-ir '/etc/passwd' exists and is not a directory"),
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


# ---------------------------------------------------------------------------------------------
# the command line itself: pipes, --version, help, usage, flag checks
@pytest.mark.parametrize("args", [["ops"], ["stats", "models/kimi_k3.mtc", "-v", "tiny", "--json"]])
def test_a_closed_pipe_ends_quietly(args):
    """`mtc ops | head -1`: the reader is gone before mtc writes; no BrokenPipeError traceback."""
    p = subprocess.Popen([sys.executable, "-m", "dsl.cli", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.close()                       # before the child has imported anything: its first write fails
    err = p.stderr.read().decode()
    p.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert p.returncode == 1


def test_version_from_the_package_metadata():
    from importlib.metadata import version
    r = mtc("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"mtc {version('mtc')}", (r.stdout, r.stderr)


def test_short_version_flag():
    from importlib.metadata import version
    r = in_process("-V")
    assert r.returncode == 0 and r.stdout.strip() == f"mtc {version('mtc')}", (r.stdout, r.stderr)


def test_a_full_stdout_is_one_error_line():
    """`mtc ops > /dev/full`: like a closed pipe, exit 1 and one line, no OSError traceback."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "dsl.cli", "ops"], stdout=full, stderr=subprocess.PIPE,
                           text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 1 and r.stderr == "mtc: error: cannot write to stdout: No space left on device\n", \
        r.stderr


def test_output_paths_are_checked_before_any_work(tmp_path):
    """A folder, a place that cannot be written, an input file: refused up front (nothing compiled)."""
    spec = tmp_path / "k3.mtc"
    spec.write_text((ROOT / "models" / "kimi_k3.mtc").read_text())
    text = tmp_path / "t.txt"
    text.write_text("some text to read " * 4)
    before = spec.read_text()
    for args, needle in [
        (["run", "--json", str(tmp_path)], f"--json '{tmp_path}' is a directory"),
        (["run", "--json", "/proc/x.json"], "cannot write --json '/proc/x.json'"),
        (["run", "--input", str(text), "--json", str(text)], "would overwrite the --input text"),
        (["run", str(spec), "-v", "tiny", "--json", str(spec)], "would overwrite the input spec"),
        (["ir", str(spec), "-v", "tiny", "-o", str(tmp_path)], f"--output '{tmp_path}' is a directory"),
        (["ir", str(spec), "-v", "tiny", "-o", str(spec)],
         f"--output '{spec}' would overwrite the input spec"),
        (["ir", str(spec), "--stage", "lowered", "--output", str(spec)], "would overwrite the input spec"),
        (["ir", str(spec), "--dump-ir", str(text)], f"--dump-ir '{text}' exists and is not a directory"),
        (["compile", str(spec), "--emit", str(text)], f"--emit '{text}' exists and is not a directory"),
    ]:
        r = in_process(*args)
        _clean_error(r, needle)
        assert r.stdout == "", (args, r.stdout)            # refused before loading or running anything
    assert spec.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k3.mtc", "t.txt"]   # the checks leave nothing


def test_bare_mtc_prints_the_help():
    r = mtc()
    assert r.returncode == 2 and "Traceback" not in r.stderr
    for cmd in ("stats", "ir", "run", "compile", "ops", "examples:"):
        assert cmd in r.stderr, r.stderr


def test_a_mistyped_flag_shows_the_commands_usage():
    r = mtc("stats", "models/kimi_k3.mtc", "--seqlen", "5")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: mtc stats"), r.stderr
    assert "unrecognized arguments: --seqlen 5 (did you mean '--seq-len'?)" in r.stderr


def _after(stdout):
    return [ln.split()[4] for ln in stdout.splitlines() if ln.startswith("// ----- IR after ")]


@pytest.mark.parametrize("flags,want", [
    (["--print-after", "lower"], ["lower"]),
    (["--print-after", "verify,canonicalize"], ["verify", "canonicalize"]),
    (["--print-after", "fuse_tiles", "--print-after", " infer_shapes,"], ["infer_shapes", "fuse_tiles"]),
])
def test_print_after_lists_and_lower(flags, want):
    r = mtc("ir", "models/kimi_k3.mtc", "-v", "tiny", "--stage", "canonical", *flags)
    assert r.returncode == 0, r.stderr
    assert _after(r.stdout) == want
    if "lower" in want:                    # the kernel IR, then the canonical IR asked for
        body = r.stdout.split("// ----- IR after lower", 1)[1]
        assert "kernels kimi_k3.tiny(B, T) target=triton" in body and "\ngraph kimi_k3.tiny(B, T)" in body


def test_print_after_unknown_lists_the_passes():
    r = mtc("ir", "models/kimi_k3.mtc", "-v", "tiny", "--print-after", "verify,fuse_tile")
    _clean_error(r, "unknown pass 'fuse_tile' (did you mean 'fuse_tiles'?)")
    assert "canonicalize, batch_attn_residual, fuse_tiles, lower, or all" in r.stderr
    assert "comma-separated or repeat the flag" in r.stderr
    from dsl.cli import PRINT_AFTER        # the list --help shows
    from passes import PIPELINES
    assert PRINT_AFTER == PIPELINES["default"] + ["lower"]


def test_dtype_aliases_are_documented_and_canonicalised(tmp_path):
    h = " ".join(mtc("run", "--help").stdout.split())
    assert all(a in h for a in ("bfloat16 (bf16)", "float32 (fp32, f32)", "float16 (fp16, f16)")), h
    j = tmp_path / "r.json"
    r = mtc("run", "--dtype", "BF16", "--max-tokens", "40", "--seq-len", "16", "--set", "n_layers=2", "--json", str(j))
    assert r.returncode == 0, r.stderr
    assert json.loads(j.read_text())["dtype"] == "bfloat16"
    assert "target reference, bfloat16)" in " ".join(r.stdout.split())
    _clean_error(in_process("run", "--dtype", "fp8"),
                 "float32 (fp32, f32) | bfloat16 (bf16) | float16 (fp16, f16); got 'fp8'")


def test_lowered_only_flags_warn_at_other_stages():
    r = mtc("ir", "models/kimi_k3.mtc", "-v", "tiny", "--stage", "canonical", "--gpus", "8", "--slots", "16")
    assert r.returncode == 0, r.stderr
    assert "warning: --gpus, --slots only affect --stage lowered; ignored at --stage canonical" in r.stderr
    assert r.stdout.startswith("graph kimi_k3.tiny(B, T)")
    r = mtc("ir", "models/kimi_k3.mtc", "-v", "tiny", "--stage", "canonical")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


def test_bad_slots_name_the_flag():
    r = mtc("ir", "models/kimi_k3.mtc", "-v", "tiny", "--stage", "lowered", "--slots", "3")
    _clean_error(r, "--slots 3: needs at least the 16 experts of a MoE layer and a multiple of --gpus 1")
    assert "plan_memory" not in r.stderr


def test_seq_len_beyond_max_seq_len_warns():
    r = mtc("stats", "models/kimi_k3.mtc", "-v", "tiny", "--seq-len", "5000", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["seq_len"] == 5000
    assert "warning: --seq-len 5,000 is beyond the spec's max_seq_len = 4,096" in r.stderr, r.stderr
    r = mtc("stats", "models/kimi_k3.mtc", "-v", "tiny", "--seq-len", "4096", "--json")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    # the model has no position embeddings (KDA, NoPE MLA): a run past max_seq_len works, with the warning
    r = mtc("run", "--seq-len", "65", "--max-tokens", "200", "--set", "n_layers=2", "--set", "max_seq_len=63")
    assert r.returncode == 0, r.stderr
    assert "warning: --seq-len 65 is beyond the spec's max_seq_len = 63" in r.stderr, r.stderr
    assert r.stderr.count("warning") == 1, r.stderr              # once (not again from the runtime)
    assert "loss" in r.stdout


def test_run_refuses_a_spec_it_cannot_feed_before_compiling(tmp_path):
    p = tmp_path / "two.mtc"
    p.write_text("model two {\n  forward(input_ids: i64[B, T], other: i64[B, T]) {\n"
                 "    x = embedding(input_ids, vocab=256, dim=32)\n    return lm_head(rmsnorm(x), vocab=256)\n  }\n}\n")
    r = in_process("run", str(p))
    _clean_error(r, "`mtc run` feeds one input, byte token ids [batch, seq-len]; model 'two' takes 2 "
                    "(input_ids: i64[B, T], other: i64[B, T])")
    assert "compiled" not in r.stdout
    p.write_text(p.read_text().replace("input_ids: i64[B, T], other: i64[B, T]", "input_ids: i64[2, 16]"))
    _clean_error(in_process("run", str(p)), "takes input_ids: i64[2, 16], a fixed shape")


def test_config_field_named_like_a_shape_symbol(tmp_path):
    """config { T: int = 64 } makes T in input_ids: i64[B, T] the constant 64 (a config value in a shape is a
    constant): a warning at that dim when the spec loads, and `mtc run`'s error says why the shape is fixed (new-user
    trial, 16th session: it advised declaring i64[B, T], which the spec already did). A config width elsewhere (the
    third dim of x: f32[B, T, d]) stays silent."""
    import warnings
    import dsl
    from dsl.errors import MtcWarning
    p = tmp_path / "tclash.mtc"
    p.write_text("model m {\n  config { T: int = 64\n           d: int = 32 }\n  forward(input_ids: i64[B, T]) {\n"
                 "    x = embedding(input_ids, vocab=256, dim=d)\n    return lm_head(rmsnorm(x), vocab=256)\n  }\n}\n")
    with pytest.warns(MtcWarning, match=r"tclash.mtc:4:29: .*dimension 1 is 'T', the config field T = 64, so the "
                                        r"model takes exactly 64 there"):
        g = dsl.load(p)
    assert str(g.inputs()[0].types[0]) == "i64[B, 64]"
    r = in_process("run", str(p))
    _clean_error(r, "a fixed shape: declare it input_ids: i64[B, T] with B and T not config fields")
    q = tmp_path / "width.mtc"
    q.write_text("model w {\n  config { d: int = 8 }\n  forward(x: f32[B, T, d]) {\n    return rmsnorm(x)\n  }\n}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", MtcWarning)
        assert str(dsl.load(q).inputs()[0].types[0]) == "f32[B, T, 8]"
        q.write_text(q.read_text().replace("f32[B, T, d]", "f32[B, d]"))        # [B, d]: dim 1 is a width
        assert str(dsl.load(q).inputs()[0].types[0]) == "f32[B, 8]"
        # weights passed as inputs (sized by lowercase fields, as `mtc ops` examples declare them) stay silent
        q.write_text("model w {\n  config { d: int = 8 }\n  forward(x: f32[B, T, d], w: f32[d], c: f32[d, 1, 4]) {\n"
                     "    return short_conv(mul(x, w), c)\n  }\n}\n")
        assert [str(n.types[0]) for n in dsl.load(q).inputs()] == ["f32[B, T, 8]", "f32[8]", "f32[8, 1, 4]"]
    # a float input's first dim named by a shape-symbol-like field still warns
    q.write_text("model w {\n  config { N: int = 8 }\n  forward(x: f32[N, 16]) {\n    return rmsnorm(x)\n  }\n}\n")
    with pytest.warns(MtcWarning, match=r"dimension 0 is 'N', the config field N = 8"):
        dsl.load(q)


def test_lowered_listing_says_when_compile_would_refuse_the_model(tmp_path):
    """head_dim 300 (the Triton kda_chunk takes K <= 256): `mtc ir --stage lowered` still lists the kernels, with
    a warning at the spec line that dsl.compile(target='triton') refuses the model (new-user trial, 16th session:
    the listing showed a kernel that cannot run, silently)."""
    p = tmp_path / "k300.mtc"
    p.write_text("model r {\n  block a = kda_layer(heads=1, head_dim=300, v_head_dim=8)\n  forward(x: f32[B, T, 300]) "
                 "{\n    return a(x)\n  }\n}\n")
    r = in_process("ir", str(p), "--stage", "lowered")
    assert r.returncode in (0, None), r.stderr
    assert (f"mtc: warning: {p}:4:12: dsl.compile(target='triton') refuses this model, so the listing below cannot "
            f"run as is: target 'triton': the Triton kda_chunk kernel takes head_dim (K) up to 256, got 300") in r.stderr
    assert "triton.kda_chunk" in r.stdout
    r = in_process("ir", str(ROOT / "models" / "kimi_k3.mtc"), "--variant", "tiny", "--stage", "lowered")
    assert "refuses this model" not in r.stderr


def test_stats_of_a_fixed_input_shape(tmp_path):
    """A spec with input i64[2, 16] is counted at B = 2, T = 16: the same numbers as the symbolic spec
    at --batch 2 --seq-len 16 (MLA FLOPs grow with T, so a wrong T shows)."""
    body = ("    x = embedding(input_ids, vocab=256, dim=64)\n"
            "    y = mla_layer(x, heads=2, kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=8, v_dim=16, name=\"a\")\n"
            "    z = kda_layer(y, heads=2, head_dim=16, name=\"k\")\n"
            "    return lm_head(rmsnorm(z), vocab=256)\n  }\n}\n")
    fixed, sym = tmp_path / "fixed.mtc", tmp_path / "sym.mtc"
    fixed.write_text("model m {\n  forward(input_ids: i64[2, 16]) {\n" + body)
    sym.write_text("model m {\n  forward(input_ids: i64[B, T]) {\n" + body)
    rf = mtc("stats", str(fixed), "--json", "--seq-len", "999")
    rs = mtc("stats", str(sym), "--json", "--seq-len", "16", "--batch", "2")
    assert rf.returncode == 0 and rs.returncode == 0, rf.stderr + rs.stderr
    assert "--seq-len 999 ignored: the spec fixes it to 16" in rf.stderr
    f, s = json.loads(rf.stdout), json.loads(rs.stdout)
    for k in ("seq_len", "batch", "flops_per_token", "kv_cache_bytes", "kda_state_bytes", "residual_stream_bytes"):
        assert f[k] == pytest.approx(s[k], rel=1e-12), k
    assert f["seq_len"] == 16 and f["batch"] == 2
    table = mtc("stats", str(fixed)).stdout
    assert "T=16" in table and "4,096" not in table


# ---------------------------------------------------------------------------------------------
# mtc ops: how a spec writes each op
def test_every_op_has_a_spec_form_whose_example_builds(tmp_path):
    import importlib.util
    import warnings
    import dsl
    from dsl.ops import OPS
    from dsl.spec_forms import SPEC_FORMS, STACK
    has_tvm = importlib.util.find_spec("tvm") is not None      # --stage tvm prints Apache TVM's TVMScript
    assert set(SPEC_FORMS) == set(OPS)
    for name, f in [*SPEC_FORMS.items(), ("stack", STACK)]:
        if f.form is None:
            assert f.example is None and f.notes, name
            continue
        p = tmp_path / f"{name}.mtc"
        p.write_text(f.example)
        with warnings.catch_warnings():
            warnings.simplefilter("error")            # an example that leaves something unused is wrong
            g = dsl.load(str(p))
        ops = {n.op for n in g.nodes}
        assert (name in ops) if name != "stack" else {"kda_layer", "mla_layer", "glu_ffn"} <= ops, name
        # what `mtc ops OP` says of it: `mtc stats`, every `mtc ir` stage and compile(target=reference /
        # triton) accept it (B, T inputs; head dims the Triton kernels take)
        stages = ["graph", "typed", "canonical", "fused", "lowered"] + (["tvm"] if has_tvm else [])
        for args in (["stats", "--json"], ["ir", "--stage", "lowered", "--target", "tvm"],
                     *(["ir", "--stage", st] for st in stages)):
            r = in_process(args[0], str(p), *args[1:])
            assert r.returncode == 0 and r.stdout, (name, args, r.stderr)
        assert json.loads(in_process("stats", str(p), "--json").stdout)["seq_len"] > 0
        for target in ("reference", "triton"):
            dsl.compile(g, target=target, device="meta")


@pytest.mark.parametrize("op,needles", [
    ("linear", ['in a spec:  y = linear(x, out=N, name="...")', "out (required), name (required)",
                "graph op:   linear(x, weight)",
                'example (a whole spec: `mtc stats`, `mtc ir` at every --stage and dsl.compile(target="reference" or '
                '"triton") accept it)']),
    ("embedding", ["embedding(ids, vocab=V, dim=D", 'name="model.embed_tokens"']),
    ("rmsnorm", ['rmsnorm(x, eps=1e-6, name="model.norm")']),
    ("stack", ['prefix="model.layers"', 'residual="add"', "block_size=", "attn = ", "ffn = "]),
    ("kda_layer", ["block kda = kda_layer(heads=H, head_dim=K)", 'gate="sigmoid"']),
])
def test_ops_shows_the_spec_form(op, needles):
    r = mtc("ops", op)
    assert r.returncode == 0, r.stderr
    for n in needles:
        assert n in r.stdout, (n, r.stdout)


def test_ops_help_has_a_description():
    r = mtc("ops", "--help")
    assert r.returncode == 0 and "the form a .mtc spec writes" in " ".join(r.stdout.split())


def test_run_reads_only_max_tokens_takes_stdin_and_writes_json_to_stdout():
    # a new-user trial: `--input /dev/zero` hung (the whole file was read before --max-tokens applied),
    # `--input -` was "no such file", `--json -` wrote a file named '-', and --set dtype was silently ignored
    r = subprocess.run([sys.executable, "-m", "dsl.cli", "run", "--input", "/dev/zero", "--max-tokens", "80",
                        "--json", "-"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)                             # stdout is the JSON alone; the report went to stderr
    assert d["tokens"] == 79 and d["input"] == "/dev/zero" and d["max_tokens"] == 80 and d["seed"] == 0
    assert abs(d["perplexity"] - math.exp(d["loss"])) < 1e-9 * d["perplexity"]
    assert abs(d["bits_per_byte"] - d["loss"] / math.log(2)) < 1e-12 and "loss" in r.stderr
    text = "the same bytes from standard input and from a file\n" * 3
    a = subprocess.run([sys.executable, "-m", "dsl.cli", "run", "--input", "-", "--json", "-"], input=text,
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["tokens"] == len(text) - 1
    r = mtc("run", "--set", "dtype=bf16", "--max-tokens", "50")
    _clean_error(r, "use --dtype instead")
    r = mtc("run", "--json", "", "--max-tokens", "50")
    _clean_error(r, "--json needs a file name")


MIXED_MOE = """model mixed {
  config {
    d: int = 64
  }
  block kda = kda_layer(heads=2, head_dim=32)
  block moe_a = moe(experts=10, top_k=2, inter=32, shared=1)
  block moe_b = latent_moe(experts=12, top_k=3, inter=32, latent=32)
  forward(input_ids: i64[B, T]) {
    x = embedding(input_ids, vocab=256, dim=d)
    x = stack(x, layers=1) {
      attn = kda
      ffn = moe_a
    }
    x = stack(x, layers=1, prefix="model.late") {
      attn = kda
      ffn = moe_b
    }
    return lm_head(rmsnorm(x), vocab=256)
  }
}
"""


def test_lowered_plan_with_moe_layers_of_different_expert_counts(tmp_path):
    # one slot count per layer, at least the largest layer's experts; one placement per expert count
    spec = tmp_path / "mixed.mtc"
    spec.write_text(MIXED_MOE)
    out = mtc("ir", str(spec), "--stage", "lowered")
    assert out.returncode == 0, out.stderr
    assert "routed experts (up to 12 per MoE layer x 2 layers" in out.stdout
    assert "// MoE layers with 10 experts (top-2): 1 of 2" in out.stdout
    assert "// MoE layers with 12 experts (top-3): 1 of 2" in out.stdout
    assert "expert placement: 10 experts -> 12 slots" in out.stdout
    assert "expert placement: 12 experts -> 12 slots" in out.stdout
    _clean_error(mtc("ir", str(spec), "--stage", "lowered", "--slots", "10"),
                 "--slots 10: needs at least the 12 experts of the largest MoE layer")


@pytest.mark.parametrize("cmd,flags", [("stats", ["--seq-len", "--gpus"]), ("ir", ["--stage", "--seq-len", "--slots"]),
                                       ("run", ["--target", "--device", "--seq-len"])])
def test_help_states_the_defaults(cmd, flags):
    # every option with a default says what it is (third new-user trial: --stage, --slots, --gpus, --target and
    # --device did not)
    import re
    r = in_process(cmd, "--help")
    options = r.stdout.split("options:", 1)[1]
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=-)", options)]        # one entry per option
    for flag in flags:
        entry = next(e for e in entries if re.match(r"(-\w+ \S+, )?" + re.escape(flag) + r"\b", e))
        assert "default" in entry, entry


def test_memory_plan_prints_an_uneven_token_split_and_no_dangling_colon():
    r = in_process("ir", str(ROOT / "models" / "kimi_k3.mtc"), "--stage", "lowered", "--seq-len", "1", "--gpus", "128")
    assert r.returncode in (0, None), r.stderr
    assert "(0.008 tokens per GPU on average, 0 or 1 each)" in r.stdout and "x 0.008 tokens" in r.stdout
    assert "127 GPUs hold no token" in r.stderr
    assert not any(ln.rstrip().endswith("launches:") for ln in r.stdout.splitlines())


def test_out_of_memory_while_running_is_one_line(monkeypatch):
    # torch's out-of-memory errors (user trial: `mtc run --seq-len 65536` on a CPU, where the reference MLA forms
    # [T, T] scores) end in one `mtc: error:` line, exit 1; another RuntimeError is not hidden
    import torch
    import dsl.cli as cli

    def oom(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")
    monkeypatch.setattr(cli, "cmd_run", oom)
    r = in_process("run")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "mtc: error: out of memory while running: CUDA out of memory. Tried to allocate 32.00 GiB" in r.stderr

    def cpu_oom(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 34359738368 bytes.")
    monkeypatch.setattr(cli, "cmd_run", cpu_oom)
    r = in_process("run")
    assert r.returncode == 1 and "out of memory while running" in r.stderr and "--seq-len" in r.stderr

    def other(args):
        raise RuntimeError("some other failure")
    monkeypatch.setattr(cli, "cmd_run", other)
    with pytest.raises(RuntimeError, match="some other failure"):
        in_process("run")


def test_weights_that_do_not_fit_name_the_other_variants(monkeypatch):
    # the advice lists the spec's other variants, not the one that was asked for (user trial: `--variant small`
    # was told to run "--variant tiny or small")
    import os
    import dsl
    import dsl.cli as cli
    from dsl.errors import MtcError
    spec = ROOT / "models" / "kimi_k3.mtc"
    g = dsl.load(spec, "tiny")
    monkeypatch.setattr(os, "sysconf", lambda name: 1)            # a machine with (almost) no free memory
    with pytest.raises(MtcError, match="try another variant") as e:
        cli._check_fits(g, 4, "cpu", spec, "tiny")
    listed = str(e.value).split("--variant ")[1].split(")")[0].split(" or ")
    assert "tiny" not in listed and listed and set(listed) <= set(cli._spec_variants(spec))


def test_lowered_report_formats_from_a_user_trial():
    # 409.6 tokens per GPU, not 409.600 (read as 409,600 beside the thousands separators); the placement table says
    # that it shows 5 of the 12 experts; with --print-after the requested stage gets a header of its own
    r = in_process("ir", str(ROOT / "examples" / "hybrid_tiny.mtc"), "--stage", "lowered", "--gpus", "5")
    assert r.returncode in (0, None), r.stderr
    assert "(409.6 tokens per GPU on average, 409 or 410 each)" in r.stdout
    assert "x 409.6 tokens, 0.8 remote" in r.stdout
    assert "GPUs   (the first 5 of 12; all of them: summary(top=12))" in r.stdout
    r = in_process("ir", str(ROOT / "examples" / "hybrid_tiny.mtc"), "--stage", "graph", "--print-after", "all")
    assert r.returncode in (0, None), r.stderr
    heads = [ln for ln in r.stdout.splitlines() if ln.startswith("// ----- ")]
    assert heads[-2].startswith("// ----- IR after lower") and heads[-1] == "// ----- IR at stage graph (--stage) -----"


def test_run_triton_on_cpu_with_triton_interpret_0_names_the_setting():
    # mtc run only sets TRITON_INTERPRET when it is unset: an explicit 0 is named as the cause (the message said
    # "mtc run does this itself", which it does not then)
    import os
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "dsl.cli", "run", "--target", "triton", "--max-tokens", "16",
                        "--seq-len", "8", "--device", "cpu"], capture_output=True, text=True, cwd=ROOT, env=env)
    _clean_error(r, "it is set to '0' in the environment, which mtc run keeps: unset it or set it to 1")


def test_ir_print_after_listings_go_to_the_output_file(tmp_path):
    # user trial: with -o only the --stage IR went to the file and the --print-after listings still to stdout
    out = tmp_path / "ir.txt"
    r = mtc("ir", "models/kimi_k3.mtc", "--variant", "tiny", "--stage", "canonical", "--print-after",
            "canonicalize", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and "wrote" in r.stderr
    text = out.read_text()
    a, b = text.find("// ----- IR after canonicalize"), text.find("// ----- IR at stage canonical (--stage)")
    assert a == 0 and b > a and "attn_residual" in text[a:b] and "attn_residual" in text[b:]
