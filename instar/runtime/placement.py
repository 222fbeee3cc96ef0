"""Where each engine and trainer rank runs (`--ray.placement`), decided from the Ray nodes' resources.

disaggregated: engines and trainer ranks on GPUs of their own (with no GPUs: the trainer on the driver's
node, the engines on the other nodes). colocated: they share GPUs (each takes half of one, Ray's
fractional GPUs; vLLM's --engine.gpu_memory_utilization bounds the engine's share of its memory) or, on
CPUs, nodes. auto: disaggregated when the GPUs (or nodes) suffice, else colocated. A pure function of the
node list, so every layout is tested without a cluster; `nodes()` reads the live one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from instar.config import ConfigError
from instar.train.weight_sync import Transport

Layout = Literal["auto", "colocated", "disaggregated"]


@dataclass(frozen=True)
class Node:
    node_id: str
    cpus: float
    gpus: int


@dataclass(frozen=True)
class Slot:
    """One actor's place: its node, the GPUs it asks Ray for, and how many compute processes share
    that node's cores with it (its threads: the node's cores / cpu_share)."""

    node_id: str
    gpus: float
    cpu_share: int


@dataclass(frozen=True)
class Placement:
    """Each engine's and trainer rank's slot, and how the weights reach the engines (`instar.train.weight_sync`):
    gloo through host memory to engines on CPUs, NCCL to engines on GPUs of their own, CUDA IPC to engines on
    trainer rank 0's one GPU. Engines that share several GPUs with the trainer get gloo: NCCL refuses two ranks of
    a group on one GPU, and IPC reaches only the GPU rank 0 sends from."""

    layout: Literal["colocated", "disaggregated"]
    engines: list[Slot]
    ranks: list[Slot]
    transport: Transport = "gloo"


class PlacementError(ConfigError):
    pass


def plan(nodes: list[Node], engines: int, tp: int, ranks: int, layout: Layout = "auto",
         sync: bool = False) -> Placement:
    """``nodes``: the driver's node first. ``tp``: GPUs per engine, on one node (vLLM's tensor parallelism;
    0 for an engine that runs on CPUs). ``sync``: generation and training take turns, so they do not share
    cores at the same time."""
    if any(n.gpus for n in nodes):
        return _on_gpus(nodes, engines, tp, ranks, layout)
    if layout == "colocated" or len(nodes) == 1 or not engines:
        # everything on one node: in sync mode each side has the cores while it computes
        both = engines + ranks
        return Placement("colocated", [Slot(nodes[0].node_id, 0, engines if sync else both)] * engines,
                         [Slot(nodes[0].node_id, 0, ranks if sync or not engines else both)] * ranks)
    # disaggregated CPU nodes: the trainer on the driver's node, engines round-robin over the others
    others = nodes[1:]
    homes = [others[i % len(others)].node_id for i in range(engines)]
    return Placement("disaggregated", [Slot(h, 0, homes.count(h)) for h in homes],
                     [Slot(nodes[0].node_id, 0, ranks)] * ranks)


def _on_gpus(nodes: list[Node], engines: int, tp: int, ranks: int, layout: Layout) -> Placement:
    free = {n.node_id: n.gpus for n in nodes}
    gpus = [n for n in free for _ in range(free[n])]  # each GPU's node, the driver's first
    need = engines * tp + ranks
    if layout == "disaggregated" or (layout == "auto" and need <= len(gpus)):
        if need > len(gpus):
            raise PlacementError(f"{_needs(engines, tp, ranks)} need {need} GPUs, found {len(gpus)} "
                                 "(--ray.placement colocated shares them)")
        # the trainer first, from the driver's node on: rank 0 hosts its store
        out = Placement("disaggregated", [], [Slot(gpu, 1, 1) for gpu in gpus[:ranks]], "nccl" if tp else "gloo")
        for gpu in gpus[:ranks]:
            free[gpu] -= 1
        for i in range(engines):  # an engine's tensor-parallel workers share one node
            node = next((n for n in free if free[n] >= tp), None)
            if node is None:
                raise PlacementError(f"engine {i} needs {tp} GPUs on one node (--engine.tensor_parallel_size); "
                                     f"the nodes have {sorted(free.values(), reverse=True)} left after "
                                     f"{ranks} trainer ranks")
            free[node] -= tp
            out.engines.append(Slot(node, 1 if tp == 1 else 0, 1))  # tp > 1: vLLM's workers take the GPUs
        return out
    if tp > 1:
        raise PlacementError("--ray.placement colocated shares each GPU between one engine and one trainer rank: "
                             f"it needs --engine.tensor_parallel_size 1, got {tp}")
    used = max(engines if tp else 0, ranks)  # tp 0: an engine that takes no GPU (the embedded one)
    if used > len(gpus):
        raise PlacementError(f"{_needs(engines, tp, ranks)} need {used} GPUs colocated, found {len(gpus)}")
    half = 0.5 if engines and tp and ranks else 1
    return Placement("colocated", [Slot(gpus[i % len(gpus)], half if tp else 0, 1) for i in range(engines)],
                     [Slot(gpu, half, 1) for gpu in gpus[:ranks]], "ipc" if tp and used == 1 and ranks else "gloo")


def _needs(engines: int, tp: int, ranks: int) -> str:
    return f"{engines} engines x tp {tp} + {ranks} trainer ranks"


def nodes() -> list[Node]:
    """The live Ray cluster's nodes, the driver's first."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    alive = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: (n["NodeID"] != here, n["NodeID"]))
    return [Node(n["NodeID"], n["Resources"].get("CPU", 0), int(n["Resources"].get("GPU", 0))) for n in alive]


def ray_options(slot: Slot) -> dict:
    """The actor options that put it in ``slot`` (and keep it there when Ray restarts it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"num_cpus": 0, "num_gpus": slot.gpus,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(slot.node_id, soft=False)}
