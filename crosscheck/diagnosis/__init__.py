"""Which weighting does a gradient have? Least-squares weights per group, the precision-aware
verdict, the named bug patterns and families, and the explanation in the user's terms.

Layer 4: imports the layers below it (contract, fixtures, judge). Inside it, the order is
patterns, candidates, families, naming, verdict, judgement, explain, diagnose.
"""
