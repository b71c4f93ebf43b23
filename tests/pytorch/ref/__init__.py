"""Reference implementations (fp32/fp64 eager PyTorch) that tests compare kernels against."""
