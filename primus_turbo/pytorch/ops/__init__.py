"""User-facing ops: thin functions over torch.autograd.Function (forward + backward)."""
# One import line per op module; keep sorted.
