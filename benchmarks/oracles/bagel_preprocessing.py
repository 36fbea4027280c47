"""Oracle: BAGEL's image preprocessing (the resize rule, transparency), from the official code.

Usage::

    python benchmarks/oracles/bagel_preprocessing.py PATH/TO/ByteDance-Seed/Bagel [OUT.json] [COMMIT]

writes (default) tests/data/bagel_official_preprocessing.json, which
tests/models/bagel/test_bagel_official.py checks `packing.resize_shape` and
`packing.image_to_tensor` against.

What runs of the official code (CPU):
- `data/transforms.py`, imported from the checkout: `ImageTransform` built with the arguments
  the official `app.py` passes (read from app.py with `ast`: 1024, 512, 16 for the VAE side;
  980, 224, 14 for the ViT side) and with bagel-tiny's sizes (magi_zoo's `bagel-tiny` config: the
  tiny variant's rule); its `MaxLongEdgeMinShortEdgeResize` decides every size;
- `data/data_utils.py`'s `pil_img2rgb` on small images of each mode (transparency handling).

Stand-ins, imports only: transforms.py imports cv2 and torchvision, which this script's
environment need not have. `cv2` is an empty module (transforms.py uses it only in the training
augmentations); `torchvision.transforms.functional.resize` returns the (height, width) it is
asked for instead of resampling pixels, so the recorded sizes are the official rule's own
decisions (the rule runs verbatim; only the pixel work after it is skipped); `ToTensor` /
`Normalize` / `InterpolationMode` are placeholders (built by ImageTransform, not called here).

Cases: the issue's example (205 x 224), 600 random sizes (Python's random.Random(0), sides
16..4096) and a grid of edge cases (each side at the rules' boundaries); five transparency cases
on 4 x 3 images (numpy's default_rng(0)). Sizes are [width, height].
"""

from __future__ import annotations

import ast
import importlib
import json
import random
import sys
import types
from pathlib import Path

import numpy as np

TRANSFORMS_PY, DATA_UTILS_PY, APP_PY = "data/transforms.py", "data/data_utils.py", "app.py"


class _Sized:
    """What the resize rule reads of an image: `.size` (width, height)."""

    def __init__(self, width: int, height: int):
        self.size = (width, height)


def import_official(repo: Path):
    stubs = {}
    if importlib.util.find_spec("cv2") is None:
        stubs["cv2"] = types.ModuleType("cv2")
    tv, tvt, tvf = (types.ModuleType(n) for n in ("torchvision", "torchvision.transforms",
                                                   "torchvision.transforms.functional"))
    tvf.resize = lambda img, size, *a, **k: tuple(size)  # (height, width): the rule's decision
    tvt.functional, tv.transforms = tvf, tvt
    tvt.InterpolationMode = types.SimpleNamespace(BICUBIC="bicubic", BILINEAR="bilinear", NEAREST="nearest")
    tvt.ToTensor = lambda *a, **k: None
    tvt.Normalize = lambda *a, **k: None
    stubs.update({"torchvision": tv, "torchvision.transforms": tvt, "torchvision.transforms.functional": tvf})
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    sys.path.insert(0, str(repo))
    try:
        for name in ("data", "data.transforms", "data.data_utils"):
            sys.modules.pop(name, None)
        data = types.ModuleType("data")  # a bare package: data/__init__.py imports the training datasets
        data.__path__ = [str(repo / "data")]
        sys.modules["data"] = data
        transforms = importlib.import_module("data.transforms")
        data_utils = importlib.import_module("data.data_utils")
    finally:
        sys.path.remove(str(repo))
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return transforms, data_utils


def app_transform_args(repo: Path) -> dict[str, list]:
    """{'vae_transform': [1024, 512, 16], 'vit_transform': [...]}: the official app's calls."""
    tree = ast.parse((repo / APP_PY).read_text())
    out = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and ast.unparse(n.value.func) == "ImageTransform":
            out[ast.unparse(n.targets[0])] = [ast.literal_eval(a) for a in n.value.args]
    return out


