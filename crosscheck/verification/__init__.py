"""`crosscheck verify`: a user's own training step run at several layouts and judged against the
intended scheme (`verifier`; its result `report`; the set-up check of the step `step_check`),
the step protocol it is called with (`protocol`), and one driver per framework.

Layer 8: imports the layers below it.
"""
