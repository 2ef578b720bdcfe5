"""`crosscheck bugs`: every pattern of the bug catalogue run as a buggy step in each framework,
diagnosed and named (`catalogue_run`), with one driver per framework.

Layer 7: imports the layers below it.
"""
