"""Inference with caches on the reference target (backends/inference.py): chunked prefill and decode against the
full forward, greedy generate against repeated argmax of the forward, a batch of prompts of different lengths
against each prompt alone, the cache's bytes against `mtc stats`, sampling against transformers' logits warpers,
and bad input (clear errors, nothing written)."""
import pytest
import torch

import dsl
from dsl.errors import MtcError
from passes.plan_memory import plan_memory
from passes.stats import compute_stats

SPECS = [("models/kimi_k3.mtc", "tiny"), ("examples/hybrid_tiny.mtc", None)]


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


_MODELS = {}


def _model(spec, variant):
    """The compiled model (eval), its router weights drawn with a standard deviation near 2 in logits (as
    tests/tiny_model.exercise does: the 0.02 init bunches the scores near 0.5, where a top-k near-tie is likely).
    The AttnRes pseudo-queries stay at their zero init: they mix over depth at one position, which caching does
    not touch, and exercise()'s N(0, 0.5) queries amplify the float32 rounding of every layer (prefill in chunks
    of 21 vs the forward: 4-5e-6 with them, 1.1-1.6e-6 without, over three seeds each of both models)."""
    key = (spec, variant)
    if key not in _MODELS:
        m = dsl.compile(dsl.load(spec, variant=variant), target="reference", seed=0).eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("gate.weight"):
                    p.normal_(0, 2.0 / p.shape[1] ** 0.5)
        _MODELS[key] = m
    return _MODELS[key]


def _vocab(m) -> int:
    return int(m.graph.type_of(m.graph.outputs[0]).shape[-1])


def _clear(m, shape, margin=1e-6, tries=30):
    """Token ids without a top-k near-tie (< margin) in any router of the forward: prefill computes the router
    inputs with other roundings (~1e-7), and at a tie the choice of expert may flip (a switch, not an error)."""
    for _ in range(tries):
        ids = torch.randint(0, _vocab(m), shape)
        if min(m.route_margins(ids).values()) >= margin:
            return ids
    raise AssertionError(f"no draw of {shape} ids without a routing near-tie in {tries} tries")


@pytest.mark.parametrize("spec,variant", SPECS)
def test_prefill_equals_forward(spec, variant):
    """B = 2, T = 1000 in chunks of 128 and 333 tokens per row (neither divides T; chunk_tokens counts the tokens
    of one program run, all rows): every position's logits equal the forward's."""
    m = _model(spec, variant)
    ids = _clear(m, (2, 1000))
    with torch.no_grad():
        ref = m(ids)
    for per_row in (128, 333):
        cache = m.new_cache(2, 1000)
        out = m.prefill(ids, cache, chunk_tokens=2 * per_row)
        assert out.shape == ref.shape
        assert _rel(out, ref) < 1e-5, per_row
        assert cache.lengths == [1000, 1000]
        # the last run was the remainder (1000 - 3 * 333 = 1 token per row) on both rows
        assert {str(k): v for k, v in m.last_run.bind.items()} == {"B": 2, "T": 1000 % per_row}


@pytest.mark.parametrize("spec,variant", SPECS)
def test_prefill_then_decode_equals_forward(spec, variant):
    """prefill(T - k) then k decode steps: the logits of those k positions equal the forward's (the absorbed MLA
    form over the latent cache, kda_step, the conv state)."""
    m = _model(spec, variant)
    T, k = 301, 7
    ids = _clear(m, (2, T))
    with torch.no_grad():
        ref = m(ids)
    cache = m.new_cache(2, T)
    last = m.prefill(ids[:, :T - k], cache, chunk_tokens=97, logits="last")
    assert last.shape == (2, 1, _vocab(m))
    assert _rel(last[:, 0], ref[:, T - k - 1]) < 1e-5
    for i in range(T - k, T):
        out = m.decode(ids[:, i:i + 1], cache)
        assert out.shape == (2, 1, _vocab(m))
        assert _rel(out[:, 0], ref[:, i]) < 1e-5, i
    assert cache.lengths == [T, T]


