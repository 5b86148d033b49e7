"""``cfc_hook``: a DistributedDataParallel communication hook that all-reduces compressed buckets.

Example::

    >>> # needs an initialised process group: not run as a doctest
    >>> from cfc import CfcState, cfc_hook  # doctest: +SKIP
    >>> ddp.register_comm_hook(CfcState(), cfc_hook)  # doctest: +SKIP

Every bucket is quantized with a strict bound (by default ``0.3 x`` the RMS of the bucket's
gradient), with error feedback: what rounding drops on a rank is added to that rank's next
gradient, so over many steps nothing is lost. NaN and infinities travel exactly, so AMP's
GradScaler still sees an overflow on any rank.

Two engines, chosen by where the bucket lives:

* **CPU buckets** (gloo): cfc's collective in the Rust core (``cfc.distributed.all_reduce``):
  one step shared by all ranks, an exact reduce-scatter of integer codes, an all-gather. It runs
  on the autograd thread.
* **CUDA buckets** (NCCL): the hook records an event and hands the bucket to a comm thread, and
  returns at once. The comm thread, on its own CUDA stream, compresses the bucket on the GPU
  (residual add, quantize, pack and new residual in one pass) with a bound from the bucket's
  previous step, and moves it in one of two ways (``algorithm``):

  - *all-gather* (2 ranks): every rank's frame goes to every rank (each in a slot sized from
    the bucket's earlier frames, with its size); each rank waits for the sizes, decodes every
    frame on the GPU and averages them in float32 in rank order. With an ``eps`` or ``rms``
    bound this runs in the Rust core (``cfc::bucket_exchange``, on an NCCL communicator of
    cfc's own): one call per bucket queues the compression and the all-gather, one waits for
    the sizes and queues the averaging, where the same work through ``torch.distributed``
    (:class:`_FrameExchange`, the way it goes otherwise) takes about 25 calls of the comm
    thread. Both give the same bits.
  - *reduce-scatter* (3 ranks or more): the bucket is cut into one shard per rank, every shard
    compressed with one step shared by all ranks; shard ``j`` of every rank goes to rank ``j``
    (all-to-all), which adds the frames' codes in an integer accumulator on the GPU (an exact
    sum, packed as one frame with no second rounding, :func:`cfc.sum_compressed`) and
    all-gathers it.
    A rank receives about ``2 (n-1)/n`` times a compressed bucket instead of ``n - 1`` times
    (a ring all-reduce's ranks receive ``2 (n-1)/n`` times the plain bucket).

  Every rank gets the same bits. While the comm thread waits for one bucket's sizes, the next
  bucket is already on the wire. The autograd thread never waits for the GPU.

  With the state's private ``_use_pipeline`` set on every rank (off by default: at one rank it
  measured as fast as the comm thread, and it has not yet been measured over sockets on two
  GPUs), after the warm-up (and ``fallback="auto"``'s trial), where the native exchange runs
  and ``per_tensor`` is off, the whole step goes through a thread of the Rust core instead
  (``cfc::bucket_pipeline``, :func:`_pipeline_submit`): the hook hands each bucket over with one
  call and returns a completed future, the thread runs the same launches and finishes in the
  same order with no Python on it, and at the step's last bucket the hook waits until every
  bucket is averaged and checked (DDP's reducer reads the buckets only after that bucket).
  Same bits as the comm thread.

Both engines run their collectives on a communicator of their own, made by :class:`CfcState`
at the first bucket (so they never interleave with DDP's own collectives). One exception: in a
step where no CUDA bucket is compressed (the warm-up, or ``fallback="auto"`` having found
plain all-reduce faster for every bucket), the buckets go out from the autograd thread over
DDP's own process group, as PyTorch's hooks do, and the comm thread has nothing to send. NCCL
asks for one communicator at a time per step, so the two are never mixed within a step.
"""

from __future__ import annotations

import datetime
import logging
import math
import queue
import threading
import time
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

import cfc
from cfc import _native
from cfc.codec import (
    _check_flag,
    _check_integer,
    _check_number,
    _compress_cuda,
    _cuda_ready,
    _decode_status_error,
    _decode_sum_cuda,
    _dtype_name,
    _sum_frames_cuda,
)

__all__ = ["CfcState", "cfc_hook", "register_comm_hook"]

logger = logging.getLogger("cfc")

# Launches of later parts a part's finish waits for on the comm thread (_CommThread). 2 and 3
# measured no different from 1 on the 217M LM over sockets (docs/perf-notes.md), and hold more
# buckets' frames in memory.
_PIPELINE_DEPTH = 1
_STATE_VERSION = 3  # 2: the algorithm option (with the reduce-scatter, saved RMS sums are all ranks'); 3: per_tensor
_BOUND_KINDS = ("eps", "rel", "rms")
_ALGORITHMS = ("all-gather", "reduce-scatter")
# The absolute bounds the codec accepts (src/codec.rs, check_abs_bound): normal float64 values
# up to a quarter of the largest, so that a step of 2 eps and its sums stay finite.
_EPS_MIN, _EPS_MAX = 2.2250738585072014e-308, 1.7976931348623157e308 / 4


