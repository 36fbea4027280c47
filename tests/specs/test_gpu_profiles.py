import pytest
import torch

from magi_zoo import get_profile
from magi_zoo.specs import GPU_CHOICES


def test_all_named_profiles_exist():
    assert set(GPU_CHOICES) == {"auto", "cpu", "h100", "h200", "a100", "l40s", "rtx4090", "rtx5090"}
    for name in GPU_CHOICES[1:]:
        p = get_profile(name)
        # the attention step hands it to diffusers: it must name a diffusers backend
        from diffusers.models.attention_dispatch import AttentionBackendName

        from magi_zoo.engine.attention import ENGINE_BACKENDS

        assert p.name == name and p.attention_backend in {*ENGINE_BACKENDS, *(b.value for b in AttentionBackendName)}
    assert get_profile("H100").name == "h100"  # case-insensitive
    assert get_profile("h100").memory_gib == 80 and get_profile("rtx4090").memory_gib == 24
    assert get_profile("h100").fp8 and not get_profile("a100").fp8 and not get_profile("cpu").fp8


def test_profile_reaches_every_step():
    # The engine is told the card: the offload step reads its memory, the attention step
    # its preferred backend (for backend="auto").
    import torch.nn as nn

    import magi_zoo

    m = nn.Sequential(nn.Linear(1024, 1024))  # 4 MiB of fp32 weights on the CPU
    rep = magi_zoo.apply(m, {"": {"backend": "eager"}}, gpu="cpu")
    assert rep.profile == "cpu"
    assert "weights 0.00 GiB on cpu, profile cpu has 16 GiB" in rep.step("offload").did
    tiny = get_profile("cpu").model_copy(update={"memory_gib": 0.001})  # 1 MiB: the weights do not fit
    with pytest.warns(RuntimeWarning, match="exceed the cpu profile"):
        rep = magi_zoo.apply(m, {"": {"backend": "eager"}}, gpu=tiny)
    assert "does not fit" in rep.step("offload").did


def test_unknown_gpu_lists_choices_and_suggests():
    with pytest.raises(ValueError, match=r"choices: auto, cpu, h100.*Did you mean 'h100'"):
        get_profile("h10")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_auto_without_cuda_is_cpu():
    p = get_profile("auto")
    assert p.name == "cpu" and p.default_dtype == "float32"
