"""Input image files as the families read them: checked and decoded whole, before any work."""

from __future__ import annotations

import os
from pathlib import Path


def open_image(path: str | os.PathLike, what: str = "--image"):
    """The image file at `path`, decoded (PIL, pixels loaded: the file may change after), in
    its own mode; each family converts it to RGB by its own rule. A missing file or one PIL
    cannot read is an error naming `what` (the CLI flag or keyword) and the path."""
    from PIL import Image, UnidentifiedImageError  # lazy: PIL costs ~15 ms; only image inputs need it

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r}: no such file")
    try:
        img = Image.open(path)
        img.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{what} {str(path)!r}: not an image PIL can read ({e})") from e
    return img
