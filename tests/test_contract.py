"""The token-first contract: every invariant violation is caught with a message naming field, index, value."""

import json
import math

import pytest
import torch

from instar.contract import (
    NO_VERSION,
    ContractError,
    ImageInputs,
    Result,
    Sample,
    SamplingParams,
    Trajectory,
    read_jsonl,
    write_jsonl,
)


def seg(**over):
    base = dict(token_ids=[5, 6, 7, 8, 9], action_mask=[0, 0, 1, 1, 0],
                rollout_logprobs=[0.0, 0.0, -0.5, -1.25, 0.0], versions=[NO_VERSION, NO_VERSION, 3, 3, NO_VERSION])
    return Sample(**{**base, **over})


def test_valid_sample_passes_and_counts_actions():
    s = seg()
    s.validate()
    assert s.num_actions == 2


@pytest.mark.parametrize("field,value,message", [
    ("action_mask", [0, 0, 1, 1], "sample.action_mask has length 4 but token_ids has length 5"),
    ("rollout_logprobs", [0.0] * 6, "sample.rollout_logprobs has length 6 but token_ids has length 5"),
    ("versions", [3], "sample.versions has length 1 but token_ids has length 5"),
])
def test_length_mismatch(field, value, message):
    with pytest.raises(ContractError, match=f"^{message}$"):
        seg(**{field: value}).validate()


def test_non_finite_logprob_on_action():
    with pytest.raises(ContractError, match=r"^sample.rollout_logprobs\[3\] on an action token must be finite and "
                                            r"<= 0, got nan$"):
        seg(rollout_logprobs=[0.0, 0.0, -0.5, math.nan, 0.0]).validate()
    with pytest.raises(ContractError, match=r"rollout_logprobs\[2\] .* got -inf$"):
        seg(rollout_logprobs=[0.0, 0.0, -math.inf, -1.0, 0.0]).validate()


def test_positive_logprob_on_action():
    with pytest.raises(ContractError, match=r"^sample.rollout_logprobs\[2\] on an action token must be finite and "
                                            r"<= 0, got 0.1$"):
        seg(rollout_logprobs=[0.0, 0.0, 0.1, -1.0, 0.0]).validate()


def test_logprob_on_non_action_token_is_not_checked():
    seg(rollout_logprobs=[math.nan, 5.0, -0.5, -1.0, 0.0]).validate()


def test_segment_without_actions():
    with pytest.raises(ContractError, match=r"^sample has no action tokens \(action_mask is all 0\); nothing to train"):
        seg(action_mask=[0] * 5).validate()


def test_missing_version_on_action():
    with pytest.raises(ContractError, match=r"^sample.versions\[3\] on an action token must be a policy version >= 0, "
                                            r"got -1$"):
        seg(versions=[NO_VERSION, NO_VERSION, 3, NO_VERSION, NO_VERSION]).validate()


def test_bad_action_mask_value():
    with pytest.raises(ContractError, match=r"^sample.action_mask\[1\] must be 0 or 1, got 2$"):
        seg(action_mask=[0, 2, 1, 1, 0]).validate()


def test_negative_token_id():
    with pytest.raises(ContractError, match=r"^sample.token_ids\[0\] must be a non-negative int, got -5$"):
        seg(token_ids=[-5, 6, 7, 8, 9]).validate()


@pytest.mark.parametrize("experts,shape", [
    (torch.zeros(4, 2, 2, dtype=torch.int32), "(4, 2, 2)"),
    (torch.zeros(5, 2, dtype=torch.int32), "(5, 2)"),
    (torch.zeros(5, 2, 2), "(5, 2, 2)"),
])
def test_routed_experts_shape(experts, shape):
    shape = shape.replace("(", "[(]").replace(")", "[)]")
    with pytest.raises(ContractError, match=r"^sample.routed_experts must be an int tensor shaped \(tokens=5, "
                                            rf"moe_layers, top_k\), got {shape}$"):
        seg(routed_experts=experts).validate()


def test_trajectory_messages_name_the_segment():
    t = Trajectory(segments=[seg(), seg(action_mask=[0] * 5)], reward=1.0, rollout_id="r7")
    with pytest.raises(ContractError, match=r"^trajectory 'r7' segment 1 has no action tokens"):
        t.validate()
    with pytest.raises(ContractError, match=r"^trajectory 'r7' has no segments$"):
        Trajectory(segments=[], reward=0.0, rollout_id="r7").validate()
    with pytest.raises(ContractError, match=r"^trajectory 'r7' reward must be a finite number, got inf$"):
        Trajectory(segments=[seg()], reward=math.inf, rollout_id="r7").validate()


