"""What mtc writes never costs a user data, and what it reads back is not trusted (issue 32, items 4 and 5).

* Outputs (`mtc ir -o`, `mtc run --json`, `--emit`, `--dump-ir`) are written atomically: a write that fails
  midway (a full disk) leaves the old file whole and no temporary file behind.
* `--emit DIR` / `--dump-ir DIR` replace only files mtc wrote there itself (its manifest), never a user's own
  file or the input spec.
* The `@"FILE":line:col` locations of printed IR are claims: an error shows at most one bounded line, only of
  a regular `.mtc` file; never reads a device or a FIFO, never prints another file's line.
* A damaged kernel cache entry (Triton's generated kernels.py, TVM's libraries) is a miss: rebuilt and
  repaired, with one line on stderr.
"""
import builtins
import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsl
from dsl.errors import Loc, MtcError

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "tests" / "data" / "toy.mtc"


def in_process(*args):
    """dsl.cli.main(args) in this process: (rc, stdout, stderr)."""
    import contextlib
    from dsl.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------------
# atomic outputs
# ---------------------------------------------------------------------------------------------

class _DiskFills:
    """Every file opened for writing under ``root`` takes ``room`` bytes, then fails with ENOSPC (a disk
    that fills up midway through the write)."""

    def __init__(self, root: Path, room: int):
        self.root, self.room, self.real = str(root), room, builtins.open

    def __call__(self, file, mode="r", *a, **k):
        f = self.real(file, mode, *a, **k)
        if any(c in mode for c in "wax+") and str(os.fspath(file)).startswith(self.root):
            room, real_write = [self.room], f.write

            def write(data):
                if len(data) > room[0]:
                    real_write(data[:room[0]])
                    f.flush()
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                room[0] -= len(data)
                return real_write(data)
            f.write = write
        return f


def _fill_disk(monkeypatch, root, room=100):
    fake = _DiskFills(root, room)
    monkeypatch.setattr(builtins, "open", fake)
    monkeypatch.setattr(io, "open", fake)          # (pathlib opens through io.open)


def test_ir_output_survives_a_full_disk(tmp_path, monkeypatch):
    out = tmp_path / "toy.ir"
    old = "graph old() {}\n" * 50
    out.write_text(old)
    _fill_disk(monkeypatch, tmp_path)
    rc, stdout, err = in_process("ir", str(TOY), "-o", str(out))
    monkeypatch.undo()
    assert rc == 2 and "Traceback" not in err, err
    assert f"cannot write --output '{out}': No space left on device" in err, err
    assert out.read_text() == old                                    # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy.ir"]  # and no temporary file


