"""The fa3_varlen backend (engine/kernels/fa3_varlen.py): a boolean key-padding mask taken by
FA3 as ``seqused_k``, on the CPU stand-in of the kernel (tests/helpers/fa3_standins.py), and the
spec's ``masks = "padding"`` that turns ``fa3`` into it (HunyuanVideo-1.5's plan)."""

import pytest
import torch

import magi_zoo
from magi_zoo.engine import counters, remove
from magi_zoo.engine.kernels import fa3, fa3_varlen
from helpers.fa3_standins import CALLS, install_fa3


@pytest.fixture
def kernel(monkeypatch):
    """The stand-in kernel 'installed'; diffusers' two FA3 registry slots put back afterwards."""
    from diffusers.models.attention_dispatch import AttentionBackendName as N, _AttentionBackendRegistry as R

    slots = (N._FLASH_3, N._FLASH_VARLEN_3)
    saved = [(R._backends.get(m), R._constraints.get(m), R._supported_arg_names.get(m)) for m in slots]
    yield install_fa3(monkeypatch)
    for m, (b, c, a) in zip(slots, saved):
        R._backends[m], R._constraints[m], R._supported_arg_names[m] = b, c, a


def _qkv(b=2, s=8, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(torch.bfloat16) for _ in range(3))


def _reference(q, k, v, mask4):
    """fp32 SDPA with the (B, H|1, Lq|1, Lk) boolean mask, in (B, S, H, D)."""
    t = lambda x: x.transpose(1, 2).float()  # noqa: E731
    return torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=mask4).transpose(1, 2)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


