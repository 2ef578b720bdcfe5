"""`crosscheck verify`: a user's own training step run at several layouts and judged against the
intended scheme (`verifier`), the step protocol it is called with (`protocol`), and one driver
per framework.

Layer 8: imports the layers below it.
"""
