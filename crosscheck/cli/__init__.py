"""The command line (`commands`) and what it prints and writes: tables, JSON, plots.

Layer 9, the top: imports every layer below it; nothing imports it but ``crosscheck.__main__``.
"""
