"""qsa_kernels: Triton kernels behind `qsa_core.ops` (same names as the references)."""
