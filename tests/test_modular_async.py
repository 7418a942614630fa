"""Async prepare/finalize (``prepare_async`` / ``finalize_async``: hook, receiver), DBO and ``supports_dbo``
(vLLM ``fused_moe/modular_kernel.py`` 0.17.0 / 0.33.0, ``vllm/v1/worker/ubatching.py``).

The oracles: the synchronous kernel's output (the async protocol must not change a bit), and the order in which the
hooks and receivers run, derived by hand from ``ubatching.py`` (``dbo_register_recv_hook`` stores the hook in the next
ubatch, which runs it at its next ``dbo_maybe_run_recv_hook``: in ``_prepare``, in DeepEP-LL-style ``finalize_async``,
or when its context exits)."""

from __future__ import annotations

import pytest
import torch

from reference.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig
from reference.experts import ReferenceExperts
from reference.modular import (
    AsyncMoEPrepareAndFinalizeNoEP,
    FusedMoEKernel,
    MoEPrepareAndFinalizeNoEP,
    TopKWeightAndReduceDelegate,
    split_hook_receiver,
)
from reference.modular.ubatching import dbo_current_ubatch_id, dbo_enabled, run_ubatches
from reference.semantics import point
from reference.shared_experts import SharedExperts

CFG = FusedMoEConfig(8, 3, 64, 48, 8)
QC = FUSED_MOE_UNQUANTIZED_CONFIG


def make(M=22, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 64, generator=g)
    w1 = torch.randn(8, 96, 64, generator=g) / 8
    w2 = torch.randn(8, 64, 48, generator=g) / 7
    w = torch.rand(M, 3, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(M)]).to(torch.int32)
    return x, w1, w2, w, ids


def kernel(pf, semantics="0.33"):
    return FusedMoEKernel(pf, ReferenceExperts(CFG, QC), semantics=semantics)


@pytest.mark.parametrize("return_hook", [True, False], ids=["hook_receiver", "receiver_only"])
def test_prepare_async_then_receive_equals_prepare(return_hook):
    x, _, _, w, ids = make()
    pf = AsyncMoEPrepareAndFinalizeNoEP(return_hook=return_hook)
    ret = pf.prepare_async(x, w, ids, 8, None, False, QC)
    hook, receiver = split_hook_receiver(ret)
    assert (hook is not None) == return_hook
    if hook is not None:
        with pytest.raises(RuntimeError, match="before its hook"):
            receiver()
        hook()
        with pytest.raises(RuntimeError, match="twice"):
            hook()
    got = receiver()
    want = MoEPrepareAndFinalizeNoEP().prepare(x, w, ids, 8, None, False, QC)
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    with pytest.raises(RuntimeError, match="twice"):
        receiver()


@pytest.mark.parametrize("return_hook", [True, False], ids=["hook_receiver", "receiver_only"])
def test_finalize_async_writes_output_only_when_received(return_hook):
    g = torch.Generator().manual_seed(3)
    fused = torch.randn(5, 3, 16, generator=g)
    w = torch.rand(5, 3, generator=g)
    ids = torch.randint(0, 8, (5, 3), generator=g, dtype=torch.int32)
    out = torch.full((5, 16), float("nan"))
    pf = AsyncMoEPrepareAndFinalizeNoEP(return_hook=return_hook)
    hook, receiver = split_hook_receiver(
        pf.finalize_async(out, fused, w, ids, False, TopKWeightAndReduceDelegate()))
    assert torch.isnan(out).all()  # "output not valid yet"
    if hook is not None:
        hook()
    receiver()
    # Oracle: the weighted sum over the top-k slots, in float64.
    want = (fused.double() * w.double().unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)


def test_split_hook_receiver_rejects_other_returns():
    with pytest.raises(TypeError):
        split_hook_receiver((1, 2))
    assert split_hook_receiver(print) == (None, print)


def test_base_class_async_methods_raise():
    pf = MoEPrepareAndFinalizeNoEP()
    assert not pf.supports_async() and not pf.supports_dbo()
    with pytest.raises(NotImplementedError):
        pf.prepare_async(None, None, None, 8, None, False, QC)
    with pytest.raises(NotImplementedError):
        pf.finalize_async(None, None, None, None, False, None)
    assert AsyncMoEPrepareAndFinalizeNoEP().supports_dbo()  # 0.33 default: supports_async()


@pytest.mark.parametrize("semantics", ["0.17", "0.33"])
@pytest.mark.parametrize("return_hook", [True, False], ids=["hook_receiver", "receiver_only"])
def test_async_kernel_is_bitwise_the_sync_kernel(semantics, return_hook):
    x, w1, w2, w, ids = make()
    events = []
    out = kernel(AsyncMoEPrepareAndFinalizeNoEP(return_hook, events), semantics).apply(x, w1, w2, w, ids)
    ref = kernel(MoEPrepareAndFinalizeNoEP(), semantics).apply(x, w1, w2, w, ids)
    assert torch.equal(out, ref)
    if return_hook:  # without DBO the kernel calls each hook at once, then its receiver
        assert events == [("prepare_hook", 0), ("prepare_receiver", 0), ("finalize_hook", 0),
                          ("finalize_receiver", 0)]
    else:
        assert events == [("prepare_receiver", 0), ("finalize_receiver", 0)]