VALID = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)  # right padding
HOLES = torch.tensor([[0, 1, 1, 0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)  # not a prefix


def test_key_padding_reads_every_shape_diffusers_varlen_takes():
    """A key is valid when a query may see it, for every shape diffusers' varlen backends take."""
    a = VALID
    outer = a[:, None, :, None] & a[:, None, None, :]  # HunyuanVideo-1.5's L x L form
    for mask in (a, a[:, None, :].expand(2, 8, 8), outer, a[:, None, None, :], outer.expand(2, 3, 8, 8)):
        assert torch.equal(fa3_varlen.key_padding(mask, 2, 8), a)
    assert torch.equal(fa3_varlen.key_padding(a[0], 2, 8), a[:1].expand(2, 8))  # one mask for the batch
    with pytest.raises(ValueError, match="5 dimensions is not a key-padding mask"):
        fa3_varlen.key_padding(outer[None], 2, 8)
    with pytest.raises(ValueError, match="does not match 2 sequence\\(s\\) of 9 keys"):
        fa3_varlen.key_padding(a, 2, 9)


def test_a_square_padding_mask_is_read_from_its_diagonal_not_reduced_whole():
    """Cost oracle: HunyuanVideo-1.5's m & m^T mask at L tokens costs an L x L reduction a block
    if reduced over its queries (4.5 ms a block at L = 51,275 on an H200). Read from its diagonal,
    nothing key_padding reduces holds more than L elements per head; the answer equals the whole
    reduction's for left, right and scattered padding, per batch element and head."""
    from torch.overrides import TorchFunctionMode

    size = 256
    valid = torch.ones(3, size, dtype=torch.bool)
    valid[0, 200:] = False  # right padding
    valid[1, :17] = False  # left padding
    valid[2, ::3] = False  # holes
    read = []

    class Largest(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = getattr(func, "__name__", "")
            if name in ("any", "all", "sum", "amax", "argmax", "max"):  # a reduction reads its whole input
                read.append(args[0].numel())
            elif name == "gather":  # a gather reads what it returns
                read.append(out.numel())
            return out

    for heads in (1, 2):
        outer = (valid[:, None, :, None] & valid[:, None, None, :]).expand(3, heads, size, size)
        rows = valid[:, None, None, :].expand(3, heads, size, size)  # every query sees the valid keys
        for mask in (outer, rows, rows[:, 0]):
            read.clear()
            with Largest():
                got = fa3_varlen.key_padding(mask, 3, size)
            assert torch.equal(got, mask.reshape(3, -1, size).any(dim=1))  # the whole reduction's answer
            assert torch.equal(got, valid)
            assert read and max(read) <= 3 * heads * size  # O(L) a head, not L x L


@pytest.mark.parametrize("form", ["keys", "holes", "outer"])
def test_padding_masks_run_on_the_kernel_and_equal_masked_sdpa(kernel, form):
    """Every valid query's output is masked SDPA's (fp32 reference; bf16 tolerance), for right
    padding, for valid keys that do not lead (gathered to the front), and for the L x L mask
    that hides padded queries too (compared on the valid queries: the contract leaves the
    others undefined). One kernel call each: nothing fell back to SDPA."""
    fa3_varlen.register()
    q, k, v = _qkv()
    valid = HOLES if form == "holes" else VALID
    mask = valid[:, None, :, None] & valid[:, None, None, :] if form == "outer" else valid
    mask4 = valid[:, None, None, :]
    got = fa3_varlen.fa3_varlen_attention(q, k, v, attn_mask=mask)
    assert CALLS["eager"] == 1
    ref = _reference(q, k, v, mask4)
    rows = valid if form == "outer" else torch.ones_like(valid)
    assert _rel(got[rows], ref[rows]) < 1e-2
    assert _rel(got[rows], _reference(q, k, v, None)[rows]) > 5e-2  # the padding matters here
    out, lse = fa3_varlen.fa3_varlen_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert torch.equal(out, got) and lse.shape == (2, 8, 2)  # diffusers' (B, S, H) LSE


def test_calls_the_contract_does_not_cover_run_on_sdpa_or_are_refused(kernel):
    fa3_varlen.register()
    q, k, v = _qkv()
    bias = torch.zeros(2, 1, 1, 8).masked_fill(~VALID[:, None, None, :], -10000.0).to(torch.bfloat16)
    # an additive mask may be any bias (ALiBi, ...): SDPA with it, exactly as fa3 runs it
    torch.testing.assert_close(fa3_varlen.fa3_varlen_attention(q, k, v, attn_mask=bias),
                               fa3.sdpa_bshd(q, k, v, attn_mask=bias), rtol=0, atol=0)
    assert fa3_varlen.fa3_varlen_attention(q, k, v, attn_mask=VALID, dropout_p=0.5).shape == q.shape
    assert CALLS["eager"] == 0
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))  # the trainable FA3 op takes no seqused_k
    fa3_varlen.fa3_varlen_attention(qg, kg, vg, attn_mask=VALID).sum().backward()
    assert CALLS["eager"] == 0 and qg.grad is not None
    torch.testing.assert_close(fa3_varlen.fa3_varlen_attention(q, k, v), fa3.fa3_attention(q, k, v), rtol=0, atol=0)
    assert CALLS["eager"] == 2  # no mask: fa3 itself (both calls above on the kernel)
    with pytest.raises(TypeError, match="bfloat16 only"):
        fa3_varlen.fa3_varlen_attention(q.float(), k.float(), v.float(), attn_mask=VALID)
    with pytest.raises(ValueError, match="context parallelism"):
        fa3_varlen.fa3_varlen_attention(q, k, v, attn_mask=VALID, _parallel_config=object())


def test_fp8_baseline_runs_masked_calls_in_bf16_on_the_varlen_kernel(kernel):
    """The harness's diffusers_fp8 baseline (per-tensor fp8 FA3) cannot take a mask: a padding
    mask goes to the bf16 varlen kernel, as a diffusers user would route it, instead of failing
    (HunyuanVideo-1.5 and LTX-2 mask their prompts)."""
    from benchmarks.baselines import per_tensor_fp8_attention
    from helpers.fa3_standins import fa3_fp8_forward

    fa3_varlen.register()
    attention = per_tensor_fp8_attention(fa3_fp8_forward)
    q, k, v = _qkv()
    torch.testing.assert_close(attention(q, k, v, attn_mask=VALID),
                               fa3_varlen.fa3_varlen_attention(q, k, v, attn_mask=VALID), rtol=0, atol=0)
    assert CALLS["eager"] == 2  # both on the bf16 kernel
    unmasked = attention(q, k, v)  # fp8, per-tensor scales: close to bf16, not equal
    assert CALLS["eager"] == 2 and 0 < _rel(unmasked, fa3.fa3_attention(q, k, v)) < 0.1


def test_same_kernel_baseline_reads_masks_as_diffusers_does(kernel):
    """The harness's diffusers_regional_fa3_varlen row: the same kernel, the mask read by
    diffusers' own normalisation (the whole reduction), so the engine's diagonal reading is not
    credited to the baseline. On the contract's masks both give one answer; on a mask outside it
    (a position hidden as a query, visible as a key) diffusers' union differs from the engine's diagonal."""
    from benchmarks.baselines import diffusers_varlen_attention, fa3_varlen_member
    from magi_zoo.engine.compat import diffusers as diffusers_compat

    assert diffusers_compat.registered_backend(fa3_varlen_member()) is diffusers_varlen_attention
    q, k, v = _qkv()
    outer = VALID[:, None, :, None] & VALID[:, None, None, :]
    torch.testing.assert_close(diffusers_varlen_attention(q, k, v, attn_mask=outer),
                               fa3_varlen.fa3_varlen_attention(q, k, v, attn_mask=outer), rtol=0, atol=0)
    odd = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    odd[:, :, 3, :] = False  # position 3 sees nothing, yet the others see it as a key: not padding
    union = torch.ones(2, 8, dtype=torch.bool)
    torch.testing.assert_close(diffusers_varlen_attention(q, k, v, attn_mask=odd),
                               fa3_varlen.fa3_varlen_attention(q, k, v, attn_mask=union), rtol=0, atol=0)
    assert _rel(fa3_varlen.fa3_varlen_attention(q, k, v, attn_mask=odd),
                fa3_varlen.fa3_varlen_attention(q, k, v, attn_mask=union)) > 5e-2
    # it runs inside the baseline's full-graph regions (diffusers' reading is bound outside them)
    compiled = torch.compile(diffusers_varlen_attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, attn_mask=outer), diffusers_varlen_attention(q, k, v, attn_mask=outer))


