"""``CfcState``: the options and per-rank state of :func:`cfc.cfc_hook`, and its engine."""

from __future__ import annotations

import logging
import math
import sys
import zlib
from typing import Any, Dict, List, Mapping, Optional

import cfc
from cfc import _engine
from cfc.ddp.options import Options
from cfc.ddp.residuals import Residuals
from cfc.ddp.checkpoint import STATE_VERSION, parse_state

logger = logging.getLogger("cfc")


# The engine's counters in stats(), which reset_stats() zeroes (eps and max_error are largest
# values, not counts).
_ENGINE_COUNTERS = ("compressed_buckets", "plain_buckets", "bytes_sent", "bytes_uncompressed", "resends",
                    "frame_bytes", "slack_bytes", "inside_node", "between_nodes",
                    "uncompressed_between_nodes", "seconds")


class CfcState:
    """Options and per-rank state of :func:`cfc.cfc_hook` (and of
    :class:`cfc.distributed.AllReducer`).

    Args:
        process_group: the group DDP reduces over (default: the world).
            :func:`cfc.register_comm_hook` gives a state without one DDP's group, and refuses a
            state with another; with DDP's own ``register_comm_hook`` on a DDP model over a
            subgroup, pass that group here (a bucket does not say which group it is reduced
            over).
        eps: absolute bound on each rank's quantization error, per element.
        rel: bound relative to the bucket's largest magnitude over all ranks, at the bucket's
            previous step (at its first, this step's); below 1.
        rms: bound relative to the root mean square of the bucket's finite values (gradient
            plus residual) over all ranks, at the bucket's previous step (at its first, this
            step's): nothing waits for it. The default, ``rms=0.05``, when no bound is given (on
            the models measured it kept the held-out loss within 0.5-0.7% of plain all-reduce's;
            ``rms=0.1`` and ``0.3`` send fewer bytes and cost more: see the README).
        error_feedback: carry what quantization drops into the next step (per rank, per
            bucket). (With ``find_unused_parameters``, DDP writes no gradient for a parameter
            that no rank used in a step, so what its residual sent that step is lost: the hook
            cannot tell such a parameter from one whose gradient is zero.)
        warmup_steps: steps of plain all-reduce first. DDP rebuilds its buckets after the first
            step, so residuals start on stable buckets.
        min_compress_numel: buckets with fewer elements are all-reduced plainly (compressing
            them costs more than the bytes it saves). So are buckets of sparse gradients and of
            dtypes other than float32, bfloat16 and float16 (logged once per kind).
        fallback: ``"never"`` (or ``False``): always compress (after the warm-up);
            ``"auto"``: time plain and compressed all-reduce of every bucket for
            ``trial_steps`` steps after the warm-up (alternating) and keep, per bucket, the
            faster (the slowest rank's time decides, so all ranks choose alike);
            ``"always"``: never compress (to compare). A bucket sent plainly still pays for
            running a Python hook: :func:`cfc.register_comm_hook` with ``"auto"`` first checks
            whether compression pays at all, and where it does not leaves DDP's built-in
            all-reduce in place.
        trial_steps: steps of that trial (an even number; half of each way; the fastest time of
            each way counts).
        log_every: every this many steps, report :meth:`stats`: one line on rank 0's stderr, or,
            where the application set up logging, an INFO record of logger ``"cfc"`` on every
            rank; 0: never.
        algorithm: how a compressed bucket moves: ``"reduce-scatter"`` (each rank owns a shard,
            sums everyone's codes for it and sends the sum on: a rank sends about twice a
            compressed bucket however many ranks there are) or ``"all-gather"`` (every rank's
            compressed bucket to every rank: one exchange instead of two, fewer bytes with 2
            ranks). Default (None): the all-gather for 2 ranks, the reduce-scatter from 3.
        topology: how buckets cross nodes: ``"two-level"`` reduces each bucket plainly inside
            each node (NVLink), exchanges each rank's 1/G shard of its node's sum compressed
            with the same rank of every other node, then all-gathers inside the node, so about
            G times fewer bytes leave a node of G ranks than with ``"flat"`` (every rank's codes
            to every rank). ``"auto"`` (default): two-level where there are at least 2 nodes of
            one size, each of at least 2 ranks; flat otherwise. Nodes are the ranks' host names,
            or ``CFC_NODE`` where it is set (to emulate nodes on one host). Reduce-scatters
            (FSDP's) and float16 buckets stay flat. Two-level compresses each node's *sum*: :meth:`stats`' ``eps``
            and ``max_error`` are of those sums (with ``eps=``, a step G times wider), and the
            average over the G times more ranks is within ``eps`` of the exact one, as flat.
        coder: how compressed buckets write their codes: ``"planes"`` (default: bit planes of
            each group's width) or ``"rice"`` (Rice codes in blocks of 1024: the same values in
            12-39% fewer bytes, see docs/FORMAT.md; compressing takes 3-5x the GPU time of bit
            planes, a few ms per GB). It applies to the all-gather (2 ranks, or
            ``algorithm="all-gather"``, and the exchange between 2 nodes of ``"two-level"``)
            and to :mod:`cfc.fsdp`'s reduce-scatters (whose frames are then decoded and added
            in float32, as the all-gather's are, instead of their codes summed: the same
            average to within float32 rounding); a DDP bucket's reduce-scatter, whose codes
            are summed on the way, keeps bit planes.
        block: block scales, with ``rms=``: each block of this many elements of a bucket (a
            power of two from 32 to 2**24) gets its own step, ``rms`` times the block's own RMS
            (the largest rank's, rounded down to a power of two) at the bucket's previous step,
            as ``rms=`` alone follows the bucket's: the exponents ride in the exchange (a byte
            per block), and a bucket's first compressed step agrees them in a small round of its
            own. Regions of small gradients then keep their precision where one step per bucket
            rounds them to zero. 0 (default): one step per bucket.
        timeout: seconds (or a ``timedelta``) any wait for a peer may last before every rank
            fails (default ``CFC_TIMEOUT``, else 300). A failure on any rank (an exception, a
            bad frame, a process that died) ends the waits of every rank at once, without
            waiting for this.

    Every rank must use the same options: the engine checks them when it starts (at the first
    bucket), and every rank's ``backward()`` raises ``cfc.CfcError`` (which DDP reports as a
    ``RuntimeError`` naming it) if they differ. The state may be made before the process group
    (it binds to it at the first bucket). Make one on every rank, and one per DDP model.

    :meth:`close` lets go of the engine (its thread, links and NCCL communicator); a process
    that never calls it stops the engine when it exits, waiting a few seconds at most for its
    thread (``cfc._engine._settle_at_exit``).
    """

    def __init__(
        self,
        process_group: Any = None,
        *,
        eps: Optional[float] = None,
        rel: Optional[float] = None,
        rms: Optional[float] = None,
        error_feedback: bool = True,
        warmup_steps: int = 2,
        min_compress_numel: int = 16384,
        fallback: Any = "never",
        trial_steps: int = 4,
        log_every: int = 0,
        algorithm: Optional[str] = None,
        topology: str = "auto",
        coder: str = "planes",
        block: int = 0,
        timeout: Any = None,
    ):
        self.options = Options.parse(
            eps=eps, rel=rel, rms=rms, error_feedback=error_feedback, warmup_steps=warmup_steps,
            min_compress_numel=min_compress_numel, fallback=fallback, trial_steps=trial_steps,
            log_every=log_every, algorithm=algorithm, topology=topology, coder=coder, block=block,
            timeout=timeout,
        )
        self.process_group = process_group
        self.rank, self.world = -1, 0
        self.step = 0  # steps closed (a bucket with is_last())
        self.probe: Optional[Dict[str, Any]] = None  # what register_comm_hook's probe found
        self._engine: Any = None
        self._device: Any = None
        self._residuals = Residuals()
        # Until the engine opens: a loaded checkpoint's engine state, and the token every rank
        # must agree on (which checkpoint it resumed from).
        self._loaded: Optional[Dict[str, Any]] = None
        self._token = 0
        self._agree_again = False
        self._keep: List[Any] = []  # tensors the engine works on until the step's wait
        self._held: List[Any] = []  # tensors of earlier steps the engine may still use (_let_go)
        self._scatters: List[Any] = []  # parts to write back into their buckets after the wait
        self._plain_kinds: set = set()
        self._fsdp: Any = None  # cfc.fsdp's part (cfc.fsdp.state.FsdpState), made by cfc.fsdp
        # The entry point the state serves (one of checkpoint.ENTRY_POINTS), once known: its
        # residuals, steps and choices are that entry point's, and its checkpoints say so.
        self._serves: Optional[str] = None
        self._base: Dict[str, float] = {}  # what reset_stats() subtracts
        self._closed = False
        self._model: Any = None  # a weak reference to the DDP model register_comm_hook gave it to

    # The options, under the names CfcState always had.
    bound_kind = property(lambda self: self.options.bound_kind)
    bound = property(lambda self: self.options.bound)
    error_feedback = property(lambda self: self.options.error_feedback)
    warmup_steps = property(lambda self: self.options.warmup_steps)
    min_compress_numel = property(lambda self: self.options.min_compress_numel)
    fallback = property(lambda self: self.options.fallback)
    trial_steps = property(lambda self: self.options.trial_steps)
    algorithm = property(lambda self: self.options.algorithm)
    topology = property(lambda self: self.options.topology)
    coder = property(lambda self: self.options.coder)
    block = property(lambda self: self.options.block)
    timeout = property(lambda self: self.options.timeout)
    log_every = property(lambda self: self.options.log_every)

    def __getstate__(self) -> Dict[str, Any]:
        """Pickles the options only: the process group, engine and residuals belong to the
        process (rebuilt at the next bucket), as with PyTorch's own hook states."""
        return {"options": self.options}

    def __setstate__(self, d: Dict[str, Any]) -> None:
        o = d["options"]
        self.__init__(
            **{o.bound_kind: o.bound}, error_feedback=o.error_feedback, warmup_steps=o.warmup_steps,
            min_compress_numel=o.min_compress_numel, fallback=o.fallback,
            trial_steps=o.trial_steps or 4, log_every=o.log_every, algorithm=o.algorithm,
            topology=o.topology, coder=o.coder, block=o.block, timeout=o.timeout,
        )

    def _serve(self, entry: str) -> None:
        """The state serves ``entry`` (``cfc_hook``, ``AllReducer``, ``cfc.fsdp`` or
        ``cfc.fsdp replicas``), and only it: a state serving two would mix their residuals,
        steps and choices under the same keys."""
        self._check_serve(entry)
        self._serves = entry

    def _check_serve(self, entry: str) -> None:
        """Raises ``ValueError`` where :meth:`_serve` would, changing nothing."""
        if self._serves not in (None, entry):
            raise ValueError(f"this CfcState serves {self._serves}: give {entry} a CfcState of its own")

    def _bind(self) -> None:
        """Binds the state to its process group (at the first bucket, or when a checkpoint is
        loaded), so a state can be made before ``init_process_group`` (Lightning does)."""
        import torch.distributed as dist

        if self.world:
            return
        if not dist.is_initialized():
            raise RuntimeError("cfc_hook needs an initialised torch.distributed process group")
        pg = self.process_group if self.process_group is not None else dist.group.WORLD
        self.process_group = pg
        self.rank, self.world = dist.get_rank(pg), dist.get_world_size(pg)

    def _engine_for(self, device: Any) -> Any:
        """The engine, opened at the first use (a collective of the group's ranks)."""
        if self._closed:
            raise cfc.CfcError("this CfcState was closed (CfcState.close()); make a new one to go on")
        if self._engine is None:
            self._bind()
            self._engine = _engine.open_engine(self.process_group, device, self.options.engine(), self._token)
            self._device = device
            if self._loaded is not None:
                self._engine.load_state(self._loaded)
                self._loaded = None
            self._agree_again = False
        elif device != self._device:
            raise ValueError(f"cfc_hook drives one device per process; buckets on {self._device} and {device}")
        if self._agree_again:  # a checkpoint was loaded since the engine opened
            self._agree_again = False
            self._engine.agree(self._token)
        return self._engine

    def _feeds(self, buf: Any) -> bool:
        """Whether a bucket gets a residual: error feedback, a bucket cfc compresses, past the
        warm-up (buckets are rebuilt after the first step)."""
        return (self.options.error_feedback and buf.numel() >= self.options.min_compress_numel
                and self.step >= self.options.warmup_steps)

    def _end_step(self, stream: Any) -> None:
        """At a step's last bucket: wait for the engine (every bucket done on every rank, or its
        failure raised), write back the parts, and count the step."""
        try:
            if self._engine is not None:
                self._engine.wait(stream)
            for scatter in self._scatters:
                scatter()
        finally:
            self._scatters = []
            self._let_go()
            self._residuals.end_step()
            self.step += 1
        if self._residuals.saved_layouts and self.step >= self._token_step + 2:
            # A fresh DDP model keeps its initial buckets for one step (two with static_graph),
            # then rebuilds them: from then on a loaded layout is of no more use.
            self._residuals.saved_layouts = {}
        if self.options.log_every and self.step % self.options.log_every == 0:
            self._log_stats()

    def _log_stats(self) -> None:
        """``log_every``'s line. Where the application set up logging (a handler on the
        ``"cfc"`` logger or above it), an INFO record with every counter, on every rank; where it
        did not, one line on rank 0's stderr, so that the option shows without any setup."""
        s = self.stats()
        if logger.hasHandlers():
            if logger.isEnabledFor(logging.INFO):
                logger.info("cfc step %d: %s", self.step, s)
            return
        if self.rank != 0:
            return
        mb = lambda b: f"{b / 1e6:.1f} MB"  # noqa: E731
        error = "not measured" if math.isnan(s["max_error"]) else f"{s['max_error']:.3g} (bound {s['eps']:.3g})"
        between = (f", {s['ratio_between_nodes']:.2f}x fewer between nodes" if s.get("between_nodes") else "")
        print(f"cfc step {self.step}: {s['ratio']:.2f}x fewer bytes than a float32 ring all-reduce "
              f"({mb(s['bytes_sent'])} sent, {mb(s['bytes_uncompressed'])} plain{between}), "
              f"{s['compressed_buckets']} buckets compressed, {s['plain_buckets']} plain, "
              f"largest error {error}", file=sys.stderr, flush=True)

    def __repr__(self) -> str:
        o = self.options
        where = f"rank {self.rank} of {self.world}, step {self.step}" if self.world else "not bound to a group yet"
        return (f"CfcState({o.bound_kind}={o.bound:g}, error_feedback={o.error_feedback}, "
                f"warmup_steps={o.warmup_steps}, min_compress_numel={o.min_compress_numel}, "
                f"fallback={o.fallback!r}, algorithm={o.algorithm!r}, topology={o.topology!r}, "
                f"coder={o.coder!r}, block={o.block}, timeout={o.timeout:g}; {where})")

    _token_step = 0  # the step a checkpoint was loaded at

    def _let_go(self) -> None:
        """Drops the tensors the engine worked on since the last wait, once it is done with
        them. After a wait that ran out of time the engine may still be at work on them (its
        thread gives up at its next look at the failure board; a device may never drain): they
        are then kept alive, and let go at a later wait that finds the engine settled, so that
        the engine never writes into memory that was freed."""
        held, self._keep = self._held + self._keep, []
        try:
            settled = self._engine is None or self._engine.settled()
        except cfc.CfcError:  # closed: its close() waited for its thread
            settled = True
        if not settled and held and not self._held:
            logger.warning("cfc: the engine may still be at work on this rank's tensors (after a failure, or a "
                           "wait that ran out of time); they are kept alive until it lets go of them")
        self._held = [] if settled else held

    def close(self) -> None:
        """Let go of the engine (its thread, links and NCCL communicator), once the work
        submitted is done. Call it on every rank when training with the hook is over; a process
        that does not stops the engine when it exits. Afterwards the hook refuses buckets (``backward()``
        raises a ``RuntimeError`` naming ``cfc.CfcError``); ``stats()`` and ``state_dict()`` still
        work. Calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        engine, self._engine = self._engine, None
        if engine is not None:
            self._final_stats = dict(engine.stats())
            engine.close()

    # ---- stats ----

    def _raw_stats(self) -> Dict[str, float]:
        keys = _ENGINE_COUNTERS + ("eps", "max_error")
        if self._engine is not None:
            s = dict(self._engine.stats())
        else:
            s = dict(getattr(self, "_final_stats", {}))
        s = {k: s.get(k, 0) for k in keys}
        if self._fsdp is not None:  # (FSDP's groups sent through torch's own reduce-scatter)
            s["plain_buckets"] += self._fsdp.direct["plain_buckets"]
            s["bytes_sent"] += self._fsdp.direct["bytes_sent"]
            s["bytes_uncompressed"] += self._fsdp.direct["bytes_sent"]
        s["residual_resets"] = self._residuals.resets
        return s

    @property
    def levels(self) -> Optional[Dict[str, int]]:
        """Where the engine runs the two-level exchange (see ``topology``): ``{"nodes",
        "per_node", "node", "local"}`` (this rank's node and its index there); None where it
        runs flat or has not opened yet (it opens at the first bucket)."""
        if self._engine is None or self._engine.levels is None:
            return None
        return dict(zip(("nodes", "per_node", "node", "local"), self._engine.levels))

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats`."""
        self._base = self._raw_stats()

    def stats(self) -> Dict[str, float]:
        """Counters since the start (or :meth:`reset_stats`), as a plain dict.

        A *bucket* here is what the state reduces in one go: one of DDP's gradient buckets, one
        call of :mod:`cfc.fsdp` (an FSDP group's reduce-scatter in one backward pass, or its
        replicas' average), or one chunk of an :class:`cfc.distributed.AllReducer` call.

        * ``step``: completed steps;
        * ``compressed_buckets`` / ``plain_buckets``: buckets each way;
        * ``bytes_sent``: bytes this rank sent; ``bytes_uncompressed``: what a plain ring
          all-reduce of the same buckets would send; ``ratio``: the second over the first;
        * ``inside_node`` / ``between_nodes``: the engine's part of ``bytes_sent`` to ranks of
          this rank's node and of other nodes (nodes as :attr:`levels` says; for a plain ring
          across nodes, this rank's share of the bytes out of its node);
          ``uncompressed_between_nodes``: a float32 ring's bytes between nodes, counted alike;
          ``ratio_between_nodes``: the second over ``between_nodes`` (0 on one node): what
          compression saves on the link between nodes;
        * ``max_error``: the largest quantization error of any element this rank sent (what its
          residual kept, measured at each step's close), next to ``eps``, the largest bound
          used; NaN with ``error_feedback=False`` once a bucket was compressed (not measured);
        * ``seconds``: host time the engine's thread spent on buckets;
        * ``residual_resets``: residuals restarted because a bucket changed in a way its
          parameters could not be followed;
        * ``resends``: exchanges in which a frame outgrew the slot sized from the bucket's
          earlier frames (its bytes past the slot then went in a second exchange);
        * ``frame_bytes``: the part of ``bytes_sent`` that is compressed frames themselves (once
          per peer each went to), and ``slack_bytes`` the part that is slot bytes frames did not
          fill (and the padding of frames' tails to the longest); the rest is rows' heads (with
          block exponents), the rounds that first agree a bound or block scales, and buckets
          sent plainly.
        """
        s = self._raw_stats()
        for k in _ENGINE_COUNTERS + ("residual_resets",):
            s[k] -= self._base.get(k, 0)
        if not self.options.error_feedback and s["compressed_buckets"]:
            s["max_error"] = math.nan
        s["step"] = self.step
        s["ratio"] = s["bytes_uncompressed"] / s["bytes_sent"] if s["bytes_sent"] else 0.0
        s["ratio_between_nodes"] = (s["uncompressed_between_nodes"] / s["between_nodes"]
                                    if s["between_nodes"] else 0.0)
        return s

    # ---- checkpoints ----

    def state_dict(self) -> Dict[str, Any]:
        """This rank's state: step, residuals (on the CPU), bucket layouts, and the engine's
        per-bucket statistics and choices. Save one per rank (residuals differ between ranks)."""
        self._bind()
        if self._engine is not None:
            self._engine.wait(_engine.stream_of_device(self._device))
            engine = dict(self._engine.state())
        else:
            engine = self._loaded or {"step": self.step, "origin": 0, "buckets": []}
        layouts = {**self._residuals.saved_layouts,
                   **{i: l for i, l in self._residuals.layouts.items() if l is not None}}
        return {
            "version": STATE_VERSION,
            "rank": self.rank,
            "world": self.world,
            "options": self.options.saved(),
            "step": self.step,
            "residuals": self._residuals.saved(),  # per parameter ordinal
            "layouts": layouts,
            "engine": engine,
            "serves": self._serves,
            "stats": self.stats(),
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved on this rank.

        Raises:
            ValueError: the state was saved by another rank, world size or options, or is not
                one :meth:`state_dict` makes (a missing or malformed field; residuals that are
                not finite 1-D float32 dense tensors). Nothing is changed then. (A residual
                whose size does not match its parameter's restarts at zero, counted in
                ``residual_resets``.)
            cfc.CfcError: the state was closed.

        The residuals are kept as given until their buckets first use them (not copied): leave
        the loaded tensors unchanged until the next step. At the next bucket every rank checks
        that every rank loaded a state of the same step, buckets and choices; otherwise every
        rank's ``backward()`` raises.

        A fresh DDP model runs its first step (its first two with ``static_graph``) on its
        initial buckets, where the hook replays the saved run's buckets from the state, so that
        the resumed run repeats the bits of the uninterrupted one.
        """
        if self._closed:
            raise cfc.CfcError("this CfcState was closed (CfcState.close()); make a new one to go on")
        self._bind()
        loaded = parse_state(sd, self.options, self.rank, self.world)  # all checked first
        serves = loaded["serves"]
        if serves is not None and self._serves not in (None, serves):
            raise ValueError(f"this checkpoint is of a state that served {serves}; this CfcState serves "
                             f"{self._serves}")
        if self._engine is not None:  # a load mid-run: the engine's work is all done first
            self._engine.wait(_engine.stream_of_device(self._device))
        self.step = loaded["step"]
        self._token_step = self.step
        self._residuals.load(loaded["residuals"], loaded["layouts"])
        if serves is not None:
            self._serves = serves  # (a state that served nothing yet serves what the saved one did)
        if self._fsdp is not None:
            self._fsdp.load()
        check = loaded["engine"].get("step_check")
        shared = repr((sorted(loaded["layouts"].items()),
                       [(b["key"], b["decision"]) for b in loaded["engine"]["buckets"]],
                       None if check is None else check["verdict"]))
        self._token = (self.step << 32) | zlib.crc32(shared.encode())
        if self._engine is not None:
            self._engine.load_state(loaded["engine"])
            self._agree_again = True
        else:
            self._loaded = loaded["engine"]
        self.reset_stats()
