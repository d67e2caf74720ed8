"""What every stage after sampling reads: both dumps, the plan, the fingerprints, the
dtypes the values really carry, the noise model. Read-only: the stages return values."""

from __future__ import annotations

from dataclasses import dataclass, field

from consistency.compare import identify, precision, refslots
from consistency.compare.tolerance import ToleranceModel
from consistency.compare.types import Note, Pair, Plan
from consistency.dump.reader import Dump, TensorView

Shape = tuple[int, int]
Prints = dict[Shape, identify.Fingerprints]


def key(v: TensorView) -> Shape:
    return (v.rows, v.cols)


@dataclass(frozen=True)
class Context:
    dumps: Pair[Dump]
    plan: Plan
    tol: ToleranceModel
    fp: Pair[Prints]
    effective: Pair[dict[str, str]]  # tensor name -> the dtype its values carry (a float32 file may hold bf16)
    notes: tuple[Note, ...] = ()
    _streams: dict[Shape, frozenset[int]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ref(self) -> Dump:
        return self.dumps.ref

    @property
    def cand(self) -> Dump:
        return self.dumps.cand

    @property
    def ref_fp(self) -> Prints:
        return self.fp.ref

    @property
    def cand_fp(self) -> Prints:
        return self.fp.cand

    def dtype(self, side: str, view: TensorView | None) -> str:
        """The dtype the values carry (a float32 file may hold bf16 values)."""
        if view is None:
            return "float32"
        return self.effective.side(side).get(view.name, view.dtype)

    def ref_view(self, name: str) -> TensorView | None:
        if name in self.ref.tensors:
            return self.ref.tensors[name]
        return next((v for v in self.plan.ref.slots.values() if v.name == name), None)

    def name_by_values(self, ref_name: str | None) -> str | None:
        """What a reference tensor is by its values (compare.refslots.name_by_values): for
        tensors identification ranked; a result's own expected tensor is ``r.identity``."""
        return refslots.name_by_values(self.plan.ref_slots, ref_name)

    def stream_by_values(self, ref_name: str | None) -> int | None:
        """The stream a reference tensor stands for (compare.refslots.stream_by_values)."""
        return refslots.stream_by_values(self.plan.ref_slots, ref_name)

    def recorded_streams(self, shape: Shape) -> frozenset[int]:
        """Streams the reference records at this shape (computed once per shape: a dump of
        30,000 tensors must not re-scan every name once per tensor)."""
        if shape not in self._streams:
            fp = self.ref_fp.get(shape)
            got = (self.stream_by_values(n) for n in (fp.names if fp is not None else []))
            self._streams[shape] = frozenset(x for x in got if x is not None)
        return self._streams[shape]

    def noise_floor(self, name: str, ref: TensorView | None, cand: TensorView, gap: float | None = None,
                    user: bool = True) -> tuple[float, Note]:
        """The pair's floor: user rules first (unless ``user`` is False: identity is judged
        against noise, never against a tolerance), else the dtype floor of the precision
        the values really carry; a float8 side earns a floor measured on these values."""
        dr, dc = self.dtype("ref", ref), self.dtype("cand", cand)
        narrow = [d for d in (dr, dc) if d in precision.NARROW]
        tol = self.tol if user else ToleranceModel()
        if not narrow or (user and (any(rule.matches(name) for rule in self.tol.rules)
                                    or self.tol.floor_override is not None)):
            return tol.floor(name, dr, dc, gap)
        wide = [d for d in (dr, dc) if d not in precision.NARROW] or ["bfloat16"]
        compute = self.tol.dtype_floor(wide[0], wide[-1])
        side_view = ref if dr not in precision.NARROW else cand
        fps = self.ref_fp if side_view is ref else self.cand_fp
        fp = fps.get(key(cand))
        sample = fp.rows(side_view.name) if fp is not None and side_view is not None and side_view.name in fp else None
        if sample is None:
            return tol.floor(name, dr, dc, gap)
        measured = precision.storage_floor(sample, narrow[0])
        f = max(compute, measured)
        if gap is not None and gap > 0 and gap / 10 < f:
            return gap / 10, Note.of("floor_gap", gap=gap, divisor=10.0)
        return f, Note.of("floor_storage", dtype=narrow[0], floor=f, measured=measured / precision.STORAGE_MARGIN)
