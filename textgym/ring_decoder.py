"""Batched incremental decoding in a preallocated ring of KV columns: a decode step of fixed shapes.

Why: :class:`textgym.models.CachedDecoder` grows a ``DynamicCache`` by one column per step, which
copies every layer's keys and values (N × C columns) each step and gives every step new shapes. Here
the keys and values live in ``(N, H, W, D)`` tensors allocated once, ``W = max_len + 1`` columns used
as a ring: a step writes its column at ``head`` (for every slot at once) and attends to the columns
its row marks valid. Attention does not care where a column sits (RoPE is applied before caching and
every row carries its own position ids), so the ring changes only the order of a softmax's sum.

A live slot's context never spans more than ``max_len`` columns, so the column a step overwrites
(written ``W`` steps ago) is outside every live context: no slot loses a token it attends to.

Fixed shapes are what a CUDA graph needs: on CUDA, :class:`GraphedStep` captures one decode step
(the model's forward, the cache writes and the mask) once and replays it, which removes the
per-kernel launch and Python cost that made a small model's step take the same time at N = 16 and
N = 64. Everything else runs the same on CPU, where the step runs eagerly.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from textgym.decoders import DECODERS
from textgym.models import FP32_ATTENTION, CachedDecoder, prefill_forward

__all__ = ["DECODERS", "GraphedStep", "RingDecoder", "make_decoder", "resolve_decoder"]

# attention implementations that read a custom 4D mask: True/False (sdpa's) or additive (eager's)
_BOOL_MASK = ("sdpa", FP32_ATTENTION)
_ADDITIVE_MASK = ("eager",)


def resolve_decoder(kind: str, device: torch.device) -> str:
    """The decoder ``kind`` names on ``device``: ``auto`` is ``ring`` (``graph`` is asked for by name, CUDA only).

    Raises:
        ValueError: ``kind`` is not one of :data:`DECODERS`, or ``graph`` off CUDA (CUDA graphs need CUDA).
    """
    if kind not in DECODERS:
        raise ValueError(f"decoder={kind!r} must be one of {DECODERS}")
    if kind == "auto":
        return "ring"
    if kind == "graph" and device.type != "cuda":
        raise ValueError(f"decoder='graph' captures CUDA graphs; the model is on {device.type} (use 'ring' or 'auto')")
    return kind


def make_decoder(kind: str, model, num_slots: int, max_len: int):
    """The decoder ``kind`` (see :func:`resolve_decoder`) over ``model`` for ``num_slots`` slots of ``max_len``."""
    device = next(model.parameters()).device
    kind = resolve_decoder(kind, device)
    if kind == "dynamic":
        return CachedDecoder(model, num_slots, max_len)
    return RingDecoder(model, num_slots, max_len, graphed=kind == "graph")


class _RingLayer:
    """One layer's keys and values ``(N, H, W, D)``; ``update`` writes the step's column at ``column``."""

    def __init__(self, column: Tensor):
        self.column = column  # (1,) long, shared by every layer: the ring's write position
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def allocate(self, num_slots: int, width: int, keys: Tensor, values: Tensor) -> None:
        """Zeroed ``(N, H, W, D)`` tensors shaped and typed after a prefill's ``keys``/``values`` ``(k, H, P, D)``."""
        self.keys = keys.new_zeros(num_slots, keys.shape[1], width, keys.shape[3])
        self.values = values.new_zeros(num_slots, values.shape[1], width, values.shape[3])

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        # in place, at a device-side index: the step's kernels are the same every call (a CUDA graph replays them)
        self.keys.index_copy_(2, self.column, key_states.to(self.keys.dtype))  # (N, H, 1, D) into (N, H, W, D)
        self.values.index_copy_(2, self.column, value_states.to(self.values.dtype))
        return self.keys, self.values


