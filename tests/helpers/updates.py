"""What the tests of several optimizer updates per batch share (tests/test_train_updates.py,
test_forward_only.py): eight made-up samples whose rollout logprobs are the tiny model's own, a one-rank (or
N-rank) trainer worker, and its full state."""

import torch

from instar.config import ActorConfig, FSDPConfig, RLConfig, TrainConfig
from instar.contract import Sample
from instar.train.launch import reserve_port
from instar.train.model import load_model
from instar.train.worker import TrainWorker

from .layouts import full

LENGTHS = [9, 14, 6, 11, 8, 12, 7, 10]
LR = 3e-2


def make_samples(model_dir) -> list[Sample]:
    """Samples whose rollout logprobs are the initial model's own, so every IS weight is exactly 1."""
    model = load_model(str(model_dir))
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(i)).tolist()
        mask = [0] * 3 + [1] * (n - 3)
        lp = token_logprobs(model, ids).tolist()
        out.append(Sample(ids, mask, [x if m else 0.0 for x, m in zip(lp, mask)], [0 if m else -1 for m in mask]))
    return out


def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """logprob of token t given the tokens before it (index 0 holds 0), one unpacked forward."""
    x = torch.tensor([ids])
    lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None])[:, 0]
    return torch.cat([lp.new_zeros(1), lp])


def rl_config(**actor) -> RLConfig:
    return RLConfig(actor=ActorConfig(learning_rate=LR, **actor))


def worker(model_dir, rank=0, world=1, port=None, ref=False, **actor) -> TrainWorker:
    w = TrainWorker(ActorConfig(model_name_or_path=str(model_dir), learning_rate=LR, **actor),
                    FSDPConfig(num_ranks=world), TrainConfig(max_tokens_per_gpu=32, max_steps=10),
                    ref_path=str(model_dir) if ref else None)
    w.init(rank, world, "127.0.0.1", port or reserve_port())
    return w


def state(w: TrainWorker) -> dict[str, torch.Tensor]:
    return {k: full(v).detach().clone() for k, v in w.policy.state_dict().items()}
