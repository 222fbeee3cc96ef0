"""--fsdp.cpu_matmul: the trainer's linear layers through oneDNN compute what `nn.Linear` computes (forward,
input, weight and bias gradients, within float32 reordering), fall back to `F.linear` for anything else,
keep their parameters and names, stay on oneDNN inside torch.compile (--fsdp.compile), and a trainer that
uses them trains like one that does not."""

import pytest
import torch
import torch.nn.functional as F
from layouts import assert_same, make_sample, train_job
from torch import nn

from instar.train import cpu_kernels
from instar.train.cpu_kernels import OneDNNLinear, amd_cpu, use_cpu_matmul
from instar.train.launch import reserve_port
from instar.train.model import load_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def _turned(layer: nn.Linear) -> nn.Linear:
    twin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    twin.load_state_dict(layer.state_dict())
    twin.__class__ = OneDNNLinear
    return twin


@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_equals_nn_linear_forward_and_backward(bias):
    torch.manual_seed(0)
    plain = nn.Linear(48, 80, bias=bias)
    fast = _turned(plain)
    x = torch.randn(2, 37, 48)  # batch and token dimensions, as the trainer's [1, N, hidden] rows
    grad = torch.randn(2, 37, 80)
    outs = []
    for layer in (plain, fast):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(grad)
        outs.append([y, xi.grad, layer.weight.grad] + ([layer.bias.grad] if bias else []))
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert outs[1][0].shape == (2, 37, 80)


def test_a_compiled_layer_keeps_its_products_on_onednn_and_its_gradients(monkeypatch):
    """Traced as the aten op, inductor has no training lowering for oneDNN's linear and would fall back to the
    BLAS (or fail): the layer's product is an operator of its own, called as one kernel from the graph."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(24, 40, bias=False), nn.SiLU(), nn.Linear(40, 24))
    fast = nn.Sequential(_turned(plain[0]), nn.SiLU(), _turned(plain[2]))
    calls = []
    kernel = cpu_kernels.onednn_linear
    monkeypatch.setattr(cpu_kernels, "onednn_linear", lambda *a: calls.append(a[0].shape) or kernel(*a))
    x, grad = torch.randn(1, 29, 24), torch.randn(1, 29, 24)
    outs = []
    for model in (plain, torch.compile(fast, dynamic=True)):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(grad)
        outs.append([y, xi.grad] + [p.grad for p in model.parameters()])
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the two forwards and the input gradients of both layers (the weight gradients run on the BLAS)
    assert sorted(calls) == sorted([(1, 29, 24), (1, 29, 40), (1, 29, 24), (1, 29, 40)])


def test_a_frozen_input_or_weight_gets_no_gradient_computed():
    fast = _turned(nn.Linear(16, 8, bias=False))
    fast.weight.requires_grad_(False)
    x = torch.randn(5, 16, requires_grad=True)
    fast(x).sum().backward()
    torch.testing.assert_close(x.grad, fast.weight.sum(0).expand(5, 16), rtol=1e-5, atol=1e-6)
    assert fast.weight.grad is None


def test_anything_but_float32_on_the_cpu_goes_through_f_linear(monkeypatch):
    fast = _turned(nn.Linear(16, 8)).to(torch.bfloat16)
    called = []
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: called.append(a))
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(fast(x), F.linear(x, fast.weight, fast.bias)) and not called
    empty = torch.zeros(0, 16, requires_grad=True)  # a context-parallel rank's share can be empty
    fast.float()(empty).sum().backward()
    assert fast.weight.grad is not None and not fast.weight.grad.any() and not called


def test_use_cpu_matmul_turns_plain_linear_layers_and_keeps_their_names(tiny_model_dir):
    model = load_model(str(tiny_model_dir))
    names = dict(model.named_parameters())
    plain = [m for m in model.modules() if type(m) is nn.Linear]
    assert use_cpu_matmul(model, "blas") == 0
    assert use_cpu_matmul(model, "onednn") == len(plain) > 0
    assert all(type(m) is OneDNNLinear for m in plain)
    assert dict(model.named_parameters()) == names  # the same tensors under the same names
    assert (use_cpu_matmul(load_model(str(tiny_model_dir)), "auto") > 0) == amd_cpu()  # a rule, not a timing


def test_onednn_asked_of_a_build_without_it_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no oneDNN"):
        use_cpu_matmul(nn.Linear(2, 2), "onednn")
    assert use_cpu_matmul(nn.Linear(2, 2), "auto") == 0


@pytest.mark.slow
def test_a_trainer_on_onednn_trains_like_one_on_the_blas(tiny_model_dir):
    """Three steps, logprobs before and after, the metrics and the weights: equal within float32 reordering."""
    samples = [make_sample(n, i) for i, n in enumerate([7, 12, 5, 9, 3, 10])]
    blas = train_job(0, 1, reserve_port(), tiny_model_dir, {"cpu_matmul": "blas"}, samples, None)
    assert_same(train_job(0, 1, reserve_port(), tiny_model_dir, {"cpu_matmul": "onednn"}, samples, None), blas)
