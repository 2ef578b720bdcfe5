"""The command line (`commands`, its grammar `parser`, the set-up checks of `outputs`) and what
it prints and writes: tables, JSON, plots.

Layer 9, the top: imports every layer below it; nothing imports it but ``crosscheck.__main__``.
"""
