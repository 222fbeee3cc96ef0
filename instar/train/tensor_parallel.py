"""Tensor parallelism for the Qwen3 family, with PyTorch's own parallel styles.

In each decoder layer the query, key, value and MLP gate/up projections are split by output (each
tp rank holds whole heads and a slice of the MLP width), and the output and down projections by
input, so a layer needs one all-reduce after attention and one after the MLP. The per-head query and
key norms see only their rank's heads: their weights are replicated DTensors fed a head-sharded input,
so their gradients are summed over the tp ranks. Embeddings, the other norms, routers and the head
stay whole on every tp rank (FSDP still shards them over the data ranks).
MoE experts are not split here: their fused gate/up weight would cut gate from up; expert
parallelism (`--fsdp.ep_size`) splits them instead.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from instar.train.model import decoder_layers

ATTENTION = {"q_proj": ColwiseParallel, "k_proj": ColwiseParallel, "v_proj": ColwiseParallel, "o_proj": RowwiseParallel}
DENSE_MLP = {"gate_proj": ColwiseParallel, "up_proj": ColwiseParallel, "down_proj": RowwiseParallel}


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split every decoder layer's attention and dense MLP over ``mesh`` (the tp dimension), in place.
    The attention code needs no change: it reshapes to ``(-1, head_dim)``, so it sees its local heads."""
    for layer in decoder_layers(model):
        plan = {f"self_attn.{name}": style() for name, style in ATTENTION.items()}
        # [1, N, heads, head_dim]: the norm runs over head_dim, the input is split on the heads (dim 2)
        plan |= {f"self_attn.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
                 for norm in ("q_norm", "k_norm") if hasattr(layer.self_attn, norm)}
        if all(hasattr(layer.mlp, name) for name in DENSE_MLP):  # a sparse MoE block has experts instead
            plan |= {f"mlp.{name}": style() for name, style in DENSE_MLP.items()}
        parallelize_module(layer, mesh, plan)