def test_official_package_keeps_diffusers_own_varlen_entry(monkeypatch, kernel):
    from diffusers.models import attention_dispatch as ad

    before = ad._AttentionBackendRegistry._backends[ad.AttentionBackendName._FLASH_VARLEN_3]
    monkeypatch.setattr(ad, "_CAN_USE_FLASH_ATTN_3", True)
    assert fa3_varlen.register() is ad.AttentionBackendName._FLASH_VARLEN_3
    assert ad._AttentionBackendRegistry._backends[ad.AttentionBackendName._FLASH_VARLEN_3] is before
    assert "diffusers' own _flash_varlen_3" in fa3_varlen.describe()


def _hunyuan_inputs(h):
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant)
    assert kw["encoder_attention_mask"].sum() < kw["encoder_attention_mask"].numel()  # the prompt is padded
    return kw


def test_spec_masks_padding_puts_hunyuan_masked_attention_on_the_kernel(kernel, fresh_dynamo):
    """HunyuanVideo-1.5 masks every joint attention (its padded prompt). On plain fa3 each call
    runs on SDPA (0 kernel calls); with the spec's masks = "padding" fa3 becomes fa3_varlen and
    every block's call takes the kernel, inside one fullgraph region (1 frame, 0 breaks; the op
    runs at every call), with the output of the model on its native backend."""
    h = magi_zoo.load("hunyuanvideo-1.5-tiny", gpu="cpu", dtype="bfloat16", compile=False)
    t, kw = h.pipe.transformer, _hunyuan_inputs(h)
    blocks = len(t.transformer_blocks)
    with torch.no_grad():
        ref = t(**kw)[0]
        magi_zoo.apply(h.modules, {"attention": {"transformer": "fa3"}, "compile": {"": False}}, gpu="h100")
        try:
            t(**kw)
            assert CALLS["eager"] == 0  # every call masked: SDPA
        finally:
            remove(h.modules)
        rep = magi_zoo.apply(h.modules, {
            "attention": {"transformer": {"backend": "fa3", "masks": "padding"}},
            "compile": {"HunyuanVideo15TransformerBlock": {"backend": "aot_eager", "fullgraph": True}}}, gpu="h100")
        try:
            assert "fa3_varlen" in str(rep) and "masks are padding" in str(rep)
            out = t(**kw)[0]
            counters.expect(rep.region("HunyuanVideo15TransformerBlock").counters, frames=1, breaks=0)
            n = CALLS["eager"]
            t(**kw)
            # the refiner's attention (eager, also padding-masked) and every block's, at each call
            assert CALLS["eager"] - n >= blocks
            assert _rel(out, ref) < 1e-2
        finally:
            remove(h.modules)