class CfcState:
    """Options and per-rank state of :func:`cfc_hook`.

    Args:
        process_group: the group DDP reduces over (default: the world). cfc creates its own
            communicator over the same ranks. :func:`register_comm_hook` gives a state without
            one DDP's group, and refuses a state with another; with DDP's own
            ``register_comm_hook`` on a DDP model over a subgroup, pass that group here (a
            bucket does not say which group it is reduced over).
        eps: absolute bound on each rank's quantization error, per element.
        rel: bound relative to the bucket's largest magnitude (over all ranks on CPU, per rank
            on GPU); below 1.
        rms: bound relative to the root mean square of the bucket's finite gradient values
            (over all ranks on CPU; on GPU from the bucket's previous compressed step, so that
            nothing waits for it: over all ranks with the reduce-scatter, per rank with the
            all-gather). The default, ``rms=0.3``, when no bound
            is given: about 12x fewer bytes on the real LM gradient vectors compressed alone,
            7-10x in DDP training with error feedback (the parity LM and the demo of the
            README), where the loss follows plain all-reduce's.
        per_tensor: with ``rms``, bound each parameter's gradient by its own scale rather than
            the bucket's (only ``rms`` allows it). One bucket holds parameters whose gradients
            differ by 50x in RMS (an LM's output layer against its MLP weights); under one
            bound for all, the small ones are mostly rounded to zero and reach the optimizer in
            bursts through error feedback, which inflates Adam's second moment for them and
            slows their training. Off by default: as built it costs host time on every bucket
            (1.5-1.6x the step time of the default over NCCL's socket transport, in
            ``docs/perf-notes.md``), about 19% more bytes on the parity LM (6.3x fewer instead of
            7.5x), and on four seeds of that LM it did not train better on average. Each
            parameter's gradient is divided by its scale before compression and multiplied by
            it after: the scale is the RMS of that parameter's averaged gradient at the
            bucket's previous compressed step (the same bits on every rank, so no extra
            collective; at the first compressed step, 1), at least 1/100 of the bucket's. The bound ``rms x`` the RMS of the scaled
            bucket then holds per element in scaled units, so ``stats()``'s ``max_error`` and
            ``eps`` are in those units too. Residuals stay in gradient units.
        error_feedback: carry what quantization drops into the next step (per rank, per bucket).
            (With ``find_unused_parameters``, DDP writes no gradient for a parameter that no
            rank used in a step, so what its residual sent that step is lost: the hook cannot
            tell such a parameter from one whose gradient is zero.)
        warmup_steps: steps of plain all-reduce first. DDP rebuilds its buckets after the first
            step, so residuals start on stable buckets.
        min_compress_numel: buckets with fewer elements are all-reduced plainly (the fixed
            costs of compressing outweigh the bytes saved). So are buckets of sparse gradients
            (where the backend takes them: gloo, not NCCL) and of dtypes other than float32,
            bfloat16 and float16 (logged once per kind; in ``stats()`` as plain buckets, sparse
            ones counted at their dense size).
        fallback: ``"auto"`` times plain and compressed all-reduce of every bucket for
            ``trial_steps`` steps after the warm-up (alternating) and then keeps, per bucket,
            the faster (the slowest rank's time decides, so all ranks choose alike). ``False``
            always compresses buckets of ``min_compress_numel`` or more. A bucket sent plainly
            still pays for running a Python hook: :func:`register_comm_hook` with ``"auto"``
            first checks whether compression pays at all, and where it does not leaves DDP's
            built-in all-reduce in place.
        trial_steps: steps of that trial (an even number; half of each kind; the fastest time
            of each kind counts).
        log_every: log :meth:`stats` (logger ``"cfc"``, INFO) every this many steps; 0: never.
        algorithm: how a compressed bucket moves: ``"reduce-scatter"`` (each rank owns one
            shard of the bucket, sums everyone's codes for it and sends the sum on: the bytes
            a rank receives stay near twice a compressed bucket however many ranks there are)
            or ``"all-gather"`` (every rank's compressed bucket goes to every rank: one
            exchange instead of two, fewer bytes with 2 ranks). Default (None): all-gather for
            CUDA buckets with 2 ranks or a ``rel`` bound, else reduce-scatter. CUDA buckets
            with ``"reduce-scatter"`` need ``eps`` or ``rms`` (all ranks must use one step;
            ``rel`` is per rank there); CPU buckets always share the step.
        timeout: seconds (or a ``timedelta``) the collectives of cfc's own communicators wait
            for a peer before they fail, e.g. when a rank died; default: the backend's (torch's
            own default timeout), and for the native exchange ``CFC_NCCL_TIMEOUT`` or 300 s.
            Steps that send every CUDA bucket plainly use DDP's process group, and its timeout.
            On gloo the waiting rank gets the error; on NCCL torch's watchdog aborts the
            communicator (and, with its default error handling, the process).

    Every rank must use the same options: the first step checks, and every rank's
    ``backward()`` raises if they disagree (DDP reports the hook's ``cfc.CfcError`` as a
    ``RuntimeError`` that names it). The state may be made before the process group (it
    binds to it at the first bucket); make one on every rank of the process group, and one per
    DDP model (its step count, residuals and per-bucket choices are that model's:
    :func:`register_comm_hook` refuses a state that already serves another model; a hook
    registered with DDP's own ``register_comm_hook`` is not checked, since a bucket does not
    say which model it comes from).
    """

    def __init__(
        self,
        process_group: Any = None,
        *,
        eps: Optional[float] = None,
        rel: Optional[float] = None,
        rms: Optional[float] = None,
        per_tensor: bool = False,
        error_feedback: bool = True,
        warmup_steps: int = 2,
        min_compress_numel: int = 16384,
        fallback: Any = False,
        trial_steps: int = 4,
        log_every: int = 0,
        algorithm: Optional[str] = None,
        timeout: Any = None,
    ):
        given = [(k, v) for k, v in (("eps", eps), ("rel", rel), ("rms", rms)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of eps, rel, rms; got {[k for k, _ in given]}")
        self.bound_kind, bound = given[0] if given else ("rms", 0.3)
        self.bound = _check_number(self.bound_kind, bound)
        if not (math.isfinite(self.bound) and self.bound > 0):
            raise ValueError(f"{self.bound_kind} must be positive and finite, got {bound!r}")
        if self.bound_kind == "rel" and self.bound >= 1:
            # Every element lies within the bucket's largest magnitude of zero: all would come
            # back as zero, every step, and the residuals would only grow.
            raise ValueError(f"rel must be below 1 (rel=0.01 is 1% of the largest magnitude), got {bound!r}")
        if self.bound_kind == "eps" and not (_EPS_MIN <= self.bound <= _EPS_MAX):
            # what the codec accepts (src/codec.rs, check_abs_bound): every bucket would fail
            raise ValueError(f"eps must lie between {_EPS_MIN:g} and {_EPS_MAX:g}, got {bound!r}")
        _check_flag("per_tensor", per_tensor)
        _check_flag("error_feedback", error_feedback)
        for name, count in (("warmup_steps", warmup_steps), ("min_compress_numel", min_compress_numel),
                            ("log_every", log_every), ("trial_steps", trial_steps)):
            _check_integer(name, count)
        if warmup_steps < 0 or min_compress_numel < 0 or log_every < 0:
            raise ValueError("warmup_steps, min_compress_numel and log_every must be >= 0")
        if fallback not in (False, "auto"):
            raise ValueError(f"fallback must be False or 'auto', got {fallback!r}")
        if fallback == "auto" and (trial_steps < 2 or trial_steps % 2):
            raise ValueError(f"trial_steps must be an even number >= 2, got {trial_steps}")
        if algorithm is not None and algorithm not in _ALGORITHMS:
            raise ValueError(f"algorithm must be None, 'all-gather' or 'reduce-scatter', got {algorithm!r}")
        if algorithm == "reduce-scatter" and self.bound_kind == "rel":
            raise ValueError(
                "algorithm='reduce-scatter' needs one quantization step on every rank: give eps or "
                "rms (a rel bound is per rank on CUDA buckets)"
            )
        if per_tensor and self.bound_kind != "rms":
            raise ValueError(f"per_tensor needs an rms bound (an {self.bound_kind} bound is absolute or per bucket)")
        self.per_tensor = bool(per_tensor)
        self.algorithm = algorithm
        self.error_feedback = bool(error_feedback)
        self.warmup_steps = int(warmup_steps)
        self.min_compress_numel = int(min_compress_numel)
        self.fallback = fallback
        self.trial_steps = int(trial_steps) if fallback == "auto" else 0
        self.log_every = int(log_every)
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
                raise ValueError(f"timeout must be positive seconds or a timedelta, got {timeout!r}")
            timeout = datetime.timedelta(seconds=timeout)
        if timeout is not None and timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.timeout = timeout

        self.process_group = process_group
        self.group: Any = None  # made by _setup, once the process group exists
        self.rank, self.world = -1, 0

        self.step = 0  # completed steps (counted at each step's last bucket)
        self._origin = 0  # the step the warm-up and trial count from (moved by _forget_buckets, _start_trial)
        # Residuals live per bucket (one flat float32 tensor, like the bucket) but are keyed
        # per parameter, so they survive DDP rebuilding its buckets and a resumed run whose
        # first step has DDP's initial bucket layout. A parameter's key is its ordinal: the
        # order in which this process first saw it, which is DDP's initial layout and the same
        # in every run of the same model.
        self._ordinal: Dict[int, int] = {}  # id(parameter) -> ordinal
        self._residuals: Dict[int, Tuple[tuple, Any]] = {}  # bucket -> (ordinals, residual)
        self._where: Dict[int, Tuple[Any, int, int]] = {}  # ordinal -> (residual, offset, numel)
        self._pending: Dict[int, Any] = {}  # ordinal -> loaded residual, placed at first use
        self._layouts: Dict[int, Optional[tuple]] = {}  # bucket -> ordinals, as last seen
        self._saved_layouts: Dict[int, tuple] = {}  # bucket -> ordinals, from a checkpoint
        # Once _saved_layouts is dropped: (the step after, the buckets it ran); _prune_buckets
        self._prune: Optional[Tuple[int, set]] = None
        self._decisions: Dict[int, bool] = {}  # bucket -> compress? (fallback="auto")
        self._plain_kinds: set = set()  # the kinds of bucket never compressed, logged (_numel)
        self._trial: Dict[int, Dict[str, List[float]]] = {}
        self._trial_times: Dict[int, Tuple[float, float]] = {}  # bucket -> (plain, compressed), all ranks'
        # The ordinals of each bucket as its trial timed it, and as its decision was made for:
        # a decision holds for the parameters it timed, not for whatever bucket has its index.
        self._trial_layouts: Dict[int, Optional[tuple]] = {}
        self._decided: Dict[int, Optional[tuple]] = {}
        # What register_comm_hook's probe found (None: no probe ran)
        self.probe: Optional[Dict[str, Any]] = None
        self._trial_device: Any = None
        # bucket (or ("shard", bucket), ("sum", bucket) for the reduce-scatter's two
        # exchanges) -> bytes per rank in the frame exchange
        self._slots: Dict[Any, int] = {}
        # Buckets whose residual may be nonzero: a plain all-reduce sends it along (and zeroes
        # it) only then, so buckets that stay plain pay no extra pass over memory.
        self._unflushed: set = set()
        # bucket -> (sum of squares, event, numel, whether per_tensor's scales applied to it)
        self._rms: Dict[int, Tuple[Any, Any, int, bool]] = {}
        self._scales: Dict[int, Tuple[tuple, Any]] = {}  # bucket -> (layout, per-parameter scales), per_tensor
        self._counts: Dict[Tuple[tuple, Any], Any] = {}  # (layout, device) -> parameter sizes, on the device
        self._agreed = False
        self._resumed = (-1.0, 0.0)  # what load_state_dict loaded (_note_resume): nothing yet
        self._nccl = False  # CUDA tensors go through NCCL in the group (set by _setup)
        self._fast_step = (-1, False)  # (step, whether its CUDA buckets all go out plainly)
        self._worker: Optional[_CommThread] = None
        # The compressed CUDA buckets' exchange over an NCCL communicator of cfc's own, run by
        # the Rust core (_native.BucketExchange); made at the first step where every rank can,
        # else None and the exchange goes through torch.distributed (_FrameExchange). Not an
        # option: every rank must take the same way; benches turn it off to compare.
        self._exchange: Any = None
        self._use_exchange = True
        self._exchange_polling: Optional[Tuple[int, int]] = None  # (spin, nap) us; benches compare
        self._exchange_graphs = False  # BucketExchange.set_graphs; benches compare
        # With _use_pipeline, the run phase's steps of compressed CUDA buckets through the native
        # exchange go through _native.BucketPipeline (a thread of cfc's own, no Python on it),
        # made at the first such step; (step, whether that step does), decided at its first
        # bucket; the parts' write-backs of a step waiting for its end. Off by default until
        # measured over sockets on two GPUs (docs/perf-notes.md, "The native bucket pipeline").
        # Not an option: every rank must take the same way (it is not in the agreed options, so
        # set it on every rank); tests and benches turn it on.
        self._pipeline: Any = None
        self._use_pipeline = False
        self._pipeline_step = (-1, False)
        self._pipeline_scatters: List[Any] = []
        # The comm thread's pipeline depth (_CommThread). Not an option: it orders collectives,
        # so every rank must use the same; benches set it before the first bucket to compare.
        self._pipeline_depth = _PIPELINE_DEPTH
        self._closed = False  # close() was called: the hook refuses further buckets
        self._model: Any = None  # a weak reference to the DDP model register_comm_hook gave it to
        # The status of the decodings outside the native exchange (_decode_sum) on the device,
        # and its copy on the host (pinned, read without a wait): made at the first.
        self._decode_status: Any = None
        self._decode_seen: Any = None
        # A bucket was decoded on the comm thread since the last check of the decodings'
        # status (_check_decoded, at each step's last bucket).
        self._decoded = False
        self._lock = threading.Lock()
        self._max_err_dev: Dict[Any, Any] = {}  # device -> running maximum (0-d float64), read by stats()
        self._reset_counters()

    def _setup(self, own_communicator: bool = True) -> None:
        """Binds the state to its process group (at the first bucket, or when a checkpoint is
        loaded), so a state can be made before ``init_process_group`` (Lightning does).
        ``own_communicator=False`` runs cfc's collectives over the process group itself (for
        :func:`register_comm_hook`'s probe, when nothing else uses the group)."""
        import torch.distributed as dist

        if self.group is not None:
            return
        if not dist.is_initialized():
            raise RuntimeError("cfc_hook needs an initialised torch.distributed process group")
        pg = self.process_group if self.process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(pg)
        self.process_group, self.rank, self.world = pg, dist.get_rank(pg), len(ranks)
        if own_communicator:
            # A communicator of cfc's own: its collectives run on the comm thread and must not
            # interleave with DDP's (e.g. the unused-parameter map of find_unused_parameters).
            # Only this group's ranks take part in making it (DDP over several disjoint
            # subgroups works), at the same point: the first bucket of the first step.
            kw = {} if self.timeout is None else {"timeout": self.timeout}
            self.group = dist.new_group(ranks=ranks, use_local_synchronization=True, **kw)
        else:
            self.group = pg
        # NCCL alone, or NCCL for CUDA tensors in a mixed group ("cpu:gloo,cuda:nccl")
        self._nccl = "nccl" in str(dist.get_backend(self.group))

    # ---- configuration ----

    def _config(self) -> List[float]:
        """The options every rank must share, as numbers (compared in the agreement round)."""
        return [
            _STATE_VERSION,
            _BOUND_KINDS.index(self.bound_kind),
            float(self.bound),
            float(self.error_feedback),
            float(self.warmup_steps),
            float(self.min_compress_numel),
            1.0 if self.fallback == "auto" else 0.0,
            float(self.trial_steps),
            float(self.world),
            0.0 if self.algorithm is None else 1.0 + _ALGORITHMS.index(self.algorithm),
            float(self.per_tensor),
        ]

    def _engine(self) -> List[float]:
        """The private engine settings every rank must share too (they order or size the
        collectives: the comm thread's depth, the pipeline, the native exchange and its graphs'
        slots), as numbers; agreed on, not saved with the state."""
        return [float(self._use_exchange), float(self._use_pipeline), float(self._pipeline_depth),
                float(self._exchange_graphs)]

    @staticmethod
    def _describe_engine(c: List[float]) -> str:
        return (f"_use_exchange={bool(c[0])}, _use_pipeline={bool(c[1])}, _pipeline_depth={int(c[2])}, "
                f"_exchange_graphs={bool(c[3])}")

    def _describe(self, c: List[float]) -> str:
        kind = _BOUND_KINDS[int(c[1])] if 0 <= int(c[1]) < 3 else "?"
        alg = int(c[9]) if len(c) > 9 else 0
        return (
            f"{kind}={c[2]!r}, error_feedback={bool(c[3])}, warmup_steps={int(c[4])}, "
            f"min_compress_numel={int(c[5])}, fallback={'auto' if c[6] else False}, "
            f"trial_steps={int(c[7])}, algorithm={_ALGORITHMS[alg - 1] if 0 < alg <= 2 else None!r}, "
            f"per_tensor={bool(c[10]) if len(c) > 10 else '?'}"
        )

    def _agree(self, device) -> None:
        """Every rank sees every rank's options, and what it resumed from (again after each
        :meth:`load_state_dict`); all raise alike if they differ."""
        import torch
        import torch.distributed as dist

        config, engine = self._config(), self._engine()
        mine = torch.tensor(config + engine + list(self._resumed), dtype=torch.float64, device=device)
        table = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(table, mine, group=self.group)
        rows = [t.cpu().tolist() for t in table]
        k, e = len(config), len(config) + len(engine)
        for r, row in enumerate(rows):
            if row[:k] != rows[0][:k]:
                raise cfc.CfcError(
                    f"ranks disagree on the cfc_hook options: rank 0 has {self._describe(rows[0])}; "
                    f"rank {r} has {self._describe(row)}"
                )
        for r, row in enumerate(rows):
            if row[k:e] != rows[0][k:e]:
                raise cfc.CfcError(
                    "ranks disagree on cfc's engine settings: rank 0 has "
                    f"{self._describe_engine(rows[0][k:e])}; rank {r} has {self._describe_engine(row[k:e])}"
                )
        for r, row in enumerate(rows):
            if row[e:] != rows[0][e:]:
                raise cfc.CfcError(
                    "ranks resumed from different cfc_hook states: rank 0 loaded "
                    f"{self._describe_resume(rows[0][e:])}; rank {r} {self._describe_resume(row[e:])} "
                    "(each rank loads its own state of the same step)"
                )
        self._agreed = True
        if (device.type == "cuda" and self._nccl and self._use_exchange and self._exchange is None
                and _exchange_fits(self)):
            self._exchange = _open_exchange(self, device)
            if self._exchange is not None and self._exchange_polling is not None:
                self._exchange.set_polling(*self._exchange_polling)
            if self._exchange is not None and self._exchange_graphs:
                self._exchange.set_graphs(True)

    @staticmethod
    def _describe_resume(row: List[float]) -> str:
        if row[0] < 0:
            return "none"
        return f"the state of step {int(row[0])} (buckets and choices {int(row[1]):08x})"

    def _note_resume(self) -> None:
        """What the next agreement compares between ranks after a load: the step, and a
        checksum of the bucket layouts and per-bucket choices (the same on every rank of a run;
        residuals differ)."""
        import zlib

        shared = repr((sorted(self._saved_layouts.items()), sorted(self._decisions.items())))
        self._resumed = (float(self.step), float(zlib.crc32(shared.encode())))
        self._agreed = False

    # ---- per-bucket decisions ----

    def _phase(self) -> str:
        age = self.step - self._origin
        if age < self.warmup_steps:
            return "warmup"
        if age < self.warmup_steps + self.trial_steps:
            return "trial"
        return "run"

    def _compress_this(self, numel: int) -> Optional[bool]:
        """Whether to compress a bucket this step; ``None``: as the trial decided (looked up
        where the trial's times are, after every trial bucket has been timed)."""
        if numel < self.min_compress_numel:
            return False
        phase = self._phase()
        if phase == "warmup":
            return False
        if phase == "trial":
            return (self.step - self._origin - self.warmup_steps) % 2 == 1
        return None if self.trial_steps else True

    def _numel(self, buf) -> int:
        """A bucket's element count as the choices above see it: -1, below any
        ``min_compress_numel`` (sent plainly, no residual), for one that cfc does not compress:
        sparse gradients (``nn.Embedding(sparse=True)``) and dtypes other than float32,
        bfloat16 and float16 (float64, say). Logged once per kind."""
        import torch

        if not buf.is_sparse and buf.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return buf.numel()
        kind = _bucket_kind(buf)
        if kind not in self._plain_kinds:
            self._plain_kinds.add(kind)
            logger.warning("cfc: buckets of %s gradients are all-reduced plainly (cfc compresses dense "
                           "float32, bfloat16 and float16)", kind)
        return -1

    def _feeds(self, numel: int) -> bool:
        """Whether a bucket has a residual this step (not during the warm-up: buckets are
        rebuilt after the first step)."""
        return numel >= self.min_compress_numel and self._phase() != "warmup"

    def _decision(self, index: int) -> bool:
        if self._trial:
            self._decide()
        return self._decisions.get(index, True)

    def _ordinals(self, bucket, buf) -> Optional[Tuple[Tuple[int, int, int], ...]]:
        """(ordinal, offset, numel) of each parameter in the bucket's buffer ``buf``; None when
        the parameters do not tile the buffer (then residuals are kept per bucket only)."""
        out, off = [], 0
        for p in bucket.parameters():
            o = self._ordinal.setdefault(id(p), len(self._ordinal))
            n = p.numel()
            out.append((o, off, n))
            off += n
        return tuple(out) if off == buf.numel() else None

    def _parts(self, index: int, buf, layout):
        """How to run a bucket: ``[(index, flat tensor, layout)]`` and a function that writes
        the parts back into ``buf`` (None when the bucket runs whole).

        After a checkpoint is loaded, DDP's first step uses its initial bucket layout, not the
        rebuilt one the checkpoint was saved with. Such a bucket runs as the saved buckets it
        is made of, so that the resumed run does exactly what the uninterrupted one did.
        """
        whole = [(index, buf, layout)], None
        if not self._saved_layouts or layout is None or buf.is_sparse:
            return whole
        mine = tuple(o for o, _, _ in layout)
        if self._saved_layouts.get(index) == mine:
            return whole
        where = {o: (off, n) for o, off, n in layout}
        chosen = [(k, ords) for k, ords in sorted(self._saved_layouts.items()) if ords and set(ords) <= where.keys()]
        if sorted(o for _, ords in chosen for o in ords) != sorted(where):
            return whole
        parts = []
        for k, ords in chosen:
            flat = buf.new_empty(sum(where[o][1] for o in ords))
            sub, off = [], 0
            for o in ords:
                a, n = where[o]
                flat[off : off + n].copy_(buf[a : a + n])
                sub.append((o, off, n))
                off += n
            parts.append((k, flat, tuple(sub)))

        def scatter():
            for _, flat, sub in parts:
                for o, off, n in sub:
                    a = where[o][0]
                    buf[a : a + n].copy_(flat[off : off + n])

        return parts, scatter

    def _prune_buckets(self, keys) -> None:
        """After a loaded layout is dropped (:meth:`_end_of_bucket`), the buckets the next step
        runs (``keys``, as each comes) are the ones that stay. At the first bucket of the step
        after it, the per-bucket state of any other (the loaded layout's, where DDP's buckets
        are not those) goes: its residual's values live on in the running buckets' residuals
        (carried per parameter), and nothing would read the rest again."""
        step, ran = self._prune
        if self.step == step:
            ran.update(keys)
            return
        self._prune = None
        if self._worker is not None:
            self._worker.drain()  # no bucket on the comm thread still reads what goes
        if self._decisions and any(self._decided.get(k) != self._layouts.get(k) for k in ran):
            self._start_trial()  # (before the step's first bucket: this step is the trial's first)
        per_bucket = (self._residuals, self._layouts, self._decisions, self._trial, self._trial_times,
                      self._rms, self._scales)
        stale = {k for d in per_bucket for k in d} - ran
        if not ran or not stale:
            return
        for d in per_bucket:
            for k in stale & d.keys():
                del d[k]
        for k in [k for k in self._slots if _key_bucket(k) in stale]:
            del self._slots[k]
        self._unflushed -= stale  # (their values were carried, and the carrying residual marked)
        layouts = {held[0] for held in self._scales.values()}
        for k in [k for k in self._counts if k[0] not in layouts]:
            del self._counts[k]
        # What the comm thread and the native exchange keep per bucket: pinned words, events
        # and graphs (the device is idle: drained above).
        if self._worker is not None:
            sums, sizes = self._worker.sums, self._worker.sizes
            for k in stale & sums.keys():
                del sums[k]
            for k in [k for k in sizes if _key_bucket(k) in stale]:
                del sizes[k]
        if self._pipeline is not None:
            self._pipeline.forget(sorted(stale))
        if self._exchange is not None:
            self._exchange.forget(sorted(stale))

    def _residual(self, index: int, layout, buf):
        """This bucket's residual, zero at first; kept across steps, and carried over per
        parameter when DDP rebuilds its buckets or a checkpoint is loaded."""
        import torch

        if not self.error_feedback:
            return None
        key = (layout, str(buf.dtype), buf.numel())
        held = self._residuals.get(index)
        if held is not None and held[0] == key and held[1].device == buf.device:
            return held[1]
        r = torch.zeros(buf.numel(), dtype=torch.float32, device=buf.device)
        for o, off, n in layout or ():
            if o in self._pending:
                src = self._pending.pop(o).reshape(-1)
                if src.numel() == n:
                    r[off : off + n].copy_(src)
                else:  # a state saved for another model: counted, not silently dropped
                    logger.warning("cfc: the loaded residual of parameter %d holds %d values, the parameter %d; "
                                   "it restarts at zero", o, src.numel(), n)
                    self._stats["residual_resets"] += 1
            elif o in self._where:
                t, toff, tn = self._where[o]
                if tn == n and t.device == r.device:
                    r[off : off + n].copy_(t[toff : toff + n])
            self._where[o] = (r, off, n)
        if held is not None and layout is None:
            logger.warning("cfc: bucket %d changed; its residual restarts at zero", index)
            self._stats["residual_resets"] += 1
        self._residuals[index] = (key, r)
        self._unflushed.add(index)  # it may hold carried-over or loaded values
        return r

    def _forget_buckets(self) -> None:
        """Drop what is kept per bucket (residuals, slot sizes, choices, RMS): the buckets that
        come next are other ones (:class:`cfc.distributed.AllReducer`, given a new size); their
        warm-up and trial start again."""
        if self._worker is not None:
            self._worker.drain()
        for d in (self._residuals, self._where, self._pending, self._layouts, self._decisions,
                  self._trial, self._trial_times, self._slots, self._rms, self._unflushed, self._scales,
                  self._counts, self._decided, self._trial_layouts):
            d.clear()
        self._origin = self.step

    def _record_trial(self, index: int, compressed: bool, seconds: float, device, layout) -> None:
        """One timed trial of a bucket, plain or compressed (read by :meth:`_decide`), whose
        parameters are ``layout`` (its ``(ordinal, offset, numel)``, or None). Times of the
        bucket with another layout (DDP rebuilt its buckets during the trial, as with
        ``static_graph`` and ``warmup_steps`` below 2) were of other parameters: they go."""
        layout = _layout_ordinals(layout)
        if index in self._trial and self._trial_layouts.get(index, layout) != layout:
            del self._trial[index]
        self._trial_layouts[index] = layout
        self._trial.setdefault(index, {"plain": [], "cfc": []})["cfc" if compressed else "plain"].append(seconds)
        self._trial_device = device

    def _start_trial(self) -> None:
        """Time every bucket again from this step on (``fallback="auto"``): the buckets that run
        are not those the trial timed or decided for (DDP rebuilt them during the trial; a run
        resumed with another bucket size). At a step's first bucket: the step is the trial's
        first."""
        logger.info("cfc: the buckets are not those the trial timed; timing them again")
        self._origin = max(0, self.step - self.warmup_steps)
        for d in (self._decisions, self._decided, self._trial, self._trial_times, self._trial_layouts):
            d.clear()

    def _decide(self, group: Any = None, again: bool = False) -> None:
        """End of the trial: per bucket, compress iff it was faster (slowest rank decides).
        ``group``: where to compare the times (default cfc's own communicator, for a caller on
        the comm thread). ``again``: where a bucket was timed only one way (its layout changed
        between the trial's steps), time every bucket again from this step (:meth:`_start_trial`)
        instead; only at a step's first bucket, on the thread that chooses each bucket's way
        (the same on every rank: every rank has the same buckets). Otherwise such a bucket is
        compressed, as buckets the trial never timed are."""
        import torch
        import torch.distributed as dist

        if not self._trial:
            return
        if again and any(not t["plain"] or not t["cfc"] for t in self._trial.values()):
            self._start_trial()
            return
        keys = sorted(self._trial)
        # The fastest of each kind: the first compressed sample also pays one-off costs
        # (kernel compilation, the first size exchange).
        best = lambda xs: min(xs) if xs else math.inf  # noqa: E731
        device = self._trial_device
        if device is None:  # timings loaded from a checkpoint: where the group's collectives run
            device = torch.device("cuda", torch.cuda.current_device()) if self._nccl else torch.device("cpu")
        times = torch.tensor(
            [[best(self._trial[k]["plain"]), best(self._trial[k]["cfc"])] for k in keys],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=self.group if group is None else group)
        for k, (plain, comp) in zip(keys, times.cpu().tolist()):
            self._decisions[k] = comp < plain
            self._trial_times[k] = (plain, comp)
            self._decided[k] = self._trial_layouts.get(k)
        self._trial.clear()
        self._trial_layouts.clear()
        logger.info("cfc: buckets compressed after the trial: %s", self._decisions)

    def close(self) -> None:
        """Let go of what the state holds outside Python: its comm thread (once the work queued
        on it is done) and the NCCL communicator of its native exchange. Call it on every rank
        when training with the hook is over, e.g. before ``dist.destroy_process_group()``;
        otherwise they stay until the process ends (a CUDA state's comm thread holds the state,
        so it is never collected). Afterwards the hook refuses buckets (``backward()`` raises a
        ``RuntimeError`` naming ``cfc.CfcError``); ``stats()`` and ``state_dict()`` still
        work. Calling it again does nothing. cfc's process group stays until torch's groups are
        destroyed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        worker, self._worker = self._worker, None
        exchange, self._exchange = self._exchange, None
        pipeline, self._pipeline = self._pipeline, None
        try:
            if pipeline is not None:
                pipeline.close()  # finishes what is in flight (within the timeout), ends its thread
            if worker is not None:
                try:
                    worker.drain()  # raises the queued work's failure, after which...
                finally:
                    worker.stop()
                    worker.thread.join()
        finally:  # ...the communicator is let go all the same
            if exchange is not None:
                exchange.close()  # waits for this rank's queued work, then NCCL finalizes

    # ---- stats ----

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats` (waits for the GPU work already queued)."""
        if getattr(self, "_worker", None) is not None:
            self._worker.drain()
        with self._lock:
            self._reset_counters()

    def _reset_counters(self) -> None:
        self._stats = {
            "compressed_buckets": 0,
            "plain_buckets": 0,
            "bytes_sent": 0,
            "bytes_uncompressed": 0,
            "max_error": 0.0,
            "eps": 0.0,
            "seconds": 0.0,
            "residual_resets": 0,
            "resends": 0,
            "direct_buckets": 0,
        }
        self._max_err_dev.clear()  # (the callers hold the lock, or no other thread exists yet)

    def stats(self) -> Dict[str, float]:
        """Counters since the start (or :meth:`reset_stats`), as a plain dict.

        * ``step``: completed steps;
        * ``compressed_buckets`` / ``plain_buckets``: buckets each way;
        * ``bytes_sent``: bytes this rank sent; ``bytes_uncompressed``: what a plain ring
          all-reduce of the same buckets would send; ``ratio``: the second over the first;
        * ``max_error``: the largest quantization error of any element this rank sent (what its
          residual kept), next to ``eps``, the largest bound used (the error includes rounding
          the compensated value to a bf16/fp16 bucket's dtype). It is measured from the
          residuals: NaN with ``error_feedback=False`` once a bucket was compressed (not
          measured, which a 0 would hide);
        * ``seconds``: time spent in cfc (autograd thread for CPU buckets; comm thread, busy
          time, for CUDA buckets);
        * ``residual_resets``: residuals restarted because a bucket changed in a way its
          parameters could not be followed;
        * ``resends``: CUDA frames that outgrew their slot and were sent again;
        * ``direct_buckets``: CUDA buckets of steps with nothing to compress, averaged from the
          autograd thread over the process group, as PyTorch's own hooks do (the others of
          ``plain_buckets`` went through cfc's comm thread).

        Reading it waits for the GPU work already queued.
        """
        if self._worker is not None:
            self._worker.drain()
        s = dict(self._stats)
        with self._lock:
            maxima = list(self._max_err_dev.values())
        for t in maxima:  # the CUDA buckets' running maxima (the worker is drained)
            s["max_error"] = max(s["max_error"], float(t))
        if not self.error_feedback and s["compressed_buckets"]:
            s["max_error"] = math.nan
        s["step"] = self.step
        s["ratio"] = s["bytes_uncompressed"] / s["bytes_sent"] if s["bytes_sent"] else 0.0
        return s

    # ---- checkpoints ----

    def state_dict(self) -> Dict[str, Any]:
        """This rank's state: step, residuals (on the CPU), per-bucket choices and stats.
        Save one per rank (residuals differ between ranks)."""
        self._setup()
        if self._worker is not None:
            self._worker.drain()
        residuals = {o: t[off : off + n].detach().cpu().clone() for o, (t, off, n) in self._where.items()}
        residuals.update({o: v for o, v in self._pending.items() if o not in residuals})
        return {
            "version": _STATE_VERSION,
            "rank": self.rank,
            "world": self.world,
            "config": self._config(),
            "step": self.step,
            "origin": self._origin,  # where the warm-up and the trial count from
            "residuals": residuals,  # per parameter ordinal
            "layouts": {**self._saved_layouts, **{i: l for i, l in self._layouts.items() if l is not None}},
            "decisions": dict(self._decisions),
            # fallback="auto": the trial's timings not yet decided on (the choice is made at the
            # first bucket after the trial, from every rank's timings)
            "trial": {i: {k: list(v) for k, v in t.items()} for i, t in self._trial.items()},
            "rms": {i: (float(h), n) for i, (h, _, n, _) in self._rms.items()},  # CUDA buckets' sums of squares
            "rms_scaled": [i for i, e in self._rms.items() if e[3]],  # those of scaled values (per_tensor)
            "scales": {i: (l, s.cpu().tolist()) for i, (l, s) in self._scales.items()},  # per_tensor
            "stats": self.stats(),
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved on this rank.

        Raises:
            ValueError: the state was saved by another rank, world size or options, or is not
                one :meth:`state_dict` makes (a missing or malformed field; residuals that are
                not finite 1-D float32 dense tensors; a negative step). Nothing is changed then.
                (A residual whose size does not match its parameter's restarts at zero,
                counted in ``residual_resets``.)
            cfc.CfcError: the state was closed.

        The residuals are kept as given until their buckets first use them (not copied):
        leave the loaded tensors unchanged until the next step.

        The next bucket's agreement round, a collective like the first one, checks that every
        rank loaded a state of the same step, buckets and choices; otherwise every rank's
        ``backward()`` raises (the hook's ``cfc.CfcError``, which DDP reports as a
        ``RuntimeError``), before any of the step's exchanges.

        A fresh DDP model runs its first step (its first two with ``static_graph``) on its
        initial buckets, where the hook replays the saved run's buckets from the state. A state
        saved before its run had seen DDP's rebuilt buckets cannot: if such a step compresses,
        the run resumes within the bound but not bit for bit. Examples: a state saved after
        step 1 with ``warmup_steps`` at most 1; after step 1 or 2 with ``static_graph``; one
        saved one step after resuming from a state of step 1.
        """
        if self._closed:
            raise cfc.CfcError("this CfcState was closed (CfcState.close()); register a new one to go on")
        if not isinstance(sd, Mapping) or sd.get("version") != _STATE_VERSION:
            raise ValueError("not a cfc_hook state (or one of another version)")
        self._setup()
        loaded = _parse_state(sd)  # every field checked before anything changes
        if (loaded["world"], loaded["rank"]) != (self.world, self.rank):
            raise ValueError(
                f"this state was saved by rank {loaded['rank']} of {loaded['world']}; this is rank "
                f"{self.rank} of {self.world} (each rank loads its own)"
            )
        if len(loaded["config"]) != len(self._config()):
            raise ValueError(f"this state was saved with {len(loaded['config'])} options, of another version")
        if loaded["config"] != self._config():
            raise ValueError(
                f"this state was saved with {self._describe(loaded['config'])}; these options are "
                f"{self._describe(self._config())}"
            )
        if self._worker is not None:  # a load mid-run: the comm thread's work is all done first
            self._worker.drain()
        self.step = loaded["step"]
        self._residuals.clear()
        self._where.clear()
        self._pending = loaded["residuals"]
        self._saved_layouts = loaded["layouts"]
        self._prune = None
        self._decisions = loaded["decisions"]
        # (the layouts saved are those the choices and the trial's times were made with)
        self._decided = {k: self._saved_layouts.get(k) for k in self._decisions}
        # Per-bucket memory of this process's earlier steps does not carry over; the loaded
        # residuals (in _pending) are placed, and later sent along, at their buckets' first use.
        self._unflushed.clear()
        self._slots.clear()
        self._trial = loaded["trial"]
        self._trial_layouts = {k: self._saved_layouts.get(k) for k in self._trial}
        self._trial_device = None
        self._origin = loaded["origin"]
        self._fast_step = (-1, False)
        self._pipeline_step = (-1, False)
        self._pipeline_scatters = []
        self._rms = loaded["rms"]
        self._scales = loaded["scales"]
        self.reset_stats()
        self._note_resume()

    # ---- bookkeeping shared by both engines ----

    def _account(self, compressed: bool, sent: int, uncompressed: int, eps: float, seconds: float) -> None:
        with self._lock:
            s = self._stats
            s["compressed_buckets" if compressed else "plain_buckets"] += 1
            s["bytes_sent"] += sent
            s["bytes_uncompressed"] += uncompressed
            s["eps"] = max(s["eps"], eps)
            s["seconds"] += seconds

    def _end_of_bucket(self, last: bool) -> None:
        """After each bucket's hook (``last``: the step's last bucket, ``bucket.is_last()``)."""
        if last:
            self.step += 1
            if self._saved_layouts and self.step >= self._resumed[0] + 2:
                # A fresh DDP model keeps its initial buckets for one step (two with
                # static_graph), then rebuilds them; so from the third step after a load they
                # are as they will stay, and a loaded layout is of no more use (where the
                # buckets are the saved ones it would run them whole anyway; where they are
                # not, e.g. another bucket_cap_mb, it would split each bucket into the saved
                # ones at every step). Residuals go on per parameter. Not earlier: an exact
                # resume with static_graph needs the loaded layout for both initial steps.
                self._saved_layouts = {}
                self._prune = (self.step, set())
            if self.log_every and self.step % self.log_every == 0 and logger.isEnabledFor(logging.INFO):
                logger.info("cfc step %d: %s", self.step, self.stats())


def _parse_state(sd: Mapping) -> Dict[str, Any]:
    """The fields of a :meth:`CfcState.state_dict`, checked and converted, or ``ValueError``
    naming the first field that is not what ``state_dict`` makes. CPU residuals are kept as
    they are, not copied (a large model's take as much memory as its parameters)."""
    import torch

    def field(name: str) -> Any:
        if name not in sd:
            raise ValueError(f"not a cfc_hook state: no {name!r}")
        return sd[name]

    def count(value: Any, what: str, key: bool = False) -> int:
        if key and isinstance(value, str) and value.isdigit():
            value = int(value)  # a key that went through a format whose keys are strings
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"not a cfc_hook state: {what} is {value!r}, not an integer >= 0")
        return value

    def mapping(name: str, required: bool = True) -> Mapping:
        value = field(name) if required else sd.get(name, {})
        if not isinstance(value, Mapping):
            raise ValueError(f"not a cfc_hook state: {name!r} is a {type(value).__name__}, not a mapping")
        return value

    def triples(value: Any, what: str) -> Tuple[Tuple[int, int, int], ...]:
        if not isinstance(value, (list, tuple)) or not all(isinstance(e, (list, tuple)) and len(e) == 3 for e in value):
            raise ValueError(f"not a cfc_hook state: {what} is not a list of (ordinal, offset, numel)")
        return tuple(tuple(count(x, what) for x in e) for e in value)

    def number(value: Any, what: str, finite: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (finite and not math.isfinite(value)):
            raise ValueError(f"not a cfc_hook state: {what} is {value!r}, not a {'finite ' if finite else ''}number")
        return float(value)

    config = field("config")
    out: Dict[str, Any] = {
        "world": count(field("world"), "world"),
        "rank": count(field("rank"), "rank"),
        "config": [number(c, "an option") for c in _sequence(config, "config")],
        "step": count(field("step"), "step"),
        # (absent from a checkpoint of the previous format: there the trial began at step 0)
        "origin": count(sd.get("origin", 0), "origin"),
    }
    if out["origin"] > out["step"]:
        raise ValueError(f"not a cfc_hook state: origin {out['origin']} is past step {out['step']}")
    residuals = {}
    for o, r in mapping("residuals").items():
        o = count(o, "a residual's parameter ordinal", key=True)
        if not (isinstance(r, torch.Tensor) and r.dtype == torch.float32 and r.dim() == 1
                and r.layout == torch.strided and r.device.type != "meta"):
            raise ValueError(f"the residual of parameter {o} is not a 1-D float32 dense tensor: not a saved state")
        r = r.detach().cpu()  # no copy of a CPU tensor: residuals take as much memory as the model
        if not bool(torch.isfinite(r).all()):
            # the codec never leaves a non-finite value in a residual (it would reach the
            # gradients of every rank)
            raise ValueError(f"the residual of parameter {o} holds a NaN or an infinity: not a saved state")
        residuals[o] = r
    out["residuals"] = residuals
    out["layouts"] = {count(i, "a bucket index", key=True): tuple(count(x, "a layout's ordinal") for x in _sequence(l, "a layout"))
                      for i, l in mapping("layouts").items()}
    decisions = {}
    for k, v in mapping("decisions").items():
        if not isinstance(v, bool):
            raise ValueError(f"not a cfc_hook state: the decision of bucket {k!r} is {v!r}, not True or False")
        decisions[count(k, "a bucket index", key=True)] = v
    out["decisions"] = decisions
    trial = {}
    for i, t in mapping("trial", required=False).items():
        if not isinstance(t, Mapping) or not set(t) <= {"plain", "cfc"}:
            raise ValueError(f"not a cfc_hook state: the trial of bucket {i!r} is {t!r}")
        trial[count(i, "a bucket index", key=True)] = {
            k: [number(x, "a trial time") for x in _sequence(t.get(k, ()), "trial times")] for k in ("plain", "cfc")
        }
    out["trial"] = trial
    # (a checkpoint of the previous format has no "rms_scaled": a bucket with scales had them
    # applied at its last step unless that was its first compressed one)
    scales_in = mapping("scales")
    scaled = {count(i, "a bucket index", key=True) for i in _sequence(sd.get("rms_scaled", list(scales_in.keys())), "rms_scaled")}
    rms = {}
    for i, e in mapping("rms").items():
        if not isinstance(e, (list, tuple)) or len(e) != 2:
            raise ValueError(f"not a cfc_hook state: the RMS entry of bucket {i!r} is {e!r}")
        i = count(i, "a bucket index", key=True)
        # (a sum of squares may have overflowed: the bound then falls back, see _rms_eps)
        rms[i] = (torch.tensor(number(e[0], "a sum of squares", finite=False), dtype=torch.float64), None,
                  count(e[1], "an element count"), i in scaled)
    out["rms"] = rms
    scales = {}
    for i, e in scales_in.items():
        if not isinstance(e, (list, tuple)) or len(e) != 2:
            raise ValueError(f"not a cfc_hook state: the scales of bucket {i!r} are {e!r}")
        layout = triples(e[0], "a scales layout")
        values = [number(v, "a scale") for v in _sequence(e[1], "scales")]
        if not all(v > 0 for v in values):
            # (a gradient is divided by its scale: 0 or less would reach every rank as NaN)
            raise ValueError(f"not a cfc_hook state: bucket {i!r} has a scale that is not positive")
        if len(values) != len(layout):
            raise ValueError(f"not a cfc_hook state: bucket {i!r} has {len(values)} scales for {len(layout)} parameters")
        scales[count(i, "a bucket index", key=True)] = (layout, torch.tensor(values, dtype=torch.float32))
    out["scales"] = scales
    return out


def _sequence(value: Any, what: str) -> Sequence:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"not a cfc_hook state: {what} is a {type(value).__name__}, not a list")
    return value


def _whole_plain(state: CfcState, sizes: List[int]) -> bool:
    """Whether the trial of ``fallback="auto"`` chose plain all-reduce for every one of a
    tensor's chunks (of ``sizes`` elements; those below ``min_compress_numel`` are always
    plain): :class:`cfc.distributed.AllReducer` then reduces it in one call."""
    if state.fallback != "auto" or state._phase() != "run" or state._trial or state._pending:
        return False
    decisions = state._decisions  # set once, when the trial ends (the caller waited for it)
    return all(
        n < state.min_compress_numel or (i in decisions and not decisions[i])
        for i, n in enumerate(sizes)
    )


def _plain_whole(state: CfcState, tensor, starts: List[int], step: int):
    """Average ``tensor`` with one plain all-reduce on the caller's stream (over the process
    group itself, in the caller's order of collectives), after sending along what the trial
    left in the chunks' residuals. Returns what to wait for (None: done)."""
    worker = state._worker
    if worker is not None and (worker.pending or state._unflushed):
        worker.drain()  # no collective of the comm thread may still be in flight
    flat = tensor.view(-1)
    for i, a in enumerate(starts):
        held = state._residuals.get(i)
        if held is not None:
            _flush(state, i, flat[a : a + step], held[1])
        ring = _ring_bytes(min(step, flat.numel() - a) * tensor.element_size(), state.world)
        state._account(False, ring, ring, 0.0, 0.0)
    state.step += 1
    return _average(state, tensor, state.process_group, async_op=True)


def _average(state: CfcState, t, group, async_op: bool = False):
    """Average ``t`` in place over ``group`` (one of the state's two, of the same ranks), plainly:
    inside NCCL for dense CUDA tensors (no second pass over the memory), else a sum and a division.
    Returns the work to wait for when ``async_op`` and NCCL took it, else None (done)."""
    import torch.distributed as dist

    if state._nccl and t.is_cuda and not t.is_sparse:
        return dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
    dist.all_reduce(t, group=group)
    t.div_(state.world)
    return None


def _line_up(state: CfcState, device) -> None:
    """Wait until every rank has reached this bucket (a one-element all-reduce), so that a
    trial's timing is the exchange's alone: ranks reach a bucket at different times (their
    backward passes differ), and that lag would otherwise count against whichever kind of
    exchange the trial step happened to try. Only trial buckets pay it."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1, device=device), group=state.group)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world - 1) * -(-nbytes // world)


def _flush(state: CfcState, index: int, buf, r) -> None:
    """A bucket all-reduced plainly sends its residual along (nothing stays behind)."""
    if r is not None and r.numel() and index in state._unflushed:
        buf.add_(r.to(buf.dtype))
        r.zero_()
        state._unflushed.discard(index)


def _rms_eps(bound: float, rms: float) -> float:
    """The absolute bound of ``rms=bound``; any positive one when the bucket is all zeros."""
    return bound * rms if rms > 0 and math.isfinite(rms) else 1e-30


def _finite_sumsq(x) -> Any:
    import torch

    v = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.dot(v.reshape(-1), v.reshape(-1))


def cfc_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """Compressed all-reduce (average) of one DDP gradient bucket: register it with
    ``ddp.register_comm_hook(CfcState(...), cfc_hook)``.

    Returns a ``torch.futures.Future`` holding the averaged bucket, written in place into
    ``bucket.buffer()``.
    """
    return _average_bucket(state, bucket, for_ddp=True)


def _average_bucket(state: CfcState, bucket, for_ddp: bool) -> Any:
    """:func:`cfc_hook`'s work, for DDP's reducer (``for_ddp``) or for
    :class:`cfc.distributed.AllReducer`. The two differ only in how a failure reaches the
    returned future: the reducer needs a callback's error (:func:`_failed_future`), which
    ``Future.wait()`` raises as a RuntimeError that only names the original; AllReducer's
    ``wait()`` raises the exception itself (``cfc.CfcError``, say)."""
    try:
        if not isinstance(state, CfcState):
            raise TypeError(f"cfc_hook's state must be a cfc.CfcState, got {type(state).__name__}")
        if state._closed:
            raise cfc.CfcError("this CfcState was closed (CfcState.close()); register a new one to go on")
        if state.group is None:
            state._setup()
    except Exception as e:  # noqa: BLE001 - handed to DDP (backward() raises it) or AllReducer
        return _failed_future(e, for_ddp)
    # Each of the bucket's methods lets go of Python's lock, which cfc's comm thread may then
    # hold for a while: each is called once.
    buf, last = bucket.buffer(), bucket.is_last()
    layout = state._ordinals(bucket, buf)
    parts, scatter = state._parts(bucket.index(), buf, layout)
    if state._prune is not None:
        state._prune_buckets([k for k, _, _ in parts])
    for k, _, sub in parts:  # what runs, as a checkpoint made now must record it
        state._layouts[k] = _layout_ordinals(sub)
    if buf.device.type == "cuda":
        return _gpu_bucket(state, last, buf, parts, scatter, for_ddp)
    return _cpu_bucket(state, last, buf, parts, scatter, for_ddp)


def _failed_future(e: BaseException, for_ddp: bool) -> Any:
    """A future that has failed with ``e``. For DDP's reducer (``for_ddp``), as it sees a
    failure: backward() raises a RuntimeError that names ``e``'s type and message.
    (``Future.set_exception`` keeps the exception as the future's value, for Python's
    ``wait()`` to raise; the reducer reads that value as the bucket and reports only "Unable to
    cast <message> to Tensor".) A callback that raises is what marks a future failed where the
    reducer looks. Otherwise (AllReducer) the exception is set, and ``wait()`` raises ``e``
    itself."""
    import torch

    if not for_ddp:
        failed = torch.futures.Future()
        failed.set_exception(e)
        return failed

    def fail(_: Any) -> None:
        raise e

    done = torch.futures.Future()
    failed = done.then(fail)
    done.set_result(None)
    return failed


def register_comm_hook(ddp, state: Optional[CfcState] = None) -> bool:
    """Register :func:`cfc_hook` on a ``DistributedDataParallel`` model, unless it measurably
    cannot pay on this link. Returns whether it registered the hook.

    Any Python comm hook costs host time on every bucket, even one that only calls NCCL's
    all-reduce: on links fast enough that compression never pays (NVLink), the fastest hook is
    no hook. So with ``state.fallback == "auto"`` and CUDA parameters, this first runs the
    hook's own trial on one bucket of the size DDP's largest bucket will have (``bucket_cap_mb``
    or the largest parameter, random values of the parameters' dtype, the slowest rank's time
    deciding, as in training): if plain all-reduce was faster, nothing is registered and DDP
    keeps its built-in all-reduce; otherwise :func:`cfc_hook` is registered and its own trial
    then decides bucket by bucket. What the probe measured is in ``state.probe``. In every
    other case (no ``fallback="auto"``, CPU parameters) it registers the hook directly.

    Call it on every rank, after ``init_process_group`` (the probe is collective, and ranks
    with different options all get a ``cfc.CfcError``). ``state`` defaults to ``CfcState()``;
    its process group defaults to DDP's. Frameworks that register the hook themselves
    (Lightning's ``DDPStrategy(ddp_comm_hook=...)``) get the per-bucket choice only.

    Example::

        >>> # needs an initialised process group and GPUs: not run as a doctest
        >>> state = cfc.CfcState(fallback="auto")  # doctest: +SKIP
        >>> # over NVLink: False, and DDP's own all-reduce stays
        >>> cfc.register_comm_hook(ddp_model, state)  # doctest: +SKIP
        False
    """
    import torch

    from cfc.distributed import AllReducer

    state = state if state is not None else CfcState()
    if not isinstance(state, CfcState):
        raise TypeError(f"state must be a cfc.CfcState, got {type(state).__name__}")
    ddp = getattr(ddp, "_orig_mod", ddp)  # torch.compile(ddp_model) wraps the DDP model
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register_comm_hook takes a DistributedDataParallel model, got {type(ddp).__name__}")
    served = state._model() if state._model is not None else None
    if served is not None and served is not ddp:
        raise ValueError(
            "this CfcState already serves another DDP model: give each model its own (its step "
            "count, residuals and per-bucket choices are that model's)"
        )
    if state.process_group is None and state.group is None:
        state.process_group = ddp.process_group
    elif _group_ranks(state.process_group) != _group_ranks(ddp.process_group):
        # The buckets would be averaged over other ranks than DDP's: replicas would drift apart
        # (or ones DDP keeps apart would be mixed), with no error anywhere.
        raise ValueError(
            f"the state's process group (ranks {_group_ranks(state.process_group)}) is not the DDP "
            f"model's (ranks {_group_ranks(ddp.process_group)}): give CfcState DDP's group, or none"
        )
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if state.fallback != "auto" or not params or not params[0].is_cuda or state.group is not None:
        ddp.register_comm_hook(state, cfc_hook)
        state._model = weakref.ref(ddp)
        return True

    # The probe: a state of the same options (its warm-up: one plain call, to set NCCL up;
    # at least two timed calls each way, since the first compressed one also compiles the
    # kernels), on a bucket of the largest size DDP will make. It runs over DDP's process group
    # itself (nothing else uses it now), so no communicator is made or destroyed for it.
    probe = CfcState(
        state.process_group, **{state.bound_kind: state.bound}, error_feedback=state.error_feedback,
        warmup_steps=1, min_compress_numel=state.min_compress_numel, fallback="auto",
        trial_steps=max(4, state.trial_steps), algorithm=state.algorithm, timeout=state.timeout,
    )
    probe._setup(own_communicator=False)
    dev, dtype = params[0].device, params[0].dtype
    cap = max(1, ddp.bucket_bytes_cap // params[0].element_size())
    n = min(sum(p.numel() for p in params), max(cap, max(p.numel() for p in params)))
    gen = torch.Generator(device=dev).manual_seed(1234 + probe.rank)
    values = (torch.randn(n, device=dev, generator=gen) * 1e-3).to(dtype)
    x = torch.empty_like(values)
    reducer = AllReducer(probe, chunk_numel=n)
    try:
        for _ in range(probe.warmup_steps + probe.trial_steps):
            x.copy_(values)  # the same gradient-like values each time (a call averages in place)
            reducer(x).wait()
        probe._decide()
    finally:
        if probe._worker is not None:
            probe._worker.stop()
    plain, compressed = probe._trial_times.get(0, (math.nan, math.nan))
    register = probe._decisions.get(0, False)
    state.probe = {"numel": n, "dtype": _dtype_name(dtype), "plain_seconds": plain,
                   "compressed_seconds": compressed, "registered": bool(register)}
    logger.info("cfc: probe of %d-element buckets: plain %.3f ms, compressed %.3f ms: %s", n, 1e3 * plain,
                1e3 * compressed, "cfc_hook registered" if register else "DDP's own all-reduce kept")
    if register:
        ddp.register_comm_hook(state, cfc_hook)
        state._model = weakref.ref(ddp)
    return bool(register)


def _layout_ordinals(layout) -> Optional[tuple]:
    """The parameter ordinals of a bucket's ``(ordinal, offset, numel)`` layout (None: none),
    what ``_layouts``, the trial's times and its choices compare."""
    return None if layout is None else tuple(o for o, _, _ in layout)


def _key_bucket(key) -> int:
    """The bucket a per-exchange key names: the bucket's index, or the reduce-scatter's
    ``("shard", index)`` and ``("sum", index)``."""
    return key[1] if isinstance(key, tuple) else key


def _bucket_kind(buf) -> str:
    """A bucket's kind as messages name it: its dtype, with "sparse" before it for sparse
    gradients."""
    return f"sparse {buf.dtype}" if buf.is_sparse else str(buf.dtype)


def _group_ranks(group: Any) -> List[int]:
    """The global ranks of ``group`` (None: the world)."""
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


# ---- CPU buckets: the Rust collective, on the autograd thread ----


def _cpu_bucket(state: CfcState, last: bool, buf, parts, scatter, for_ddp: bool) -> Any:
    import torch

    try:
        if not state._agreed:
            state._agree(buf.device)
        for index, flat, layout in parts:
            _cpu_part(state, index, flat, layout)
        if scatter is not None:
            scatter()
        state._end_of_bucket(last)
    except Exception as e:  # noqa: BLE001 - handed to DDP (backward() raises it) or AllReducer
        return _failed_future(e, for_ddp)
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _cpu_part(state: CfcState, index: int, buf, layout) -> None:
    import torch.distributed as dist

    n = state._numel(buf)
    if state._trial and state._phase() == "run":
        state._decide(again=True)  # the step's first bucket after the trial: before its choice
    compress = state._compress_this(n)
    trial = state._phase() == "trial" and n >= state.min_compress_numel
    if trial:
        _line_up(state, buf.device)
    t0 = time.perf_counter()
    if compress is None:
        compress = state._decision(index)
    r = state._residual(index, layout, buf) if state._feeds(n) else None
    ring = _ring_bytes(buf.numel() * buf.element_size(), state.world)
    if compress:
        scaled = _per_tensor(state, index, layout, buf, r)
        x, xr = (buf, r) if scaled is None else (scaled.y, scaled.z)
        kind, bound = state.bound_kind, state.bound
        if kind == "rms":
            ss = _finite_sumsq(x if scaled is not None or r is None else x.float() + r).reshape(1).double()
            dist.all_reduce(ss, group=state.group)
            rms = math.sqrt(float(ss) / (buf.numel() * state.world))
            kw = {"eps": _rms_eps(bound, rms)}
        else:
            kw = {kind: bound}
        if r is not None:
            state._unflushed.add(index)
        y, report = cfc.distributed.all_reduce(
            x, average=True, residual=xr, group=state.group, algorithm=state.algorithm, **kw
        )
        x.copy_(y)
        if xr is not None and xr.numel():
            state._stats["max_error"] = max(state._stats["max_error"], float(xr.abs().max()))
        if scaled is not None:
            scaled.finish(buf, r)
        sent, eps = report["bytes_sent"], report["eps"]
    else:
        _flush(state, index, buf, r)
        _average(state, buf, state.group)
        sent, eps = ring, 0.0
    seconds = time.perf_counter() - t0
    state._account(compress, sent, ring, eps, seconds)
    if trial:
        state._record_trial(index, compress, seconds, buf.device, layout)


# ---- CUDA buckets: the comm thread ----


class _CommThread:
    """One thread that runs every CUDA bucket's exchange in the order the hook queued them (so
    all ranks issue their collectives in the same order), on a CUDA stream of its own.

    A compressed part runs in stages: *launch* (compress, all-gather the frames) and *finish*
    (wait for the frame sizes, decode, average). A part's finish runs after the launches of
    the next ``depth`` parts (default 1), so those buckets are on the wire while this thread
    waits for its sizes. A ``flush`` item at each step's last bucket finishes everything. The
    reduce-scatter has one more stage (its finish sends the shard's sum; the stage after it
    waits for the sums), which again waits for ``depth`` launches. The order of the
    collectives depends only on the order of the items, never on timing.
    """

    def __init__(self, state: CfcState, device, depth: int = _PIPELINE_DEPTH):
        import torch

        self.state = state
        self.device = device
        self.depth = max(1, int(depth))
        self.launched = 0  # parts launched so far: each deferred stage waits for `depth` more
        self.stream = torch.cuda.Stream(device)
        # Where each frame exchange's sizes are copied to the host: a stream that waits for that
        # exchange alone, so that this thread's stream (the next bucket's compression, the last
        # one's decoding) need not wait for the wire.
        self.sizes_stream = torch.cuda.Stream(device)
        self.raw_stream = self.stream.cuda_stream  # the handle native calls take
        self._caller_stream: Any = None  # (caller_stream)
        self.sum_ws = torch.empty(_native.CUDA_SUM_SQUARES_WORKSPACE, dtype=torch.uint8, device=device)
        # bucket -> (pinned float64 scalar, event): where its sum of squares goes (_sum_squares)
        self.sums: Dict[int, Tuple[Any, Any]] = {}
        # exchange (a bucket, or the reduce-scatter's ("sum", bucket)) -> (pinned int64 per rank,
        # event): where its frame sizes go (_FrameExchange)
        self.sizes: Dict[Any, Tuple[Any, Any]] = {}
        # Batches of items, one per hand-over (a bucket's items go together). A SimpleQueue:
        # putting takes no lock that this thread may hold, so the autograd thread does not
        # block on a hand-over. Hand-overs queued (counted under a lock of the submitting
        # threads', which this thread never takes) and handled (written by this thread only).
        self.jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.counting = threading.Lock()
        self.queued = 0
        self.handled = 0
        self.failed: Optional[BaseException] = None
        # (parts launched when it was queued, closure, future or None), in order
        self.deferred: List[Tuple[int, Any, Any]] = []
        # After a failure: stages that will not run, and buffers of an exchange that did not
        # finish. The GPU may still write into their buffers (an all-gather in flight), so they
        # are let go only by drain(), after the device is idle.
        self.kept: List[Any] = []
        self.thread = threading.Thread(target=self._run, name="cfc-comm", daemon=True)
        self.thread.start()

    def caller_stream(self, device) -> Any:
        """The hook's current stream on ``device`` (the autograd thread's), as a
        ``torch.cuda.Stream``: the one made last time while the stream is the same.
        (``torch.cuda.current_stream`` makes a new one in several calls, each of which may let
        go of Python's lock, and the comm thread may hold it for a while.)"""
        import torch

        raw = torch._C._cuda_getCurrentRawStream(device.index)
        held = self._caller_stream
        if held is None or held.cuda_stream != raw:
            held = self._caller_stream = torch.cuda.current_stream(device)
        return held

    def submit(self, kind: str, work=None, fut=None) -> None:
        """Queue an item: ``("part", launch)``: ``launch()`` returns the part's finish (or
        None); ``("done", value, fut)``: ``fut`` gets ``value()`` once the earlier parts are
        finished; ``("flush",)``: finish everything queued so far; ``("sync", set)``: call
        ``set()`` once everything queued before is handled."""
        self.submit_all([(kind, work, fut)])

    def submit_all(self, items: List[Tuple[str, Any, Any]]) -> None:
        """Queue several items (``(kind, work, fut)``, as :meth:`submit`) in one hand-over."""
        with self.counting:
            self.queued += 1
            self.jobs.put(items)

    @property
    def pending(self) -> int:
        """Hand-overs queued and not yet handled."""
        return self.queued - self.handled

    def drain(self) -> None:
        """Wait until every queued bucket has been handed to the GPU, then for the GPU (the
        state's pipeline's buckets too)."""
        import torch

        pipeline = getattr(self.state, "_pipeline", None)
        if pipeline is not None:
            pipeline.sync()
        if self.thread.is_alive():
            handled = threading.Event()
            self.submit("sync", handled.set)
            # (a thread that was stopped before the marker never sets it)
            while not handled.wait(timeout=1.0) and self.thread.is_alive():
                pass
        self.stream.synchronize()
        self.sizes_stream.synchronize()
        torch.cuda.synchronize(self.device)
        self.kept.clear()

    def stop(self) -> None:
        """End the thread once everything queued before is done (without waiting for it)."""
        self.submit("stop")

    def _fail(self, e: BaseException) -> None:
        """Note the first failure: every later stage then fails with it. Its traceback is
        logged here, since backward() shows only its type and message (the bucket's future
        fails through :func:`_bucket_of`)."""
        if self.failed is None:
            self.failed = e
            rank = getattr(self.state, "rank", "?")
            logger.error("cfc: the comm thread failed on rank %s", rank, exc_info=e)

    def _run_deferred(self, items) -> None:
        """Run deferred stages in order. A stage may return a further stage (a callable): that
        one waits for ``depth`` more launches, so it and everything after it go back to the
        front of the queue (a bucket's future is set only after all its stages)."""
        for k, (_, work, fut) in enumerate(items):
            try:
                if self.failed is not None:
                    self.kept.append(work)
                    raise cfc.CfcError(f"cfc_hook failed: {self.failed}")
                value = work()
                if fut is not None:
                    fut.set_result(value)  # records an event on this stream for DDP
                elif callable(value):
                    self.deferred = [(self.launched, value, None)] + list(items[k + 1 :]) + self.deferred
                    return
            except BaseException as e:  # noqa: BLE001 - reaches backward() through the future
                self._fail(e)
                if fut is not None:
                    fut.set_exception(e)

    def _due(self) -> List[Tuple[int, Any, Any]]:
        """Take the deferred stages whose ``depth`` launches have happened (a prefix: nothing
        overtakes an earlier stage)."""
        k = 0
        while k < len(self.deferred) and self.deferred[k][0] <= self.launched - self.depth:
            k += 1
        due, self.deferred = self.deferred[:k], self.deferred[k:]
        return due

    def _run(self) -> None:
        import torch

        torch.cuda.set_device(self.device)
        while True:
            items = self.jobs.get()
            try:
                with torch.cuda.stream(self.stream):
                    for kind, work, fut in items:
                        if kind == "stop":
                            return
                        self._handle(kind, work, fut)
            finally:
                self.handled += 1

    def _handle(self, kind: str, work, fut) -> None:
        """One item of a hand-over (see :meth:`submit`)."""
        if kind == "part":
            finish = None
            try:
                if self.failed is None:
                    finish = work()
            except BaseException as e:  # noqa: BLE001 - reaches backward() through the future
                self._fail(e)
            self.launched += 1
            self._run_deferred(self._due())
            if finish is not None:
                self.deferred.append((self.launched, finish, None))
        elif kind == "done":
            self.deferred.append((self.launched, work, fut))
        elif kind == "flush":
            while self.deferred:
                earlier, self.deferred = self.deferred, []
                self._run_deferred(earlier)
        else:  # sync: everything queued before is handled
            work()


def _gpu_bucket(state: CfcState, last: bool, buf, parts, scatter, for_ddp: bool) -> Any:
    dev = buf.device
    worker = state._worker
    if worker is None:  # once: the lock only then (the comm thread takes it too)
        with state._lock:
            if state._worker is None:
                state._worker = _CommThread(state, dev, state._pipeline_depth)
            worker = state._worker
    try:
        return _gpu_submit(state, worker, last, buf, parts, scatter, for_ddp)
    except Exception as e:  # noqa: BLE001 - handed to DDP (backward() raises it) or AllReducer
        if last:  # the step's earlier buckets must still complete
            worker.submit("flush")
            state._end_of_bucket(last)
        return _failed_future(e, for_ddp)


def _gpu_submit(state: CfcState, worker, last: bool, buf, parts, scatter, for_ddp: bool) -> Any:
    import torch

    dev = buf.device
    if worker.device != dev:
        raise ValueError(f"cfc_hook drives one GPU per process; buckets on {worker.device} and {dev}")
    if not state._agreed:  # once, before any collective: a disagreement never hangs
        state._agree(dev)
    if state._trial and state._phase() == "run":
        # The trial is over: decide now, on this thread, at the first bucket of the step, so
        # that every rank knows every bucket's choice before the step's first collective
        # (the earlier steps' buckets are all done: DDP waited for them).
        state._decide(state.process_group, again=True)
    if _fast_step(state):
        # The whole bucket, even where a loaded checkpoint would split it into parts (plain
        # all-reduce is element-wise) or a bucket the trial never timed: nothing of this step
        # may go through cfc's communicator.
        return _gpu_plain(state, worker, last, buf)
    if _pipeline_step(state, worker, for_ddp):
        return _pipeline_submit(state, worker, last, buf, parts, scatter)
    ready = torch.cuda.Event()
    jobs = []
    for index, flat, layout in parts:
        n = state._numel(flat)
        compress = state._compress_this(n)
        trial = state._phase() == "trial" and n >= state.min_compress_numel
        r = state._residual(index, layout, flat) if state._feeds(n) else None
        jobs.append((index, flat, layout, r, compress, trial))
    ready.record(worker.caller_stream(dev))  # after the residuals and any gathers
    fut = torch.futures.Future(devices=[dev])

    def value():
        if last:  # no optimizer step on a bad frame: the step's backward() raises
            _check_decoded(state, worker)
        if scatter is not None:
            scatter()
        return buf

    # The bucket's items in one hand-over: its parts, its future, and at the step's last
    # bucket the flush.
    items = [("part", lambda job=job: _gpu_launch(state, worker.stream, *job, ready), None) for job in jobs]
    items.append(("done", value, fut))
    if last:
        items.append(("flush", None, None))
    # What DDP holds is a callback's future: a failure on the comm thread can only reach
    # ``fut`` through ``set_exception``, which DDP's reducer would read as the bucket ("Unable
    # to cast ... to Tensor"); the callback raises it instead, and so backward() names it.
    # (AllReducer holds ``fut`` itself: its wait() raises the exception as it was.)
    held = fut.then(_bucket_of) if for_ddp else fut
    # The hand-over comes last: it wakes the comm thread, which then takes Python's lock at
    # every torch call that lets go of it. Nothing after it here lets go of the lock.
    worker.submit_all(items)
    state._end_of_bucket(last)
    return held


def _bucket_of(fut) -> Any:
    """The bucket that the comm thread set on ``fut``, or the exception it set, raised."""
    return fut.value()


def _fast_step(state: CfcState) -> bool:
    """Whether this step's CUDA buckets go out from the autograd thread: decided at the step's
    first bucket, for the whole step, so that a step never mixes DDP's communicator and cfc's
    (NCCL requires one order of operations across communicators, which two threads cannot
    keep). Only steps in which no bucket is compressed qualify: the warm-up, and with
    ``fallback="auto"`` once every bucket was found faster plain; and only when no residual
    is waiting to be sent along (those go through the comm thread once). Everything read here
    is the same on every rank at a step's first bucket (DDP waited for the step before)."""
    step, fast = state._fast_step
    if step != state.step:
        phase = state._phase()
        decisions = state._decisions
        all_plain = phase == "warmup" or (
            phase == "run" and state.trial_steps > 0 and bool(decisions) and not any(decisions.values())
        )
        fast = state._nccl and all_plain and not state._unflushed and not state._pending
        state._fast_step = (state.step, fast)
    return fast


def _pipeline_step(state: CfcState, worker, for_ddp: bool) -> bool:
    """Whether this step's CUDA buckets go through the state's :class:`_native.BucketPipeline`
    rather than the comm thread: decided at the step's first bucket, for the whole step (the
    two must never issue collectives at once). The steps of the run phase whose compressed
    buckets take the native exchange, without ``per_tensor``, for DDP (whose reducer reads the
    buckets only once the step's last bucket is done; :class:`cfc.distributed.AllReducer`
    waits for each future), once no bucket of a kind it does not take (float64 or sparse
    gradients) has been seen. Everything read here is the same on every rank at a step's first
    bucket."""
    step, on = state._pipeline_step
    if step != state.step:
        on = (
            for_ddp
            and state._use_pipeline
            and state._exchange is not None
            and not state.per_tensor
            and state._phase() == "run"
            and not state._trial
            # (a kind of bucket it does not take was seen: float64 or sparse, sent plainly)
            and not state._plain_kinds
        )
        if on and worker.pending:  # the comm thread's last step is still closing: let it end
            worker.drain()
        state._pipeline_step = (state.step, on)
    return on


def _pipeline_submit(state: CfcState, worker, last: bool, buf, parts, scatter) -> Any:
    """A bucket of a pipeline step (:func:`_pipeline_step`): its parts are handed to the
    pipeline's thread, and the future returned is already complete. DDP reads the buckets only
    after the step's last bucket, and this waits there (:meth:`_native.BucketPipeline.end_step`)
    until every bucket is averaged and checked, then writes the parts back into their buckets on
    this stream: the reducer's copies into the gradients and the optimizer come after."""
    import torch

    pipe = state._pipeline
    if pipe is None:
        pipe = state._pipeline = _native.BucketPipeline(state._exchange, _reciprocal(state.world))
    dev = buf.device
    stream = torch._C._cuda_getCurrentRawStream(dev.index)
    try:
        for index, flat, layout in parts:
            _pipeline_part(state, worker, pipe, stream, index, flat, layout)
        if scatter is not None:
            state._pipeline_scatters.append(scatter)
    except BaseException:
        if last:  # the step's earlier buckets are finished all the same
            state._pipeline_scatters = []
            try:
                pipe.end_step()
            except Exception:  # noqa: BLE001 - the first error is the one raised
                pass
        raise
    if last:
        scatters, state._pipeline_scatters = state._pipeline_scatters, []
        report = pipe.end_step()  # raises a bucket's failure: no optimizer step on it
        with state._lock:
            s = state._stats
            s["bytes_sent"] += report["bytes_sent"]
            s["resends"] += report["resends"]
            s["seconds"] += report["seconds"]
            s["eps"] = max(s["eps"], report["eps"])
        state._slots.update(report["slots"])
        for write_back in scatters:
            write_back()
    fut = torch.futures.Future()
    fut.set_result(buf)
    state._end_of_bucket(last)
    return fut


def _pipeline_part(state: CfcState, worker, pipe, stream: int, index: int, flat, layout) -> None:
    """One part of a pipeline step's bucket, handed to the pipeline after what this stream
    queued so far (its gradient, its residual's placement, a flush): the same choices, bounds
    and bookkeeping as :func:`_gpu_launch` and :func:`_exchange_launch` make on the comm
    thread, so that the two give the same bits."""
    n = flat.numel()
    if state._numel(flat) != n:
        # (Its plain all-reduce is the native exchange's, which averages the three float types.)
        raise cfc.CfcError("the bucket pipeline takes dense float32, bfloat16 and float16 buckets, not "
                           + _bucket_kind(flat))
    compress = state._compress_this(n)
    if compress is None:  # the trial is decided (_pipeline_step)
        compress = state._decisions.get(index, True)
    r = state._residual(index, layout, flat) if state._feeds(n) else None
    ring = _ring_bytes(n * flat.element_size(), state.world)
    name = _dtype_name(flat.dtype)
    if not compress:
        _flush(state, index, flat, r)
        pipe.submit(index, stream, flat.data_ptr(), n, name, 0, compress=False)
        state._account(False, 0, ring, 0.0, 0.0)  # the bytes sent come with the step's report
        return
    _check_compressible(flat)
    sum_out = 0
    if state.bound_kind == "rms":
        rms = _last_rms(state, index, n, False)  # read before this step's sum overwrites it
        host, _ = worker.sums.get(index) or _pinned_sum(worker, index)
        # No event: the pipeline's end_step waits for the copy.
        state._rms[index] = (host, None, n, False)
        sum_out = host.data_ptr()
        # Without a sum of the step before, the pipeline measures this step's (and waits).
        kw = {"rms": state.bound} if rms is None else {"eps": _rms_eps(state.bound, rms)}
    else:
        kw = {"eps": float(state.bound)}
    if r is not None:
        state._unflushed.add(index)
    target = _max_error_ptr(state, r, flat.device)
    pipe.submit(
        index, stream, flat.data_ptr(), n, name, 0 if r is None else r.data_ptr(), compress=True,
        sum_out_ptr=sum_out, slot=state._slots.get(index, 0), max_error_ptr=target, **kw,
    )
    state._account(True, 0, ring, kw.get("eps", 0.0), 0.0)


def _gpu_plain(state: CfcState, worker, last: bool, buf) -> Any:
    """A bucket of a step with nothing to compress (:func:`_fast_step`): averaged by NCCL over
    the process group itself, in the autograd thread's order of collectives, with no hand-over
    to the comm thread."""

    state._numel(buf)  # notes a kind of bucket cfc does not compress: the pipeline then stays off
    ring = _ring_bytes(buf.numel() * buf.element_size(), state.world)
    work = _average(state, buf, state.process_group, async_op=True)  # NCCL: _fast_step's rule
    state._account(False, ring, ring, 0.0, 0.0)
    with state._lock:
        state._stats["direct_buckets"] += 1
    if last:  # ends the step on the comm thread too (nothing is queued there)
        worker.submit("flush")
    state._end_of_bucket(last)
    if work is None:  # a sparse bucket: summed, and divided, already
        import torch

        done = torch.futures.Future(devices=[buf.device])
        done.set_result(buf)
        return done
    return work.get_future().then(lambda fut: fut.value()[0])


def _exchange_fits(state: CfcState) -> bool:
    """Whether the state's compressed CUDA buckets can take the native exchange: on a
    communicator of cfc's own (not :func:`register_comm_hook`'s probe, which borrows DDP's group
    and makes no communicator), with one bound for all ranks' grids known on the host (``eps``
    or ``rms``; a ``rel`` bound is read from each frame), and the all-gather of frames (the
    reduce-scatter keeps its exchange over torch.distributed, so that one communicator carries
    every compressed bucket). The same on every rank (the options were agreed)."""
    if state.group is state.process_group or state.bound_kind == "rel":
        return False
    return _cuda_algorithm(state) == "all-gather"


def _open_exchange(state: CfcState, device) -> Any:
    """cfc's own NCCL communicator for the compressed exchanges (:class:`_native.BucketExchange`),
    made by every rank at the same point (the first bucket of the first step, on the autograd
    thread, before any other collective of the comm thread). Returns None on every rank when
    any rank cannot load NCCL: the exchange then goes through torch.distributed everywhere."""
    import torch
    import torch.distributed as dist

    try:
        _native.nccl_version()  # loads the library, as the communicator will
        ok = 1.0
    except Exception as e:  # noqa: BLE001 - every rank learns it below and all take the other way
        logger.warning("cfc: no native exchange on rank %d (%s): using torch.distributed", state.rank, e)
        ok = 0.0
    flag = torch.tensor([ok], dtype=torch.float32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=state.group)
    if flag.item() < 1.0:
        return None
    box: List[Any] = [None]
    if state.rank == 0:
        try:
            box[0] = ("id", _native.nccl_unique_id())
        except Exception as e:  # noqa: BLE001 - sent to every rank, which all raise it
            box[0] = ("error", str(e))
    dist.broadcast_object_list(box, src=dist.get_global_rank(state.group, 0), group=state.group)
    kind, value = box[0]
    if kind != "id":
        raise cfc.CfcError(f"rank 0 could not make an NCCL id for cfc's exchange: {value}")
    timeout = None if state.timeout is None else state.timeout.total_seconds()
    return _native.BucketExchange(device.index, value, state.rank, state.world, timeout=timeout)


def _fence(state: CfcState, stream) -> None:
    """Before a collective of torch.distributed on the comm thread's ``stream``: with the native
    exchange, make the stream wait for the exchanges queued before it, so that every GPU meets
    the two communicators' collectives in the one order all ranks issued them."""
    if state._exchange is not None:
        state._exchange.fence(stream.cuda_stream)


def _max_error_target(state: CfcState, device) -> Any:
    """The device's running maximum of the error sent (0-d float64, read by :meth:`CfcState.stats`)."""
    import torch

    held = state._max_err_dev.get(device)
    if held is None:
        with state._lock:
            held = state._max_err_dev[device] = torch.zeros((), dtype=torch.float64, device=device)
    return held


def _max_error_ptr(state: CfcState, r, device) -> int:
    """Where a native call raises the running maximum of the error sent with residual ``r``:
    the address of :func:`_max_error_target`, or 0 for no residual (or an empty one)."""
    return 0 if r is None or not r.numel() else _max_error_target(state, device).data_ptr()


def _record_stream(t, stream) -> None:
    """``t.record_stream(stream)``, for a sparse tensor on its indices and values (sparse
    tensors have no record_stream of their own)."""
    if t.is_sparse:
        t._indices().record_stream(stream)
        t._values().record_stream(stream)
    else:
        t.record_stream(stream)


def _check_compressible(buf) -> None:
    """Refuse a CUDA bucket that cfc_hook cannot compress (the comm thread's and the pipeline's
    one check)."""
    import torch

    if buf.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not _cuda_ready(buf):
        raise cfc.CfcError(
            f"cfc_hook compresses float32, bfloat16 and float16 buckets on GPUs of compute capability 8.0 or "
            f"newer; this one holds {buf.dtype} on {buf.device}"
        )


def _gpu_launch(state: CfcState, stream, index, buf, layout, r, compress, trial, ready):
    """A part's first stage, on the comm thread under ``torch.cuda.stream(stream)``: queue its
    all-reduce, or its compression and frame exchange. Returns the second stage (or None)."""
    t0 = time.perf_counter()
    if trial:
        _fence(state, stream)  # (_line_up below)
        if not compress:
            # What the step before left in the residual goes along untimed: after the trial
            # only the first plain step does that, but every plain trial step would, which
            # would count against plain.
            stream.wait_event(ready)
            _flush(state, index, buf, r)
        ready.synchronize()  # time the exchange alone
        _line_up(state, buf.device)  # (also waits for this stream: the flush)
        t0 = time.perf_counter()
    stream.wait_event(ready)
    _record_stream(buf, stream)
    world, n = state.world, buf.numel()
    ring = _ring_bytes(n * buf.element_size(), world)
    if compress is None:  # every trial bucket was timed before this one (FIFO): decide
        if state._trial:
            _fence(state, stream)  # (_decide's collective)
        compress = state._decision(index)

    busy = [0.0]  # seconds this thread spent on the part, outside the wait for the next bucket

    def account(compressed, sent, eps):
        if trial:
            stream.synchronize()
        seconds = time.perf_counter() - t0 if trial else busy[0]
        state._account(compressed, sent, ring, eps, seconds)
        if trial:
            state._record_trial(index, compressed, seconds, buf.device, layout)

    if not compress:
        _flush(state, index, buf, r)
        if r is not None:
            r.record_stream(stream)
        _fence(state, stream)
        _average(state, buf, state.group)
        busy[0] = time.perf_counter() - t0
        account(False, ring, 0.0)
        return None

    _check_compressible(buf)
    scaled = _per_tensor(state, index, layout, buf, r)
    x, xr = (buf, r) if scaled is None else (scaled.y, scaled.z)  # what is compressed, and its residual
    units = scaled is not None and scaled.vec is not None  # x is in per_tensor's scaled units

    if _reduce_scatter(state, n):
        if r is not None:
            state._unflushed.add(index)
        shards = _ShardExchange(state, index, x, xr, units)  # compresses the shards, queues the all-to-all
        busy[0] = time.perf_counter() - t0

        def finish_shards():
            t1 = time.perf_counter()
            shards.send_sum()  # waits for the shard's frames, sums them, queues the all-gather
            busy[0] += time.perf_counter() - t1

            def receive_sums():
                t2 = time.perf_counter()
                sent = shards.receive_sums()  # waits for the sums' sizes, writes x
                _note_max_error(state, x, xr)
                if scaled is not None:
                    scaled.finish(buf, r)
                busy[0] += time.perf_counter() - t2
                account(True, sent, shards.eps)

            return receive_sums

        if trial:
            finish_shards()()
            return None
        return finish_shards

    if state._exchange is not None:
        return _exchange_launch(state, stream, index, x, xr, units, scaled, buf, r, trial, account, busy, t0)

    kind, bound = state.bound_kind, state.bound
    if kind == "rms":
        # The bound follows the RMS of the bucket's previous compressed step (copied to the
        # host a step ago: no wait); the first time, this step's (waits for this stream).
        rms = _last_rms(state, index, n, units)  # read before this step's sum overwrites it
        host, done = _sum_squares(state, index, x, None if scaled is not None else r)
        state._rms[index] = (host, done, n, units)
        if rms is None:
            done.synchronize()
            rms = math.sqrt(float(host) / max(n, 1))
        kw = {"eps": _rms_eps(bound, rms)}
    else:
        kw = {kind: bound}
    if r is not None:
        state._unflushed.add(index)
    # On this stream: residual add, quantize, pack. (cfc.compress without its argument checks:
    # the bucket and its residual are contiguous, of one size, on this device.)
    c = _compress_cuda(x, _dtype_name(x.dtype), tuple(x.shape), kw.get("eps"), kw.get("rel"), None, xr)
    exchange = _FrameExchange(state, index, c, n)

    busy[0] = time.perf_counter() - t0

    def finish():
        t1 = time.perf_counter()
        frames, sent = exchange.finish()
        # Every rank's frame decoded and added in rank order (the same bits on every rank),
        # divided and written into the bucket, in one pass.
        _decode_sum(state, frames, n, c._dtype, x.view(-1), _reciprocal(world))
        _note_max_error(state, x, xr)
        if scaled is not None:
            scaled.finish(buf, r)
        busy[0] += time.perf_counter() - t1
        account(True, sent, float(kw["eps"]) if "eps" in kw else c.eps)  # c.eps: the frame's

    if trial:
        finish()
        return None
    return finish


def _decode_sum(state: CfcState, frames, n: int, dtype: str, out, scale: float) -> None:
    """Every rank's frame decoded and added into ``out`` (:func:`_decode_sum_cuda`), on the
    current stream, with the state's status. A frame from elsewhere that fails its check on the
    GPU leaves ``out`` as it was, as every later decoding does; the status is copied to the host
    without a wait, and read only after one (:func:`_check_decoded`), as the native exchange's
    is: read earlier, ranks would find it at different buckets, and one that stopped there
    would leave its peers in the next bucket's collectives."""
    import torch

    seen = state._decode_seen
    if seen is None:
        state._decode_status = torch.zeros(2, dtype=torch.int32, device=out.device)
        state._decode_seen = seen = torch.zeros(2, dtype=torch.int32, pin_memory=True)
    _decode_sum_cuda(frames, n, dtype, out, scale, status=state._decode_status)
    seen.copy_(state._decode_status, non_blocking=True)
    state._decoded = True


def _raise_bad_frame(seen) -> None:
    """Raise if the decodings' status, as copied to ``seen`` (pinned: read without a wait),
    reports a frame that failed its check."""
    if int(seen[0]) != 0:
        raise cfc.CfcError(f"a bucket's exchange received a bad frame: {_decode_status_error(seen)}")


def _check_decoded(state: CfcState, worker) -> None:
    """At the step's last bucket, before its future completes (on the comm thread): wait for this
    thread's stream, and raise if a frame decoded so far failed its check on the GPU. This is
    the one place the status is read: after the wait, every rank has decoded the same frames
    and so raises here alike, before any optimizer step runs on a bucket left undecoded (and
    again at every later step: nothing more is decoded). The wait is for the step's last
    decoding, which the copies DDP queues into the gradients wait for anyway: it costs the host
    a round trip per step, and nothing where no bucket was decoded."""
    if not state._decoded:
        return
    state._decoded = False
    worker.stream.synchronize()
    if state._exchange is not None:
        state._exchange.check()
    if state._decode_seen is not None:
        _raise_bad_frame(state._decode_seen)


def _exchange_launch(state: CfcState, stream, index, x, xr, units, scaled, buf, r, trial, account, busy, t0):
    """A compressed part through the native exchange (:class:`_native.BucketExchange`): one call
    queues the sum of squares of the next step's bound, the compression and the all-gather;
    the returned finish makes one call that waits for the sizes and queues the average (a
    second, with larger rows, when a frame outgrew its slot). The same frames, bounds and
    results as the exchange over torch.distributed, in two calls instead of about 25; its slots
    follow ``cfc::bucket_exchange::next_slot`` and its scratch ``ScratchLayout``."""
    import torch

    worker, ex = state._worker, state._exchange
    dev, n, world = x.device, x.numel(), state.world
    name = _dtype_name(x.dtype)
    sum_ws = sum_out = 0
    if state.bound_kind == "rms":
        rms = _last_rms(state, index, n, units)  # read before this step's sum overwrites it
        if rms is None:  # the first time: this step's own, waited for
            host, done = _sum_squares(state, index, x, xr)
            state._rms[index] = (host, done, n, units)
            done.synchronize()
            rms = math.sqrt(float(host) / max(n, 1))
        else:
            host, _ = worker.sums.get(index) or _pinned_sum(worker, index)
            # No event: the copy precedes the all-gather, which this bucket's finish waits for,
            # and the next step reads the sum only after that finish.
            state._rms[index] = (host, None, n, units)
            sum_ws, sum_out = worker.sum_ws.data_ptr(), host.data_ptr()
        eps = _rms_eps(state.bound, rms)
    else:
        eps = float(state.bound)
    if xr is not None:
        state._unflushed.add(index)
        xr.record_stream(stream)  # made on the autograd thread's stream, read and written here
    # This rank's row, every rank's rows, then the workspace, in one allocation, placed as the
    # pipeline places them (the same frames and slots on both ways).
    at = _native.BucketExchange.scratch_layout(n, name, eps, xr is not None, state._slots.get(index, 0), world)
    slot, ws_at, ws_len = at["slot"], at["workspace_at"], at["workspace_len"]
    mem = torch.empty(at["len"], dtype=torch.uint8, device=dev)
    base = mem.data_ptr()
    # The compressor raises the running maximum of the error sent with the residual it leaves.
    target = _max_error_ptr(state, xr, dev)
    try:
        ex.launch(index, stream.cuda_stream, x.data_ptr(), n, name, 0 if xr is None else xr.data_ptr(), base,
                  at["capacity"], base + ws_at, ws_len, sum_ws, sum_out, slot, base + at["recv_at"], target, eps=eps)
    except BaseException:
        worker.kept.append(mem)  # the all-gather may be queued: see _CommThread.kept
        raise
    busy[0] = time.perf_counter() - t0

    def finish():
        t1 = time.perf_counter()
        scale = _reciprocal(world)
        # (`mem` is referenced here so that it lives until the decoding is queued; the caching
        # allocator reuses it only for work queued on this stream after that.)
        args = (index, stream.cuda_stream, scale, mem.data_ptr() + ws_at, ws_len)
        rows = None
        try:
            need, sent, slot_next = ex.finish(*args)
            if need:  # a frame outgrew its slot (every rank sees it): all frames again, whole
                rows = torch.empty(world * need, dtype=torch.uint8, device=dev)
                need, sent, slot_next = ex.finish(*args, rows.data_ptr())
                if slot:
                    with state._lock:
                        state._stats["resends"] += 1
        except BaseException:
            worker.kept.extend((mem, rows))  # the all-gather may still be on the wire
            raise
        state._slots[index] = slot_next
        state._decoded = True
        if scaled is not None:
            scaled.finish(buf, r)
        busy[0] += time.perf_counter() - t1
        account(True, sent, eps)

    if trial:
        finish()
        return None
    return finish


def _pinned_sum(worker, index: int):
    """The bucket's pinned float64 for its sum of squares (and an event), made once."""
    import torch

    held = worker.sums[index] = (torch.zeros((), dtype=torch.float64, pin_memory=True), torch.cuda.Event())
    return held


def _last_rms(state: CfcState, index: int, n: int, units: bool) -> Optional[float]:
    """The RMS of the bucket's previous compressed step (:func:`_prev_rms`), waiting for its
    copy to the host if it has an event; None where there is none, or it is not positive and
    finite (the caller then takes this step's own)."""
    prev = _prev_rms(state, index, n, units)
    if prev is None:
        return None
    if prev[1] is not None:
        prev[1].synchronize()
    last = float(prev[0])
    return math.sqrt(last / max(n, 1)) if 0 < last < math.inf else None


def _prev_rms(state: CfcState, index: int, n: int, units: bool):
    """The bucket's entry in ``state._rms`` (its previous compressed step's sum of squares), or
    None where that is no measure of this step: another bucket under this index (rebuilt), or
    per_tensor's scales applied then and not now, or now and not then (``units``): a sum of
    values in other units (gradients of RMS 1e-3 against scaled values of RMS about 1). A
    change of units also drops the bucket's slots: its frames change size (a small parameter's
    zeros become codes), and a slot sized from the old ones would be outgrown and the frames
    sent twice. All of this is the same on every rank."""
    prev = state._rms.get(index)
    if prev is None or prev[2] != n:
        return None
    if prev[3] != units:
        state._slots.pop(index, None)
        state._slots.pop(("shard", index), None)
        return None
    return prev


def _sum_squares(state: CfcState, index: int, x, r):
    """Queue the sum of squares of the finite values of ``x + r`` (``r`` may be None) on the
    comm thread's stream, copied to a pinned float64 scalar that the bucket keeps from step to
    step. Returns (that scalar, an event recorded after the copy). One native call (two small
    kernels and the copy) where PyTorch took five operations' host time on every bucket; the
    sum is deterministic, so a resumed run takes the bounds the uninterrupted one took.

    The scalar is the bucket's entry in ``state._rms`` until its next compressed step, which
    reads it (:func:`_prev_rms`) before queueing the copy that overwrites it."""
    worker = state._worker
    host, done = worker.sums.get(index) or _pinned_sum(worker, index)
    dev = x.device
    _native.cuda_sum_squares(
        dev.index, worker.raw_stream, x.data_ptr(), x.numel(), _dtype_name(x.dtype), 0 if r is None else r.data_ptr(),
        worker.sum_ws.data_ptr(), host.data_ptr(),
    )
    done.record(worker.stream)
    return host, done


def _note_max_error(state: CfcState, buf, r) -> None:
    """Raise the largest quantization error sent so far (what the residual kept) by this
    bucket's: a running maximum on the device (one launch, read by :meth:`CfcState.stats`)."""
    if r is not None and r.numel():
        held = _max_error_target(state, buf.device)
        _native.cuda_running_max_abs(buf.device.index, state._worker.raw_stream, r.data_ptr(), r.numel(),
                                     held.data_ptr())


class _PerTensor:
    """A bucket under ``per_tensor``: each parameter's slice of ``x + r`` divided by that
    parameter's scale (``y``, float32), a zeroed residual in those units (``z``); the exchange
    runs on them, and :meth:`finish` multiplies the average back into the bucket, puts the new
    residual back in gradient units and keeps the next step's scales, from the average (the
    same bits on every rank). Queued on the current stream, as the exchange around it."""

    FLOOR = 0.01  # a scale is at least this times the bucket's RMS

    def __init__(self, state: CfcState, index: int, layout, buf, r):
        import torch

        self.state, self.index, self.layout = state, index, layout
        dev, n = buf.device, buf.numel()
        key = (layout, dev)
        if key not in state._counts:
            state._counts[key] = torch.tensor([k for _, _, k in layout], dtype=torch.int64, device=dev)
        self.counts = state._counts[key]
        held = state._scales.get(index)
        self.vec = None  # the scale of every element (None: all 1)
        if held is not None and held[0] == layout:
            self.vec = torch.repeat_interleave(held[1].to(dev), self.counts, output_size=n)
        self.y = buf.float() + r if r is not None else buf.float().clone()
        if self.vec is not None:
            self.y.div_(self.vec)
        self.z = torch.zeros_like(self.y) if r is not None else None

    def finish(self, buf, r) -> None:
        import torch

        if self.vec is not None:
            self.y.mul_(self.vec)
        buf.copy_(self.y)
        if r is not None:
            if self.vec is not None:
                torch.mul(self.z, self.vec, out=r)
            else:
                r.copy_(self.z)
        # The next step's scales: each parameter's RMS in the average, at least FLOOR x the
        # bucket's; where that is not a positive finite number (a NaN step), 1.
        views = [self.y[off : off + k] for _, off, k in self.layout]
        norms = torch.stack(torch._foreach_norm(views)).double()
        sizes = self.counts.double()
        rms = norms / sizes.sqrt()
        whole = (norms.square().sum() / sizes.sum()).sqrt()
        scale = torch.maximum(rms, self.FLOOR * whole).float()  # (a tiny one may round to 0 here)
        scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.ones_like(scale))
        self.state._scales[self.index] = (self.layout, scale)


def _per_tensor(state: CfcState, index: int, layout, buf, r) -> Optional[_PerTensor]:
    """The bucket's :class:`_PerTensor`, where ``per_tensor`` applies (a bucket whose
    parameters tile it, with more than one of them)."""
    if not state.per_tensor or layout is None or len(layout) < 2:
        return None
    return _PerTensor(state, index, layout, buf, r)


def _reciprocal(world: int) -> float:
    """1 / world rounded to float32, as torch's ``div_(world)`` multiplies by it on the GPU."""
    return float(np.float32(1.0) / np.float32(world))


def _cuda_algorithm(state: CfcState) -> str:
    """How compressed CUDA buckets move: the ``algorithm`` option, or cfc's choice (the
    all-gather for 2 ranks or a ``rel`` bound, else the reduce-scatter)."""
    if state.algorithm is not None:
        return state.algorithm
    return "all-gather" if state.world <= 2 or state.bound_kind == "rel" else "reduce-scatter"


def _reduce_scatter(state: CfcState, n: int) -> bool:
    """Whether a compressed CUDA bucket of ``n`` elements moves as a reduce-scatter of codes
    (:class:`_ShardExchange`) rather than an all-gather of frames. The same on every rank."""
    if _cuda_algorithm(state) != "reduce-scatter":
        return False
    shard = -(-n // state.world)
    return (state.world - 1) * shard < n  # every rank's shard holds elements


def _next_slot(largest: int, cap: int) -> int:
    """Bytes per rank for a bucket's next frame exchange: 12.5% and 256 bytes above its largest
    frame this time, at most the frame's capacity (the native exchange's rule,
    ``cfc::bucket_exchange::next_slot``, but for the rounding to 16 bytes)."""
    return min(cap, largest + largest // 8 + 256)


def _sum_in_rank_order(values: List[float]) -> float:
    """A sum that every rank computes alike from the same values (so all pick one step)."""
    total = 0.0
    for v in values:
        total += v
    return total


class _ShardExchange:
    """One bucket as a reduce-scatter of quantization codes and an all-gather of their sums.

    The bucket is cut into ``world`` shards of ``L`` elements (the last one shorter). Each
    rank compresses every shard with the same ``eps`` (a bound all ranks agree on: with
    ``rms``, from the sum of all ranks' sums of squares at the bucket's previous step), so
    every decoded value lies on one grid, ``2 eps`` apart. Shard ``j`` of every rank travels
    to rank ``j`` (all-to-all), in a slot sized from the bucket's earlier frames; a 24-byte
    tail carries the frame's size, the largest frame size of its sender (so every rank sees the
    largest frame of all and all decide alike whether to send again) and the sender's sum of
    squares. Rank ``j`` adds the codes of every rank's frame of its shard as integers, in rank
    order, and packs the sum as one frame (on the GPU, the bytes of :func:`cfc.sum_compressed`:
    exact, with no second quantization), and the sums of all shards are all-gathered
    (:class:`_FrameExchange`) and decoded by every rank.

    The constructor queues the compression and the all-to-all; :meth:`send_sum` waits for the
    sizes, sums the shard and queues the all-gather of the sums; :meth:`receive_sums` waits
    for their sizes and writes the average into ``buf``. The comm thread runs ``send_sum``
    after the next bucket's launch and ``receive_sums`` after the one after that, so the next
    bucket is on the wire while it waits. Bounds hold as for the all-gather: each rank's
    rounding error is at most ``eps`` per element (its residual keeps it), so the average is
    within ``eps``, up to the float32 roundings of decoding the sum and dividing it.
    """

    TAIL = 24  # bytes after each slot: frame size, sender's largest frame, sender's sum of squares

    def __init__(self, state: CfcState, index: int, buf, r, units: bool = False):
        import torch
        import torch.distributed as dist

        self.state, self.index, self.buf, self.r, self.units = state, index, buf, r, units
        world, n, dev = state.world, buf.numel(), buf.device
        self.n, self.L = n, -(-n // world)
        self.bounds = [(j * self.L, min((j + 1) * self.L, n)) for j in range(world)]
        # Frames of float32 values, whatever the bucket's dtype: the sum is decoded once, to float32.
        x = buf.reshape(-1) if buf.dtype == torch.float32 else buf.reshape(-1).float()
        ss = torch.zeros((), dtype=torch.float64, device=dev)
        if state.bound_kind == "rms":
            ss = _finite_sumsq(x if r is None else x + r).double()
            prev = _prev_rms(state, index, n, units)
            if prev is not None:
                total = float(prev[0])  # all ranks' sum at the bucket's last step: no wait
            else:  # the bucket's first compressed step: every rank's sum now (waits, once)
                table = torch.empty(world, dtype=torch.float64, device=dev)
                dist.all_gather_into_tensor(table, ss.reshape(1), group=state.group)
                total = float(torch.tensor(_sum_in_rank_order(table.tolist()), dtype=torch.float32))
            rms = math.sqrt(total / (n * world)) if 0 < total < math.inf else 0.0
            self.eps = _rms_eps(state.bound, rms)
        else:
            self.eps = float(state.bound)
        self.frames = [
            cfc.compress(x[a:b], eps=self.eps, residual=None if r is None else r[a:b]) for a, b in self.bounds
        ]
        if not isinstance(self.frames[0], cfc.CudaCompressed):
            raise cfc.CfcError(f"the GPU codec cannot drive {dev} (compute capability 8.0 or newer is needed)")
        sizes = torch.stack([c.size_tensor for c in self.frames])
        tail = torch.stack([sizes, sizes.max().expand(world), ss.view(torch.int64).expand(world)], dim=1)
        self.slot = state._slots.get(("shard", index))
        if self.slot is not None:
            slot = self.slot = min(self.slot, self.frames[0]._out.numel())
            send = self._rows(slot, self.TAIL)
            send[:, slot:].copy_(tail.view(torch.uint8))
            self.got = torch.empty_like(send)
            dist.all_to_all_single(self.got.view(-1), send.view(-1), group=state.group)
            # (world, 3), by sender; a dense copy: with one rank the slice itself would pass
            # for contiguous, at an offset (and a row stride) that int64 cannot view
            tails = self.got[:, slot:].clone(memory_format=torch.contiguous_format).view(torch.int64)
        else:  # the bucket's first time: everyone's tails to everyone, then the frames exactly
            tails = torch.empty(world, world, 3, dtype=torch.int64, device=dev)
            dist.all_gather_into_tensor(tails.view(-1), tail.reshape(-1), group=state.group)
        self.tails_host = torch.empty(tails.shape, dtype=torch.int64, pin_memory=True)
        self.tails_host.copy_(tails, non_blocking=True)
        self.tails_ready = torch.cuda.Event()
        self.tails_ready.record()

    def _rows(self, width: int, extra: int = 0):
        """One row per shard: the first ``width`` bytes of its frame (the frame's size tells
        the receiver where it ends), then ``extra`` bytes left for the caller."""
        import torch

        rows = torch.empty(len(self.frames), width + extra, dtype=torch.uint8, device=self.buf.device)
        for j, c in enumerate(self.frames):
            k = min(width, c._out.numel())
            rows[j, :k].copy_(c._out[:k])
        return rows

    def send_sum(self) -> None:
        """Add the codes of this rank's shard and queue the all-gather of the sums. Waits for the
        shard's frame sizes (this thread only)."""
        import torch
        import torch.distributed as dist

        state, world, rank, dev = self.state, self.state.world, self.state.rank, self.buf.device
        self.tails_ready.synchronize()
        t = self.tails_host
        if self.slot is not None:
            mine, largest, sums = t[:, 0].tolist(), t[:, 1].tolist(), t[:, 2].contiguous()
        else:
            mine, largest, sums = t[:, rank, 0].tolist(), t[:, :, 0].max(dim=1).values.tolist(), t[:, 0, 2].contiguous()
        cap_mine = self.frames[rank]._out.numel()
        cap = self.frames[0]._out.numel()  # shard 0 is the longest
        if any(x < 64 or x > cap for x in largest):  # every rank sees these: all stop alike
            raise cfc.CfcError(f"ranks sent shard frames of up to {largest} bytes for {self.n} elements")
        # These only this rank sees. It must not stop alone (its peers would wait for its sum),
        # so it goes on with the exchanges and sends a sum frame of size 0, which every rank's
        # check refuses alike (:meth:`_FrameExchange.finish`).
        broken = any(x < 64 or x > cap_mine or x > top for x, top in zip(mine, largest))
        if state.bound_kind == "rms":
            # every rank's sum of squares, for the next step's bound (the same on every rank)
            everyone = _sum_in_rank_order(sums.view(torch.float64).tolist())
            state._rms[self.index] = (torch.tensor(everyone, dtype=torch.float32), None, self.n, self.units)
        m = max(largest)
        state._slots[("shard", self.index)] = _next_slot(m, cap)
        if self.slot is not None:
            sent = (world - 1) * (self.slot + self.TAIL)
            rows = self.got[:, : self.slot]
        else:
            sent = (world - 1) * world * self.TAIL
        if self.slot is None or m > self.slot:
            if self.slot is not None:
                with state._lock:
                    state._stats["resends"] += 1
            send = self._rows(m)
            rows = torch.empty_like(send)
            dist.all_to_all_single(rows.view(-1), send.view(-1), group=state.group)
            sent += (world - 1) * m
        a, b = self.bounds[rank]
        if broken:
            logger.error("cfc: rank %d received shard frame sizes %s for %d elements", rank, mine, b - a)
            parts = [cfc.compress(torch.zeros(b - a, device=dev), eps=self.eps)._out]
        else:
            parts = [rows[i] for i in range(world)]
        # The codes of every rank's frame of this shard, added in an integer accumulator in rank
        # order and packed as one frame (the same bytes on any rank). Every rank's sum frame has
        # the capacity of the longest shard's, so that all check the sizes alike.
        cap = _native.cuda_sum_sizes(self.L, "float32", 1, world)[0]
        summed = _sum_frames_cuda(parts, "float32", (b - a,), capacity=cap)
        if broken:
            summed.size_tensor.fill_(0)  # after the sum, on this stream
        self.sums = _FrameExchange(state, ("sum", self.index), summed, self.L)
        self.sent = sent
        self.frames = self.got = None  # sent and summed: free them before the sums arrive

    def receive_sums(self) -> int:
        """Decode every shard's sum into the bucket (averaged). Returns the bytes this rank
        sent in both exchanges. Waits for the sums' sizes (this thread only)."""
        frames, sent = self.sums.finish()
        flat, scale = self.buf.view(-1), _reciprocal(self.state.world)
        for j, (a, b) in enumerate(self.bounds):  # decoded, divided, written in the bucket's dtype
            _decode_sum(self.state, [frames[j]], b - a, "float32", flat[a:b], scale)
        return self.sent + sent


class _FrameExchange:
    """Every rank's frame of one bucket, moved in two steps over ``torch.distributed``: the
    constructor queues the all-gather, :meth:`finish` waits for the sizes and returns the
    frames. (Where the native exchange is open, :func:`_exchange_launch` does this instead.)

    The all-gather is asynchronous: the comm thread's stream does not wait for it, so the next
    bucket's compression (and the last one's decoding) run while this one is on the wire; the
    sizes' copy to the host waits for it on the comm thread's ``sizes_stream``, and
    :meth:`finish` makes the current stream wait for that copy (and so for the frames) before
    anything reads them.

    Frame sizes depend on the data and NCCL wants counts on the host. The first time a bucket
    is compressed, the ranks exchange their sizes (a collective and a wait) and then the frames.
    After that each frame travels in a slot sized from the bucket's previous frames (12.5% and
    256 bytes above the largest), with its size in the slot's last 8 bytes: one collective, and
    a wait for the sizes before decoding. A frame too big for its slot (all ranks see it) is
    sent again, exactly.
    """

    def __init__(self, state: CfcState, index: int, c, n: int):
        import torch
        import torch.distributed as dist

        self.state, self.index, self.c, self.n = state, index, c, n
        world, dev, worker = state.world, c.device, state._worker
        stream = worker.raw_stream  # (the current stream: this runs on the comm thread)
        # Where the sizes reach the host, and the event recorded once they are on their way: the
        # exchange's (kept from step to step: this step's finish() has read them before the
        # bucket's next exchange is queued, and pinned memory costs host time to allocate).
        held = worker.sizes.get(index)
        if held is None or held[0].numel() != world:
            held = worker.sizes[index] = (torch.empty(world, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
        self.sizes_host, self.sizes_ready = held
        self.slot = state._slots.get(index)
        if self.slot is not None:
            slot = self.slot = min(self.slot, c._out.numel())
            row = slot + 8
            # The slot: the frame's first bytes, then its size (from the compressor's workspace).
            # Driver copies, as the size's copy to the host below: each tensor operation they
            # replace costs host time on every bucket of every step.
            send = torch.empty(row, dtype=torch.uint8, device=dev)
            size_at = c._ws.data_ptr() + _native.CUDA_FRAME_SIZE_OFFSET
            _native.cuda_copy_rows(dev.index, stream, c._out.data_ptr(), slot, send.data_ptr(), row, slot, 1)
            _native.cuda_copy_rows(dev.index, stream, size_at, 8, send.data_ptr() + slot, 8, 8, 1)
            self.got = torch.empty(world * row, dtype=torch.uint8, device=dev).view(world, row)
            self.send = send  # NCCL reads it until the exchange ends: kept until finish()
            work = dist.all_gather_into_tensor(self.got.view(-1), send, group=state.group, async_op=True)
            # Every rank's size, from the end of its row to the host, behind this exchange only
            # (read later, it must not wait for the next bucket's exchange).
            side = worker.sizes_stream
            with torch.cuda.stream(side):
                work.wait()  # the side stream waits for the exchange; the host does not
                _native.cuda_copy_rows(
                    dev.index, side.cuda_stream, self.got.data_ptr() + slot, row, self.sizes_host.data_ptr(), 8, 8, world
                )
                self.sizes_ready.record(side)
        else:
            sizes_dev = torch.empty(world, dtype=torch.int64, device=dev)
            dist.all_gather_into_tensor(sizes_dev, c.size_tensor.reshape(1), group=state.group)
            self.sizes_host.copy_(sizes_dev, non_blocking=True)
            self.sizes_ready.record()

    def _check(self, sizes) -> None:
        cap = self.c._out.numel()
        if any(x < 64 or x > cap for x in sizes):
            raise cfc.CfcError(f"ranks sent frame sizes {sizes} for {self.n} elements")
        self.state._slots[self.index] = _next_slot(max(sizes), cap)

    def finish(self):
        """(frames by rank, bytes this rank sent); waits for the sizes (this thread only)."""
        import torch
        import torch.distributed as dist

        world, slot = self.state.world, self.slot
        self.sizes_ready.synchronize()
        torch.cuda.current_stream(self.c.device).wait_event(self.sizes_ready)  # the frames are in
        sizes = self.sizes_host.tolist()
        self._check(sizes)
        if slot is not None:
            sent = (world - 1) * (slot + 8)
            if max(sizes) <= slot:
                return [self.got[j, :slot] for j in range(world)], sent
            with self.state._lock:
                self.state._stats["resends"] += 1
        else:
            sent = (world - 1) * 8
        m = max(sizes)
        frames = torch.empty(world * m, dtype=torch.uint8, device=self.c.device).view(world, m)
        dist.all_gather_into_tensor(frames.view(-1), self.c._out[:m], group=self.state.group)
        return [frames[j] for j in range(world)], sent + (world - 1) * m
