"""HunyuanVideo-1.5: sizes checked against the config before any work, and the preparation
that gives the first block the layout of the others (one compile for the 54 blocks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from magi_zoo.adapters import lookup
from magi_zoo.adapters.diffusers_pipeline import same_layout_preparation
from magi_zoo.engine.prepare import prepare


@pytest.mark.parametrize("name", ["hunyuanvideo-1.5-tiny", "hunyuanvideo-1.5-480p-t2v"])
def test_sizes_are_checked_against_the_config_before_any_work(name, tmp_path):
    adapter, variant = lookup(name)
    with pytest.raises(ValueError, match="--frames"):  # 1 + 4k: the VAE's temporal factor
        adapter.check_run(variant, {"num_frames": 6}, tmp_path / "v.mp4")
    with pytest.raises(ValueError, match="--height.*16"):  # the VAE's 16x times the 1x1 patch
        adapter.check_run(variant, {"height": 72}, tmp_path / "v.mp4")
    adapter.check_run(variant, {"num_frames": 9, "height": 64, "width": 96}, tmp_path / "v.mp4")


class _Seen(nn.Module):
    def __init__(self):
        super().__init__()
        self.got = []

    def forward(self, hidden_states, encoder_hidden_states=None):
        self.got.append((hidden_states, encoder_hidden_states))
        return hidden_states + 1


def test_first_block_gets_fresh_contiguous_inputs_and_remove_undoes_it():
    blocks = nn.ModuleList([_Seen(), _Seen()])
    x = torch.randn(1, 4, 3).transpose(1, 2)  # a patch embedding's transposed view
    ctx = torch.randn(1, 2, 3)
    rec = prepare(nn.ModuleDict({"blocks": blocks}), [same_layout_preparation(blocks, (0, "hidden_states"), "test")])
    blocks[1](blocks[0](x, encoder_hidden_states=ctx))
    got, enc = blocks[0].got[0]
    assert got.is_contiguous() and got.data_ptr() != x.data_ptr() and torch.equal(got, x)
    assert enc is ctx  # inputs not named are passed as they are
    rec.undo()
    blocks[0](x)
    assert blocks[0].got[1][0] is x
