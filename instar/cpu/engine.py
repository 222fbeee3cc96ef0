"""The embedded engine's side of the CPU accelerator: one `engines.protocol.StepAccelerator` that runs a step's
dense layers through the AOT-compiled halves (`cpu.aot`), decode attention and sampling through the C kernels
(`cpu.decode`). Each part that cannot be built stays plain PyTorch (one printed line)."""

from __future__ import annotations

import torch
from torch import nn

from instar.cpu.aot import AotLayers, compilable
from instar.cpu.decode import DecodeKernel
from instar.engines import kv_model


class EngineAccelerator:
    """Implements `StepAccelerator` with whichever of its parts built here: the layers' halves and the decode
    kernel are its own methods (bound here: each is called per layer of every engine step), used only where
    `takes_layer` / `takes_decode` say so."""

    def __init__(self, layers: AotLayers | None, kernel: DecodeKernel | None) -> None:
        self.layers, self.kernel = layers, kernel
        if layers is not None:
            self.before_attention, self.after_attention = layers.before_attention, layers.after_attention
        if kernel is not None:
            self.decode = kernel

    def takes_layer(self, layer: nn.Module) -> bool:
        return self.layers is not None and not kv_model.is_moe(layer)

    def logits(self, h: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor | None:
        return None if self.layers is None else self.layers.logits(h, norm, lm_head)

    def takes_decode(self, q: torch.Tensor, cache: torch.Tensor) -> bool:
        return self.kernel is not None and self.kernel.takes(q, cache)

    def sample(self, logits: torch.Tensor, u: torch.Tensor, keys: torch.Tensor | None,
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.kernel is None or logits.dtype != torch.float32 or logits.device.type != "cpu":
            return None
        return self.kernel.sample(logits, u, keys)


def accelerator(model: nn.Module) -> EngineAccelerator | None:
    """The accelerator for ``model``'s engine (None when no part of it applies), saying in one line what it runs."""
    inner, lm_head = kv_model.decoder(model), model.lm_head
    if model.device.type != "cpu":  # its kernels are the CPU's
        print(f"instar: the CPU accelerator stays off: the engine runs on {model.device}", flush=True)
        return None
    dense = [layer for layer in inner.layers if not kv_model.is_moe(layer)]
    fits = (dense and inner.embed_tokens.weight.dtype == torch.float32 and all(map(compilable, dense))
            and getattr(lm_head, "bias", None) is None)
    if dense and not fits:
        print("instar: the engine's layers stay on plain PyTorch: the CPU accelerator compiles float32 dense layers "
              "on the CPU without projection biases and with a SiLU MLP", flush=True)
    layers = AotLayers.load_or_build(dense[0], kv_model.text_config(model).rms_norm_eps,
                                     (inner.norm.weight, lm_head.weight)) if fits else None
    kernel = DecodeKernel.load_or_build()
    if layers is None and kernel is None:
        return None
    parts = [*(["compiled dense layers"] if layers else []), *(["C decode attention and sampling"] if kernel else [])]
    print(f"instar: CPU accelerator in the engine: {', '.join(parts)}", flush=True)
    return EngineAccelerator(layers, kernel)
