"""Quantized linear weights: how they are held (weight.py), made (int8.py at load, fp8.py and
gguf.py from checkpoints) and multiplied (kernels/cpu/quant_linear.py)."""
