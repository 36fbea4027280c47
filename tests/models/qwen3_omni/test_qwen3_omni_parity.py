"""Qwen3-Omni parity with transformers' own `Qwen3OmniMoeForConditionalGeneration`.

Our side: the tiny variant through the adapter (our weights init, our tokenizer, our audio
/ image preprocessing, our generate loop with the bucketed static KV cache), eager, fp32.
Reference: a plain transformers model loaded *strictly* from the checkpoint we save (no
missing, unexpected or mismatched keys), run with its own `generate` (dynamic cache).
Same inputs (an audio clip, an image and text), greedy decoding. Checked: the thinker's
per-step logits (<= 1e-5 relative), its tokens, and the talker path end to end -- the
speech waveform, which is a function of every talker code.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks.oracles.qwen3_omni_processor import TEXT, parity_inputs
from helpers import DATA

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import magi_zoo  # noqa: E402

pytest.importorskip("transformers")

from magi_zoo.adapters.qwen3_omni.ops import moe_experts  # noqa: E402
from magi_zoo.adapters.qwen3_omni.pipeline import _talker_sees_audio_window  # noqa: E402

MODEL = "qwen3-omni-tiny"
N_TOKENS, N_CODES = 4, 5
AUDIO_PAD, IMAGE_PAD = 151675, 151655  # the published token ids of <|audio_pad|> / <|image_pad|>
ORACLE = json.loads((DATA / "qwen3_omni_processor_oracle.json").read_text())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    ours = magi_zoo.load(MODEL, gpu="cpu", compile=False, dtype="float32")
    path = tmp_path_factory.mktemp("qwen3_omni_tiny")
    ours.adapter.save_pretrained(ours.pipe, path)
    ref, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                     output_loading_info=True)
    assert all(not v for v in info.values()), info  # strict: every key matched
    return ours, ref.eval()


def _inputs(pipe, which: str = "small"):
    image, audio, large = parity_inputs()
    return pipe.encode(TEXT, audio=audio, image=image if which == "small" else large)


@pytest.mark.parametrize("which", ["small", "large"])
def test_inputs_match_the_official_processor(pair, which):
    """Placeholder counts, image grid and the features / pixels against what transformers'
    Qwen3OmniMoeProcessor makes of the same audio and image with the published preprocessor
    config (tests/data/qwen3_omni_processor_oracle.json, from
    benchmarks/oracles/qwen3_omni_processor.py: the processor needs torchvision, so its numbers
    are recorded). "large" is 1024 x 1280: above Qwen2-VL's default pixel cap, below the
    published one."""
    want = ORACLE[which]
    enc = _inputs(pair[0].pipe, which)
    ids, mask, feats, pixels = enc["input_ids"][0], enc["feature_attention_mask"], enc["input_features"], \
        enc["pixel_values"].double()
    assert int((ids == AUDIO_PAD).sum()) == want["audio_tokens"]
    assert int((ids == IMAGE_PAD).sum()) == want["image_tokens"]
    assert enc["image_grid_thw"].tolist() == want["image_grid_thw"]
    assert int(mask.sum()) == want["mel_frames"] and list(feats.shape) == want["input_features_shape"]
    valid = feats[mask.bool()[:, None, :].expand_as(feats)].double().sum().item()
    assert valid == pytest.approx(want["input_features_sum"], rel=1e-6)
    assert list(pixels.shape) == want["pixel_values_shape"]
    assert pixels.sum().item() == pytest.approx(want["pixel_values_sum"], rel=1e-6, abs=1e-6 * pixels.numel())
    assert pixels.abs().sum().item() == pytest.approx(want["pixel_values_abs_sum"], rel=1e-6)


def test_thinker_logits_and_tokens_match_transformers(pair):
    ours, ref = pair
    enc = _inputs(ours.pipe)
    # The official processor's placeholder counts and grid (tests/data/qwen3_omni_processor_oracle.json:
    # 13 audio tokens for 100 mel frames; the 40x56 px image resized to 64x96, a 1x4x6 grid of
    # 16-px patches merged 2x2 -> 6).
    ids, want = enc["input_ids"][0], ORACLE["small"]
    assert (ids == AUDIO_PAD).sum() == want["audio_tokens"]
    assert enc["image_grid_thw"].tolist() == want["image_grid_thw"]
    assert (ids == IMAGE_PAD).sum() == want["image_tokens"]
    media = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    common = dict(thinker_output_logits=True, thinker_return_dict_in_generate=True)
    got = ours.pipe.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=N_TOKENS, ignore_eos=True,
                             **media, **common)
    with torch.no_grad():
        want = ref.generate(enc["input_ids"], attention_mask=enc["attention_mask"], return_audio=False,
                            thinker_max_new_tokens=N_TOKENS, thinker_do_sample=False, thinker_eos_token_id=None,
                            **media, **common)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits) == N_TOKENS
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert _rel(a, b) <= 1e-5, (step, _rel(a, b))


def test_speech_matches_transformers(pair):
    ours, ref = pair
    enc = _inputs(ours.pipe)
    media = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    got = ours.pipe.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=N_TOKENS, return_audio=True,
                             speaker="Aiden", talker_max_new_tokens=N_CODES, ignore_eos=True, **media)
    # transformers 5.24's talker reads the audio window from its own config, which lacks it
    # (an AttributeError with any audio prompt); the reference gets the same workaround.
    with torch.no_grad(), _talker_sees_audio_window(ref, True):
        want = ref.generate(enc["input_ids"], attention_mask=enc["attention_mask"], return_audio=True,
                            speaker="Aiden", thinker_max_new_tokens=N_TOKENS, thinker_do_sample=False,
                            thinker_eos_token_id=None, talker_max_new_tokens=N_CODES, talker_do_sample=False,
                            **media)
    (seq, wav), (seq_ref, wav_ref) = got, want
    seq = seq if torch.is_tensor(seq) else seq.sequences
    seq_ref = seq_ref if torch.is_tensor(seq_ref) else seq_ref.sequences
    assert torch.equal(seq, seq_ref)
    wav, wav_ref = (w[0] if isinstance(w, (list, tuple)) else w for w in (wav, wav_ref))
    assert wav.shape == wav_ref.shape and wav.numel() > 0
    assert _rel(wav, wav_ref) <= 1e-5


def test_experts_op_skips_the_expert_parallel_sentinel():
    """Index num_experts marks a token routed to another rank's expert: transformers'
    loop skips it (num_experts + 1 one-hot classes); so must the op, with equal numbers."""
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextExperts

    from magi_zoo.adapters.qwen3_omni.configs import TINY, build_config

    cfg: Qwen3OmniMoeConfig = build_config(TINY)
    text = cfg.thinker_config.text_config
    text._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = Qwen3OmniMoeThinkerTextExperts(text)
    for p in experts.parameters():
        p.data.normal_(0, 0.02)
    e = text.num_experts
    h = torch.randn(6, text.hidden_size)
    idx = torch.tensor([[0, 1], [e, 2], [3, e], [1, 0], [e, e], [2, 3]])  # `e`: the sentinel
    w = torch.rand(6, 2)
    want = Qwen3OmniMoeThinkerTextExperts.forward.__wrapped__(experts, h, idx, w) \
        if hasattr(Qwen3OmniMoeThinkerTextExperts.forward, "__wrapped__") else experts(h, idx, w)
    got = moe_experts(h, idx, w, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[4].abs().max() == 0  # both slots on other ranks: nothing computed here
