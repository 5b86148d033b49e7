"""Error-feedback residuals of :func:`cfc.cfc_hook`, and the bucket layouts a checkpoint replays.

A residual lives per bucket (one flat float32 tensor, like the bucket, which the engine updates
in place) but is keyed per parameter, so that it survives DDP rebuilding its buckets and a
resumed run whose first step has DDP's initial bucket layout. A parameter's key is its
*ordinal*: the order in which this process first saw it, which is DDP's initial layout and the
same in every run of the same model.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

logger = logging.getLogger("cfc")

# (ordinal, offset, numel) of each parameter of a bucket, or None where they do not tile it
Layout = Optional[Tuple[Tuple[int, int, int], ...]]


def ordinals(layout: Layout) -> Optional[tuple]:
    """The parameter ordinals of a layout (None: none)."""
    return None if layout is None else tuple(o for o, _, _ in layout)


def fingerprint(layout: Layout, buf: Any) -> int:
    """What a bucket holds, as the engine compares it from step to step (the same on every
    rank): its parameters, dtype and size."""
    return zlib.crc32(repr((ordinals(layout), str(buf.dtype), buf.numel())).encode())


class Residuals:
    """See the module docs."""

    def __init__(self) -> None:
        self.ordinal: Dict[int, int] = {}  # id(parameter) -> ordinal
        self.by_bucket: Dict[int, Tuple[tuple, Any]] = {}  # bucket -> ((layout, dtype, numel), residual)
        self.where: Dict[int, Tuple[Any, int, int]] = {}  # ordinal -> (residual, offset, numel)
        self.pending: Dict[int, Any] = {}  # ordinal -> loaded residual, placed at first use
        self.layouts: Dict[int, Optional[tuple]] = {}  # bucket -> ordinals, as last run
        self.saved_layouts: Dict[int, tuple] = {}  # bucket -> ordinals, from a checkpoint
        self.resets = 0  # residuals restarted at zero (counted in stats)
        self.seen: set = set()  # buckets run this step
        # Whether a bucket's residual outlives a step in which it did not run. DDP runs every
        # bucket every step (one that does not run was rebuilt into others); FSDP2 runs one
        # group per step (cfc.fsdp), so there every residual is kept.
        self.keep_unseen = False
        # What else holds residuals for checkpoints (cfc.fsdp's packed ones): ordinal -> tensor
        self.held_elsewhere: Optional[Callable[[], Dict[int, Any]]] = None

    def layout(self, bucket: Any, buf: Any) -> Layout:
        """(ordinal, offset, numel) of each parameter in the bucket's buffer ``buf``; None when
        the parameters do not tile it (then its residual is kept per bucket only)."""
        out, off = [], 0
        for p in bucket.parameters():
            o = self.ordinal.setdefault(id(p), len(self.ordinal))
            n = p.numel()
            out.append((o, off, n))
            off += n
        return tuple(out) if off == buf.numel() else None

    def parts(self, index: int, buf: Any, layout: Layout) -> Tuple[List[Tuple[int, Any, Layout]], Optional[Callable[[], None]]]:
        """How to run a bucket: ``[(key, flat tensor, layout)]``, and what writes the parts back
        into ``buf`` once they are reduced (None when the bucket runs whole).

        After a checkpoint is loaded, DDP's first step uses its initial bucket layout, not the
        rebuilt one the checkpoint was saved with. Such a bucket runs as the saved buckets it
        is made of, so that the resumed run does exactly what the uninterrupted one did."""
        whole = [(index, buf, layout)], None
        if not self.saved_layouts or layout is None or buf.is_sparse:
            return whole
        if self.saved_layouts.get(index) == ordinals(layout):
            return whole
        where = {o: (off, n) for o, off, n in layout}
        chosen = [(k, ords) for k, ords in sorted(self.saved_layouts.items()) if ords and set(ords) <= where.keys()]
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

        def scatter() -> None:
            for _, flat, sub in parts:
                for o, off, n in sub:
                    a = where[o][0]
                    buf[a : a + n].copy_(flat[off : off + n])

        return parts, scatter

    def get(self, index: int, layout: Layout, buf: Any) -> Tuple[Any, bool]:
        """This bucket's residual (zero at first), and whether it holds values no exchange has
        sent yet (carried over from other buckets, or loaded)."""
        import torch

        self.seen.add(index)
        key = self._key(layout, buf)
        held = self.by_bucket.get(index)
        if held is not None and held[0] == key and held[1].device == buf.device:
            return held[1], False
        r = torch.zeros(buf.numel(), dtype=torch.float32, device=buf.device)
        for o, off, n in layout or ():
            if o in self.pending:
                src = self.pending.pop(o).reshape(-1)
                if src.numel() == n:
                    r[off : off + n].copy_(src)
                else:  # a state saved for another model: counted, not silently dropped
                    logger.warning("cfc: the loaded residual of parameter %d holds %d values, the parameter %d; "
                                   "it restarts at zero", o, src.numel(), n)
                    self.resets += 1
            elif o in self.where:
                t, toff, tn = self.where[o]
                if tn == n and t.device == r.device:
                    r[off : off + n].copy_(t[toff : toff + n])
            self.where[o] = (r, off, n)
        if held is not None and layout is None:
            logger.warning("cfc: bucket %d changed; its residual restarts at zero", index)
            self.resets += 1
        self.by_bucket[index] = (key, r)
        return r, True

    def held(self, index: int, layout: Layout, buf: Any) -> Optional[Any]:
        """The residual bucket ``index`` holds, as :meth:`get` gives it (placed by an exchange,
        or loaded from a checkpoint for its parameters and not placed yet), or None where it
        holds none (no residual is made for it). What cfc.fsdp adds to a group it sends
        plainly."""
        if index in self.by_bucket or any(o in self.pending for o, _, _ in layout or ()):
            return self.get(index, layout, buf)[0]
        return None

    @staticmethod
    def _key(layout: Layout, buf: Any) -> tuple:
        """What a bucket's residual was made for: its layout, dtype and size."""
        return (layout, str(buf.dtype), buf.numel())

    def put(self, index: int, layout: Layout, buf: Any, r: Any) -> None:
        """``r`` as the residual of bucket ``index`` (holding ``buf``, laid out as ``layout``):
        what :meth:`get` returns next, as one that exchanges have sent (cfc.fsdp's residuals
        kept packed between calls)."""
        self.by_bucket[index] = (self._key(layout, buf), r)
        for o, off, n in layout or ():
            self.where[o] = (r, off, n)

    def drop(self, index: int, layout: Layout) -> None:
        """Forgets bucket ``index``'s residual (and its parameters'), e.g. one kept elsewhere."""
        self.by_bucket.pop(index, None)
        for o, _, _ in layout or ():
            self.where.pop(o, None)

    def end_step(self) -> None:
        """At a step's end: residuals of buckets that did not run go (what they held lives on
        in the buckets that took their parameters), unless ``keep_unseen``."""
        for k in [k for k in self.by_bucket if k not in self.seen and not self.keep_unseen]:
            del self.by_bucket[k]
        live = {id(r) for _, r in self.by_bucket.values()}
        for o in [o for o, (t, _, _) in self.where.items() if id(t) not in live]:
            del self.where[o]
        self.seen = set()

    def saved(self) -> Dict[int, Any]:
        """Every parameter's residual, on the CPU (the engine has finished with them)."""
        out = {o: t[off : off + n].detach().cpu().clone() for o, (t, off, n) in self.where.items()}
        if self.held_elsewhere is not None:
            out.update(self.held_elsewhere())
        out.update({o: v for o, v in self.pending.items() if o not in out})
        return out

    def load(self, residuals: Dict[int, Any], layouts: Dict[int, tuple]) -> None:
        """Replaces everything with a checkpoint's: placed at their buckets' first use."""
        self.by_bucket.clear()
        self.where.clear()
        self.pending = dict(residuals)
        self.saved_layouts = dict(layouts)
        self.seen = set()
