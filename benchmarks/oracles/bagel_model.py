"""Oracle: bagel-tiny's outputs from the official BAGEL model code (every task, CPU, fp32).

Usage (from the repository root, in the project's environment)::

    python benchmarks/oracles/bagel_model.py PATH/TO/ByteDance-Seed/Bagel [OUT.json] [COMMIT] \\
        --official-python /tmp/bagel-oracle-venv/bin/python

writes (default) tests/data/bagel_tiny_parity.json, which tests/models/bagel/test_bagel_parity.py
checks our bagel-tiny against. docs/testing.md says how to make the official environment
(the official code needs transformers 4.x: its SigLIP fork imports
`transformers.modeling_attn_mask_utils`, gone in 5.x; its requirements.txt names 4.49.0).

Two stages, two interpreters:
1. here (the project's environment): bagel-tiny is built as the test builds it
   (`magi_zoo.load("bagel-tiny")`: random weights, seeded) and saved in the official layout
   (`save_pretrained`: llm_config.json, vit_config.json, ema.safetensors, ae.safetensors,
   tokenizer.json) into a temporary directory, beside a JSON of the tiny config and the cases;
2. `--official-python` runs this file again with `--official`: it imports the checkout's
   `modeling/` (Bagel, its Qwen2 / SigLIP forks, autoencoder.py), `data/` and `inferencer.py`,
   builds the model as the official app.py does (qk_norm, untied embeddings,
   Qwen2MoTDecoderLayer, the ViT without its last layer, the conv patch embedding turned
   linear) at the tiny config's sizes, loads the saved weights strictly, and runs every case
   through `InterleaveInferencer.interleave_inference` with greedy text, the seeds drawn from
   the global torch RNG (`torch.manual_seed(seed)` before each call; our pipeline draws the
   same stream from a CPU generator).

Stand-ins (the arithmetic is the official code's):
- `flash_attn.flash_attn_varlen_func` (a CUDA-only package) is per-segment attention: each
  packed sequence's queries attend to its keys with softmax(q k^T / sqrt(d)) v, grouped-query
  heads as flash-attn groups them, and `causal` aligned bottom-right as flash-attn >= 2.1 does
  (a query at row i of Lq sees keys up to i + Lk - Lq);
- the casts to bfloat16 around attention in modeling/bagel/qwen2_navit.py and siglip_navit.py
  (flash-attn takes only half precision) are casts to float32, for an fp32 comparison; the
  official inference's bf16 dtypes are checked apart (bagel_cfg_combine.py);
- `cv2`, where absent, is an empty module (data/transforms.py uses it only in the training
  augmentations);
- the tokenizer is the official `Qwen2TokenizerFast` class over the saved tokenizer.json (the
  tiny checkpoint has no vocab.json / merges.txt for the slow class app.py names), with the
  official `add_special_tokens`;
- the autoencoder is autoencoder.py's `AutoEncoder` at bagel-tiny's sizes (load_ae hard-codes
  FLUX's), loaded with strict=True;
- images are recorded as the float image before the uint8 PNG: `decode_image`'s VAE decode is
  observed and its `(image * 0.5 + 0.5).clamp(0, 1)` kept; each image is stored as 8x8-pixel
  means rounded to 6 decimals (the fingerprint the test compares).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

DEFAULT_OUT = "tests/data/bagel_tiny_parity.json"
# The cases the test runs through our pipeline (tests/models/bagel/test_bagel_parity.py).
QUESTION = "what is in the picture?"
T2I = dict(num_inference_steps=4, timestep_shift=3.0, cfg_text_scale=4.0, cfg_img_scale=1.5, cfg_interval=[0.0, 1.0],
           cfg_renorm_type="global", cfg_renorm_min=0.0)
EDIT = dict(num_inference_steps=4)  # the variant's editing defaults otherwise
UNDERSTAND_TOKENS, THINK_TOKENS = 12, 6
SEEDS = dict(t2i=3, edit=5, edit_rgba=6, t2i_think=7, edit_think=8)
SIZES = dict(t2i=(48, 32), t2i_think=(32, 32))  # (height, width)
PROMPTS = dict(ids="a red fox", t2i="a red fox", edit="make the sky purple", edit_think="make it blue")


def input_images():
    """The test's two input images: 50x70 RGB and 40x60 RGBA (numpy RandomState(0))."""
    import numpy as np  # lazy: the test imports this module's constants; stage 1 needs no numpy
    from PIL import Image  # lazy: as numpy

    rs = np.random.RandomState(0)
    img = Image.fromarray((rs.rand(50, 70, 3) * 255).astype("uint8"))
    rgba = Image.fromarray((rs.rand(40, 60, 4) * 255).astype("uint8"), "RGBA")
    return img, rgba


