"""``fused_head_logprobs``: the LM head's log-probs chunk by chunk in the forward and the
backward pass, equal to the plain computation and holding no (N, V) logits for the backward."""

import math

import pytest
import torch

from learners.training.logprob_kernel import fused_head_logprobs
from learners.objectives.losses import entropy_from_logits, logprobs_from_logits


def _plain(h, w, labels, t):
    return logprobs_from_logits((h @ w.t()).float() / t, labels)


def test_by_hand_one_state_two_tokens():
    # z = h W^T = [h, 0]; log p(token 0) = h - log(e^h + 1); d/dh = 1 - e^h / (e^h + 1) = 1 / (e + 1) at h = 1.
    h = torch.tensor([[1.0]], requires_grad=True)
    w = torch.tensor([[1.0], [0.0]], requires_grad=True)
    lp, ent = fused_head_logprobs(h, w, torch.tensor([0]))
    assert lp.item() == pytest.approx(1 - math.log(math.e + 1), abs=1e-6) and ent.numel() == 0
    lp.sum().backward()
    assert h.grad.item() == pytest.approx(1 / (math.e + 1), abs=1e-6)
    # d/dW: row 0 gets (1 - p0) h, row 1 gets -p1 h.
    p0 = math.e / (math.e + 1)
    assert w.grad[:, 0].tolist() == pytest.approx([1 - p0, -(1 - p0)], abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
def test_values_entropy_and_gradients_equal_the_plain_path(chunk):
    g = torch.Generator().manual_seed(0)
    n, hdim, vocab, t = 37, 16, 50, 0.7
    h = torch.randn(n, hdim, generator=g, requires_grad=True)
    w = torch.randn(vocab, hdim, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    lp, ent = fused_head_logprobs(h, w, labels, t, chunk, with_entropy=True)
    (lp * upstream).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    want = _plain(h, w, labels, t)
    (want * upstream).sum().backward()
    assert torch.allclose(lp, want, atol=1e-5)
    assert torch.allclose(ent, entropy_from_logits((h @ w.t()).detach() / t), atol=1e-5)
    assert torch.allclose(gh, h.grad, atol=1e-5) and torch.allclose(gw, w.grad, atol=1e-5)
    assert not ent.requires_grad


def test_a_naive_loop_over_rows_agrees():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(5, 4, generator=g), torch.randn(9, 4, generator=g)
    labels = torch.randint(0, 9, (5,), generator=g)
    lp, _ = fused_head_logprobs(h, w, labels, 2.0, 2)
    for i in range(5):
        z = [sum(h[i, k].item() * w[v, k].item() for k in range(4)) / 2.0 for v in range(9)]
        m = max(z)
        lse = m + math.log(sum(math.exp(x - m) for x in z))
        assert lp[i].item() == pytest.approx(z[labels[i]] - lse, abs=1e-5)


def test_bf16_inputs_match_the_bf16_plain_path_and_return_bf16_gradients():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(20, 32, generator=g).bfloat16().requires_grad_()
    w = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, 64, (20,), generator=g)
    lp, _ = fused_head_logprobs(h, w, labels, 1.0, 7)
    lp.sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    _plain(h, w, labels, 1.0).sum().backward()
    assert lp.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
    assert torch.allclose(lp, _plain(h.detach(), w.detach(), labels, 1.0), atol=1e-4)
    assert torch.allclose(gh.float(), h.grad.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(gw.float(), w.grad.float(), atol=2e-2, rtol=2e-2)


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps for the backward pass while ``fn`` builds its graph."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_no_logits_are_kept_for_the_backward_pass():
    n, hdim, vocab = 256, 16, 4096
    h = torch.randn(n, hdim, requires_grad=True)
    w = torch.randn(vocab, hdim, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    logits_bytes = n * vocab * 4
    plain = _saved_bytes(
        lambda: torch.cat([_plain(h[s : s + 64], w, labels[s : s + 64], 1.0) for s in range(0, n, 64)])
    )
    fused = _saved_bytes(lambda: fused_head_logprobs(h, w, labels, 1.0, 64))
    assert plain >= logits_bytes  # every chunk's logits, alive until backward
    assert fused < logits_bytes / 10  # hidden, weight, labels and one logsumexp per row