def _ring_cache(layers: list[_RingLayer]):
    """A transformers ``Cache`` whose layers are the ring's (the attention modules call ``cache.update``)."""
    from transformers.cache_utils import Cache

    class RingCache(Cache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return self.layers[layer_idx].update(key_states, value_states)

    return RingCache(layers=layers)


class RingDecoder:
    """:class:`textgym.models.CachedDecoder`'s interface over a preallocated ring of ``max_len + 1`` columns.

    Args:
        model: a Hugging Face causal LM whose attention takes a custom 4D mask (``sdpa``, ``eager``).
        num_slots: number of rows N.
        max_len: the longest prompt + response a slot can hold.
        graphed: replay the decode step as a CUDA graph (:class:`GraphedStep`; CUDA only).
    """

    def __init__(self, model, num_slots: int, max_len: int, graphed: bool = False):
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in _BOOL_MASK + _ADDITIVE_MASK:
            raise ValueError(f"the ring decoder needs attention that reads a 4D mask ({_BOOL_MASK + _ADDITIVE_MASK}); "
                             f"the model has attn_implementation={impl!r} (use decoder='dynamic')")  # fmt: skip
        self.model, self.num_slots, self.max_len = model, num_slots, max_len
        self.width = max_len + 1  # one spare column: the one a step overwrites is in no live context
        self.device = next(model.parameters()).device
        self.context = contextlib.nullcontext  # every forward runs inside context() (see reference_context)
        self.additive = impl in _ADDITIVE_MASK
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)  # (1,) the next column written
        self.valid = torch.zeros(num_slots, self.width, dtype=torch.bool, device=self.device)  # (N, W)
        self.next_pos = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # (N,)
        self.layers = [_RingLayer(self.column) for _ in range(model.config.num_hidden_layers)]
        self.cache = None  # the ring's Cache once the first prefill has shaped it
        self.head = 0  # host copy of column
        self._started = False
        self.graph = GraphedStep(self) if graphed else None

    @property
    def started(self) -> bool:
        """Whether any slot was prefilled since the last :meth:`reset` (a step before that has nothing to extend)."""
        return self._started

    def reset(self) -> None:
        """Forget every slot (the ring's tensors stay allocated: a captured graph keeps reading them).

        The ring starts again at column 0: where a column sits sets the order of attention's sums, so a
        rollout's logits depend on what happened since the last reset only, bit for bit (a resumed run
        samples what the uninterrupted one did).
        """
        self.valid.zero_()
        self.next_pos.zero_()
        self.head = 0
        self.column.zero_()
        self._started = False

    def release(self) -> None:
        """Forget every slot and free the ring (a captured graph too): the next prefill allocates it again.

        The trainer calls it after a rollout: the ring spans ``max_len + 1`` columns whatever the episodes
        used, and would otherwise stay resident through the update (smollm2-guess: 0.39 GB at 32 slots).
        """
        self.reset()
        for layer in self.layers:
            layer.keys = layer.values = None
        self.cache = None
        if self.graph is not None:
            self.graph = GraphedStep(self)

    @torch.no_grad()
    def prefill(self, slots: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Start ``slots`` on left-padded contexts ``(k, P)``; return their next-token logits ``(k, V)``.

        The context fills the P columns before ``head``, the ring's most recent, so the slot's next
        step continues it at ``head`` like every other slot's.
        """
        return self.write_prefill(slots, self.forward_prefill(input_ids, attention_mask), attention_mask)

    @torch.no_grad()
    def forward_prefill(self, input_ids: Tensor, attention_mask: Tensor):
        """The prefill's forward, nothing written (:meth:`write_prefill` keeps it): a step computes first."""
        if attention_mask.shape[1] > self.max_len:
            raise ValueError(f"a context of {attention_mask.shape[1]} tokens does not fit max_len={self.max_len}")
        return prefill_forward(self.model, self.context, input_ids, attention_mask)

    def write_prefill(self, slots: Tensor, out, attention_mask: Tensor) -> Tensor:
        """Write :meth:`forward_prefill`'s keys and values into rows ``slots``; return their logits ``(k, V)``."""
        k, p = attention_mask.shape
        if k == self.num_slots:  # every slot starts again (a vector env's reset): as after reset()
            self.reset()
        cols = (self.head - p + torch.arange(p, device=self.device)) % self.width  # (P,) ring columns, oldest first
        for layer, new in zip(self.layers, out.cache.layers, strict=True):
            if layer.keys is None:
                layer.allocate(self.num_slots, self.width, new.keys, new.values)
            for ring, fresh in ((layer.keys, new.keys), (layer.values, new.values)):
                rows = ring[slots]  # (k, H, W, D) copy; written back whole (advanced indexing on both axes)
                rows[:, :, cols] = fresh.to(ring.dtype)
                ring[slots] = rows
        if self.cache is None:
            self.cache = _ring_cache(self.layers)
        rows = torch.zeros(k, self.width, dtype=torch.bool, device=self.device)
        rows[:, cols] = attention_mask.bool()
        self.valid[slots] = rows
        self.next_pos[slots] = attention_mask.sum(-1)
        self._started = True
        return out.logits[:, -1].float()

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """Feed one token per slot ``(N,)``; return the next-token logits ``(N, V)``.

        A forward that raises leaves every slot's context as it was: the column it was writing is in
        no live context, and it is marked invalid again.
        """
        if not self._started:
            raise RuntimeError("RingDecoder.step() before any prefill()")
        try:
            logits = self.graph(tokens) if self.graph is not None else self.forward_step(tokens.view(-1, 1))
        except BaseException:
            self.valid[:, self.head] = False
            raise
        self.next_pos += 1
        self.head = (self.head + 1) % self.width
        self.column.fill_(self.head)
        return logits

    def forward_step(self, tokens: Tensor) -> Tensor:
        """The decode step on ``tokens`` ``(N, 1)``: mark ``column`` valid, run the model, return logits ``(N, V)``.

        Only tensor operations at fixed shapes (no host reads): the body :class:`GraphedStep` captures.
        """
        self.valid.index_fill_(1, self.column, True)
        mask = self.valid[:, None, None, :]  # (N, 1, 1, W): every query attends to its row's valid columns
        if self.additive:
            dtype = self.layers[0].keys.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=self.device).masked_fill(~mask, torch.finfo(dtype).min)
        with self.context():
            out = self.model(input_ids=tokens, attention_mask=mask, position_ids=self.next_pos.view(-1, 1),
                             cache=self.cache, use_cache=True)  # fmt: skip
        return out.logits[:, -1].float()


