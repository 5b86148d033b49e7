"""The compressed all-reduce across processes, over torch.distributed.

:func:`all_reduce` runs cfc's collective algorithm (``cfc::collective`` in the Rust core: an
agreement round, one shared quantization step, an exact reduce-scatter of integer codes, an
all-gather) with :class:`TorchTransport` moving the bytes through an initialised
``torch.distributed`` process group. CPU tensors, any backend (gloo in CI).

Example::

    >>> # needs an initialised process group: not run as a doctest
    >>> y, report = cfc.distributed.all_reduce(grad, eps=1e-4, average=True, residual=r)  # doctest: +SKIP

:class:`AllReducer` averages whole tensors, CPU or CUDA, on :func:`cfc.cfc_hook`'s engines: a
CUDA tensor is cut into chunks that are compressed, exchanged over NCCL and decoded one behind
the other on a comm thread, and the call returns before the GPU has finished.

:class:`NcclAllReducer` averages CUDA tensors with the same GPU codec run entirely by the Rust
core (``cfc::gpu_allreduce``) over an NCCL communicator of its own: less host time per call.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

from cfc import _native
from cfc.codec import (
    _addr, _check_apart, _check_flag, _check_number, _check_residual, _dtype_name, _flat_view, _span,
    _tensor_bytes,
)

__all__ = ["AllReducer", "NcclAllReducer", "Pending", "TorchTransport", "all_reduce"]


class TorchTransport:
    """Moves cfc's byte messages between the ranks of a torch.distributed group.

    ``all_to_all`` first gathers every rank's message sizes, then posts one non-blocking send
    and one receive per peer, so each rank sends only its own messages.
    """

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)

    def _peer(self, j: int) -> int:
        import torch.distributed as dist

        return j if self.group is dist.group.WORLD else dist.get_global_rank(self.group, j)

    def all_to_all(self, parts: List[bytes]) -> List[bytes]:
        """Sends ``parts[j]`` to rank ``j``; returns what each rank sent here, by sender."""
        import torch
        import torch.distributed as dist

        sizes = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        table = [torch.empty(self.world, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(table, sizes, group=self.group)
        received: List[Any] = [None] * self.world
        requests = []
        for j in range(self.world):
            if j == self.rank:
                received[j] = parts[j]
                continue
            incoming = torch.empty(int(table[j][self.rank]), dtype=torch.uint8)
            received[j] = incoming
            outgoing = torch.frombuffer(bytearray(parts[j]), dtype=torch.uint8)
            requests.append(dist.isend(outgoing, dst=self._peer(j), group=self.group))
            requests.append(dist.irecv(incoming, src=self._peer(j), group=self.group))
        # Every request is waited for, even after one failed (a peer timed out): a buffer must
        # not be freed while the backend may still write into it or read from it.
        failure: Optional[BaseException] = None
        for r in requests:
            try:
                r.wait()
            except Exception as e:  # noqa: BLE001 - the first failure is raised below
                failure = failure or e
        if failure is not None:
            raise failure
        return [r if isinstance(r, bytes) else r.numpy().tobytes() for r in received]


def all_reduce(
    tensor: Any,
    *,
    eps: Optional[float] = None,
    rel: Optional[float] = None,
    average: bool = False,
    residual: Any = None,
    group: Any = None,
    transport: Any = None,
    algorithm: Optional[str] = None,
) -> Tuple[Any, Dict[str, float]]:
    """Sum (or average) a CPU tensor over the ranks of a process group, compressed.

    Every rank must call it with the same shape, dtype and options; otherwise every rank gets a
    ``cfc.CfcError`` (no rank hangs on the others). A rank whose own input is refused (a wrong
    dtype, device, bound or residual) raises that error once it has told the others, in the
    round where they compare options (it waits for them there, as a call would), and they
    raise ``cfc.CfcError``. A call that fails on one rank after that round (a malformed frame
    from a peer) fails on every rank, at once: the failing rank tells the others in the next
    round, or in a closing one after every rank has decoded its result. A call that fails
    leaves the residual as it was.

    Args:
        tensor: a CPU float32, bfloat16 or float16 tensor.
        eps, rel: the bound each rank's contribution is quantized with (exactly one). ``rel`` is
            relative to the largest magnitude over all ranks.
        average: divide the sum by the number of ranks.
        residual: error feedback: a float32 CPU tensor of the same size, zero at the first call,
            updated in place with what this rank's quantization dropped.
        group: the process group (default: the world).
        transport: anything with ``rank``, ``world`` and ``all_to_all`` (default:
            :class:`TorchTransport` over ``group``).
        algorithm: ``"reduce-scatter"`` (the default: shards of codes summed on their owners,
            then gathered) or ``"all-gather"`` (every frame to every rank; the same bits, one
            round, ``N - 1`` times the compressed size per rank).

    Returns:
        (tensor, dict): the result, same shape and dtype; and ``eps``, ``bound`` (on
        ``|result - exact|``, besides the one rounding of the result to the tensor's dtype: an
        average is divided before it is rounded), ``bytes_sent``, ``bytes_uncompressed`` (a
        ring all-reduce's).
    """
    import torch

    try:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise ValueError(
                "cfc.distributed.all_reduce takes CPU tensors; CUDA tensors go through "
                "cfc.distributed.AllReducer (compressed on the GPU, exchanged over NCCL)"
            )
        data, name, shape = _tensor_bytes(tensor)
        # Types the binding would refuse before it could take part in the agreement round.
        for what, bound in (("eps", eps), ("rel", rel)):
            if bound is not None:
                _check_number(what, bound)
        _check_flag("average", average)
        if algorithm is not None and not isinstance(algorithm, str):
            raise TypeError(f"algorithm must be a string or None, got {type(algorithm).__name__}")
        r = None
        if residual is not None:
            if not isinstance(residual, torch.Tensor):
                raise TypeError(f"residual must be a float32 CPU tensor, got {type(residual).__name__}")
            _check_residual(residual, tensor)
            r = _flat_view(residual.detach()).view(torch.uint8).numpy()
            _check_apart(*_span(tensor), _addr(r), r.nbytes)  # updated while the tensor is read
    except Exception as e:
        # The peers are on their way to the agreement round: refuse there, so that they raise
        # now (cfc.CfcError, "rank R refused its input") rather than wait for this rank.
        try:
            t = transport if transport is not None else TorchTransport(group)
            _native.allreduce_refuse(t, f"{type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001 - no group, or the round failed: this rank's error stands
            pass
        raise
    t = transport if transport is not None else TorchTransport(group)
    raw, report = _native.allreduce(
        t,
        _addr(data),
        data.nbytes,
        name,
        eps=None if eps is None else float(eps),
        rel=None if rel is None else float(rel),
        average=bool(average),
        residual_ptr=0 if r is None else _addr(r),
        residual_nbytes=0 if r is None else r.nbytes,
        algorithm=algorithm,
    )
    dtype = getattr(torch, name)
    out = torch.frombuffer(raw, dtype=dtype) if len(raw) else torch.empty(0, dtype=dtype)
    return out.reshape(shape), report


class _Chunk:
    """The part of DDP's ``GradBucket`` that :func:`cfc.cfc_hook` reads, over one chunk of a
    tensor (no parameters: the residual is kept per chunk)."""

    def __init__(self, index: int, buffer: Any, last: bool):
        self._index, self._buffer, self._last = index, buffer, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> Any:
        return self._buffer

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> List[Any]:
        return []


class Pending:
    """An all-reduce on its way: :meth:`wait` returns the averaged tensor (for a CUDA tensor,
    once the caller's current stream is ordered after the result; it may still be running), or
    raises the call's error, a frame from another rank that failed its check on the GPU among
    them."""

    def __init__(self, tensor: Any, futures: List[Any]):
        self.tensor, self._futures = tensor, futures
        self._waited = False  # wait() was called (returned or raised)

    def wait(self) -> Any:
        self._waited = True
        for f in self._futures:
            f.wait()  # raises the engine's error (e.g. cfc.CfcError) on every rank
        return self.tensor


class AllReducer:
    """Compressed average of whole tensors over a process group, with error feedback.

    It runs :func:`cfc.cfc_hook`'s engines on chunks of the tensor: on CUDA tensors (NCCL) a
    chunk is compressed on the GPU while the one before it is on the wire and the one before
    that is decoded, on a comm thread, so ``reducer(x)`` returns before the GPU work is done;
    on CPU tensors (gloo) each chunk runs cfc's Rust collective on the calling thread. With
    ``fallback="auto"`` (see :class:`cfc.CfcState`) the first calls time each chunk both ways;
    if no chunk gains from compression, later calls run one plain all-reduce of the tensor.

    A call first waits for the previous call's result (not for the GPU), so calls do not
    overlap each other; the chunks of one call do. (One limit: CUDA queues a bounded number of
    launches per process. When the GPU is far behind and hundreds of chunks' kernels wait in
    that queue, any CUDA call waits for room, the caller's too: keep chunks large.)

    The state (residuals, the trial's choices) lives in memory only: ``state.state_dict()``
    does not save an AllReducer's residuals.

    Every rank must call it with tensors of the same size and dtype, in the same order. Every
    call checks that first, with one small collective on the host (over a gloo group of the
    reducer's own, so it waits for no GPU work; it costs a round trip between the processes):
    ranks that disagree all get a ``cfc.CfcError`` instead of a hang, even where the size is
    new to some ranks only; a rank whose tensor is refused (dtype, layout) raises that error
    after this check (which waits for the other ranks), and the others ``cfc.CfcError``. The
    error feedback residual of each chunk is kept from one call to the next while the size and
    dtype stay the same (a call with another size starts afresh): use one reducer per kind of
    tensor.

    Args:
        state: the options (:class:`cfc.CfcState`; its ``warmup_steps`` and ``fallback`` apply
            per call, as they would per training step). Default: ``CfcState(warmup_steps=0)``,
            a bound of 0.3 x each chunk's RMS.
        chunk_numel: elements per chunk (default 16 Mi: 64 MB of float32; smaller chunks
            overlap better but each costs about 0.8 ms of host time on the comm thread).

    Example::

        >>> # needs an initialised process group: not run as a doctest
        >>> reducer = cfc.distributed.AllReducer(cfc.CfcState(eps=1e-5, warmup_steps=0))  # doctest: +SKIP
        >>> # x is averaged in place and returned
        >>> y = reducer(x).wait()  # doctest: +SKIP
    """

    def __init__(self, state: Any = None, *, chunk_numel: int = 1 << 24):
        from cfc.ddp import CfcState

        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        self.state = state if state is not None else CfcState(warmup_steps=0)
        self.chunk_numel = int(chunk_numel)
        self._last: Any = None  # the last call's (numel, dtype, device type)
        self._check_group: Any = None  # gloo, for the check of every call (made at the first)
        self._pending: Optional[Pending] = None  # the last call, until the next one waits for it

    def _check(self, tensor: Any, refused: bool = False) -> None:
        """Every rank's size and dtype, compared on every rank (before any chunk moves), at
        every call: a check at the new sizes alone would run on the ranks to which the size is
        new, while the others went on to the chunks' collectives. A rank that ``refused`` its
        tensor takes part too and returns after the round (its caller raises its error); the
        others raise ``cfc.CfcError``."""
        import torch
        import torch.distributed as dist

        if isinstance(tensor, torch.Tensor):
            sig = (tensor.numel(), str(tensor.dtype), tensor.device.type)
        else:
            sig = (-1, type(tensor).__name__, "cpu")
        state = self.state
        state._setup()
        if self._check_group is None:  # every rank's first call: all make it together
            kw = {} if state.timeout is None else {"timeout": state.timeout}  # a silent peer: an error
            self._check_group = dist.new_group(
                ranks=dist.get_process_group_ranks(state.process_group), backend="gloo",
                use_local_synchronization=True, **kw,
            )
        dtypes = ("torch.float32", "torch.bfloat16", "torch.float16")
        code = dtypes.index(sig[1]) if sig[1] in dtypes else -1
        mine = torch.tensor(
            [float(sig[0]), float(code), float(sig[2] == "cuda"), float(refused)], dtype=torch.float64
        )
        table = [torch.empty_like(mine) for _ in range(state.world)]
        dist.all_gather(table, mine, group=self._check_group)
        if refused:
            return
        rows = [tuple(t.tolist()) for t in table]
        for r, row in enumerate(rows):
            if row[3]:
                raise _native.CfcError(f"rank {r} refused its tensor to all-reduce (its own error says why)")
        rows = [row[:3] for row in rows]
        if any(row != rows[0] for row in rows):
            seen = ", ".join(
                f"rank {r}: {int(n)} x {dtypes[int(c)][6:] if 0 <= c < 3 else 'other'}{' (CUDA)' if cuda else ''}"
                for r, (n, c, cuda) in enumerate(rows)
            )
            raise _native.CfcError(f"ranks disagree on the tensor to all-reduce ({seen})")
        if sig != self._last and self._last is not None:
            if state._worker is not None:
                state._worker.drain()  # the last chunks are done before their residuals go
            state._forget_buckets()  # other chunks now: their residuals start at zero
        self._last = sig

    def __call__(self, tensor: Any) -> Pending:
        """Start averaging ``tensor`` (contiguous, float32/bf16/fp16) in place."""
        import torch

        from cfc.ddp import _average_bucket, _plain_whole, _whole_plain

        # A tensor refused here is refused in the check below, which every rank takes part in:
        # the other ranks then raise too, rather than wait for this one in their chunks.
        refused: Optional[Exception] = None
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (
            torch.float32, torch.bfloat16, torch.float16
        ):
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            refused = TypeError(f"AllReducer takes float32, bfloat16 or float16 tensors, got {got}")
        elif not tensor.is_contiguous() or tensor.is_neg():
            refused = ValueError(
                "AllReducer averages in place: give it a contiguous tensor (not a lazily negated view)"
            )
        if refused is None or torch.distributed.is_initialized():  # else no peer to tell
            if self.state._closed:
                raise _native.CfcError("this AllReducer was closed (its CfcState is closed)")
            if self._pending is not None:
                # The previous call's chunks finish first: this call reads what they leave
                # behind (residuals to send along, the trial's times), and every rank must
                # read the same.
                # (a call already waited for is done, or raised its error to the caller once)
                pending, self._pending = self._pending, None
                if not pending._waited:
                    pending.wait()
            self._check(tensor, refused is not None)
        if refused is not None:
            try:
                raise refused
            finally:
                refused = None  # the traceback holds this frame: no cycle through the error
        flat = tensor.view(-1)
        n, step = flat.numel(), self.chunk_numel
        if n == 0:  # every rank agreed on an empty tensor: nothing to send
            return Pending(tensor, [])
        starts = list(range(0, n, step))
        if _whole_plain(self.state, [min(step, n - a) for a in starts]):
            # fallback="auto" found no chunk worth compressing: one plain all-reduce of the
            # whole tensor (chunked, it would be slower than the plain collective it replaces)
            work = _plain_whole(self.state, tensor, starts, step)
            self._pending = Pending(tensor, [] if work is None else [work])
            return self._pending
        futures = [
            _average_bucket(self.state, _Chunk(i, flat[a : a + step], i == len(starts) - 1), for_ddp=False)
            for i, a in enumerate(starts)
        ]
        self._pending = Pending(tensor, futures)
        return self._pending

    def close(self) -> None:
        """Finish the last call, then let go of what the state holds outside Python: the comm
        thread and the NCCL communicator of CUDA chunks (:meth:`cfc.CfcState.close`). Call it
        on every rank when done, e.g. before ``dist.destroy_process_group()``; otherwise they stay
        until the process ends. A last call that was never waited for and failed raises
        its error here. Later calls raise ``cfc.CfcError``; closing again does nothing."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None and not pending._waited:
                pending.wait()
        finally:
            self.state.close()


class NcclAllReducer:
    """Compressed average of CUDA tensors run entirely by cfc's Rust core, over an NCCL
    communicator of its own.

    Each call compresses the tensor on the GPU with error feedback, all-gathers the frames
    with NCCL and decodes and averages them in one kernel, in chunks (``cfc::gpu_allreduce``;
    ``cfc-bench --gpu`` measures the same code). No Python runs between those steps, so it
    has less host overhead than :class:`AllReducer` (which runs :func:`cfc.cfc_hook`'s
    engine); it takes only CUDA tensors and an absolute bound per call. The call returns once
    the frames are exchanged; the result is on the device when the current stream gets there.
    A frame from a peer that fails its check on the GPU is not decoded: the tensor keeps its
    input, and so does every later call's. The next compressed call raises ``cfc.CfcError`` on
    every rank alike (after its first exchange, where every rank knows the last call's
    outcome); :meth:`check` and :meth:`close` wait for the last call's work and raise it.

    Every rank must call it with tensors of the same size and dtype, in the same order. The
    first call with a new size, dtype or options checks that with one small exchange (ranks
    that disagree all get ``cfc.CfcError``); later calls like this rank's last one exchange
    nothing first, so that no call waits for a round trip. A rank that alone changes its
    tensor, or refuses one (dtype, device, layout) while the others call, is therefore not
    caught there: the ranks' collectives no longer match, and they fail with an NCCL error or
    at the timeout. :class:`AllReducer` checks every call instead, at a round trip's cost.

    The communicator is made at construction: rank 0 of ``group`` makes an NCCL id and
    broadcasts it over ``group`` (so construction is a collective of ``group``), and every rank
    joins on its current CUDA device. NCCL is loaded by path (``CFC_NCCL_LIBRARY``, else
    ``libnccl.so.2`` / ``libnccl.so`` on the loader's path). A peer that stops answering is an
    error after ``timeout`` seconds (in the call, or in :meth:`check` for work it queued), not a
    hang: the communicator is non-blocking, which makes
    each NCCL call slower than on torch's own communicator (over NVLink, measured 0.54-0.81x
    of torch's fp32 all-reduce even where ``fallback="auto"`` chose plain;
    ``CFC_NCCL_BLOCKING=1`` makes its calls blocking). Where compression does not pay, the
    faster choice is :class:`AllReducer` with ``fallback="auto"`` or torch's own all-reduce.

    Args:
        group: the process group whose ranks take part (default: the world). Any backend.
        eps: the absolute bound per call, or
        rms: the bound as a multiple of the tensor's RMS, measured at each call (one wait for
            the current stream, to read it).
        error_feedback: keep what rounding drops and add it to the next call with the same
            size and dtype.
        fallback: ``False`` (always compress), ``"always"`` (NCCL's own all-reduce, after adding
            the residuals), or ``"auto"``: the first ``2 * trials`` calls with a tensor size time
            both ways and every rank keeps the faster (plain over NVLink, compressed over a
            network, as measured in ``docs/perf-notes.md``).
        trials: timed calls of each way for ``fallback="auto"``.
        chunk_mb: MB of float32 per chunk.
        timeout: seconds any wait may last (default: ``CFC_NCCL_TIMEOUT``, else 300).

    Example::

        >>> # needs an initialised process group and GPUs: not run as a doctest
        >>> reducer = cfc.distributed.NcclAllReducer(rms=0.3, fallback="auto")  # doctest: +SKIP
        >>> # grad is averaged in place
        >>> report = reducer(grad)  # doctest: +SKIP
    """

    def __init__(
        self,
        group: Any = None,
        *,
        eps: Optional[float] = None,
        rms: Optional[float] = None,
        error_feedback: bool = True,
        fallback: Any = False,
        trials: int = 3,
        chunk_mb: float = 256.0,
        timeout: Optional[float] = None,
    ):
        import torch
        import torch.distributed as dist

        if (eps is None) == (rms is None):
            raise ValueError("give exactly one of eps= or rms=")
        bound = eps if eps is not None else rms
        if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound > 0):
            raise ValueError(f"the bound must be a positive number, got {bound!r}")
        if fallback not in (False, "always", "auto"):
            raise ValueError(f'fallback must be False, "always" or "auto", got {fallback!r}')
        if trials < 1:
            raise ValueError(f"trials must be >= 1, got {trials}")
        if not chunk_mb > 0:
            raise ValueError(f"chunk_mb must be positive, got {chunk_mb}")
        if not torch.cuda.is_available():
            raise _native.CfcError("NcclAllReducer needs CUDA: no CUDA device is visible")
        self.eps, self.rms = eps, rms
        self.error_feedback = bool(error_feedback)
        self.fallback = "never" if fallback is False else fallback
        self.trials = int(trials)
        self.chunk_numel = max(1, int(chunk_mb * (1 << 20)) // 4)
        self.device = torch.device("cuda", torch.cuda.current_device())
        group = group if group is not None else dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        # Rank 0's id, or the reason it has none (so that no rank waits for an id never sent).
        box: List[Any] = [None]
        if rank == 0:
            try:
                box[0] = ("id", _native.nccl_unique_id())
            except _native.CfcError as e:
                box[0] = ("error", str(e))
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        kind, value = box[0]
        if kind != "id":
            raise _native.CfcError(f"rank 0 could not make an NCCL id: {value}")
        self._native = _native.NcclAllReducer(self.device.index, value, rank, world, timeout=timeout)
        self._stream: Any = None  # the last call's stream, which its decoding was queued on

    def __call__(self, tensor: Any) -> Dict[str, Any]:
        """Average ``tensor`` (a contiguous float32/bf16/fp16 CUDA tensor on this rank's device)
        in place. Returns the call's report: ``eps``, ``bound``, ``bytes_sent``,
        ``bytes_uncompressed`` and ``compressed``."""
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (
            torch.float32, torch.bfloat16, torch.float16
        ):
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"NcclAllReducer takes float32, bfloat16 or float16 tensors, got {got}")
        if tensor.device != self.device:
            raise ValueError(f"NcclAllReducer works on {self.device}; the tensor is on {tensor.device}")
        if not tensor.is_contiguous() or tensor.is_neg():
            raise ValueError(
                "NcclAllReducer averages in place: give it a contiguous tensor (not a lazily negated view)"
            )
        eps = self.eps
        if eps is None:
            from cfc.ddp import _finite_sumsq, _rms_eps

            rms = math.sqrt(float(_finite_sumsq(tensor)) / max(1, tensor.numel()))
            eps = _rms_eps(self.rms, rms)
        stream = torch.cuda.current_stream(self.device)
        report = self._native.allreduce(
            stream.cuda_stream,
            tensor.data_ptr(),
            tensor.numel(),
            _dtype_name(tensor.dtype),
            eps=float(eps),
            average=True,
            feedback=self.error_feedback,
            chunk_numel=self.chunk_numel,
            fallback=self.fallback,
            trials=self.trials,
        )
        self._stream = stream
        return report

    def compressing(self) -> Optional[bool]:
        """Whether calls with the last size are compressed (None before a first call and
        during ``fallback="auto"``'s trial). Raises ``cfc.CfcError`` after :meth:`close`."""
        return self._native.compressing()

    def check(self) -> None:
        """Wait for the last call's work on the GPU, then raise ``cfc.CfcError`` if a frame of any
        call so far failed its check on the GPU (that call's tensor then kept its input, as every
        later call's does). Without it, the last call's bad frame shows only at the next
        compressed call. The wait lasts at most ``timeout`` seconds: a peer that stopped is then
        a ``cfc.CfcError`` (and the communicator is aborted), where synchronizing the stream
        would wait for good (an uncompressed call's all-reduce is queued on it, and nothing on
        the host waits for it)."""
        if self._stream is not None:
            self._native.wait()
        self._native.check()

    def close(self) -> None:
        """Raise a bad frame of the calls so far, as :meth:`check` does, and leave the
        communicator either way (also done when the reducer is collected). Closing again does
        nothing; other calls after it raise ``cfc.CfcError``."""
        try:
            if self._stream is not None:  # (None once closed: closing again checks nothing)
                self.check()
        finally:
            self._stream = None
            self._native.close()
