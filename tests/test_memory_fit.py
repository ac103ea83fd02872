"""A folder's model that cannot fit in memory is refused from its safetensors headers, before loading."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from trillm.engine.execution.gguf_support import UnsupportedModel
from trillm.engine.execution.memory_fit import check_folder_fits, folder_elements, folder_packed_bytes


def test_the_headers_give_the_weights_size_in_the_dtype_served(tmp_path):
    save_file({"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7)}, tmp_path / "one.safetensors")
    save_file({"c": torch.zeros(2, 2, 2)}, tmp_path / "two.safetensors")
    assert folder_elements(tmp_path) == 15 + 7 + 8
    check_folder_fits(tmp_path, 4, available=120)  # 30 float32 values: 120 bytes fit exactly
    with pytest.raises(UnsupportedModel, match=r"in 32-bit floats take 0\.0 GiB; 0\.0 GiB of memory is available"):
        check_folder_fits(tmp_path, 4, available=119)
    check_folder_fits(tmp_path, 2, available=60)  # bfloat16 halves it


def test_mxfp4_blocks_count_as_the_values_they_decode_to(tmp_path):
    """gpt-oss's packed experts (uint8 blocks and scales: 17 bytes a 32 values) decoded to a dtype."""
    blocks, scales = torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    save_file({"e_blocks": blocks, "e_scales": scales, "w": torch.zeros(10)}, tmp_path / "m.safetensors")
    assert folder_packed_bytes(tmp_path) == 4 * 2 * 17 and folder_elements(tmp_path) == 10
    check_folder_fits(tmp_path, 4, available=(10 + 4 * 2 * 32) * 4)
    with pytest.raises(UnsupportedModel):
        check_folder_fits(tmp_path, 4, available=(10 + 4 * 2 * 32) * 4 - 1)
