"""jamp: mixed-precision training for JAX and Flax."""
