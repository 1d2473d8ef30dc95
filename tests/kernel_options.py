"""The kernels' options the kernel tests plan and bind with: Triton's interpreter needs its own
(`KernelOptions.for_interpreter`, TRITON_INTERPRET=1: CPU tensors), a GPU the production ones."""

import os

from qsa_kernels.options import KernelOptions

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
OPTS = KernelOptions.for_interpreter() if INTERPRETING else KernelOptions()
