"""The ``torsh-jax`` command line."""
