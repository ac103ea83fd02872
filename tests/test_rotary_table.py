"""Rotary rows made as positions are reached (``rope.RotaryTable``): the whole table's values."""

from __future__ import annotations

import pytest
import torch

from trillm.engine.execution.rope import RotaryTable, cos_sin_table

SCALINGS = [
    None,
    {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    {
        "rope_type": "longrope",
        "original_max_position_embeddings": 4096,
        "factor": 2.0,
        "short_factor": [1.0] * 16,
        "long_factor": [2.0] * 16,
    },
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=["plain", "llama3", "yarn", "longrope"])
def test_rows_made_on_the_cpu_as_steps_reach_them_are_the_whole_tables(scaling):
    max_len = 3 * RotaryTable.BLOCK + 100
    cos, sin = cos_sin_table(32, 500000.0, scaling, max_len)
    table = RotaryTable.make(32, 500000.0, scaling, max_len, torch.device("cpu"), torch.float32)
    assert table.cos.shape == (0, 32)  # nothing made at start
    early = torch.tensor([0, 5, 17])
    got = table.rows(early)
    assert table.cos.shape[0] == RotaryTable.BLOCK  # one block, no more
    assert torch.equal(got[0], cos[early]) and torch.equal(got[1], sin[early])
    late = torch.tensor([2 * RotaryTable.BLOCK + 7, 4100, 1])  # a jump past a block: both made
    got = table.rows(late)
    assert table.cos.shape[0] == 3 * RotaryTable.BLOCK
    assert torch.equal(got[0], cos[late]) and torch.equal(got[1], sin[late])
    whole = table.whole()
    assert whole[0].shape == (max_len, 32)  # the last block stops at max_len
    assert torch.equal(whole[0], cos) and torch.equal(whole[1], sin)
    with pytest.raises(IndexError):
        table.rows(torch.tensor([max_len]))


def test_elsewhere_the_whole_table_is_made_at_once():
    table = RotaryTable.make(16, 10000.0, None, 300, torch.device("meta"), torch.float32)
    assert table.cos.shape == (300, 16) and table.cos.device.type == "meta"
