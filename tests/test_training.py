"""Training a compiled model (target="reference", the tiny K3 variant, float32): activation checkpointing with
router balancing on, resuming from a state dict, the balance mode's validation. From a new-user trial of the
training workflow (2026-11-30)."""
import copy
import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dsl
from dsl.errors import MtcError, MtcWarning

K3 = Path(__file__).resolve().parent.parent / "models" / "kimi_k3.mtc"
VOCAB = 256


@pytest.fixture(scope="module")
def fresh():
    """A freshly initialised tiny model (train mode); tests deep-copy it."""
    return dsl.compile(dsl.load(K3, "tiny"), target="reference", seed=0).train()


def loss_of(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def biases(m):
    return {k: v.clone() for k, v in m.state_dict().items() if k.endswith("e_score_correction_bias")}


def test_activation_checkpointing_with_balancing_matches_plain_backward(fresh):
    # the recomputation inside the backward routes with the bias the forward used, and does not update the
    # bias, count the update or call the hooks again: gradients and biases equal those of a plain step
    # (non-reentrant checkpointing, torch's default; the reentrant form needs an input that requires a
    # gradient, and token ids cannot)
    a, b = copy.deepcopy(fresh), copy.deepcopy(fresh)
    calls = {"a": 0, "b": 0}
    a.stats_hooks.append(lambda layer, load: calls.__setitem__("a", calls["a"] + 1))
    b.stats_hooks.append(lambda layer, load: calls.__setitem__("b", calls["b"] + 1))
    for step in range(2):                                   # the second step routes with an updated bias
        ids = torch.randint(0, VOCAB, (2, 65))
        la = loss_of(a(ids), ids)
        la.backward()
        lb = loss_of(checkpoint(b, ids, use_reentrant=False), ids)
        lb.backward()
        assert torch.equal(la.detach(), lb.detach()), step
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-7), name
    ba, bb = biases(a), biases(b)
    assert ba and all(torch.equal(ba[k], bb[k]) for k in ba)
    assert not all(torch.equal(ba[k], biases(fresh)[k]) for k in ba)   # balancing did update the biases
    assert calls["a"] == calls["b"] > 0
    assert torch.equal(a.balance_updates, b.balance_updates) and int(a.balance_updates.min()) == 2


def _grads_equal(a, b):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-7), name


def test_checkpointed_micro_batches_summed_into_one_backward(fresh):
    # two train-mode forwards (each moves the router biases) before one backward: each recomputation routes with
    # the bias its own forward used, so gradients and biases equal those of the same step without checkpointing
    a, b = copy.deepcopy(fresh), copy.deepcopy(fresh)
    micro = [torch.randint(0, VOCAB, (2, 65)) for _ in range(3)]
    la = sum(loss_of(a(ids), ids) for ids in micro)
    la.backward()
    lb = sum(loss_of(checkpoint(b, ids, use_reentrant=False), ids) for ids in micro)
    lb.backward()
    assert torch.equal(la.detach(), lb.detach())
    _grads_equal(a, b)
    ba, bb = biases(a), biases(b)
    assert all(torch.equal(ba[k], bb[k]) for k in ba) and int(b.balance_updates.min()) == 3


