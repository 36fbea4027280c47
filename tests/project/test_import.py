"""`import magi_zoo` stays cheap: no diffusers, no transformers, no CUDA initialisation."""

import subprocess
import sys


def test_import_is_cheap():
    code = (
        "import sys, magi_zoo, torch\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'diffusers', 'transformers'})\n"
        "print(heavy, torch.cuda.is_initialized(), magi_zoo.list_models()[:1])\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'diffusers', 'transformers'})\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    # list_models() reads the flavour tables, which must not import the libraries either
    assert out == ["[] False ['wan2.1-t2v-1.3b']", "[]"]
