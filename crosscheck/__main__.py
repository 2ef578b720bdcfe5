"""`python -m crosscheck`."""

import sys

from crosscheck.cli import main

sys.exit(main())
