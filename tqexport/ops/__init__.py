"""Per-layer custom ops: reference implementation, torch.library registration, attributes."""
