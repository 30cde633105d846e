"""A parallel layout and what each of its ranks holds of every parameter.

``Layout(tp, pp, dp, zero, fsdp)``: rank = ``(pp_index * dp + dp_index) * tp +
tp_index`` (TP fastest, as in Megatron-LM). Each rank holds:

* the parameters of its pipeline stage, renamed to the stage's local layer
  numbers (:func:`stage_names`);
* each as its TP-local tensor (:func:`storage_pieces` + the rank's rows of the
  cat dim), fused parts split per part, vocabulary padded;
* with ``fsdp``: dim-0 chunk ``dp_index`` of that tensor (torch ``Shard(0)``
  semantics, uneven allowed) for parameters and optimizer state;
* with ``zero`` 1/2: optimizer state as a contiguous range of the flat
  concatenation of the stage's TP-local tensors (padded to a multiple of
  ``dp * align``); with ``zero`` 3 the parameters too.

:func:`rank_holdings` returns pieces (logical box -> local box or flat offset),
so loading and saving any layout is the same copy loop.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from checkmate.universal.geometry import (
    Box,
    Piece,
    chunk_bounds,
    extents,
    flat_range_boxes,
    numel,
    restrict,
    whole,
)
from checkmate.universal.spec import LayoutError, ReshapeRule, ReshapeSpec, check_fused


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    fsdp: bool = False
    align: int = 1
    """ZeRO flat partitions are padded to a multiple of ``dp * align`` elements."""

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "align"):
            if getattr(self, key) < 1:
                raise LayoutError(f"layout: {key} must be >= 1, got {getattr(self, key)}")
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"layout: zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.fsdp and self.zero:
            raise LayoutError("layout: fsdp and zero are alternatives; pick one")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_index, dp_index, tp_index) of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is not in 0..{self.world_size - 1} of {self}")
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def describe(self) -> str:
        text = f"tp={self.tp},pp={self.pp},dp={self.dp}"
        if self.zero:
            text += f",zero={self.zero}"
        if self.fsdp:
            text += ",fsdp=1"
        if self.align != 1:
            text += f",align={self.align}"
        return text

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``tp=2,pp=1,dp=3,zero=1`` (missing keys default; ``fsdp=1`` for FSDP2)."""
        values: dict[str, int] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("tp", "pp", "dp", "zero", "fsdp", "align"):
                raise LayoutError(f"layout {text!r}: {item!r} is not one of tp= pp= dp= zero= fsdp= align=")
            try:
                values[key] = int(value)
            except ValueError:
                raise LayoutError(f"layout {text!r}: {key} needs an integer, got {value!r}") from None
        return cls(
            tp=values.get("tp", 1),
            pp=values.get("pp", 1),
            dp=values.get("dp", 1),
            zero=values.get("zero", 0),
            fsdp=bool(values.get("fsdp", 0)),
            align=values.get("align", 1),
        )


