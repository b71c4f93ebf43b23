"""nn.Module wrappers over turbo ops."""
# One import line per module file; keep sorted.
