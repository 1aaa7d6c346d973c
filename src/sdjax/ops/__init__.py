"""Low-level array operations with several lowerings of the same math, picked for speed per backend.

`conv`: 2-D convolution (NHWC/HWIO). `attention`: multi-head scaled dot-product attention.
"""