def storage_shape(
    name: str, rule: ReshapeRule, logical: Sequence[int], tp: int, vocab_size: int | None = None
) -> tuple[int, ...]:
    """The whole (all TP ranks together) shape a layout of degree ``tp`` stores for ``name``.

    A vocabulary dimension is padded to ``vocab_size`` when given (the target
    model's padded size), else to the next multiple of ``tp``.
    """
    shape = list(logical)
    if rule.cat_dim is None:
        return tuple(shape)
    size = shape[rule.cat_dim]
    if rule.vocab:
        padded = vocab_size if vocab_size is not None else -(-size // tp) * tp
        if padded < size:
            raise LayoutError(
                f"{name}: {rule.describe()}: the target vocabulary dimension has {padded} rows, "
                f"smaller than the saved {size}"
            )
        if padded % tp:
            raise LayoutError(f"{name}: {rule.describe()}: TP degree {tp} does not divide {padded} rows")
        shape[rule.cat_dim] = padded
        return tuple(shape)
    for part in rule.parts or (size,):
        if part % tp:
            what = f"sub-parameter of size {part}" if rule.parts else f"dim {rule.cat_dim} (size {size})"
            raise LayoutError(f"{name}: TP degree {tp} does not divide its {what} ({rule.describe()})")
    check_heads(name, rule, tp, size)
    return tuple(shape)


def check_heads(name: str, rule: ReshapeRule, tp: int, size: int) -> None:
    """Under a rule with ``head_dim``, each TP rank must get whole heads of every part."""
    if not rule.head_dim or tp <= 1:
        return
    for part in rule.parts or (size,):
        heads = part // rule.head_dim
        if heads % tp:
            raise LayoutError(
                f"{name}: TP degree {tp} does not divide its {heads} heads of {rule.head_dim} "
                f"(a part of {part}; {rule.describe()}); use a TP degree that divides {heads}"
            )


def storage_pieces(
    name: str, rule: ReshapeRule, logical: Sequence[int], stored: Sequence[int], tp: int
) -> list[Piece]:
    """Where the logical parameter lies in the whole stored tensor of a TP-degree-``tp`` layout.

    Fused parts are stored rank by rank: rank r's block is ``[part0_r; part1_r; ...]``.
    """
    logical, stored = tuple(logical), tuple(stored)
    if rule.cat_dim is None:
        if logical != stored:
            raise LayoutError(f"{name}: stored shape {stored} differs from {logical} but {rule.describe()}")
        return [Piece(whole(logical), whole(logical))]
    dim = rule.cat_dim
    mismatched = [i for i, (a, b) in enumerate(zip(logical, stored, strict=False)) if a != b and i != dim]
    if len(stored) != len(logical) or mismatched:
        raise LayoutError(f"{name}: stored shape {stored} does not fit {logical} under {rule.describe()}")
    if rule.vocab or not rule.parts:
        if stored[dim] < logical[dim] or (not rule.vocab and stored[dim] != logical[dim]):
            raise LayoutError(
                f"{name}: {rule.describe()}: stored dim {dim} has {stored[dim]}, saved {logical[dim]}"
                + (" (a vocabulary smaller than the saved one)" if rule.vocab else "")
            )
        return [Piece(whole(logical), whole(logical))]
    if stored[dim] != logical[dim]:
        raise LayoutError(
            f"{name}: stored dim {dim} has {stored[dim]}, the parts of {rule.describe()} need {logical[dim]}"
        )
    check_heads(name, rule, tp, logical[dim])
    pieces = []
    block = logical[dim] // tp
    for rank in range(tp):
        local_offset, logical_offset = rank * block, 0
        for part in rule.parts:
            if part % tp:
                raise LayoutError(
                    f"{name}: TP degree {tp} does not divide its sub-parameter of size {part} "
                    f"({rule.describe()})"
                )
            chunk = part // tp
            src = list(whole(logical))
            dst = list(whole(logical))
            src[dim] = (logical_offset + rank * chunk, logical_offset + (rank + 1) * chunk)
            dst[dim] = (local_offset, local_offset + chunk)
            pieces.append(Piece(tuple(src), tuple(dst)))
            local_offset += chunk
            logical_offset += part
    return pieces


def dim_window(shape: Sequence[int], dim: int, lo: int, hi: int) -> Box:
    box = list(whole(shape))
    box[dim] = (lo, hi)
    return tuple(box)


@dataclass
class LocalTensor:
    """One local tensor of a rank: its shape and the logical pieces it holds (the rest is padding)."""

    name: str
    """The checkpoint's (global) name of the parameter (a tied alias's canonical name)."""
    shape: tuple[int, ...]
    pieces: list[Piece]


@dataclass(frozen=True)
class FlatPiece:
    """Logical box ``logical`` of parameter ``name`` at flat offset ``offset`` of a partition."""

    name: str
    logical: Box
    offset: int


@dataclass
class FlatPartition:
    """A ZeRO rank's contiguous range of the padded flat concatenation of its stage's tensors."""

    numel: int
    start: int
    pieces: list[FlatPiece]


@dataclass
class RankHoldings:
    rank: int
    layout: Layout
    tensors: dict[str, LocalTensor]
    """Local name -> the rank's tensor of it (TP-local, FSDP chunk); for parameters unless ``param_flat``."""
    param_flat: FlatPartition | None = None
    """ZeRO-3: the parameters as a flat partition instead of ``tensors``."""
    state_flat: FlatPartition | None = None
    """ZeRO-1/2/3: optimizer states as a flat partition instead of ``tensors``."""
    local_names: dict[str, str] = field(default_factory=dict)
    """Local name -> global name (pipeline renaming; a tied alias keeps its own name)."""


def stage_names(spec: ReshapeSpec, names: Sequence[str], pp: int) -> list[dict[str, str]]:
    """For each stage, local name -> checkpoint name; layers split in order, evenly."""
    layers = sorted({idx[0] for n in names if (idx := spec.layer_index(n)) is not None})
    if layers and layers != list(range(len(layers))):
        raise LayoutError(f"layers are numbered {layers[:8]}..., expected 0..{len(layers) - 1}")
    if pp > 1 and len(layers) % pp:
        raise LayoutError(f"pipeline: {pp} stages do not divide the {len(layers)} layers")
    per_stage = len(layers) // pp if pp > 1 else len(layers)
    stages: list[dict[str, str]] = [{} for _ in range(pp)]
    for name in names:
        idx = spec.layer_index(name)
        if idx is None:
            stage = 0 if (pp == 1 or spec.on_first_stage(name)) else pp - 1
            stages[stage][name] = name
            continue
        layer, start, end = idx
        stage = layer // per_stage if pp > 1 else 0
        local = name[:start] + str(layer - stage * per_stage) + name[end:]
        stages[stage][local] = name
    return stages


def ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, n in zip(index, shape, strict=True):
        flat = flat * n + i
    return flat


def contiguous_split(piece: Piece, shape: Sequence[int]) -> list[Piece]:
    """``piece`` (local box inside a tensor of ``shape``) as pieces each contiguous in row-major order."""
    dims = len(shape)
    split = dims
    while split > 0 and piece.local[split - 1] == (0, shape[split - 1]):
        split -= 1
    # dims [split:] are whole; dim split-1 may be a range; dims before it must be single indices
    lead = max(split - 1, 0)
    out = [piece]
    for dim in range(lead):
        expanded = []
        for item in out:
            (la, _), (pa, pb) = item.logical[dim], item.local[dim]
            for i in range(pb - pa):
                logical = list(item.logical)
                local = list(item.local)
                logical[dim] = (la + i, la + i + 1)
                local[dim] = (pa + i, pa + i + 1)
                expanded.append(Piece(tuple(logical), tuple(local)))
        out = expanded
    return out


def zero_partition(total: int, rank: int, dp: int, align: int) -> tuple[int, int]:
    """DeepSpeed-style: pad ``total`` to a multiple of ``dp * align``; rank's equal range."""
    unit = dp * align
    padded = -(-total // unit) * unit
    size = padded // dp
    return rank * size, (rank + 1) * size


def _flat(tensors: Sequence[LocalTensor], rank: int, dp: int, align: int) -> FlatPartition:
    total = sum(numel(whole(t.shape)) for t in tensors)
    start, stop = zero_partition(total, rank, dp, align)
    pieces: list[FlatPiece] = []
    cursor = 0
    for tensor in tensors:
        count = numel(whole(tensor.shape))
        lo, hi = max(start, cursor), min(stop, cursor + count)
        if lo < hi:
            for offset, box in flat_range_boxes(tensor.shape, lo - cursor, hi - cursor):
                size = extents(box)
                for piece in restrict(tensor.pieces, box):
                    for part in contiguous_split(piece, size):
                        flat_in_box = ravel([a for a, _ in part.local], size)
                        where = cursor + offset - start + flat_in_box
                        pieces.append(FlatPiece(tensor.name, part.logical, where))
        cursor += count
    return FlatPartition(stop - start, start, pieces)


def rank_holdings(
    layout: Layout,
    spec: ReshapeSpec,
    parameters: Mapping[str, Sequence[int]],
    rank: int,
    stored_shapes: Mapping[str, Sequence[int]] | None = None,
    untied: Collection[str] = (),
) -> RankHoldings:
    """What ``rank`` of ``layout`` holds of each parameter (``parameters``: name -> logical shape).

    ``stored_shapes`` (checkpoint name -> whole stored shape) overrides the
    default padding of vocabulary dimensions (the target model's sizes).
    A tied alias (``spec.ties``) on the stage of its canonical parameter is the
    canonical's tensor and not held again, unless named in ``untied`` (a
    module that keeps its own copy); on another stage it is its own copy.
    Either way its pieces read and write the canonical atom.
    """
    pp_index, dp_index, tp_index = layout.coords(rank)
    parameters = spec.with_aliases(parameters)
    stages = stage_names(spec, sorted(parameters), layout.pp)
    stage = {
        local: name
        for local, name in stages[pp_index].items()
        if spec.canonical(name) == name
        or name in untied
        or spec.canonical(name) not in stages[pp_index].values()
    }
    tensors: dict[str, LocalTensor] = {}
    for alias in sorted(set(stages[pp_index].values()) - set(stage.values())):
        spec.check_tie(alias, parameters[alias], layout.tp)
    for local, name in sorted(stage.items()):
        shape = tuple(parameters[name])
        rule = spec.check_rule(name, shape)
        vocab = None
        if stored_shapes and name in stored_shapes and rule.cat_dim is not None:
            vocab = tuple(stored_shapes[name])[rule.cat_dim]
        if rule.cat_dim is not None:
            check_fused(name, rule, layout.tp, rule.cat_dim)
        stored = storage_shape(name, rule, shape, layout.tp, vocab)
        if stored_shapes and name in stored_shapes and tuple(stored_shapes[name]) != stored:
            raise LayoutError(f"{name}: the target stores {tuple(stored_shapes[name])}, rule gives {stored}")
        pieces = storage_pieces(name, rule, shape, stored, layout.tp)
        local_shape = list(stored)
        if rule.cat_dim is not None and layout.tp > 1:
            block = stored[rule.cat_dim] // layout.tp
            window = dim_window(stored, rule.cat_dim, tp_index * block, (tp_index + 1) * block)
            pieces = restrict(pieces, window)
            local_shape[rule.cat_dim] = block
        if layout.fsdp and local_shape:
            lo, hi = chunk_bounds(local_shape[0], dp_index, layout.dp)
            pieces = restrict(pieces, dim_window(local_shape, 0, lo, hi))
            local_shape[0] = hi - lo
        tensors[local] = LocalTensor(spec.canonical(name), tuple(local_shape), pieces)
    holdings = RankHoldings(rank, layout, tensors, local_names=stage)
    if layout.zero:
        ordered = [tensors[k] for k in sorted(tensors)]
        holdings.state_flat = _flat(ordered, dp_index, layout.dp, layout.align)
        if layout.zero == 3:
            holdings.param_flat = holdings.state_flat
    return holdings