@pytest.mark.parametrize("semantics", ["0.17", "0.33"])
def test_dbo_runs_each_hook_in_the_other_ubatch(semantics):
    x, w1, w2, w, ids = make()
    h = x.size(0) // 2
    events = []
    k = kernel(AsyncMoEPrepareAndFinalizeNoEP(True, events), semantics)
    seen = []

    def ub(s):
        def f():
            seen.append((dbo_enabled(), dbo_current_ubatch_id()))
            return k.apply(x[s], w1, w2, w[s], ids[s])
        return f

    a, b = run_ubatches([ub(slice(0, h)), ub(slice(h, None))])
    assert seen == [(True, 0), (True, 1)]
    sync = kernel(MoEPrepareAndFinalizeNoEP(), semantics)
    assert torch.equal(a, sync.apply(x[:h], w1, w2, w[:h], ids[:h]))
    assert torch.equal(b, sync.apply(x[h:], w1, w2, w[h:], ids[h:]))
    # Hand-derived from ubatching.py: ubatch 1 runs ubatch 0's prepare hook in its _prepare, ubatch 0 runs ubatch
    # 1's in its finalize_async, ubatch 1 runs ubatch 0's finalize hook in its finalize_async, and ubatch 0's
    # context exit runs ubatch 1's finalize hook: every hook in the other ubatch, every hook before its receiver.
    assert events == [("prepare_hook", 1), ("prepare_receiver", 0), ("prepare_hook", 0), ("prepare_receiver", 1),
                      ("finalize_hook", 1), ("finalize_receiver", 0), ("finalize_hook", 0),
                      ("finalize_receiver", 1)]


def test_dbo_receiver_only_runs_the_ubatches_one_after_the_other():
    x, w1, w2, w, ids = make()
    events = []
    k = kernel(AsyncMoEPrepareAndFinalizeNoEP(False, events))
    run_ubatches([lambda: k.apply(x[:8], w1, w2, w[:8], ids[:8]), lambda: k.apply(x[8:], w1, w2, w[8:], ids[8:])])
    assert events == [("prepare_receiver", 0), ("finalize_receiver", 0), ("prepare_receiver", 1),
                      ("finalize_receiver", 1)]


class _SyncDbo(MoEPrepareAndFinalizeNoEP):
    """A synchronous prepare/finalize that does its own DBO hand-off (0.33 NaiveDPEP on ROCm)."""

    def supports_dbo(self) -> bool:
        return True


@pytest.mark.parametrize("semantics,pf_cls,ok", [
    ("0.17", MoEPrepareAndFinalizeNoEP, False), ("0.17", _SyncDbo, False),
    ("0.33", MoEPrepareAndFinalizeNoEP, False), ("0.33", _SyncDbo, True)])
def test_synchronous_prepare_finalize_under_dbo(semantics, pf_cls, ok):
    x, w1, w2, w, ids = make()
    k = kernel(pf_cls(), semantics)
    fns = [lambda: k.apply(x[:8], w1, w2, w[:8], ids[:8]), lambda: k.apply(x[8:], w1, w2, w[8:], ids[8:])]
    if ok:
        a, b = run_ubatches(fns)
        assert torch.equal(torch.cat([a, b]), torch.cat([k.apply(x[:8], w1, w2, w[:8], ids[:8]),
                                                          k.apply(x[8:], w1, w2, w[8:], ids[8:])]))
    else:
        with pytest.raises(ValueError, match="DBO"):
            run_ubatches(fns)
    # Outside DBO every synchronous prepare/finalize runs, under both versions.
    k.apply(x, w1, w2, w, ids)


def test_mk_internal_shared_experts_run_between_finalize_async_and_its_hook():
    x, w1, w2, w, ids = make()
    events = []
    k = kernel(AsyncMoEPrepareAndFinalizeNoEP(True, events))

    def layer(h):
        events.append(("shared", 0))
        return h * 2

    se = SharedExperts(layer, mk_can_overlap_shared_experts=lambda: k.can_overlap_shared_experts)
    shared, routed = k.forward_with_shared_experts(se, x, w1, w2, w, ids)
    assert events == [("prepare_hook", 0), ("prepare_receiver", 0), ("shared", 0), ("finalize_hook", 0),
                      ("finalize_receiver", 0)]
    assert torch.equal(shared, x * 2)


def test_supports_dbo_is_a_semantics_point():
    p = point("modular.supports_dbo")
    assert "supports_dbo" in p.behaviour["0.33"] and "supports_async" in p.behaviour["0.17"]
