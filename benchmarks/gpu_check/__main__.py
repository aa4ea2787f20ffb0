"""`python benchmarks/gpu_check [--smoke]`: the GPU check's one entry point (see `gpu_check/__init__.py`)."""

import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/, for `import gpu_check`

from gpu_check import main  # noqa: E402


sys.exit(main())