class GraphedStep:
    """One :meth:`RingDecoder.forward_step` captured as a CUDA graph and replayed for every later step.

    The graph reads its inputs from fixed buffers (the tokens, ``column``, ``next_pos``, ``valid``, the
    ring) and the weights where they are: in-place updates (the optimizer, ``load_state_dict``, a merged
    LoRA copy's refresh) are seen. A weight replaced by a new tensor, another autocast setting or
    another context is a new graph: the step checks them and captures again.
    """

    def __init__(self, decoder: RingDecoder):
        self.decoder = decoder
        self.graph = None
        self.key = None
        self.tokens = torch.zeros(decoder.num_slots, 1, dtype=torch.long, device=decoder.device)
        self.logits: Tensor | None = None

    def _key(self) -> tuple:
        autocast = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        params = tuple(p.data_ptr() for p in self.decoder.model.parameters())
        return autocast, self.decoder.context, params

    def __call__(self, tokens: Tensor) -> Tensor:
        self.tokens.copy_(tokens.view(-1, 1))
        key = self._key()
        if self.graph is None or key != self.key:
            self._capture(key)
        self.graph.replay()
        return self.logits.clone()

    def _capture(self, key: tuple) -> None:
        """Warm up on a side stream, then capture; autocast's weight cache is off (a graph cannot reuse it)."""
        enabled, dtype = key[0]
        stream = torch.cuda.Stream(self.decoder.device)
        stream.wait_stream(torch.cuda.current_stream(self.decoder.device))
        with torch.cuda.stream(stream), torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
            for _ in range(2):  # the writes are those of the real step: same column, same values
                self.decoder.forward_step(self.tokens)
        torch.cuda.current_stream(self.decoder.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False):
            self.logits = self.decoder.forward_step(self.tokens)
        self.key = key
