"""PyTorch reference implementation of the normalization contract."""
