"""Hand-written TIR kernels, one family per module.

Each factory takes static sizes (and dtypes) and returns a scheduled ``PrimFunc`` whose
``global_symbol`` names every static parameter, so two instances never collide.  Symbolic
dimensions (``num_blocks``, the prompt length ``n``) are declared inside the kernel.
"""
