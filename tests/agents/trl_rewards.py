"""Reward functions written for TRL's GRPOTrainer, used unchanged through --train.reward_fns."""

from math_verify import parse, verify

CALLS = []  # the groups the async function saw (it runs in the agent runner's process)


def accuracy_reward(completions, solution, **kwargs):
    """TRL's own shape: chat completions, math-verify with its default (signal-based) time limit."""
    contents = [completion[0]["content"] for completion in completions]
    return [float(verify(parse(f"${s}$"), parse(c))) for c, s in zip(contents, solution)]


def length_penalty(completion_ids, **kwargs):
    return [-len(ids) / 100 for ids in completion_ids]


async def difficulty_bonus(prompts, completions, difficulty, **kwargs):
    CALLS.append((prompts, completions, difficulty))
    return [None if d is None else d / 4 for d in difficulty]


def not_numbers(completions, **kwargs):
    return ["high"] * len(completions)
