"""The CPU accelerator in the trainer (`cpu/trainer.py`). --cpu.matmul: linear layers through oneDNN compute what
`nn.Linear` computes (forward, input, weight and bias gradients, within float32 reordering), fall back to
`F.linear` for anything else, keep their parameters and names, stay on oneDNN inside torch.compile. The compiled
layers' norms are Llama's with their gradients, and one graph serves every micro-batch size. malloc keeps freed
blocks. A trainer with the accelerator trains like the plain one."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers.layouts import assert_same, full_state, make_sample, step
from torch import nn

from instar.config import ActorConfig, CpuConfig, FSDPConfig, TrainConfig
from instar.cpu import trainer as cpu_kernels
from instar.cpu.trainer import OneDNNLinear, _llama_norm, _norm_forward, amd_cpu, prepare, use_cpu_matmul
from instar.train.launch import reserve_port
from instar.train.model import decoder_layers, load_model
from instar.train.parallel import compile_layers
from instar.train.worker import TrainWorker

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


def job(model_dir, cpu: CpuConfig | None, samples) -> dict:
    """`layouts.train_job` on one rank, with the accelerator's settings ``cpu``."""
    w = TrainWorker(ActorConfig(model_name_or_path=str(model_dir), learning_rate=1e-3, lr_warmup_steps=1),
                    FSDPConfig(), TrainConfig(max_tokens_per_gpu=24, max_steps=10), cpu=cpu)
    w.init(0, 1, "127.0.0.1", reserve_port())
    out = {"attention": w.policy.config._attn_implementation, "initial": w.compute_logprobs(samples),
           "metrics": [step(w, samples) for _ in range(3)]}
    out |= {"state": full_state(w), "logprobs": w.compute_logprobs(samples)}
    w.shutdown()
    return out


@pytest.mark.slow
def test_a_trainer_with_the_accelerator_trains_like_the_plain_one(tiny_model_dir):
    """Three steps, logprobs before and after, the metrics and the weights: equal within float32 reordering, with
    the attention kernel on the BLAS and on oneDNN."""
    samples = [make_sample(n, i) for i, n in enumerate([7, 12, 5, 9, 3, 10])]
    plain = job(tiny_model_dir, None, samples)
    assert plain["attention"] == "instar_packed"
    for matmul in ("blas", "onednn"):
        accelerated = job(tiny_model_dir, CpuConfig(enable=True, matmul=matmul), samples)
        assert accelerated["attention"] == "instar_cpu"
        assert_same(accelerated, plain)


def test_prepare_swaps_linears_by_the_rule_and_the_compiled_layers_norms(tiny_heads4_dir):
    model = load_model(str(tiny_heads4_dir))
    compile_layers(model)
    prepare(model, CpuConfig(enable=True, matmul="onednn"))
    assert not any(type(m) is nn.Linear for m in model.modules())
    norms = [m for layer in decoder_layers(model) for m in layer.modules() if _llama_norm(m)]
    assert norms and all(m.forward.__func__ is _norm_forward for m in norms)
    plain = load_model(str(tiny_heads4_dir))
    prepare(plain, CpuConfig(enable=True, matmul="blas"))  # not compiled: norms untouched, linears kept
    assert any(type(m) is nn.Linear for m in plain.modules())
    assert all("forward" not in vars(m) for m in plain.modules() if _llama_norm(m))


def test_token_counts_share_one_graph(tiny_heads4_dir):
    """Micro-batches of 700 to 5000 tokens (inductor sums floats in chunks above 4096 terms: a norm's weight
    gradient over every token used to make a new graph at 1024, 2048 and 4096) all run the first graph."""
    ref, model = (load_model(str(tiny_heads4_dir)) for _ in range(2))
    compile_layers(model)
    prepare(model, CpuConfig(enable=True, matmul="blas"))
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    for k, n in enumerate((700, 1500, 3000, 5000, 2100)):
        ids, positions = torch.randint(0, 200, (1, n)), torch.arange(n)[None] % 97
        out, expect = model(ids, position_ids=positions).logits, ref(ids, position_ids=positions).logits
        torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-5)
        out.square().mean().backward()
        expect.square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
            p.grad = q.grad = None
        if k == 0:
            built = graphs["unique_graphs"]
    assert built > 0 and graphs["unique_graphs"] == built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_layers_norm_is_llamas_with_its_gradients(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    ref, norm = Qwen3RMSNorm(48, eps=1e-6), Qwen3RMSNorm(48, eps=1e-6)
    for m in (ref, norm):
        m.weight.data = torch.linspace(0.5, 1.5, 48)
    assert _llama_norm(norm) and not _llama_norm(nn.LayerNorm(48))
    x = torch.randn(5, 3, 48, dtype=dtype)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [ref(xs[0]), _norm_forward(norm, xs[1])]
    assert outs[0].dtype == outs[1].dtype
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    grad = torch.randn_like(outs[0])
    for out in outs:
        out.backward(grad)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, **tol)
    torch.testing.assert_close(norm.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)


_FAULTS = """
import ctypes, resource, statistics, sys, torch
from instar.cpu.trainer import keep_freed_memory

def faults() -> float:  # page faults of allocating, writing and freeing 12 x 8 MiB, the median of 7 rounds
    counts = []
    for _ in range(7):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones(2 << 20) for _ in range(12)]
        del blocks
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return statistics.median(counts)

libc = ctypes.CDLL("libc.so.6")  # glibc's starting thresholds, held fixed: by default they move with what was freed
libc.mallopt(-3, 128 << 10), libc.mallopt(-1, 128 << 10)
default = faults()
applied = keep_freed_memory()
print(default, applied, faults())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_blocks_are_kept_for_the_next_step_instead_of_faulted_back_in():
    # A fresh process: the test process may have applied it already (a CPU trainer does).
    out = subprocess.run([sys.executable, "-c", _FAULTS], capture_output=True, text=True, check=True, timeout=120)
    default, applied, kept = out.stdout.split()
    assert applied == "True"
    assert float(default) > 20000  # the 96 MiB go back to the OS each round: 24k pages faulted in again
    assert float(kept) < float(default) / 10