def test_ir_output_replaced_whole_keeping_its_mode(tmp_path):
    out = tmp_path / "toy.ir"
    out.write_text("x" * 100_000)                # longer than the new text: nothing of it may remain
    out.chmod(0o640)
    rc, _, err = in_process("ir", str(TOY), "--stage", "typed", "-o", str(out))
    assert rc == 0, err
    text = out.read_text()
    assert text.startswith("graph toy(B, T)") and "x" * 100 not in text
    assert dsl.parse_ir(text).name == "toy"
    assert (out.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy.ir"]
    # a device is written in place (it cannot be replaced, and holds no file to lose)
    rc, _, err = in_process("ir", str(TOY), "-o", os.devnull)
    assert rc == 0 and Path(os.devnull).is_char_device(), err


def test_write_atomic_cut_midway_leaves_the_old_file(tmp_path, monkeypatch):
    """The one helper every output goes through: a write cut short by ENOSPC leaves the old bytes and no
    temporary file; a whole write replaces them."""
    from dsl.fileio import write_atomic
    f = tmp_path / "out.json"
    f.write_bytes(b'{"old": 1}')
    new = os.urandom(3000).hex()
    _fill_disk(monkeypatch, tmp_path, room=1234)
    with pytest.raises(OSError) as ei:
        write_atomic(f, new)
    monkeypatch.undo()
    assert ei.value.errno == errno.ENOSPC
    assert f.read_bytes() == b'{"old": 1}' and os.listdir(tmp_path) == ["out.json"]
    write_atomic(f, new)
    assert f.read_text() == new and os.listdir(tmp_path) == ["out.json"]


def test_dump_ir_survives_a_full_disk(tmp_path, monkeypatch):
    d = tmp_path / "dump"
    rc, _, err = in_process("ir", str(TOY), "--dump-ir", str(d))
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    assert "03-canonicalize.ir" in before
    _fill_disk(monkeypatch, d, room=500)
    rc, _, err = in_process("ir", str(TOY), "--variant", "wide", "--dump-ir", str(d))
    monkeypatch.undo()
    assert rc == 2 and "No space left on device" in err and "Traceback" not in err, err
    after = {p.name: p.read_bytes() for p in d.iterdir()}
    assert after.keys() == before.keys()                               # no temporary file left
    assert {n: b for n, b in after.items() if n.endswith(".ir")} == \
        {n: b for n, b in before.items() if n.endswith(".ir")}          # every old dump whole
    # the dumps are still recognised as mtc's own: the next run replaces them
    rc, _, err = in_process("ir", str(TOY), "--variant", "wide", "--dump-ir", str(d))   # mtc's own files
    assert rc == 0, err
    assert "f32[B, T, 48]" in (d / "02-infer_shapes.ir").read_text()
    assert set(json.loads((d / ".mtc-outputs.json").read_text())["files"]) == {n for n in before if n.endswith(".ir")}


# ---------------------------------------------------------------------------------------------
# --emit / --dump-ir never overwrite a user's files
# ---------------------------------------------------------------------------------------------

def test_emit_refuses_a_users_kernels_py(tmp_path):
    mine = "# my own kernels\nimport triton\n"
    (tmp_path / "kernels.py").write_text(mine)
    rc, out, err = in_process("compile", str(TOY), "--emit", str(tmp_path))
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert f"'{tmp_path / 'kernels.py'}' exists and was not written there by mtc" in err
    assert "pick an empty or new directory" in err
    assert (tmp_path / "kernels.py").read_text() == mine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.py"]          # nothing else written


@pytest.mark.parametrize("cmd,flag,name", [("compile", "--emit", "kernel_ir.txt"),
                                           ("ir", "--dump-ir", "00-graph.ir"),
                                           ("ir", "--dump-ir", "03-canonicalize.ir")])
def test_emit_and_dump_never_overwrite_the_input_spec(tmp_path, cmd, flag, name):
    spec = tmp_path / name                    # the spec sits in DIR under a name mtc writes there
    spec.write_text(TOY.read_text())
    rc, out, err = in_process(cmd, str(spec), flag, str(tmp_path))
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert f"'{spec}'" in err and "pick an empty or new directory" in err, err
    assert spec.read_text() == TOY.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_emit_rewrites_its_own_files_but_not_edited_ones(tmp_path):
    d = tmp_path / "gen"
    (tmp_path / "gen").mkdir()
    (d / "notes.txt").write_text("mine")                        # other files in DIR are left alone
    assert in_process("compile", str(TOY), "--emit", str(d))[0] == 0
    first = (d / "kernels.py").read_text()
    assert "@triton.jit" in first and (d / "notes.txt").read_text() == "mine"
    manifest = json.loads((d / ".mtc-outputs.json").read_text())
    assert set(manifest["files"]) == {"kernels.py", "kernel_ir.txt"}
    # again, for another model: mtc's own earlier files are replaced
    rc, _, err = in_process("compile", str(TOY), "--variant", "wide", "--emit", str(d))
    assert rc == 0, err
    assert (d / "kernels.py").read_text() != first and "48" in (d / "kernel_ir.txt").read_text()
    assert not (d / "__pycache__").exists()                  # nothing but the listed files
    # a user edits the generated file: now it is theirs
    edited = (d / "kernels.py").read_text() + "# tuned by hand\n"
    (d / "kernels.py").write_text(edited)
    rc, _, err = in_process("compile", str(TOY), "--emit", str(d))
    assert rc == 2 and "kernels.py' was changed since mtc wrote it" in err, err
    assert (d / "kernels.py").read_text() == edited
    # a file of the manifest's name that is not mtc's manifest is not mtc's either
    e = tmp_path / "other"
    e.mkdir()
    (e / ".mtc-outputs.json").write_text("my settings")
    rc, _, err = in_process("compile", str(TOY), "--emit", str(e))
    assert rc == 2 and "is not mtc's list of the files it wrote" in err, err
    assert (e / ".mtc-outputs.json").read_text() == "my settings"


def test_python_dump_dir_and_emit_dir_follow_the_same_rule(tmp_path):
    from passes import PassManager
    (tmp_path / "01-verify.ir").write_text("mine")
    g = dsl.load(TOY)
    with pytest.raises(MtcError, match="01-verify.ir' exists and was not written there by mtc"):
        PassManager(dump_dir=tmp_path).run(g)
    assert os.listdir(tmp_path) == ["01-verify.ir"]         # checked before the first dump
    (tmp_path / "kernels.py").write_text("mine")
    with pytest.raises(MtcError, match="kernels.py' exists and was not written there by mtc"):
        dsl.compile(g, target="triton", emit_dir=tmp_path)
    assert (tmp_path / "kernels.py").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# IR source locations are claims
# ---------------------------------------------------------------------------------------------

_RENDER = r"""
import json, os, resource, sys
import dsl
from dsl.errors import MtcError
text, spec, out = sys.argv[1], sys.argv[3], {}
for name, target in json.loads(sys.argv[2]).items():
    g = dsl.parse_ir(open(text).read().replace("@" + json.dumps(spec), "@" + json.dumps(target)))
    loc = next(n.loc for n in g.nodes if n.op == "rmsnorm")
    if name == "first":
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # reading /dev/zero whole: MemoryError
    out[name] = MtcError("%2: a pass refused this node", loc).render()   # (what every pass raises)
print(json.dumps(out))
"""


def test_ir_locations_never_read_devices_fifos_or_other_files(tmp_path):
    text = dsl.print_graph(dsl.load(TOY))                   # locations @"<TOY>":line:col
    assert f"@{json.dumps(str(TOY))}:" in text
    ir = tmp_path / "toy.ir"
    ir.write_text(text)
    fifo = tmp_path / "pipe.mtc"
    os.mkfifo(fifo)                                         # opening it for reading would wait for a writer
    secret = tmp_path / "secret.txt"
    secret.write_text("\n".join(f"token{i}=s3cr3t" for i in range(200)) + "\n")
    spec = tmp_path / "k.mtc"
    spec.write_text(TOY.read_text())
    targets = {"first": "/dev/zero", "fifo": str(fifo), "secret": str(secret), "spec": str(spec)}
    r = subprocess.run([sys.executable, "-c", _RENDER, str(ir), json.dumps(targets), str(TOY)], cwd=ROOT, timeout=120,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    line = next(n.loc.line for n in dsl.load(TOY).nodes if n.op == "rmsnorm")
    for name in ("first", "fifo", "secret"):
        lines = got[name].splitlines()
        assert lines == [f"{targets[name]}:{line}:{lines[0].split(':')[2]}: error: %2: a pass refused this node"], \
            (name, got[name])
        assert "s3cr3t" not in got[name]
    # a .mtc spec, the file printed IR names: its line, with the caret
    shown = got["spec"].splitlines()
    assert shown[1] == f"  {line} | {TOY.read_text().splitlines()[line - 1]}" and shown[2].endswith("^")


def test_source_line_reads_one_bounded_line(tmp_path):
    from dsl import errors

    def excerpt(line, col=1):
        return MtcError("bad", Loc(str(f), line, col)).render().splitlines()[1:]
    f = tmp_path / "big.mtc"
    body = [f"  x{i} = rmsnorm(x{i - 1})  # {os.urandom(8).hex()}" for i in range(1, 2000)]
    f.write_text("\n".join(body) + "\n")
    k = 1234
    assert excerpt(k, 3) == [f"  {k} | {body[k - 1]}", f"  {' ' * len(str(k))} |   ^"]
    # the last line without a newline; a line past the end
    f.write_text("a\nlast")
    assert excerpt(2)[0] == "  2 | last" and excerpt(3) == []
    # one line longer than the cap (no newline anywhere): not shown, and not read whole
    line_cap = getattr(errors, "SOURCE_LINE_BYTES", 1 << 20)
    f.write_bytes(b"y" * (line_cap * 3))
    assert excerpt(1, 5) == []
    # a line past the scan limit: not shown
    n = getattr(errors, "SOURCE_SCAN_BYTES", 16 << 20) // 1000 + 5
    f.write_bytes((b"w" * 999 + b"\n") * n)
    assert excerpt(n) == [] and excerpt(2)[0] == "  2 | " + "w" * errors.EXCERPT_WIDTH + "..."
    # not UTF-8: shown with replacement characters, not an exception
    f.write_bytes(b"ok\n\xff\xfe bad\n")
    assert excerpt(2)[0] == "  2 | \ufffd\ufffd bad"


def test_a_claimed_file_name_cannot_drive_the_terminal():
    g = dsl.parse_ir('graph g(N) {\n  %x = input {name = "x"} : f32[N, 4]  @"a\\u001b[2Jb\\nc.mtc":1:1\n'
                     '  return %x\n}\n')
    shown = MtcError("boom", g.nodes[0].loc).render()
    assert "\x1b" not in shown and "\n" not in shown and shown.startswith("a\\x1b[2Jb\\nc.mtc:1:1: error: boom")


# ---------------------------------------------------------------------------------------------
# a damaged kernel cache is a miss
# ---------------------------------------------------------------------------------------------

CACHE_FILES = ("kernels.py", "kernel_ir.txt")          # a Triton cache entry


def _pointwise_program():
    """The smallest program with a generated kernel: silu(x + y) then an rmsnorm, one fused chain."""
    from dsl.builder import GraphBuilder
    from passes import PassManager
    from passes.lower import lower
    b = GraphBuilder("pw")
    x = b.input("x", "f32", ["N", 37])
    y = b.input("y", "f32", ["N", 37])
    out = b.rmsnorm(b.silu(b.add(x, y)), name="norm")
    fused = PassManager().run(b.build([out]))
    return lower(fused, target="triton"), fused


def _damage_file(f: Path, how: str):
    if how == "garbage":
        f.write_bytes(os.urandom(200) + b"\xff\xfe\x80")          # not UTF-8
    elif how == "truncated":
        f.write_bytes(f.read_bytes()[:57])
    elif how == "syntax":
        f.write_text("def kernel(:\n    return\n")
    elif how == "directory":
        f.unlink()
        (f / "sub").mkdir(parents=True)
        (f / "sub" / "junk").write_text("x")
    elif how == "empty":
        f.write_bytes(b"")
    elif how == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads a file without read permission")
        f.chmod(0)
    elif how == "entry is a file":
        import shutil
        shutil.rmtree(f.parent)
        f.parent.write_bytes(b"\x00\x01 not a directory")


@pytest.mark.parametrize("how", ["garbage", "truncated", "syntax", "directory", "empty", "unreadable"])
@pytest.mark.parametrize("which", ["kernels.py", "kernel_ir.txt"])
def test_damaged_triton_cache_entry_is_rebuilt(tmp_path, monkeypatch, capsys, how, which):
    from backends.triton import codegen
    monkeypatch.setenv("MTC_CACHE_DIR", str(tmp_path))
    prog, fused = _pointwise_program()
    path, _mod, kernels = codegen.write_and_load(prog)
    good = {n: (path.parent / n).read_bytes() for n in CACHE_FILES}
    assert capsys.readouterr().err == ""                    # a plain miss says nothing
    _damage_file(path.parent / which, how)
    path2, mod, kernels = codegen.write_and_load(prog)
    err = capsys.readouterr().err
    assert path2 == path and err.count("\n") == 1, err
    assert err.startswith(f"mtc: the kernel cache entry {path.parent} was damaged ({which}: ") and "rebuilt" in err
    assert {n: (path.parent / n).read_bytes() for n in CACHE_FILES} == good   # repaired
    assert not [p for p in path.parent.iterdir() if p.name not in CACHE_FILES]
    # and the kernel computes: x + y -> silu -> rmsnorm, against torch
    (k,) = {k.name: k for k in kernels}.values()
    xs, ys, w = torch.randn(5, 37), torch.randn(5, 37), torch.randn(37)
    outs = [torch.empty(5, 37) for _ in k.outputs]
    args = {"%x": xs, "%y": ys}
    codegen.launch(k, getattr(mod, k.name), [args.get(r, w) for r in k.inputs], outs)
    h = torch.nn.functional.silu(xs + ys)
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(outs[-1], want, rtol=1e-5, atol=1e-6)
    codegen.write_and_load(prog)
    assert capsys.readouterr().err == ""                    # repaired for good


def test_damaged_triton_cache_directory_and_bytecode(tmp_path, monkeypatch, capsys):
    import py_compile
    from backends.triton import codegen
    monkeypatch.setenv("MTC_CACHE_DIR", str(tmp_path))
    prog, fused = _pointwise_program()
    path, _, _ = codegen.write_and_load(prog)
    # a bytecode file that matches the source's size and time but holds garbage: never read
    pyc = path.parent / "__pycache__" / f"kernels.{sys.implementation.cache_tag}.pyc"
    py_compile.compile(str(path), cfile=str(pyc))
    pyc.write_bytes(pyc.read_bytes()[:16] + b"\xe3garbage" * 10)
    _, mod, kernels = codegen.write_and_load(prog)
    assert hasattr(mod, kernels[0].name) and capsys.readouterr().err == ""
    # a file where the entry's directory belongs
    _damage_file(path, "entry is a file")
    path2, mod, kernels = codegen.write_and_load(prog)
    assert path2 == path and path.read_text().startswith('"""Generated by mtc')
    assert "the entry is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["garbage", "truncated", "directory", "checksum", "entry is a file"])
def test_damaged_tvm_library_is_rebuilt(tmp_path, monkeypatch, capsys, how):
    pytest.importorskip("tvm")
    import backends.reference as R
    import backends.tvm as V
    from backends.tvm import build as B
    import hashlib

    def sha256_file(p):
        return hashlib.sha256(p.read_bytes()).hexdigest()
    monkeypatch.setenv("MTC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MTC_QUIET", "1")
    B.clear_memo()
    d = 53
    k = V.kernel_for("rmsnorm", d=d, eps=1e-6)
    path = B.build(k, "llvm")
    capsys.readouterr()
    if how == "checksum":
        (path.parent / "rmsnorm.so.sha256").write_bytes(b"\xff" * 70)
    else:
        _damage_file(path, how)
    B.clear_memo()
    x, w = torch.randn(7, d), torch.randn(d)
    y = V.rmsnorm(x, w, eps=1e-6)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mtc: the TVM kernel cache entry {path} was damaged ("), err
    assert torch.allclose(y, R.rmsnorm(x, w, eps=1e-6), rtol=1e-5, atol=1e-6)
    assert path.is_file() and (path.parent / "rmsnorm.so.sha256").read_text().strip() == sha256_file(path)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]    # no temporary file
    B.clear_memo()
    V.rmsnorm(x, w, eps=1e-6)
    assert capsys.readouterr().err == ""                    # repaired for good
    B.clear_memo()