def test_batch_of_different_lengths_equals_each_alone():
    """Rows of 150, 37 and 1 tokens in one batch (packed chunks with cu_seqlens, then decode steps in which the
    rows attend to caches of different lengths) give each row's logits as that prompt alone does."""
    m = _model("models/kimi_k3.mtc", "tiny")
    lens, steps = [150, 37, 1], 3
    rows = [_clear(m, (1, n + steps))[0] for n in lens]
    ids = torch.zeros(3, max(lens), dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, :n] = rows[b][:n]
    cache = m.new_cache(3, max(lens) + steps)
    out = m.prefill(ids, cache, lengths=lens, chunk_tokens=64)
    assert cache.lengths == lens
    dec = [m.decode(torch.stack([r[n + i] for r, n in zip(rows, lens)])[:, None], cache) for i in range(steps)]
    for b, n in enumerate(lens):
        alone = m.new_cache(1, n + steps)
        one = m.prefill(rows[b][None, :n], alone, chunk_tokens=64)
        assert _rel(out[b, :n], one[0]) < 1e-5
        assert not out[b, n:].any()                      # past the row's length: zeros
        with torch.no_grad():
            full = m(rows[b][None])
        assert _rel(out[b, :n], full[0, :n]) < 1e-5
        for i in range(steps):
            assert _rel(dec[i][b, 0], full[0, n + i]) < 1e-5, (b, i)


def test_greedy_generate_equals_repeated_argmax():
    m = _model("models/kimi_k3.mtc", "tiny")
    ids = _clear(m, (2, 45))
    new = 9
    got = m.generate(ids, max_new_tokens=new)
    ref = ids
    with torch.no_grad():
        for _ in range(new):
            ref = torch.cat([ref, m(ref)[:, -1].argmax(-1, keepdim=True)], dim=1)
        logits = m(ref)
    # (a greedy pick within float32 rounding of a tie could go either way: none here, or the test says so)
    top2 = logits[:, ids.shape[1] - 1:-1].topk(2, dim=-1).values
    assert float((top2[..., 0] - top2[..., 1]).min()) > 1e-5, "a near-tie of the argmax: redraw"
    assert got.shape == (2, 45 + new)
    assert torch.equal(got, ref)


def test_generate_eos_pad_streamer_and_attention_mask():
    m = _model("models/kimi_k3.mtc", "tiny")
    ids = _clear(m, (2, 20))
    greedy = m.generate(ids, max_new_tokens=6)
    eos = int(greedy[0, 22])                            # row 0's third new token
    seen = []

    class Streamer:                                     # transformers' streamer protocol
        def put(self, x):
            seen.append(x.clone())

        def end(self):
            seen.append("end")
    out = m.generate(ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=7, streamer=Streamer())
    # each row: greedy up to its first eos (row 0's third new token, or earlier when a new token repeats), pad
    # after it; generation stops once every row has ended
    ends = [20 + int(h[0]) + 1 if len(h) else None for h in ((greedy[r, 20:] == eos).nonzero() for r in range(2))]
    n = out.shape[1]
    assert n == (26 if None in ends else max(ends))
    for row, upto in enumerate(ends):
        upto = n if upto is None else upto
        assert torch.equal(out[row, :upto], greedy[row, :upto]) and (out[row, upto:] == 7).all()
    assert torch.equal(seen[0], ids) and seen[-1] == "end"
    assert torch.equal(torch.stack(seen[1:-1], dim=1), out[:, 20:])
    # left padding with an attention mask: the same new tokens as the unpadded prompt of that row
    padded = torch.cat([torch.full((2, 3), 5), ids], dim=1)
    mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 20, dtype=torch.long)], dim=1)
    mask[1, 3:6] = 0                                    # row 1: 6 pad tokens then 17 of the prompt
    out2 = m.generate(padded, max_new_tokens=4, attention_mask=mask)
    assert torch.equal(out2[:, :23], padded)
    assert torch.equal(out2[0, 23:], greedy[0, 20:24])
    alone = m.generate(ids[1:, 3:], max_new_tokens=4)
    assert torch.equal(out2[1, 23:], alone[0, 17:])
    calls = []
    m.generate(ids, max_new_tokens=3, streamer=calls.append)
    assert len(calls) == 3 and calls[0].shape == (2,)


def test_sampling_matches_transformers_warpers():
    """warp_logits is transformers' temperature -> top-k -> top-p chain; sampling with a generator is
    reproducible, and top_k=1 sampling is greedy."""
    tr = pytest.importorskip("transformers")
    from backends.inference import warp_logits
    x = torch.randn(4, 300) * 3
    for temperature, top_k, top_p in ((0.7, 50, 0.9), (1.3, None, 0.5), (1.0, 5, None), (2.0, 0, 0.99)):
        procs = [tr.TemperatureLogitsWarper(temperature)]
        if top_k:
            procs.append(tr.TopKLogitsWarper(top_k))
        if top_p is not None:
            procs.append(tr.TopPLogitsWarper(top_p))
        want = x.clone()
        for p in procs:
            want = p(None, want)
        got = warp_logits(x, temperature, top_k, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)], rtol=1e-6, atol=0)
    m = _model("models/kimi_k3.mtc", "tiny")
    ids = torch.randint(0, 256, (2, 12))
    a = m.generate(ids, max_new_tokens=5, do_sample=True, top_p=0.9, generator=torch.Generator().manual_seed(3))
    b = m.generate(ids, max_new_tokens=5, do_sample=True, top_p=0.9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=True, top_k=1), m.generate(ids, max_new_tokens=4))


