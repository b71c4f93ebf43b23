"""Async tensor-parallel GEMM + communication dispatchers and backends."""
