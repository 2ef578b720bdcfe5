"""Conformance: what real training frameworks weight, per version and setting, run for real.

`crosscheck conformance` runs every setting of `settings.SETTINGS` whose framework is installed:
an adapter (`crosscheck.conformance.adapters`) builds the framework's own trainer around a tiny
model and the fixture's microbatches and runs one optimizer update inside crosscheck's verify
ranks; `crosscheck.verify` judges the update against the scheme the framework's documentation
promises. Each row's verdict is then held to the versioned expectations
(`expectations.toml`, read by `crosscheck.conformance.expectations`): a framework upgrade that
changes a verdict fails the command until the file says what the new version does.
"""
