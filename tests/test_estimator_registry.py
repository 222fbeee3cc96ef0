"""An estimator registered outside instar, with what it needs, runs through `instar.rl` end to end.
Advantages are computed in the driver (instar/loop.py -> batching.advantages), so a row added to
ESTIMATORS in this process is the one the run uses."""

import json
from pathlib import Path

import pytest
import torch

import instar
from instar.algo import ESTIMATORS, Estimator, Needs
from instar.checks import check
from instar.config import ConfigError, RLConfig
from instar.runtime import batching
from instar.runtime.cluster import Cluster

ROOT = Path(__file__).resolve().parents[1]


def sign_vs_mean(x, cfg):
    """+1 / 0 / -1: the sign of the reward minus its prompt group's mean (one segment per trajectory here)."""
    groups = x.group_index
    mean = torch.zeros(int(groups.max()) + 1).index_add_(0, groups, x.rewards) / torch.bincount(groups)
    sign = torch.sign(x.rewards - mean[groups])
    CALLS.append((sign, x.action_mask.sum(1)))
    return sign[:, None].expand(x.action_mask.shape)


CALLS: list[tuple[torch.Tensor, torch.Tensor]] = []  # per call: each row's sign and its action tokens


@pytest.mark.parametrize("estimator,kl_coef,use_in,started", [
    ("grpo", 0.0, "loss", (False, False, False)),  # (reference, critic, pre-update logprob pass)
    ("grpo", 0.1, "loss", (True, False, False)),
    ("reinforce", 0.1, "reward", (True, False, True)),
    ("gae", 0.0, "loss", (False, True, False)),
    ("on_policy_distill", 0.0, "loss", (True, False, True)),
])
def test_the_run_starts_what_the_estimator_needs(estimator, kl_coef, use_in, started):
    cfg = RLConfig()
    cfg.algo.advantage.estimator, cfg.algo.kl.coef, cfg.algo.kl.use_in = estimator, kl_coef, use_in
    check(cfg)
    cluster = Cluster(cfg)  # decides what to start; starts nothing until entered
    assert (cluster.has_ref, cluster.has_critic, batching.needs_old(cfg)) == started


def test_a_registered_estimator_trains_end_to_end(tmp_path, tiny_model_dir, prompts, monkeypatch):
    monkeypatch.setitem(ESTIMATORS, "sign_vs_mean", Estimator(sign_vs_mean, Needs(grouped=True)))
    CALLS.clear()
    cfg = RLConfig()
    cfg.algo.advantage.estimator = "sign_vs_mean"
    cfg.actor.model_name_or_path = str(tiny_model_dir)
    cfg.data.prompt_dataset, cfg.data.max_new_tokens, cfg.data.max_len = prompts, 8, 128
    cfg.train.agent_path = str(ROOT / "tests/agents/length_env.py")  # rewards differ within a group
    cfg.train.max_steps, cfg.train.force_sync_mode = 2, True
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt = 2, 1
    cfg.ckpt.output_dir = str(tmp_path / "run")
    with pytest.raises(ConfigError, match="estimator sign_vs_mean compares samples of one prompt; set "
                                          r"--rollout.n_samples_per_prompt >= 2 \(got 1\)"):
        check(cfg)  # its record, not its name, says it is grouped
    cfg.rollout.n_samples_per_prompt = 3

    instar.rl(cfg)

    logged = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2] and len(CALLS) == 2  # one call per step
    for row, (sign, tokens) in zip(logged, CALLS):
        assert set(sign.tolist()) <= {-1.0, 0.0, 1.0} and len(sign) == 6  # 2 prompts x 3 samples
        assert row["advantage_mean"] == pytest.approx(((sign * tokens).sum() / tokens.sum()).item(), abs=1e-6)
        assert row["advantage_abs_mean"] == pytest.approx(((sign.abs() * tokens).sum() / tokens.sum()).item(),
                                                          abs=1e-6)
        # rows whose sign is 0 carry no gradient: the trainer ran exactly those forward only
        assert row["actor/forward_only"] == pytest.approx((sign == 0).float().mean().item())
