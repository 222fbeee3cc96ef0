"""One MoE layer's experts, forward and backward, at a 64-expert top-8 shape on CPU: transformers' per-expert
loop (`experts_implementation="eager"`) against the grouped matmuls instar trains with: transformers'
`grouped_mm` (expert parallelism 1) and instar's expert-parallel dispatch (`train/expert_parallel.py`) over a
one-rank group, which adds its sort and (here trivial) all-to-alls. Medians of --repeats timed passes after two
untimed ones, in one process; the last lines are the ratios to the loop.

    OMP_NUM_THREADS=2 python bench/moe.py [--tokens 2048] [--hidden 1024] [--intermediate 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from instar.train.expert_parallel import apply_expert_parallel, dispatch_and_combine


def timed(forward, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, repeats: int) -> float:
    grad = torch.randn_like(hidden)
    times = []
    for i in range(repeats + 2):
        x = hidden.detach().requires_grad_()
        start = time.perf_counter()
        forward(x, index, weights).backward(grad)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top_k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
                            num_experts=args.experts, num_experts_per_tok=args.top_k)
    experts = Qwen3MoeExperts(config)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    hidden = torch.randn(args.tokens, args.hidden)
    weights, index = torch.randn(args.tokens, args.experts).softmax(-1).topk(args.top_k)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    results = {}
    for name in ("eager", "grouped_mm"):
        config._experts_implementation = name
        results[name] = timed(experts, hidden, index, weights, args.repeats)
    ep = Qwen3MoeExperts(config)
    ep.load_state_dict(experts.state_dict())
    apply_expert_parallel(torch.nn.Sequential(ep), init_device_mesh("cpu", (1,)))
    results["instar_ep"] = timed(partial(dispatch_and_combine, ep, dist.group.WORLD), hidden, index, weights,
                                 args.repeats)
    dist.destroy_process_group()
    print(f"{args.experts} experts, top-{args.top_k}, {args.tokens} tokens, hidden {args.hidden}, intermediate "
          f"{args.intermediate}, {torch.get_num_threads()} threads; forward + backward median seconds:")
    for name, seconds in results.items():
        print(f"  {name:<12} {seconds:.4f}")
    for name in ("grouped_mm", "instar_ep"):
        print(f"moe_ratio[{name}]={results['eager'] / results[name]:.2f}")


if __name__ == "__main__":
    main()
