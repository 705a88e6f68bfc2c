import pytest
import torch

from lib.padding import concat_padded_tensors, pack_sequences, split_by_token_budget, unpack_sequences


def episode(ids, gen_from, reward, turns=1):
    """One trajectory (docs/trajectory.md): tokens from `gen_from` on were generated."""
    T = len(ids)
    generated = torch.tensor([[t >= gen_from for t in range(T)]])
    return {
        "input_ids": torch.tensor([ids]),
        "loss_mask": generated.long(),
        "logprobs": torch.where(generated, -0.5, 0.0),
        "versions": torch.where(generated, 3, -1),
        "attention_mask": torch.ones(1, T, dtype=torch.long),
        "rewards": torch.tensor([reward]),
        "num_turns": turns,
    }


def test_concat_right_pads_each_key_with_its_documented_value():
    batch = concat_padded_tensors([episode([5, 6, 7], 1, 1.0), episode([8, 9], 1, 0.0)])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch["logprobs"].tolist() == [[0.0, -0.5, -0.5], [0.0, -0.5, 0.0]]
    assert batch["versions"].tolist() == [[-1, 3, 3], [-1, 3, -1]]


def test_concat_uses_pad_value_for_keys_without_a_documented_value():
    items = [{"values": torch.tensor([[1.0]])}, {"values": torch.tensor([[2.0, 3.0]])}]
    assert concat_padded_tensors(items, pad_value=-9.0)["values"].tolist() == [[1.0, -9.0], [2.0, 3.0]]


def test_concat_joins_rewards_and_gathers_stats_into_lists():
    batch = concat_padded_tensors([episode([5], 0, 1.0, turns=2), episode([6, 7], 0, 0.5, turns=3)])
    assert batch["rewards"].tolist() == [1.0, 0.5]
    assert batch["num_turns"] == [2, 3]


def test_concat_of_concatenated_groups_is_one_flat_batch():
    group_a = concat_padded_tensors([episode([1, 2], 1, 1.0, turns=1), episode([3], 0, 0.0, turns=2)])
    group_b = concat_padded_tensors([episode([4, 5, 6, 7], 2, 0.5, turns=3)])
    batch = concat_padded_tensors([group_a, group_b])
    assert batch["input_ids"].tolist() == [[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 7]]
    assert batch["rewards"].tolist() == [1.0, 0.0, 0.5]
    assert batch["num_turns"] == [1, 2, 3]


def test_concat_rejects_items_with_different_keys():
    with pytest.raises(ValueError, match="same keys"):
        concat_padded_tensors([episode([1], 0, 1.0), {"input_ids": torch.tensor([[1]])}])


def test_pack_drops_padding_and_restarts_positions_per_sequence():
    batch = concat_padded_tensors([episode([5, 6, 7], 1, 1.0), episode([8, 9], 1, 0.0), episode([4], 0, 0.0)])
    packed = pack_sequences(batch)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4]]
    assert packed["loss_mask"].tolist() == [[0, 1, 1, 0, 1, 1]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert packed["cu_seqlens"].tolist() == [0, 3, 5, 6]
    assert packed["max_seqlen"] == 3


def test_unpack_inverts_pack_for_every_per_token_key():
    batch = concat_padded_tensors([episode([5, 6, 7], 1, 1.0), episode([8, 9], 1, 0.0), episode([4], 0, 0.0)])
    packed = pack_sequences(batch)
    for key in ("input_ids", "loss_mask", "logprobs", "versions"):
        pad = -1 if key == "versions" else 0
        restored = unpack_sequences(packed[key], packed["cu_seqlens"], batch[key].shape, pad_value=pad)
        assert torch.equal(restored, batch[key]), key


def test_unpack_passes_gradients_to_the_packed_values():
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    out = unpack_sequences(values, torch.tensor([0, 2, 3]), (2, 2))
    assert out.tolist() == [[1.0, 2.0], [3.0, 0.0]]
    (out * torch.tensor([[1.0, 10.0], [100.0, 1000.0]])).sum().backward()
    assert values.grad.tolist() == [1.0, 10.0, 100.0]


def test_pack_refuses_left_padding():
    batch = {"input_ids": torch.tensor([[0, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1]])}
    with pytest.raises(ValueError, match="right padding"):
        pack_sequences(batch)


def test_token_budget_groups_stay_within_budget_first_fit_decreasing():
    # Longest first: 7 -> g0, 5 -> g1, 4 -> g1 (9), 3 -> g0 (10), 2 -> g2 (g0, g1 would exceed 10).
    assert split_by_token_budget([3, 7, 2, 5, 4], 10) == [[0, 1], [3, 4], [2]]


def test_token_budget_puts_an_oversized_row_alone():
    assert split_by_token_budget([12, 3, 4], 10) == [[0], [1, 2]]


def test_token_budget_is_deterministic_on_ties():
    assert split_by_token_budget([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
