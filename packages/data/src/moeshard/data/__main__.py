"""``python -m moeshard.data``: see ``moeshard.data._cli``."""

import sys

from moeshard.data._cli import main

if __name__ == "__main__":
    sys.exit(main())