@pytest.mark.parametrize("spec,variant", SPECS)
def test_cache_bytes_equal_stats(spec, variant):
    """cache.nbytes = what `mtc stats` prints per sequence (MLA latent KV cache at T = max_len + KDA and conv state)
    times the batch, and what the memory plan counts (one GPU); in the spec's f32 and, for tiny, in bf16."""
    for dtype in ("f32", "bf16") if variant == "tiny" else ("f32",):
        g = dsl.load(spec, variant=variant, dtype=dtype)
        m = dsl.compile(g, target="reference", dtype=dtype)
        B, L = 3, 777
        cache = m.new_cache(B, L)
        s = compute_stats(g, seq_len=L, batch=B)
        assert cache.latent_bytes == s.kv_cache_bytes
        assert cache.state_bytes == s.kda_state_bytes
        p = plan_memory(g, seq_len=L, gpus=1, batch=B)
        assert cache.nbytes == p.kv_cache_bytes + p.kda_state_bytes
        assert all(t.dtype == torch.float32 for t in cache.kda.values())
        assert all(t.dtype == m.dtype for t in (*cache.latent.values(), *cache.conv.values()))


def test_bad_input_is_a_clear_error_and_writes_nothing():
    m = _model("models/kimi_k3.mtc", "tiny")
    ids = torch.randint(0, 256, (2, 30))
    cache = m.new_cache(2, 32)
    m.prefill(ids, cache)

    def snapshot():
        return list(cache.lengths), [t.clone() for t in cache.tensors()]

    def unchanged(before):
        assert cache.lengths == before[0]
        assert all(torch.equal(a, b) for a, b in zip(before[1], cache.tensors()))

    before = snapshot()
    with pytest.raises(MtcError, match="past the cache's max_len"):
        m.prefill(ids[:, :3], cache)                       # 30 + 3 > 32
    unchanged(before)
    m.decode(ids[:, :1], cache)
    m.decode(ids[:, :1], cache)
    before = snapshot()
    with pytest.raises(MtcError, match="max_len"):
        m.decode(ids[:, :1], cache)                        # row 0 already holds 32
    unchanged(before)
    with pytest.raises(MtcError, match="batch_size 2"):
        m.decode(ids[:1, :1], cache)
    with pytest.raises(MtcError, match="\\[B, 1\\]"):
        m.decode(ids[:, :2], cache)
    other = dsl.compile(dsl.load("models/kimi_k3.mtc", variant="tiny"), target="reference", seed=0).eval()
    with pytest.raises(MtcError, match="another model"):
        other.decode(ids[:, :1], cache)
    unchanged(before)
    fresh = m.new_cache(2, 10)
    with pytest.raises(MtcError, match="empty prompt"):
        m.prefill(ids[:, :0], fresh)
    with pytest.raises(MtcError, match="empty prompt"):
        m.prefill(ids[:, :5], fresh, lengths=[3, 0])
    with pytest.raises(MtcError, match="prefill the prompt first"):
        m.decode(ids[:, :1], fresh)
    with pytest.raises(MtcError, match="empty prompt"):
        m.generate(ids[:, :0], max_new_tokens=2)
    with pytest.raises(MtcError, match="outside the vocabulary"):
        m.prefill(torch.full((2, 4), 999), fresh)
    with pytest.raises(MtcError, match="lengths"):
        m.prefill(ids[:, :5], fresh, lengths=[3, 6])
    with pytest.raises(MtcError, match="temperature"):
        m.generate(ids, max_new_tokens=2, do_sample=True, temperature=0.0)
    with pytest.raises(MtcError, match="top_p"):
        m.generate(ids, max_new_tokens=2, do_sample=True, top_p=1.5)
    with pytest.raises(MtcError, match="batch_size"):
        m.new_cache(0, 10)
    assert fresh.lengths == [0, 0] and not any(t.any() for t in fresh.tensors())