def test_checkpointed_micro_batches_past_the_kept_biases(fresh, monkeypatch):
    # more pending checkpointed forwards than backends.runtime.BIAS_KEEP_FORWARDS before one backward: the oldest
    # forward's bias is dropped, and its recomputation raises a clear MtcError (new-user trial, 16th session: past
    # the old limit of 64 it was torch's CheckpointError, or silently the current bias); forwards already
    # recomputed do not count against the limit, so backward after every micro-batch never hits it
    import backends.runtime as rt
    monkeypatch.setattr(rt, "BIAS_KEEP_FORWARDS", 3)
    micro = [torch.randint(0, VOCAB, (1, 17)) for _ in range(5)]
    b = copy.deepcopy(fresh)
    lb = sum(loss_of(checkpoint(b, ids, use_reentrant=False), ids) for ids in micro)
    with pytest.raises(MtcError, match=r"router bias .* is no longer kept: more than 3 train-mode forwards"):
        lb.backward()
    del lb
    b.balance = None                                    # (no bias kept for the forwards below)
    a = copy.deepcopy(b)                                # a new forward over the dropped one's tensor is not it
    la = loss_of(a(micro[0]), micro[0])
    la.backward()
    lb = loss_of(checkpoint(b, micro[0], use_reentrant=False), micro[0])
    lb.backward()
    _grads_equal(a, b)
    a, b = copy.deepcopy(fresh), copy.deepcopy(fresh)
    for ids in micro:                                   # 5 forward+backward pairs: never more than 1 pending
        loss_of(a(ids), ids).backward()
        loss_of(checkpoint(b, ids, use_reentrant=False), ids).backward()
    _grads_equal(a, b)
    assert all(len(v) <= 3 for v in b._bias_used.values())
    a, b = copy.deepcopy(fresh), copy.deepcopy(fresh)   # 3 pending: exact
    la = sum(loss_of(a(ids), ids) for ids in micro[:3])
    la.backward()
    lb = sum(loss_of(checkpoint(b, ids, use_reentrant=False), ids) for ids in micro[:3])
    lb.backward()
    _grads_equal(a, b)


def test_checkpointing_the_same_input_tensor_twice_before_one_backward(fresh):
    # two forwards over the same tensor before one backward, the bias moving in between: a recomputation cannot
    # tell which bias was its own, so the backward refuses (clearly) instead of giving wrong gradients (new-user
    # trial, 14th session: 9% off at T = 1, a torch CheckpointError at T >= 2); a clone per forward is exact, and
    # so is the same tensor when the bias does not move (balance_defer) or each backward follows its forward
    ids = torch.randint(0, VOCAB, (1, 9))
    b = copy.deepcopy(fresh)
    lb = loss_of(checkpoint(b, ids, use_reentrant=False), ids) + loss_of(checkpoint(b, ids, use_reentrant=False), ids)
    with pytest.raises(MtcError, match="same input tensor went through two train-mode forwards"):
        lb.backward()
    for same_bias in (False, True):
        a, b = copy.deepcopy(fresh), copy.deepcopy(fresh)
        a.balance_defer = b.balance_defer = same_bias
        la = loss_of(a(ids), ids) + loss_of(a(ids), ids)
        la.backward()
        second = ids if same_bias else ids.clone()
        lb = loss_of(checkpoint(b, ids, use_reentrant=False), ids) + loss_of(
            checkpoint(b, second, use_reentrant=False), ids)
        lb.backward()
        assert torch.equal(la.detach(), lb.detach())
        _grads_equal(a, b)
    # one tensor, one backward after each forward (a loop over the same batch): exact
    a, b = copy.deepcopy(fresh), copy.deepcopy(fresh)
    for _ in range(2):
        loss_of(a(ids), ids).backward()
        loss_of(checkpoint(b, ids, use_reentrant=False), ids).backward()
    _grads_equal(a, b)
    # a whole-module save after such forwards: the kept biases (for recomputations in flight) are not saved
    buf = io.BytesIO()
    torch.save(b, buf)
    assert torch.load(io.BytesIO(buf.getvalue()), weights_only=False)._bias_used == {}


def test_checkpointing_with_apply_balance_before_the_backward(fresh):
    # balance_defer: apply_balance() may come before the backward; the recomputation still routes with the bias of
    # the forward (not the updated one)
    a, b = copy.deepcopy(fresh), copy.deepcopy(fresh)
    a.balance_defer = b.balance_defer = True
    ids = torch.randint(0, VOCAB, (2, 65))
    la = loss_of(a(ids), ids)
    a.apply_balance()
    la.backward()
    lb = loss_of(checkpoint(b, ids, use_reentrant=False), ids)
    b.apply_balance()
    lb.backward()
    _grads_equal(a, b)
    ba, bb = biases(a), biases(b)
    assert all(torch.equal(ba[k], bb[k]) for k in ba)
    assert not all(torch.equal(ba[k], biases(fresh)[k]) for k in ba)   # apply_balance did update the biases


