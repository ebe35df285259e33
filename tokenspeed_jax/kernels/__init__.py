"""Pallas kernels, each beside a pure-JAX reference of the same function (`*_ref` modules)."""
