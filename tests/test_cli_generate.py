"""`mtc generate` and `mtc run --chunk-tokens` as a user drives them."""
import io
import json
import re

import pytest
import torch

import dsl
from dsl.cli import _ByteStream
from test_cli import _clean_error, in_process


def test_generate_streams_the_greedy_text_and_tokens_per_second():
    r = in_process("generate", "models/kimi_k3.mtc", "--variant", "tiny", "--prompt", "Once upon a time",
                   "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    m = dsl.compile(dsl.load("models/kimi_k3.mtc", variant="tiny"), target="reference", seed=0).eval()
    ids = torch.tensor([list(b"Once upon a time")])
    want = io.StringIO()
    s = _ByteStream(want)
    s.write(bytes(m.generate(ids, max_new_tokens=12)[0].tolist()), final=True)
    assert r.stdout == want.getvalue() + "\n"
    assert re.search(r"prefill 16 tokens in [\d.]+ s \([\d,.]+ tokens/s\); decode 11 tokens in [\d.]+ s "
                     r"\([\d,.]+ tokens/s\)", r.stderr), r.stderr


def test_byte_stream_escapes_control_characters_and_joins_split_characters():
    out = io.StringIO()
    s = _ByteStream(out)
    for b in "é\x1b[2J".encode():
        s.write(bytes([b]))
    s.write(b"\xff", final=True)
    assert out.getvalue() == "é\\x1b[2J\ufffd"


@pytest.mark.parametrize("args,needle", [
    (["generate", "-n", "3"], "give the prompt as --prompt TEXT or --input FILE"),
    (["generate", "-p", "a", "-i", "x.txt"], "one of them"),
    (["generate", "-p", ""], "--prompt is empty"),
    (["generate", "-i", "/nonexistent.txt"], "cannot read --input"),
    (["generate", "-p", "a", "--eos-byte", "300"], "--eos-byte must be a byte value"),
    (["generate", "-p", "a", "--do-sample", "--top-p", "2"], "top_p must be a number in (0, 1]"),
    (["generate", "-p", "a", "--do-sample", "--temperature", "0"], "temperature must be a finite number > 0"),
    (["generate", "-p", "a", "--chunk-tokens", "0"], "--chunk-tokens must be >= 1"),
])
def test_generate_bad_input_is_one_clean_error(args, needle):
    _clean_error(in_process(*args), needle)


def test_run_with_chunked_prefill_gives_the_same_loss_and_loads(tmp_path):
    out = {}
    for extra in ([], ["--chunk-tokens", "150"]):
        j = tmp_path / f"r{len(extra)}.json"
        r = in_process("run", "--seq-len", "300", "--max-tokens", "700", "--batch-size", "2", "--json", str(j),
                       *extra)
        assert r.returncode == 0, r.stderr
        out[len(extra)] = json.loads(j.read_text())
    assert out[2]["chunk_tokens"] == 150 and out[0]["tokens"] == out[2]["tokens"] == 699
    assert abs(out[0]["loss"] - out[2]["loss"]) < 1e-5
    assert out[0]["expert_load"] == out[2]["expert_load"]