def pooled(t) -> list:
    """[3, H, W] in [0, 1] -> 8x8-pixel means, rounded (a compact fingerprint of the image)."""
    import torch  # lazy: as input_images

    return torch.nn.functional.avg_pool2d(t[None].float(), 8)[0].round(decimals=6).tolist()


# -- stage 1: the project's side ------------------------------------------------------------------
def save_tiny(path: Path) -> dict:
    """bagel-tiny as the test builds it, saved in the official layout; returns the settings."""
    import magi_zoo  # lazy: stage 2 runs without the project's dependencies

    handle = magi_zoo.load("bagel-tiny", gpu="cpu", compile=False)
    handle.adapter.save_pretrained(handle.pipe, path)
    cfg = handle.pipe.config
    edit = dict(handle.variant.call_defaults["edit"], **EDIT)
    edit.pop("height", None), edit.pop("width", None)
    settings = dict(config={k: cfg[k] for k in ("vae", "latent_patch_size", "max_latent_size",
                                                  "vit_max_num_patch_per_side", "vae_image", "vit_image")},
                    t2i=T2I, edit={k: list(v) if isinstance(v, tuple) else v for k, v in edit.items()})
    (path / "oracle_settings.json").write_text(json.dumps(settings))
    return settings


# -- stage 2: the official side -------------------------------------------------------------------
def flash_attn_stub():
    import torch  # lazy: the module's constants are imported without torch

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                               causal=False, **_):
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]))
            qi = q[qs:qe].transpose(0, 1)
            ki = k[ks:ke].repeat_interleave(group, dim=1).transpose(0, 1)
            vi = v[ks:ke].repeat_interleave(group, dim=1).transpose(0, 1)
            scores = qi @ ki.transpose(-1, -2) / q.shape[-1] ** 0.5
            if causal:
                lq, lk = qe - qs, ke - ks
                keep = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
                scores = scores.masked_fill(~keep, float("-inf"))
            out[qs:qe] = (scores.softmax(-1) @ vi).transpose(0, 1)
        return out

    import importlib.machinery  # lazy: stage 2 only

    mod = types.ModuleType("flash_attn")
    # a spec without package metadata: transformers' availability checks find it and answer
    # "not installed", so only the two official modules that import the function use it
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod


def import_official(repo: Path, scratch: Path):
    """The checkout's modeling/, data/ and inferencer.py, from a copy where the attention
    casts to bfloat16 are casts to float32 (the only text changed)."""
    import importlib.util  # lazy: stage 2 only
    import shutil  # lazy: stage 2 only

    for part in ("modeling", "data", "inferencer.py"):
        src = repo / part
        (shutil.copytree if src.is_dir() else shutil.copy)(src, scratch / part)
    for f in ("modeling/bagel/qwen2_navit.py", "modeling/bagel/siglip_navit.py"):
        p = scratch / f
        p.write_text(p.read_text().replace("torch.bfloat16", "torch.float32"))
    sys.modules["flash_attn"] = flash_attn_stub()
    if importlib.util.find_spec("cv2") is None:  # transforms.py uses cv2 in training augmentations only
        sys.modules["cv2"] = types.ModuleType("cv2")
    sys.path.insert(0, str(scratch))
    data = types.ModuleType("data")  # a bare package: data/__init__.py imports the training datasets
    data.__path__ = [str(scratch / "data")]
    sys.modules["data"] = data
    return {name: importlib.import_module(name) for name in
            ("modeling.bagel", "modeling.autoencoder", "modeling.qwen2", "data.data_utils", "data.transforms",
             "inferencer")}


