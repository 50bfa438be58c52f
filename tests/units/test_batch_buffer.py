import pytest
import torch
from tensordict import TensorDict

from grpo_accel import batch
from grpo_accel.trainer.buffer import ReplayBuffer


def _td(n, p, c, fill=1):
    return TensorDict(
        {
            batch.PROMPT_IDS: torch.full((n, p), fill), batch.PROMPT_MASK: torch.ones(n, p, dtype=torch.long),
            batch.COMPLETION_IDS: torch.full((n, c), fill), batch.COMPLETION_MASK: torch.ones(n, c, dtype=torch.long),
            batch.ENGINE_LOGPROBS: torch.full((n, c), -1.0), batch.REWARD: torch.arange(n, dtype=torch.float32) + 10 * fill,
            batch.REWARDS: {"a": torch.zeros(n)},
        },
        batch_size=[n],
    )


def test_pad_sequences_sides():
    assert batch.pad_sequences([[1, 2], [3]], 0, "left").tolist() == [[1, 2], [0, 3]]
    assert batch.pad_sequences([[1, 2], [3]], 9, "right").tolist() == [[1, 2], [3, 9]]


def test_concat_repads_prompts_left_and_completions_right():
    out = batch.concat_rollouts([_td(1, 2, 3, fill=1), _td(1, 4, 1, fill=2)], pad_id=0)
    assert out[batch.PROMPT_IDS].tolist() == [[0, 0, 1, 1], [2, 2, 2, 2]]
    assert out[batch.PROMPT_MASK].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert out[batch.COMPLETION_IDS].tolist() == [[1, 1, 1], [2, 0, 0]]
    assert out[batch.COMPLETION_MASK].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out[batch.ENGINE_LOGPROBS].tolist() == [[-1, -1, -1], [-1, 0, 0]]


def test_trim_padding_drops_all_padding_columns_only():
    td = batch.concat_rollouts([_td(1, 2, 3, fill=1), _td(1, 4, 1, fill=2)], pad_id=0)
    trimmed = batch.trim_padding(td[:1])
    assert trimmed[batch.PROMPT_IDS].tolist() == [[1, 1]] and trimmed[batch.COMPLETION_IDS].tolist() == [[1, 1, 1]]
    trimmed = batch.trim_padding(td[1:])
    assert trimmed[batch.PROMPT_IDS].shape == (1, 4) and trimmed[batch.COMPLETION_IDS].tolist() == [[2]]


def test_buffer_epoch_visits_every_row_once_and_sample_is_without_replacement():
    rb = ReplayBuffer(batch_size=3, seed=0)
    rb.extend(_td(4, 2, 2, fill=1))
    rb.extend(_td(3, 3, 1, fill=2))
    assert len(rb) == 7
    seen = torch.cat([mb[batch.REWARD] for mb in rb])
    assert sorted(seen.tolist()) == [10, 11, 12, 13, 20, 21, 22]
    assert [mb.shape[0] for mb in rb] == [3, 3, 1]
    sample = rb.sample()
    assert sample.shape == (3,) and len(set(sample[batch.REWARD].tolist())) == 3
    with pytest.raises(ValueError, match="holds 7"):
        rb.sample(8)
    rb.empty()
    assert len(rb) == 0 and list(rb) == []


def test_buffer_state_dict_round_trip_continues_the_same_order():
    rb = ReplayBuffer(batch_size=2, seed=1)
    rb.extend(_td(5, 2, 2))
    state = rb.state_dict()
    expected = [mb[batch.REWARD].tolist() for mb in rb]
    other = ReplayBuffer(batch_size=2, seed=99)
    other.load_state_dict(state)
    assert [mb[batch.REWARD].tolist() for mb in other] == expected
    assert all((mb[batch.REWARDS, "a"] == 0).all() for mb in other)  # nested reward columns survive the round trip


def test_buffer_rejects_zero_batch_size():
    with pytest.raises(ValueError, match="batch_size=0"):
        ReplayBuffer(batch_size=0)
