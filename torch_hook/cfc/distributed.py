"""The compressed all-reduce of whole tensors across processes.

:class:`AllReducer` averages tensors (CPU or CUDA) in place over a process group with cfc's
engine (``cfc::engine`` in the Rust core), the engine :func:`cfc.cfc_hook` runs: a tensor is cut
into chunks that are compressed, exchanged and decoded one behind the other on the engine's
thread, and the call returns before that is done.

Example::

    >>> # needs an initialised process group: not run as a doctest
    >>> reducer = cfc.distributed.AllReducer(cfc.CfcState(eps=1e-5, warmup_steps=0))  # doctest: +SKIP
    >>> y = reducer(x).wait()  # x is averaged in place and returned  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Optional

from cfc import _engine

__all__ = ["AllReducer", "Pending"]


class Pending:
    """An all-reduce on its way: :meth:`wait` returns the averaged tensor (for a CUDA tensor,
    once the caller's current stream is ordered after the result; it may still be running), or
    raises the failure of any rank (``cfc.CfcError``)."""

    def __init__(self, tensor: Any, reducer: "AllReducer"):
        self.tensor, self._reducer = tensor, reducer
        self._waited = False  # wait() was called (returned or raised)

    def wait(self) -> Any:
        if not self._waited:
            self._waited = True
            state = self._reducer.state
            state._end_step(_engine.stream_of(self.tensor))
        return self.tensor


class AllReducer:
    """Compressed average of whole tensors over a process group, with error feedback.

    Each call hands the tensor's chunks to the state's engine and returns a :class:`Pending` at
    once; on CUDA tensors a chunk is compressed on the GPU while the one before it is on the
    wire. With ``fallback="auto"`` (see :class:`cfc.CfcState`) the first calls time each chunk
    both ways and later calls take the faster. A call first waits for the previous call's
    result, so calls do not overlap each other; the chunks of one call do.

    Every rank must call it with tensors of the same size and dtype, in the same order: ranks
    that disagree all get a ``cfc.CfcError`` (the engine checks every chunk's size and place in
    the sequence against every rank's); a rank whose tensor is refused (dtype, layout) raises
    that error, and its peers ``cfc.CfcError`` naming it. The residual of each chunk is kept
    from one call to the next while the size and dtype stay the same (a call with another size
    starts afresh: use one reducer per kind of tensor). The state lives in memory only.

    Args:
        state: the options (:class:`cfc.CfcState`; its ``warmup_steps`` and ``fallback`` count
            calls as steps). Default: ``CfcState(warmup_steps=0)``, a bound of 0.05 x each
            chunk's RMS.
        chunk_numel: elements per chunk (default 16 Mi: 64 MB of float32; smaller chunks
            overlap better, each costs some host time on the engine's thread).
    """

    def __init__(self, state: Any = None, *, chunk_numel: int = 1 << 24):
        from cfc.ddp import CfcState

        if not isinstance(chunk_numel, int) or chunk_numel < 1:
            raise ValueError(f"chunk_numel must be an integer >= 1, got {chunk_numel!r}")
        self.state = state if state is not None else CfcState(warmup_steps=0)
        if not isinstance(self.state, CfcState):
            raise TypeError(f"state must be a cfc.CfcState, got {type(self.state).__name__}")
        self.state._serve("AllReducer")
        self.chunk_numel = int(chunk_numel)
        self._last: Any = None  # the last call's (numel, dtype)
        self._pending: Optional[Pending] = None

    def __call__(self, tensor: Any) -> Pending:
        """Start averaging ``tensor`` (contiguous, float32/bf16/fp16) in place."""
        import torch

        from cfc.ddp.residuals import fingerprint

        state = self.state
        refused: Optional[Exception] = None
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            refused = TypeError(f"AllReducer takes float32, bfloat16 or float16 tensors, got {got}")
        elif tensor.is_sparse or not tensor.is_contiguous() or tensor.is_neg():
            refused = ValueError("AllReducer averages in place: give it a dense contiguous tensor "
                                 "(not a lazily negated view)")
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()  # this call reads what the last one leaves (residuals, the trial)
        if refused is not None and not torch.distributed.is_initialized():
            raise refused  # no peer to tell
        device = tensor.device if isinstance(tensor, torch.Tensor) else (state._device or torch.device("cpu"))
        engine = state._engine_for(device)
        if refused is not None:
            engine.fail(f"{type(refused).__name__}: {refused}")  # the peers raise too, at once
            raise refused
        sig = (tensor.numel(), tensor.dtype)
        if sig != self._last:
            if self._last is not None:
                engine.reset()  # other chunks now: the warm-up and trial start again
                state._residuals.by_bucket.clear()
                state.step = 0
            self._last = sig
        flat = tensor.view(-1)
        n, step = flat.numel(), self.chunk_numel
        stream = _engine.stream_of(tensor)
        starts = list(range(0, n, step))
        for i, a in enumerate(starts):
            chunk = flat[a : a + step]
            r, fresh = state._residuals.get(i, None, chunk) if state._feeds(chunk) else (None, False)
            state._keep.append((chunk, r))
            engine.submit(i, fingerprint(None, chunk), chunk, r, None, None, i == len(starts) - 1, fresh, stream)
        self._pending = Pending(tensor, self)
        return self._pending

    def close(self) -> None:
        """Finish the last call, then close the state's engine (:meth:`cfc.CfcState.close`).
        Later calls raise ``cfc.CfcError``; closing again does nothing."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.wait()
        finally:
            self.state.close()
