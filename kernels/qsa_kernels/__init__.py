"""qsa_kernels: the Triton kernels of QSA, each bound once as a launch (`*Launch` classes,
`MetadataBuild`, `StaticStage`) with its planned schedule (`plan_*`); `qsa_core`'s Triton
backend is their caller. Nothing is imported here, so importing the package never loads
Triton.
"""
