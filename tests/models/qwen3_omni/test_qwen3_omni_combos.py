"""Qwen3-Omni: the shipped plan serves every prompt x output combination in one process.

The bug this guards (issue 15): the audio / vision encoders, the talker's decoder and the
code predictor all had transformers' decorator `wrapper` as their `forward` code, so dynamo
kept one cache for all of them. An encoder's graph break inside the wrapper's try/finally
made dynamo give that code up (run it eagerly from then on), and the talker's
`fullgraph=True` compile then started one frame deeper, inside the output-capture hook:
`Unsupported: ContextVar.get` on the first image (or audio) prompt with speech output. The
adapter's own-code preparation (regions.py) gives each class a forward of its own.

One tiny model with the shipped spec, unmodified except the backend, runs text / audio /
image prompts x text / speech output, twice, and must match an eager model token for
token. Counters say where each region compiled. Backends: what broke is dynamo's (frames,
caches, guards, skip verdicts), which every backend shares, so most regions run dynamo alone
("eager"); the talker's decoder adds AOTAutograd and functionalization ("aot_eager"), and the
code predictor, the smallest model, runs inductor's generated code. Measured on the shared
2-core CPU (wall): dynamo ~45% of this file's compile time, AOTAutograd on the thinker's 6
graphs another ~25% -- which is why the thinker is not on aot_eager here (inductor for
prefill / decode_step: tests/conformance). The unmodified plan with inductor everywhere:
`test_shipped_plan_unmodified_on_gpu`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import magi_zoo  # noqa: E402
from magi_zoo.specs import SpecFile, spec_path  # noqa: E402

pytest.importorskip("transformers")

from magi_zoo.adapters.qwen3_omni import audio_tower, shared_code_regions  # noqa: E402

MODEL = "qwen3-omni-tiny"
GEN = dict(max_new_tokens=3, talker_max_new_tokens=4)
INDUCTOR_REGION = "talker.code_predictor.model"


def _media():
    from PIL import Image

    rng = np.random.RandomState(0)
    image = Image.fromarray((rng.rand(40, 56, 3) * 255).astype("uint8"))  # 2x4 merged patches -> 8 tokens
    audio = (rng.randn(16000) * 0.1).astype("float32")  # 1 s at 16 kHz -> 100 mel frames -> 13 tokens
    return {"text": {}, "audio": {"audio": audio}, "image": {"image": image}}


# Every (prompt, speech?) pair; the first is the one that failed in one call, then every
# other order of modality and output follows (speech after an encoder, text after speech...).
ORDER = [("image", True), ("text", True), ("audio", False), ("text", False), ("audio", True), ("image", False)]


def _backends() -> dict:
    spec = SpecFile.from_toml(spec_path("qwen3_omni.toml"))
    over: dict = {}
    for key, method, s in spec.default.items_by_method():
        if s.enabled:
            backend = ("inductor" if key == INDUCTOR_REGION else "aot_eager" if key == "talker.model" else "eager")
            over.setdefault(key, {})[method] = {"backend": backend}
    return over


def _frames(rep) -> dict[str, int]:
    return {r.label: r.counters.frames for r in rep.regions}


@pytest.fixture(scope="module")
def eager():
    """The uncompiled tiny model (references; the last test applies a plan to it)."""
    return magi_zoo.load(MODEL, gpu="cpu", compile=False)


@pytest.fixture(scope="module")
def runs(eager):
    """(eager outputs, compiled outputs, new frames per region per call, report)."""
    media = _media()
    ref = {(p, sp): eager.pipe("hi", return_audio=sp, **GEN, **media[p]) for p, sp in ORDER}
    torch._dynamo.reset()
    h = magi_zoo.load(MODEL, gpu="cpu", compile=_backends())
    rep = h.report()
    outs, new = [], []
    for _ in range(2):  # the second round must compile nothing
        for p, sp in ORDER:
            before = _frames(rep)
            outs.append(((p, sp), h.pipe("hi", return_audio=sp, **GEN, **media[p])))
            after = _frames(rep)
            new.append(((p, sp), {k: after[k] - before[k] for k in after if after[k] != before[k]}))
    return ref, outs, new, h


def test_every_combination_matches_eager(runs):
    ref, outs, _, _ = runs
    for key, got in outs:
        want = ref[key]
        assert got.token_ids == want.token_ids, key
        if key[1]:
            assert got.audio is not None and got.audio.shape == want.audio.shape, key
            torch.testing.assert_close(torch.from_numpy(got.audio), torch.from_numpy(want.audio),
                                       rtol=1e-4, atol=1e-4)
        else:
            assert got.audio is None


def test_counters_show_where_each_region_compiles(runs):
    _, _, new, h = runs
    first, second = new[: len(ORDER)], new[len(ORDER):]
    print("\n".join(f"{k}: {v}" for k, v in new))
    # Second round: every shape and every guard state was seen in the first -> 0 frames.
    assert all(d == {} for _, d in second), second
    got = dict(first)
    # image + speech, the call that failed: every region it runs compiles here -- the vision
    # encoder, the thinker (prefill + decode step), the talker and the code predictor.
    # Code2Wav is eager (the spec). Talker: the prompt pass starts from an empty cache, the
    # frames after it from a filled one (the cache's `is_initialized` is a guard) -> 2.
    # Code predictor: empty cache; a cache of one position (a size-1 dimension is
    # specialised: its stride is a guard); then longer ones, symbolic -> 3.
    assert set(got[("image", True)]) == {"Qwen3OmniMoeVisionEncoder", "Qwen3OmniMoeThinkerTextModel.prefill",
                                          "Qwen3OmniMoeThinkerTextModel.decode_step", "talker.model",
                                          "talker.code_predictor.model"}, got[("image", True)]
    assert got[("image", True)]["talker.model"] == 2
    assert got[("image", True)]["talker.code_predictor.model"] == 3
    # text + speech: the thinker prefill gets deepstack_visual_embeds=None where it had a
    # list (a type guard) -> 1; the talker's position ids are int64 for text where the
    # multimodal rope index made float32 (a dtype guard), in both cache states -> 2.
    assert got[("text", True)] == {"Qwen3OmniMoeThinkerTextModel.prefill": 1, "talker.model": 2}
    # audio + text: the audio encoder; the thinker without output_hidden_states (the talker
    # is not fed; one kwarg fewer is a guard) -> prefill and decode step 1 each.
    assert got[("audio", False)].keys() == {"Qwen3OmniMoeAudioEncoder", "Qwen3OmniMoeThinkerTextModel.prefill",
                                            "Qwen3OmniMoeThinkerTextModel.decode_step"}, got[("audio", False)]
    assert got[("audio", False)]["Qwen3OmniMoeThinkerTextModel.prefill"] == 1
    # text + text reuses audio + text's thinker graphs (the prefill is dynamic in length).
    assert got[("text", False)] == {}
    rep = h.report()
    # No region reaches dynamo's recompile limit (fullgraph would make it a hard error):
    # every region's frames are its own code's cache entries (one code object per class).
    limit = torch._dynamo.config.recompile_limit
    for r in rep.regions:
        if r.spec.fullgraph:
            assert r.counters.frames < limit, (r.label, r.counters.frames, r.counters.recompiles)
    # The encoders (not fullgraph) still break, which is what made dynamo give up the shared
    # wrapper code in issue 15: without their breaks this test would not reproduce the bug's
    # conditions. Nothing else breaks (a fullgraph region cannot; code2wav is not compiled).
    broke = {r.label for r in rep.regions if r.counters.n_graph_breaks}
    assert broke == {"Qwen3OmniMoeAudioEncoder", "Qwen3OmniMoeVisionEncoder"}, broke
    assert rep.region(INDUCTOR_REGION).spec.backend == "inductor"
    assert rep.region(INDUCTOR_REGION).counters.backend_s > 0  # AOTAutograd + inductor ran
    assert shared_code_regions(h.pipe.model) == []


def test_shared_wrapper_failure_is_reproduced_and_named(eager):
    """Without the own-code preparation: the check names the regions sharing the wrapper and
    the pipeline refuses to run. The raw call no longer fails as the issue reported: the compile
    step now compiles each region through a copy of its method with a code object of its own
    (engine/compile/step.py `region_method`), so the regions sharing transformers' wrapper code
    no longer share dynamo's cache either."""
    h = eager
    adapter = h.adapter
    split_only = adapter.preparations(h.pipe)[:1]  # the prefill/decode split, not the own-code step
    over = {k: {m: {"backend": "eager"} for m in ms} for k, ms in _backends().items()}
    from magi_zoo.overrides import spec_layers

    torch._dynamo.reset()
    magi_zoo.apply(h.modules, layers=spec_layers(adapter, h.profile, compile=over), gpu="cpu",
                   preparations=split_only)
    shared = shared_code_regions(h.pipe.model)
    assert len(shared) == 1 and "wrapper" in shared[0], shared
    for region in ("audio_tower", "visual", "talker.model.forward", "talker.code_predictor.model.forward"):
        assert region in shared[0]
    with pytest.raises(RuntimeError, match="share one code object"):
        h.pipe("hi", return_audio=True, **GEN)
    # The sequence: one compiled audio-encoder call, then the talker's decoder (its
    # fullgraph compile), called directly as generate() would (the check bypassed). It failed
    # with dynamo's ContextVar error while both regions compiled the one shared wrapper code;
    # with a code object per region it runs.
    talker = h.pipe.model.talker.model
    with torch.no_grad():
        audio_tower(h.pipe.model.thinker)(torch.randn(128, 100), feature_lens=torch.tensor([100]))
        out = talker(inputs_embeds=torch.randn(1, 3, talker.config.hidden_size), use_cache=False)
    assert torch.isfinite(out.last_hidden_state).all()
    magi_zoo.engine.remove(h.modules)
    torch._dynamo.reset()


@pytest.mark.gpu
def test_shipped_plan_unmodified_on_gpu():
    """The shipped plan as it ships (inductor everywhere, CUDA graphs for the decode step),
    fp32 so greedy tokens can be compared: every combination twice, equal to eager, and the
    second round compiles nothing."""
    media = _media()
    eager = magi_zoo.load(MODEL, gpu="h100", dtype="float32", compile=False)
    ref = {(p, sp): eager.pipe("hi", return_audio=sp, **GEN, **media[p]) for p, sp in ORDER}
    del eager
    torch._dynamo.reset()
    h = magi_zoo.load(MODEL, gpu="h100", dtype="float32")
    rep = h.report()
    for round_ in range(2):
        before = _frames(rep)
        for p, sp in ORDER:
            got = h.pipe("hi", return_audio=sp, **GEN, **media[p])
            assert got.token_ids == ref[(p, sp)].token_ids, (round_, p, sp)
            if sp:
                torch.testing.assert_close(torch.from_numpy(got.audio), torch.from_numpy(ref[(p, sp)].audio),
                                           rtol=1e-3, atol=1e-3)
        if round_ == 1:
            assert _frames(rep) == before
    print(rep.table())
