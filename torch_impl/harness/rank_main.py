"""A torch rank's command line: ``python -m torch_impl.harness.rank_main WORKDIR RANK WORLD_SIZE
INIT_METHOD TIMEOUT_S DEVICE``, what `torch_impl.harness.launcher.launch` starts R of.

A module of its own so that the rank runs in `torch_impl.harness.rank_worker` as imported (the
zygote imported it already; `finish_rank` and the launcher know that module), not in a second
copy of it executed as ``__main__``.
"""

from __future__ import annotations

import sys

from torch_impl.harness.rank_worker import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
