"""The standalone demo from a checkout: the same as `python -m qsa_core` (its code and its
options are in qsa_core/__main__.py).

Usage: python examples/standalone.py [--seed N]
"""

import sys

from qsa_core.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