def build_official(mods: dict, ckpt: Path, cfg: dict):
    from safetensors.torch import load_file  # lazy: stage 2 only

    bagel, ae_mod = mods["modeling.bagel"], mods["modeling.autoencoder"]
    llm_config = bagel.Qwen2Config.from_json_file(str(ckpt / "llm_config.json"))
    llm_config.qk_norm, llm_config.tie_word_embeddings = True, False
    llm_config.layer_module = "Qwen2MoTDecoderLayer"
    vit_config = bagel.SiglipVisionConfig.from_json_file(str(ckpt / "vit_config.json"))
    vit_config.rope = False
    vit_config.num_hidden_layers -= 1
    v = cfg["vae"]
    ch = v["block_out_channels"][0]
    ae_params = ae_mod.AutoEncoderParams(resolution=256, in_channels=v["in_channels"], downsample=8, ch=ch,
                                         out_ch=v["out_channels"], ch_mult=[c // ch for c in v["block_out_channels"]],
                                         num_res_blocks=v["layers_per_block"], z_channels=v["latent_channels"],
                                         scale_factor=v["scaling_factor"], shift_factor=v["shift_factor"])
    ae = ae_mod.AutoEncoder(ae_params)
    ae.load_state_dict(load_file(str(ckpt / "ae.safetensors")), strict=True)
    config = bagel.BagelConfig(visual_gen=True, visual_und=True, llm_config=llm_config, vit_config=vit_config,
                               vae_config=ae_params, vit_max_num_patch_per_side=cfg["vit_max_num_patch_per_side"],
                               connector_act="gelu_pytorch_tanh", latent_patch_size=cfg["latent_patch_size"],
                               max_latent_size=cfg["max_latent_size"])
    model = bagel.Bagel(bagel.Qwen2ForCausalLM(llm_config), bagel.SiglipVisionModel(vit_config), config)
    model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
    missing, unexpected = model.load_state_dict(load_file(str(ckpt / "ema.safetensors")), strict=False)
    # the frozen sin-cos position tables are rebuilt by the model (the official resume code does too)
    assert not unexpected and set(missing) <= {"vit_pos_embed.pos_embed", "latent_pos_embed.pos_embed"}, \
        (missing, unexpected)
    return model.float().eval(), ae.float().eval()


def run_official(repo: Path, ckpt: Path, commit: str) -> dict:
    import torch  # lazy: the official environment's torch, stage 2 only
    import transformers  # lazy: the official environment's transformers 4.x, stage 2 only

    settings = json.loads((ckpt / "oracle_settings.json").read_text())
    cfg = settings["config"]
    with tempfile.TemporaryDirectory() as scratch:
        mods = import_official(repo, Path(scratch))
        model, ae = build_official(mods, ckpt, cfg)
        tokenizer = mods["modeling.qwen2"].Qwen2TokenizerFast.from_pretrained(str(ckpt))
        tokenizer, new_token_ids, _ = mods["data.data_utils"].add_special_tokens(tokenizer)
        it = mods["data.transforms"].ImageTransform
        vae_t = it(cfg["vae_image"]["max_size"], cfg["vae_image"]["min_size"], cfg["vae_image"]["stride"],
                   cfg["vae_image"]["max_pixels"])
        vit_t = it(cfg["vit_image"]["max_size"], cfg["vit_image"]["min_size"], cfg["vit_image"]["stride"],
                   cfg["vit_image"]["max_pixels"])
        inf = mods["inferencer"].InterleaveInferencer(model, ae, tokenizer, vae_t, vit_t, new_token_ids)

        decoded, sequences = [], []
        ae_decode, gen_text = ae.decode, model.generate_text
        ae.decode = lambda z: decoded.append(ae_decode(z)) or decoded[-1]
        model.generate_text = lambda **kw: sequences.append(gen_text(**kw)) or sequences[-1]

        def image():
            return pooled((decoded[-1] * 0.5 + 0.5).clamp(0, 1)[0])  # decode_image's float image

        def sampling(kw: dict) -> dict:
            kw = dict(kw)
            kw["num_timesteps"] = kw.pop("num_inference_steps")
            return kw

        def call(inputs, seed=0, **kw):
            torch.manual_seed(seed)
            with torch.no_grad():
                return inf.interleave_inference(inputs, do_sample=False, **kw)

        img, rgba = input_images()
        t2i, edit = sampling(settings["t2i"]), sampling(settings["edit"])
        out = {"source": {
            "official": "github.com/ByteDance-Seed/Bagel", "commit": commit,
            "script": "benchmarks/oracles/bagel_model.py", "torch": torch.__version__,
            "transformers": transformers.__version__, "device": "cpu", "dtype": "float32",
            "cases": dict(question=QUESTION, prompts=PROMPTS, seeds=SEEDS, sizes=SIZES, t2i=settings["t2i"],
                          edit=settings["edit"], understand_tokens=UNDERSTAND_TOKENS, think_tokens=THINK_TOKENS)}}
        generation_input = model.prepare_prompts(curr_kvlens=[0], curr_rope=[0], prompts=[PROMPTS["ids"]],
                                                 tokenizer=tokenizer, new_token_ids=new_token_ids)[0]
        out["prompt_ids"] = generation_input["packed_text_ids"].tolist()
        (text,) = call([img, QUESTION], understanding_output=True, max_think_token_n=UNDERSTAND_TOKENS)
        seq = sequences[-1][:, 0].tolist()  # the start token, then the greedy tokens (an end token is not kept)
        out["understand_tokens"], out["understand"] = seq[1:], text
        (out["understand_think"],) = call([img, QUESTION], think=True, understanding_output=True,
                                          max_think_token_n=UNDERSTAND_TOKENS)
        call([PROMPTS["t2i"]], SEEDS["t2i"], image_shapes=SIZES["t2i"], **t2i)
        out["t2i"] = image()
        call([img, PROMPTS["edit"]], SEEDS["edit"], **edit)
        out["edit"] = image()
        call([rgba, PROMPTS["edit"]], SEEDS["edit_rgba"], **edit)
        out["edit_rgba"] = image()
        thought, _ = call([PROMPTS["t2i"]], SEEDS["t2i_think"], think=True, max_think_token_n=THINK_TOKENS,
                          image_shapes=SIZES["t2i_think"], **t2i)
        out["t2i_think"] = {"text": thought, "image": image()}
        thought, _ = call([img, PROMPTS["edit_think"]], SEEDS["edit_think"], think=True,
                          max_think_token_n=THINK_TOKENS, **edit)
        out["edit_think"] = {"text": thought, "image": image()}
    return out


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--official":
        repo, ckpt, out, commit = Path(argv[1]), Path(argv[2]), Path(argv[3]), argv[4]
        data = run_official(repo, ckpt, commit)
        out.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n")
        print(f"wrote {out} (official commit {commit})")
        return
    python = sys.executable
    if "--official-python" in argv:
        i = argv.index("--official-python")
        python, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    if not argv or not (Path(argv[0]) / "modeling" / "bagel" / "bagel.py").is_file():
        raise SystemExit(f"usage: {__doc__.split('Usage')[1].split('writes')[0].strip()}\n"
                         "the first argument must be a ByteDance-Seed/Bagel checkout (modeling/bagel/bagel.py)")
    repo = Path(argv[0]).resolve()
    out = Path(argv[1] if len(argv) > 1 else DEFAULT_OUT).resolve()
    commit = argv[2] if len(argv) > 2 else "unknown"
    with tempfile.TemporaryDirectory() as ckpt:
        save_tiny(Path(ckpt))
        subprocess.run([python, str(Path(__file__).resolve()), "--official", str(repo), ckpt, str(out), commit],
                       check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
