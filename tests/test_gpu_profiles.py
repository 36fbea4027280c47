import pytest
import torch

from magi_zoo import get_profile
from magi_zoo.specs import GPU_CHOICES


def test_all_named_profiles_exist():
    assert set(GPU_CHOICES) == {"auto", "cpu", "h100", "h200", "a100", "l40s", "rtx4090", "rtx5090"}
    for name in GPU_CHOICES[1:]:
        p = get_profile(name)
        assert p.name == name and p.attention_backend in {"cudnn", "flash", "efficient", "math"}
    assert get_profile("H100").name == "h100"  # case-insensitive
    assert get_profile("h100").fp8 and not get_profile("a100").fp8


def test_unknown_gpu_lists_choices_and_suggests():
    with pytest.raises(ValueError, match=r"choices: auto, cpu, h100.*Did you mean 'h100'"):
        get_profile("h10")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_auto_without_cuda_is_cpu():
    p = get_profile("auto")
    assert p.name == "cpu" and p.default_dtype == "float32"
