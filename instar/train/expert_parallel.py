"""Expert parallelism for HF sparse-MoE blocks (Qwen3-MoE and kin): each ep rank holds E/ep of every
layer's experts, and each token-expert pair travels to the rank that holds its expert and back with
two all-to-alls.

The ep ranks are data-parallel ranks: each routes its own tokens. The experts' 3-D weights
(``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) become DTensors sharded on dim 0 over the ep
mesh with their HF names unchanged, so checkpoints, weight sync (``full_tensor()``) and HF export see
the usual tensors. Routers are untouched: routing replay and frozen routers work as without EP.
FSDP then shards the local experts over the remaining data ranks (`parallel.apply_fsdp`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from transformers.integrations.moe import _grouped_mm  # torch's grouped matmul where it runs, else a loop


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts of each sparse MoE block (HF's ``*Experts`` classes), in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split every MoE layer's experts over ``mesh`` (the ep dimension), in place."""
    for experts in experts_modules(model):
        if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
            raise NotImplementedError(f"expert parallelism handles experts stored as gate_up_proj [E, 2I, H] and "
                                      f"down_proj [E, H, I] without bias; {type(experts).__name__} differs: "
                                      "set --fsdp.ep_size 1")
        for name, p in list(experts.named_parameters(recurse=False)):
            # Every rank loaded the same full weights: each keeps its slice, no communication.
            local = distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(local, requires_grad=p.requires_grad))
        # An instance attribute shadows HF's class forward (and its experts_implementation dispatch).
        experts.forward = partial(dispatch_and_combine, experts, mesh.get_group())


def dispatch_and_combine(experts: nn.Module, group: dist.ProcessGroup, hidden: Tensor, top_k_index: Tensor,
                         top_k_weights: Tensor) -> Tensor:
    """HF's experts forward (``[N, H]`` tokens, ``[N, k]`` expert ids and weights -> ``[N, H]``) with the
    experts spread over ``group``: send each (token, expert) pair to the expert's rank, run the local
    experts on what arrived as grouped matmuls (one per projection), send the results back, weight and sum
    them per token. The only counts read back to the host are the all-to-all's splits. Every local expert
    gets a gradient, of zeros where no token came: FSDP's reduce-scatter needs every rank's."""
    ep = group.size()
    gate_up, down = experts.gate_up_proj.to_local(), experts.down_proj.to_local()
    local = gate_up.shape[0]  # experts on this rank: those of global ids [rank * local, (rank + 1) * local)
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)  # pairs grouped by expert, hence by the rank that holds it
    token = order // top_k_index.shape[-1]
    sent = torch.bincount(flat, minlength=local * ep)
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent, group=group)  # per source rank: its pairs for each of my experts
    got = got.view(ep, local)
    send_splits, recv_splits = sent.view(ep, local).sum(1).tolist(), got.sum(1).tolist()
    arrived = funcol.all_to_all_single_autograd(hidden[token], recv_splits, send_splits, group)
    # Pairs arrive grouped by source rank, then expert: regroup by expert to run each expert once.
    expert_of = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(got.flatten(),
                                                                                    output_size=sum(recv_splits))
    by_expert = expert_of.argsort(stable=True)
    ends = got.sum(0).cumsum(0).to(torch.int32)  # of each local expert's pairs, regrouped
    gate, up = _grouped_mm(arrived[by_expert], gate_up.transpose(1, 2), ends).chunk(2, dim=-1)
    out = _grouped_mm(experts.act_fn(gate) * up, down.transpose(1, 2), ends)
    out = out.new_empty(out.shape).index_copy(0, by_expert, out)  # back to arrival order
    back = funcol.all_to_all_single_autograd(out, send_splits, recv_splits, group)
    weighted = back * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden).index_add(0, token, weighted.to(hidden.dtype))

