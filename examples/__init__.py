"""Third-party-style training steps (torch and JAX) to run ``crosscheck verify`` on.

``_jax_common`` is not a step: it holds the scaffolding the JAX examples share (the per-token
loss, the micro-step loop), so that each example file shows only its own normalization.
"""