def test_resume_from_a_state_dict_continues_training_identically(fresh):
    torch.manual_seed(1)
    batches = [torch.randint(0, VOCAB, (1, 48)) for _ in range(7)]
    a = copy.deepcopy(fresh)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-3)

    def step(m, opt, ids):
        opt.zero_grad()
        loss = loss_of(m(ids), ids)
        loss.backward()
        opt.step()
        return loss.item()

    for ids in batches[:4]:                                 # past the ema warm-up (3 updates)
        step(a, opt_a, ids)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf)
    b = copy.deepcopy(fresh)
    b.load_state_dict(ck["model"])
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3)
    opt_b.load_state_dict(ck["opt"])
    assert b._updates == a._updates and all(v == 4 for v in b._updates.values())
    for ids in batches[4:]:
        assert step(a, opt_a, ids) == step(b, opt_b, ids)
    ba, bb = biases(a), biases(b)
    assert all(torch.equal(ba[k], bb[k]) for k in ba)


def test_a_state_dict_without_the_update_counts_still_loads(fresh):
    a = copy.deepcopy(fresh)
    ids = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        a(ids)                                              # one update per router
    sd = {k: v for k, v in a.state_dict().items() if k != "balance_updates"}
    b = copy.deepcopy(fresh)
    b.load_state_dict(sd)                                   # strict: no missing-key error
    assert int(b.balance_updates.sum()) == 0 and b._updates == {}
    assert all(torch.equal(v, biases(a)[k]) for k, v in biases(b).items())


def test_unknown_balance_mode_is_an_error(fresh):
    # refused where it is set (user trial: it used to surface only at the next forward)
    m = copy.deepcopy(fresh)
    with pytest.raises(ValueError, match=r"balance must be 'qb', 'fixed' or None, got 'QB'"):
        m.balance = "QB"
    assert m.balance == "qb"
    m.__dict__["balance"] = "QB"  # past the setter (a subclass, say): still refused at the forward
    with pytest.raises(ValueError, match=r"balance must be 'qb', 'fixed' or None, got 'QB'"):
        with torch.no_grad():
            m(torch.randint(0, VOCAB, (1, 20)))


def test_readme_training_snippet_runs(tmp_path, monkeypatch):
    # the README's "Training" example, as written, from a directory with the repository's models/ in it
    text = (K3.parent.parent / "README.md").read_text()
    block = text.split("## Training", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    (tmp_path / "models").symlink_to(K3.parent)
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(block, "README.md:Training", "exec"), scope)
    ck = torch.load(tmp_path / "ck.pt")
    assert int(ck["model"]["balance_updates"].min()) == 1       # one train-mode forward, one update per router
    ref = dsl.compile(dsl.load(K3, "tiny"), target="reference", seed=0).state_dict()
    moved = [k for k, v in scope["m"].state_dict().items() if v.is_floating_point() and not torch.equal(v, ref[k])]
    assert len(moved) > 10 and all(torch.isfinite(v).all() for v in scope["m"].state_dict().values())


def test_gradient_accumulation_with_deferred_balancing_equals_one_big_batch(fresh):
    # balance_defer: two micro-batches route with the same bias and apply_balance() makes one update from both,
    # so gradients and the new biases equal those of the batch of both rows in one forward
    big, acc = copy.deepcopy(fresh), copy.deepcopy(fresh)
    acc.balance_defer = True
    # rows whose top-k choices clear float32 rounding: the batched and the per-row forwards round the router
    # scores differently, and a near-tie could pick another expert in one of them (about 1 draw in 30 did)
    for _ in range(20):
        ids = torch.randint(0, VOCAB, (2, 49))
        if min(min(fresh.route_margins(ids[i:i + 1]).values()) for i in range(2)) > 1e-5:
            break
    loss_of(big(ids), ids).backward()
    for i in range(2):
        (loss_of(acc(ids[i:i + 1]), ids[i:i + 1]) / 2).backward()
    b0 = biases(fresh)
    assert all(torch.equal(v, b0[k]) for k, v in biases(acc).items())      # nothing moved before the apply
    n_routers = len(acc._router_order)
    assert acc.apply_balance() == n_routers and acc.apply_balance() == 0
    ba, bb = biases(big), biases(acc)
    assert all(torch.allclose(ba[k], bb[k], atol=1e-5) for k in ba)
    assert not all(torch.equal(bb[k], b0[k]) for k in bb)
    assert torch.equal(acc.balance_updates, big.balance_updates)
    for (name, pa), (_, pb) in zip(big.named_parameters(), acc.named_parameters()):
        if pa.grad is not None:
            assert torch.allclose(pa.grad, pb.grad, rtol=1e-4, atol=1e-6), name
    with torch.no_grad():                        # a mode change between the forwards and the apply is refused
        acc(ids[:1])
        acc.balance = "fixed"
    with pytest.raises(ValueError, match="balance mode changed"):
        acc.apply_balance()


