"""What every test session shares (each package's, the app's and the cross-package one's)."""

import os
import sys

# Under PYTHONDONTWRITEBYTECODE=1 (set by some container images) no Python process keeps the bytecode it compiles, and
# each of the hundreds of processes the tests start (ranks, torchrun agents and workers, fresh interpreters) compiles
# torch and transformers from source again: ~2x their imports, which are most of those processes' time on 2 cores.
# The tests and everything they start write it to __pycache__ (ignored by git; checked against each source file's
# mtime and size, so an edited file is compiled again).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
