"""Triton kernels for the CUDA path, each beside the plain-torch reference its tests hold it to.

Every wrapper takes CUDA tensors, or CPU tensors when TRITON_INTERPRET=1 was set before triton
was imported (how the tests run them on a machine without a GPU). The maths and the argument
conventions follow the CPU kernels (kernels/cpu/), whose torch references are reused where they
exist, so a Triton attention backend can sit behind the same metadata (workers/attention/).
"""