def test_qwen_image_batch_of_unequal_prompts_stays_on_the_kernel_under_its_shipped_plan(kernel):
    """Qwen-Image's h100 table says its masks are padding: a batch of prompts of different lengths
    (the shorter one's padding masked) runs every joint attention on the kernel, with the output
    of the model on its native backend (bf16 tolerance), and one prompt stays unmasked on it."""
    from magi_zoo import SpecFile
    from magi_zoo.overrides import eager_compile, spec_layers

    h = magi_zoo.load("qwen-image-tiny", gpu="cpu", dtype="bfloat16", compile=False)
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant, batch=2, text_len=8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0  # the second prompt is 3 tokens shorter
    blocks = len(h.pipe.transformer.transformer_blocks)
    profile = magi_zoo.get_profile("h100")
    off = magi_zoo.PlanLayer(compile=eager_compile(SpecFile.from_toml(h.adapter.spec_path())))
    layers = [*spec_layers(h.adapter, profile), ("user", off)]  # the shipped plan, nothing compiled
    with torch.no_grad():
        ref = h.pipe.transformer(**{**kw, "encoder_hidden_states_mask": mask})[0]
        # with the adapter's preparations, as load() applies the plan: the fused norm + rope
        # processor builds the same joint mask and hands it to the same dispatch
        rep = magi_zoo.apply(h.modules, layers=layers, gpu=profile, preparations=h.adapter.preparations(h.pipe))
        try:
            assert "fa3_varlen" in str(rep) and "RoPE in one pass" in rep.step("precision").did
            got = h.pipe.transformer(**{**kw, "encoder_hidden_states_mask": mask})[0]
            assert CALLS["eager"] == blocks
            assert _rel(got, ref) < 1e-2
            assert _rel(got, h.pipe.transformer(**kw)[0]) > 1e-2  # the padding mattered
        finally:
            remove(h.modules)


def test_shipped_hopper_plan_for_hunyuan_names_padding_masks():
    from magi_zoo import SpecFile
    from magi_zoo.specs import spec_path

    spec = SpecFile.from_toml(spec_path("hunyuan_video15.toml"))
    entries = spec.gpu["h100"].entries("attention")
    assert {e.masks for e in entries.values()} == {"padding"}
    assert spec.gpu["h200"].entries("attention") == entries


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["keys", "holes", "outer"])
def test_fa3_varlen_kernel_equals_masked_sdpa_on_cuda(form):
    """The real kernel (the hopper extra on a Hopper card), at a video shape: 4,096 queries and
    keys, 24 heads x 128, two sequences with different padding, against fp32 masked SDPA."""
    if fa3_varlen.missing_reason() is not None or not torch.cuda.is_available():
        pytest.skip(f"needs the FA3 kernel on CUDA: {fa3_varlen.missing_reason()}")
    fa3_varlen.register()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4096, 24, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    valid = torch.ones(2, 4096, dtype=torch.bool, device="cuda")
    valid[0, 3000:] = False
    valid[1, 4000:] = False
    if form == "holes":
        valid[1, :512] = False
    mask = valid[:, None, :, None] & valid[:, None, None, :] if form == "outer" else valid
    got = fa3_varlen.fa3_varlen_attention(q, k, v, attn_mask=mask)
    ref = _reference(q, k, v, valid[:, None, None, :])
    rows = valid if form == "outer" else torch.ones_like(valid)
    assert _rel(got[rows], ref[rows]) < 1e-2
    bf16 = fa3.sdpa_bshd(q, k, v, attn_mask=valid[:, None, None, :])
    assert _rel(got[rows], ref[rows]) <= 1.5 * _rel(bf16[rows], ref[rows]) + 1e-4  # no worse than bf16 SDPA
