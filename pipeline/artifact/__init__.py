"""The artifact format, below both the writer (``pipeline.export``) and the reader
(``pipeline.runtime``): the tensor layouts of every stored type (``ascend``: msModelSlim's
ascendv1, ``lowbit_format``: its 2/3-bit and exponential extensions), packing and unpacking one
linear, and ``manifest.json`` with its verification.
"""
