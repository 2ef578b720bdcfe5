"""Remove a top-level ``tests`` package that an installed distribution put in site-packages.

verl 0.9.1's wheel (installed by ``make conformance``) ships its own test suite as a regular
package named ``tests``. A regular package wins over a directory without ``__init__.py`` at
every position of ``sys.path``, so it shadows this repository's ``tests/`` for every
``tests.<module>`` import: the verify steps the suite names from the repository root, as a user
names theirs (``tests.jax_verify_steps:misbehaving``), stop importing. Nothing of verl's
library imports it. Only a ``tests`` package that some distribution's RECORD lists is removed;
the script says which, or that there was none.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
import sysconfig
from pathlib import Path


def main() -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    stray = site / "tests"
    if not (stray / "__init__.py").exists():
        print("no tests package in site-packages")
        return 0
    owners = [
        dist.metadata["Name"]
        for dist in importlib.metadata.distributions()
        if any(str(f).startswith("tests/") for f in dist.files or ())
    ]
    if not owners:
        print(f"{stray} belongs to no installed distribution; left alone", file=sys.stderr)
        return 1
    shutil.rmtree(stray)
    print(
        f"removed {stray} (installed by {', '.join(owners)}): it shadows this repository's tests/"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
