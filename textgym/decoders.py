"""The names of π_ref's and the sampler's decoders, torch-free: a config checks them without importing torch.

``"dynamic"`` is transformers' growing cache, ``"ring"`` the ring of KV columns allocated once
(:mod:`textgym.ring_decoder`), ``"graph"`` the ring's step captured as a CUDA graph. ``"auto"`` is the
ring on every device until the graph's replay is checked on a GPU (``bash bench/gpu_smoke.sh decode``):
it is built and its CPU side tested, but no device was lent to the session that wrote it.
"""

DECODERS = ("auto", "dynamic", "ring", "graph")

__all__ = ["DECODERS"]
