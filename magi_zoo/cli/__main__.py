"""`python -m magi_zoo.cli ...`: what the `magi-zoo` script runs (and what each rank of a
`magi-zoo run --nproc N` job runs under torchrun)."""

import sys

from . import main

sys.exit(main())
