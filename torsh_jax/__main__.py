"""``python -m torsh_jax``: the ``torsh-jax`` command line."""

import sys

from torsh_jax.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