def test_deferred_balancing_warns_when_apply_balance_is_never_called(fresh, monkeypatch):
    from backends import runtime
    from dsl.errors import MtcWarning
    monkeypatch.setattr(runtime, "DEFER_WARN_FORWARDS", 3)
    m = copy.deepcopy(fresh)
    m.balance_defer = True
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        m(ids)
        m(ids)
        with pytest.warns(MtcWarning, match="3 train-mode forwards have kept their router scores"):
            m(ids)
    assert m.apply_balance() > 0 and not m._deferred


@pytest.mark.parametrize("attr,bad,needle", [("balance_ema", 2.0, "balance_ema must be a number in \\[0, 1\\)"),
                                             ("balance_ema", -0.1, "balance_ema must be a number in \\[0, 1\\)"),
                                             ("balance_defer", "yes", "balance_defer must be True or False"),
                                             ("fixed_step", float("inf"), "fixed_step must be a finite number > 0"),
                                             ("fixed_step", float("nan"), "fixed_step must be a finite number > 0"),
                                             ("fixed_step", -1e-3, "fixed_step must be a finite number > 0")])
def test_balance_settings_are_checked_when_set_and_at_the_forward(fresh, attr, bad, needle):
    m = copy.deepcopy(fresh)
    before = getattr(m, attr)
    with pytest.raises(ValueError, match=needle):  # at the user's line (user trial: it used to wait for a forward)
        setattr(m, attr, bad)
    assert getattr(m, attr) == before
    m.__dict__[attr] = bad  # past the setter: the forward still refuses it
    if attr == "fixed_step":
        m.balance = "fixed"
    with pytest.raises(ValueError, match=needle):
        m(torch.randint(0, VOCAB, (1, 17)))


def test_kept_router_scores_are_dropped_when_no_longer_applicable(fresh):
    # balance_defer switched off with scores kept: the next forward balances at once and says it drops them;
    # load_state_dict drops them too (they belong to the replaced state)
    m = copy.deepcopy(fresh)
    m.balance_defer = True
    m(torch.randint(0, VOCAB, (1, 17)))
    m.balance_defer = False
    with pytest.warns(MtcWarning, match=r"balance_defer is off but 1 earlier forward\(s\) kept their router"):
        m(torch.randint(0, VOCAB, (1, 17)))
    assert m.apply_balance() == 0
    m.balance_defer = True
    m(torch.randint(0, VOCAB, (1, 17)))
    m.load_state_dict(copy.deepcopy(fresh).state_dict())
    assert m.apply_balance() == 0


def test_stats_hooks_are_checked_when_set_and_before_the_forward(fresh):
    """m.stats_hooks = None (or a tuple) is a TypeError at the assignment; a non-callable appended to the list is
    one before the forward runs, so no router bias moves (new-user trial, 16th session: a raw TypeError after the
    whole forward had updated every bias)."""
    m = copy.deepcopy(fresh)
    for bad in (None, (print,)):
        with pytest.raises(TypeError, match="stats_hooks must be a list of callables"):
            m.stats_hooks = bad
    m.stats_hooks.append(5)
    before = biases(m)
    ids = torch.randint(0, VOCAB, (1, 17))
    with pytest.raises(TypeError, match=r"stats_hooks\[0\] is int 5, not a callable"):
        m(ids)
    after = biases(m)
    assert all(torch.equal(before[k], after[k]) for k in before) and int(m.balance_updates.sum()) == 0
    m.stats_hooks.clear()
    m(ids)
    assert not all(torch.equal(before[k], v) for k, v in biases(m).items())