def test_jsonl_round_trip_multi_segment_with_routed_experts(tmp_path):
    experts = torch.arange(5 * 3 * 2, dtype=torch.int16).reshape(5, 3, 2)
    t = Trajectory(
        segments=[seg(routed_experts=experts, images=ImageInputs(torch.tensor([[0.1, -2.5e-8]] * 4),
                                                                 torch.tensor([[1, 2, 2]]), token_id=6)),
                  seg(token_ids=[1, 2, 3, 4, 5], rollout_logprobs=[0.0, 0.0, -1 / 3, -2 / 7, 0.0],
                      versions=[-1, -1, 4, 5, -1])],
        reward=0.75, score=1.0, info={"turns": 2, "tool": "calculator"}, group_id=3, rollout_id="g3-s1",
        prompt_index=17, finish_reason="length")
    t.validate()
    write_jsonl(str(tmp_path / "d.jsonl"), [t, t])
    back = read_jsonl(str(tmp_path / "d.jsonl"))
    assert len(back) == 2
    b = back[0]
    assert b.to_json() == t.to_json()
    assert b.segments[1].rollout_logprobs == [0.0, 0.0, -1 / 3, -2 / 7, 0.0]  # bit-exact floats
    assert b.segments[0].routed_experts.dtype == torch.int16
    assert torch.equal(b.segments[0].routed_experts, experts)
    assert torch.equal(b.segments[0].images.pixel_values, torch.tensor([[0.1, -2.5e-8]] * 4))
    assert b.segments[0].images.grid_thw.tolist() == [[1, 2, 2]] and b.segments[0].images.token_id == 6
    assert (b.reward, b.score, b.info, b.group_id, b.prompt_index, b.finish_reason, b.truncated) == (
        0.75, 1.0, {"turns": 2, "tool": "calculator"}, 3, 17, "length", True)
    b.validate()


def test_result_accepts_tensors_and_rejects_junk():
    r = Result(reward=torch.tensor(0.5), score=torch.tensor(1), info={"acc": torch.tensor(2.0), "s": "x"})
    assert (r.reward, r.score, r.info) == (0.5, 1.0, {"acc": 2.0, "s": "x"})
    with pytest.raises(ContractError, match=r"^Result.reward must be a number or a 0-d tensor, got str: 'high'$"):
        Result(reward="high")
    with pytest.raises(ContractError, match=r"tensor of shape \(2,\)"):
        Result(reward=torch.tensor([1.0, 2.0]))


def test_sampling_params_checks():
    assert SamplingParams(top_k=5).replace(temperature=0.0) == SamplingParams(temperature=0.0, top_k=5)
    with pytest.raises(ContractError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0)
    with pytest.raises(ContractError, match="max_tokens must be >= 1, got 0"):
        SamplingParams(max_tokens=0)


def test_image_keys_stand_for_pixels_not_ids():
    """Image tokens become one negative key per (image content, index); text ids stay; equal images match."""
    def images(*fills: float) -> ImageInputs:
        return ImageInputs(torch.cat([torch.full((4, 2), f) for f in fills]), torch.tensor([[1, 2, 2]] * len(fills)), 9)

    ids = [5, 9, 6, 9, 7]
    same, other = images(0.5, 0.5).keys(ids), images(0.5, 0.25).keys(ids)
    assert [same[0], same[2], same[4]] == [5, 6, 7] and same[1] == same[3] < 0
    assert other[1] == same[1] and other[3] != same[3] < 0
    two = ImageInputs(torch.zeros(8, 2), torch.tensor([[1, 2, 4]]), 9).keys([9, 9])  # one image, two tokens
    assert two[0] != two[1]


def test_large_tensors_travel_as_raw_bytes_bit_exact():
    """Past 256 elements (an image's patches) a tensor is base64 of its bytes, every dtype bit-exact."""
    from instar.contract import _decode, _encode
    g = torch.Generator().manual_seed(0)
    for t in (torch.randn(64, 96, generator=g), torch.randn(300, generator=g).bfloat16(),
              torch.randint(-2**40, 2**40, (17, 16), generator=g), torch.rand(257, generator=g) > 0.5):
        encoded = json.loads(json.dumps(_encode(t)))
        assert "bytes" in encoded and "data" not in encoded
        back = _decode(encoded)
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back, t)
    assert _encode(torch.arange(3))["data"] == [0, 1, 2]  # small ones stay readable