def test_an_error_inside_a_step_marks_the_cache_incomplete(monkeypatch):
    """A failure while the program runs (here: a launch that raises) leaves states of some layers advanced: the
    cache says so at its next use, until reset()."""
    import backends.inference as inf
    m = _model("models/kimi_k3.mtc", "tiny")
    ids = torch.randint(0, 256, (1, 20))
    cache = m.new_cache(1, 40)
    m.prefill(ids, cache)
    calls = []

    def failing(self, L, fn, call, args):
        calls.append(L.kernel)
        if len(calls) == 4:
            raise RuntimeError("injected")
        return orig(self, L, fn, call, args)
    orig = inf._Session.launch
    monkeypatch.setattr(inf._Session, "launch", failing)
    with pytest.raises(RuntimeError, match="injected"):
        m.decode(ids[:, :1], cache)
    monkeypatch.setattr(inf._Session, "launch", orig)
    assert m._seq is None and not m.training           # the session ended: no cache-aware launches left
    with pytest.raises(MtcError, match="left incomplete.*reset"):
        m.decode(ids[:, :1], cache)
    cache.reset()
    assert cache.lengths == [0] and not any(t.any() for t in cache.tensors())
    with torch.no_grad():
        ref = m(ids)
    assert _rel(m.prefill(ids, cache), ref) < 1e-5


@pytest.mark.parametrize("spec,variant", SPECS)
def test_packed_forward_with_cu_seqlens_equals_each_sequence_alone(spec, variant):
    """m(ids [1, T], cu_seqlens=...) over 4 packed documents (lengths 50, 1, 33, 16) in train mode: the logits and
    the gradients of every weight equal those of the documents run one by one (no state, no attention across a
    boundary)."""
    m = dsl.compile(dsl.load(spec, variant=variant), target="reference", seed=0)
    m.balance = None                                       # (no router-bias step between the calls compared)
    lens = [50, 1, 33, 16]
    docs = [torch.randint(0, _vocab(m), (n,)) for n in lens]
    cu = torch.tensor([0, 50, 51, 84, 100], dtype=torch.int32)
    w = torch.randn(100, _vocab(m))                       # a loss that weighs every logit differently

    def grads(loss):
        m.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    packed = m(torch.cat(docs)[None], cu_seqlens=cu)
    g_packed = grads((packed[0] * w).sum())
    alone = torch.cat([m(d[None])[0] for d in docs])
    g_alone = grads((alone * w).sum())
    assert _rel(packed[0].detach(), alone.detach()) < 1e-5
    assert _rel(g_packed, g_alone) < 1e-5
    with pytest.raises(MtcError, match="end at T = 100"):
        m(torch.cat(docs)[None], cu_seqlens=torch.tensor([0, 50, 99]))
    with pytest.raises(MtcError, match="one row"):
        m(torch.zeros(2, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5]))


def test_default_chunk_comes_from_the_plan_and_generate_of_zero_tokens():
    """Without chunk_tokens the chunk is the plan's choice (a power of two from 256, at most the prompt); the
    logits are the forward's. max_new_tokens=0 returns the prompt."""
    from backends.inference import PREFILL_CHUNK_MAX, default_chunk_tokens, prefill_bytes
    m = _model("models/kimi_k3.mtc", "tiny")
    ids = _clear(m, (1, 700))
    cache = m.new_cache(1, 700)
    c = default_chunk_tokens(m, cache, 700)
    assert c in (256, 512) and prefill_bytes(m, cache, c) >= m.plan_memory(B=1, T=c)[1] > 0
    assert default_chunk_tokens(m, m.new_cache(1, 1 << 16), 1 << 16) <= PREFILL_CHUNK_MAX
    with torch.no_grad():
        ref = m(ids)
    assert _rel(m.prefill(ids, cache), ref) < 1e-5
    assert torch.equal(m.generate(ids[:, :5], max_new_tokens=0), ids[:, :5])


def test_nan_weights_inside_a_cached_step_are_an_mtc_error_at_the_op():
    m = dsl.compile(dsl.load("models/kimi_k3.mtc", variant="tiny"), target="reference", seed=0).eval()
    with torch.no_grad():
        m.get_parameter("model.layers.0.self_attn.q_proj.weight")[0, 0] = float("nan")
    cache = m.new_cache(1, 8)
    with pytest.raises(MtcError, match=r"short_conv\(\.\.\.\) with the inference cache: .*NaN") as e:
        m.prefill(torch.randint(0, 256, (1, 5)), cache)       # the q projection's first consumer sees it
    assert e.value.loc is not None and "kimi_k3.mtc" in e.value.loc.file
    with pytest.raises(MtcError, match="left incomplete"):
        m.decode(torch.zeros(1, 1, dtype=torch.long), cache)
