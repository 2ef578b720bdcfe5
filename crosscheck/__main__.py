"""`python -m crosscheck`, and the `crosscheck` console script (``crosscheck.__main__:main``).

The command-line process gets one BLAS thread unless the caller chose otherwise: the oracle
multiplies matrices of a few thousand by 40 entries, where extra OpenBLAS threads add nothing
but spin, and a harness run shares its cores with the worker processes it starts (seen: 2x
the CPU time for the same wall time on a 2-core machine). numpy reads the variable when it is
first imported, so it is set here, before anything imports numpy (the package's
``__init__`` imports nothing heavy), and only here: importing `crosscheck` from a program
leaves that program's environment alone. The worker processes the command starts inherit it.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main() -> int:
    """Run the command line; an interrupt ends the process in bounded time (exit 130)."""
    from crosscheck.launch.processes import Interruption, exit_bounded, interrupt_on_sigterm

    # Before the imports below (numpy, rich, the harness: a second or so), so that a SIGTERM
    # during them is an interrupt too, not a silent death by signal.
    interrupt_on_sigterm()
    try:
        from crosscheck.cli.commands import main as cli_main
        from crosscheck.exit_codes import INTERRUPTED
    except KeyboardInterrupt as error:  # nothing was started yet; the line any interrupt gives
        name = str(error.args[0]) if error.args else "SIGINT"
        print(Interruption(signal_name=name).message(), file=sys.stderr)
        return 130
    code = cli_main()
    if code == INTERRUPTED:
        # A harness thread may still be waiting on a process that was just killed; the
        # interpreter would wait for it at exit. A second signal must not cut this short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        exit_bounded(code)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return code


if __name__ == "__main__":
    sys.exit(main())
