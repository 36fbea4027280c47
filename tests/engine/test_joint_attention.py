"""The engine's joint (text + image) attention on the per-head norm + rope op
(`engine/kernels/joint_attention.py`): the rotary-table op against the complex multiplication it
replaces, the checks processors make before fusing (`marked_norms`, `rope_tables_fit`), and
`joint_norm_rope_attention` against diffusers' own Flux and Qwen-Image processors on tiny
attention modules (CPU: the op's definition)."""

from __future__ import annotations

import pytest
import torch

from magi_zoo.engine import joint_norm_rope_attention, joint_rope_table, marked_norms, rope_tables_fit
from magi_zoo.engine.kernels import norm_rope
from magi_zoo.engine.precision import NORM_ROPE_MARK

from helpers.fusion import count_calls


def _tables(lengths, half, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.polar(torch.ones(n, half), torch.rand(n, half, generator=g) * 6.28) for n in lengths]


def _complex_rotation(x, freqs):
    """diffusers' Qwen-Image rotation of x (B, S, H, D) by a complex table (S, D / 2): pairs as complex numbers."""
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * freqs[None, :, None, :]).flatten(3)


def _real_rotation(x, cos, sin):
    """The interleaved-pair rotation the kernel applies with a (cos, sin) table (S, D)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[None, :, None, 0::2], sin[None, :, None, 0::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(3)


@pytest.mark.parametrize("lengths", [(5,), (3, 7), (2, 4, 6)], ids=["1 stream", "2 streams", "3 streams"])
def test_rope_table_is_the_complex_rotation_in_real_numbers_in_join_order(lengths):
    half = 4
    freqs = _tables(lengths, half)
    cos, sin = joint_rope_table(freqs)
    assert cos.shape == sin.shape == (sum(lengths), 2 * half) and cos.dtype == sin.dtype == torch.float32
    torch.testing.assert_close(cos[:, 0::2], cos[:, 1::2], rtol=0, atol=0)  # each angle over its pair
    torch.testing.assert_close(sin[:, 0::2], sin[:, 1::2], rtol=0, atol=0)
    x = torch.randn(2, sum(lengths), 3, 2 * half)
    want = torch.cat([_complex_rotation(part, f) for part, f in zip(x.split(list(lengths), dim=1), freqs)], dim=1)
    torch.testing.assert_close(_real_rotation(x, cos, sin), want, rtol=1e-6, atol=1e-6)
    # the order of the list is the join order: the first stream's angles come first
    torch.testing.assert_close(cos[: lengths[0], 0::2], freqs[0].real, rtol=0, atol=0)


def test_rope_table_fake_matches_and_traces():
    freqs = _tables((3, 7), 4)
    torch.library.opcheck(joint_rope_table, (freqs,), test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda fs: joint_rope_table(fs)[0] * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(freqs), joint_rope_table(freqs)[0] * 2, rtol=0, atol=0)


def test_rope_table_refuses_tables_it_cannot_join():
    with pytest.raises(ValueError, match="complex tables"):
        joint_rope_table([torch.ones(3, 4)])  # real, not complex
    with pytest.raises(ValueError, match="of one width"):
        joint_rope_table(_tables((3,), 4) + _tables((2,), 2))


def test_rope_tables_fit_takes_one_complex_table_per_stream_of_its_length():
    img, txt = _tables((6, 3), 4)
    assert rope_tables_fit((img, txt), (6, 3), 8)
    assert not rope_tables_fit((img, txt), (3, 6), 8)  # lengths in the other order
    assert not rope_tables_fit((img, txt), (6, 3), 16)  # another head_dim
    assert not rope_tables_fit((img,), (6, 3), 8)  # a table missing
    assert not rope_tables_fit((img.real, txt), (6, 3), 8)  # a real table
    assert not rope_tables_fit(None, (6, 3), 8)


def _marked(norm):
    norm.__dict__[NORM_ROPE_MARK] = True  # what the precision step's fuse_norm_rope sets
    return norm


def test_marked_norms_of_one_eps():
    from diffusers.models.normalization import RMSNorm

    norms = [_marked(torch.nn.RMSNorm(16, eps=1e-6)) for _ in range(3)] + [_marked(RMSNorm(16, eps=1e-6))]
    assert marked_norms(norms, 16)
    assert not marked_norms(norms, 8)  # another width
    assert not marked_norms(norms + [torch.nn.RMSNorm(16, eps=1e-6)], 16)  # one unmarked
    assert not marked_norms(norms + [_marked(torch.nn.RMSNorm(16, eps=1e-5))], 16)  # mixed eps
    assert not marked_norms(norms + [None], 16)  # a layer without the norm
    assert not marked_norms(norms + [_marked(torch.nn.LayerNorm(16))], 16)  # not an RMSNorm
    assert not marked_norms([], 16)


# -- the helper against diffusers' processors -------------------------------------------------

def _mark_all(attn):
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        if getattr(attn, name, None) is not None:
            _marked(getattr(attn, name))


def _randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if p.dim() == 1 else torch.randn(p.shape, generator=g)
                    / p.shape[-1] ** 0.5)
    return module.eval()


@pytest.mark.parametrize("joint", [True, False], ids=["double block", "single block"])
def test_helper_equals_diffusers_flux_processor(joint, monkeypatch):
    from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

    from magi_zoo.engine.compat.diffusers import flux_qkv_projections

    heads, d, text, image = 2, 16, 3, 5
    attn = _randomize(FluxAttention(query_dim=heads * d, heads=heads, dim_head=d, bias=True, eps=1e-6,
                                    added_kv_proj_dim=heads * d if joint else None, pre_only=not joint))
    _mark_all(attn)
    proc = FluxAttnProcessor()
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(2, image, heads * d, generator=g)
    ehs = torch.randn(2, text, heads * d, generator=g) if joint else None
    ang = torch.rand(text * joint + image, d // 2, generator=g) * 6.28
    rotary = (torch.cos(ang).repeat_interleave(2, -1), torch.sin(ang).repeat_interleave(2, -1))
    with torch.no_grad():
        want = proc(attn, hs, ehs, None, rotary)
        q, k, v, eq, ek, ev = flux_qkv_projections()(attn, hs, ehs)
        calls = count_calls(monkeypatch, norm_rope, "rms_norm_rope_heads")
        got = joint_norm_rope_attention(proc, attn, (q, k, v), (eq, ek, ev) if joint else None, rotary, head_dim=d)
    assert len(calls) == 2  # q and k, each in one call
    if joint:
        assert got[0].shape == want[0].shape == (2, image, heads * d) and got[1].shape == (2, text, heads * d)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # on CPU the op is diffusers' math, op for op


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "text mask"])
def test_helper_equals_diffusers_qwen_image_processor(masked, monkeypatch):
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    heads, d, text, image = 2, 16, 4, 6
    attn = _randomize(QwenImageTransformerBlock(dim=heads * d, num_attention_heads=heads, attention_head_dim=d).attn)
    _mark_all(attn)
    proc = attn.processor
    g = torch.Generator().manual_seed(2)
    hs, ehs = torch.randn(2, image, heads * d, generator=g), torch.randn(2, text, heads * d, generator=g)
    img_freqs, txt_freqs = _tables((image, text), d // 2, seed=3)
    text_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool) if masked else None
    with torch.no_grad():
        want = proc(attn, hs, ehs, text_mask, None, (img_freqs, txt_freqs))
        mask = None
        if masked:  # the joint mask Qwen-Image's processor builds: text mask, then every image token
            mask = torch.cat([text_mask, torch.ones(2, image, dtype=torch.bool)], dim=1)[:, None, None, :]
        image_qkv = [p(hs) for p in (attn.to_q, attn.to_k, attn.to_v)]
        text_qkv = [p(ehs) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        calls = count_calls(monkeypatch, norm_rope, "rms_norm_rope_heads")
        got = joint_norm_rope_attention(proc, attn, image_qkv, text_qkv, joint_rope_table([txt_freqs, img_freqs]),
                                        mask, head_dim=d)
    assert len(calls) == 2
    # diffusers rotates in complex fp32, the op in real fp32: equal up to fp32 rounding
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if masked:  # the mask mattered
        with torch.no_grad():
            unmasked = joint_norm_rope_attention(proc, attn, image_qkv, text_qkv,
                                                 joint_rope_table([txt_freqs, img_freqs]), None, head_dim=d)
        assert not torch.allclose(unmasked[0], want[0], rtol=1e-3, atol=1e-3)
