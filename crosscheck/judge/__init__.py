"""Is a result what the contract expects? Tolerances and the worst-leaf relative error
(`compare`), layout invariance of the oracle (`invariance`) and clipping placement
(`clipping`).

Layer 3: imports `crosscheck.contract` and `crosscheck.fixtures`.
"""
