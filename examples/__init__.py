"""Third-party-style training steps (torch and JAX) to run ``crosscheck verify`` on."""
