"""Runs inside vLLM's worker processes: the worker extension (``worker_extension_cls``) through which
instar loads new weights, with no fork of vLLM. `VLLMEngine` reaches these methods with
``collective_rpc``; every worker of an engine (one per tensor-parallel rank) runs them.

Two ways in, one way to load (vLLM's own ``reload_weights``, which shards and post-processes):

* ``instar_load_weights``: the tensors travel inside the RPC as one safetensors blob (CPU, tests,
  small models);
* ``instar_join_weight_group`` + ``instar_receive_weights``: each worker joins the trainer's weight
  broadcast group (NCCL on GPU, gloo on CPU) and loads the buckets as they arrive.

The group's functions are passed by qualified name: they belong to the trainer's layer, which the
engine layer must not import, and vLLM's RPC carries strings but not functions.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Iterable, Iterator

import torch

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def with_tied_head(named_tensors: Iterable[tuple[str, torch.Tensor]], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``named_tensors``, and for a model with tied embeddings the input embedding again as
    ``lm_head.weight``: a trainer sends a tied weight once (under the embedding's name), and without
    this the engine's output head would silently keep its old weights."""
    for name, tensor in named_tensors:
        if tied and name == HEAD:
            continue  # re-derived from the embedding below, so both always agree
        yield name, tensor
        if tied and name == EMBED:
            yield HEAD, tensor


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``reload_weights``, ``rank``)."""

    def instar_load_weights(self, blob: bytes, tied: bool) -> None:
        from safetensors.torch import load

        self.reload_weights(weights_iterator=with_tied_head(load(blob).items(), tied), is_checkpoint_format=True)

    def instar_join_weight_group(self, open_group: str, master_addr: str, master_port: int, first_rank: int,
                                 world_size: int, transport: str) -> None:
        """Join the broadcast group as rank ``first_rank + <this worker's tensor-parallel rank>``."""
        self.instar_weight_group = pkgutil.resolve_name(open_group)(master_addr, master_port, first_rank + self.rank,
                                                                    world_size, transport)

    def instar_receive_weights(self, receive: str, tied: bool) -> None:
        """Consume one broadcast to its end marker (every bucket is a collective) and load it."""
        stream = pkgutil.resolve_name(receive)(self.instar_weight_group)
        self.reload_weights(weights_iterator=with_tied_head(stream, tied), is_checkpoint_format=True)