def sizes() -> list[tuple[int, int]]:
    rng = random.Random(0)
    out = [(205, 224), (224, 205)]
    out += [(rng.randint(16, 4096), rng.randint(16, 4096)) for _ in range(600)]
    edges = [1, 13, 14, 15, 16, 17, 27, 28, 29, 31, 32, 33, 63, 64, 65, 111, 112, 113, 223, 224, 225, 511, 512,
             513, 979, 980, 981, 1023, 1024, 1025, 3000, 4000]
    out += [(w, h) for w in edges for h in (1, 16, 224, 512, 1024, 4000) if (w, h) not in out]
    return out


def rgb_cases() -> list[dict]:
    rng = np.random.default_rng(0)
    arr = lambda *shape: rng.integers(0, 256, size=shape, dtype=np.uint8)  # noqa: E731
    palette = arr(256 * 3).tolist()
    return [dict(case="RGBA", mode="RGBA", array=arr(3, 4, 4).tolist()),
            dict(case="LA", mode="LA", array=arr(3, 4, 2).tolist()),
            dict(case="P+transparency", mode="P", array=rng.integers(0, 4, size=(3, 4), dtype=np.uint8).tolist(),
                 palette=palette, transparency=2),
            dict(case="L+transparency", mode="L", array=arr(3, 4).tolist(), transparency=int(arr(1)[0])),
            dict(case="RGB", mode="RGB", array=arr(3, 4, 3).tolist())]


def run(repo: Path, commit: str = "unknown") -> dict:
    from PIL import Image  # lazy: only a run needs it, not --help

    from magi_zoo.adapters.bagel.config import TINY  # lazy: the tiny variant's rule (its sizes); torch loads with it

    transforms, data_utils = import_official(repo)
    app = app_transform_args(repo)
    rules = {"7b": (app["vae_transform"], app["vit_transform"])}
    tiny = {s: TINY[f"{s}_image"] for s in ("vae", "vit")}
    rules["tiny"] = tuple([t["max_size"], t["min_size"], t["stride"], t["max_pixels"]] for t in tiny.values())
    out: dict = dict(source=f"ByteDance-Seed/Bagel {TRANSFORMS_PY} ImageTransform / MaxLongEdgeMinShortEdgeResize, "
                            f"{DATA_UTILS_PY} pil_img2rgb, {APP_PY} the transforms' arguments",
                     commit=commit, rules={k: dict(vae=v[0], vit=v[1]) for k, v in rules.items()})
    for name, (vae_args, vit_args) in rules.items():
        vae, vit = transforms.ImageTransform(*vae_args), transforms.ImageTransform(*vit_args)
        rows = []
        for w, h in sizes():
            (vh, vw), (th, tw) = vae.resize_transform(_Sized(w, h)), vit.resize_transform(_Sized(w, h))
            rows.append(dict(size=[w, h], vae=[vw, vh], vit=[tw, th]))
        out[f"resize_{name}"] = rows
    rgb = []
    for case in rgb_cases():
        img = Image.fromarray(np.array(case["array"], dtype=np.uint8), case["mode"])
        if "palette" in case:
            img.putpalette(case["palette"])
        if "transparency" in case:
            img.info["transparency"] = case["transparency"]
        rgb.append(dict(case, expected=np.asarray(data_utils.pil_img2rgb(img)).tolist()))
    out["rgb"] = rgb
    return out


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    repo = Path(argv[0])
    out = Path(argv[1]) if len(argv) > 1 else \
        Path(__file__).resolve().parents[2] / "tests/data/bagel_official_preprocessing.json"
    if not (repo / TRANSFORMS_PY).is_file():
        raise SystemExit(f"{str(repo)!r} has no {TRANSFORMS_PY}: pass a checkout of ByteDance-Seed/Bagel")
    data = run(repo, argv[2] if len(argv) > 2 else "unknown")
    rows = {k: data.pop(k) for k in [k for k in data if k.startswith("resize_")]}
    text = json.dumps(data, indent=1)[:-2]
    for k, v in rows.items():  # one size a line
        text += f',\n "{k}": [\n' + ",\n".join(map(json.dumps, v)) + "\n ]"
    out.write_text(text + "\n}\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
