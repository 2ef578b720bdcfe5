"""JAX/Flax reference implementation of the normalization contract."""
