"""The declarative reshaping rules of a model, by parameter-name pattern.

One :class:`ReshapeRule` per pattern (a regular expression matched against the
fully-qualified name with ``re.fullmatch``; the first matching rule wins; a
name no rule matches is replicated):

* ``cat_dim`` — the dimension tensor parallelism splits (``None``: replicated);
* ``parts`` — sub-parameter sizes along ``cat_dim`` for fused weights (QKV,
  gate/up): each part is split over the TP ranks separately, so TP rank r holds
  ``[q_r; k_r; v_r]``, not a contiguous block of the fused weight;
* ``vocab`` — the dimension is a vocabulary padded for divisibility: the
  universal atom keeps only the real rows, a layout adds zero rows as it needs;
* ``average`` — copies held by several ranks may differ and are averaged on
  extraction (e.g. norms under sequence parallelism); otherwise copies must be
  bit-identical.

Pipeline stages: parameters named like ``layer_pattern`` (default
``layers.<i>.``) are split over the stages in order and renamed to the stage's
local index; other names go to the first stage when they match a
``first_stage`` pattern, else to the last.

Tied parameters (``ties``: alias -> canonical name, e.g. an LM head that
shares the input embedding's tensor) are saved once, under the canonical name;
the alias is recorded here. A module that holds both as one tensor loads it
once; a module (or a pipeline stage) that holds the alias as its own tensor
gets it filled from the canonical atom, and saving merges such copies like
replicas (bit-identical). Under tensor parallelism one tied tensor is split
once, so the alias's rule must split it as the canonical's does.

The spec is stored in ``global.json`` (``extra["universal"]["spec"]``) so a
checkpoint carries the rules it was written with.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkmate.checkpoint import CheckpointError


class LayoutError(CheckpointError):
    """A layout or rule that cannot hold the checkpoint; the message names the parameter and the rule."""


@dataclass(frozen=True)
class ReshapeRule:
    pattern: str
    cat_dim: int | None = None
    parts: tuple[int, ...] | None = None
    vocab: bool = False
    average: bool = False
    head_dim: int | None = None
    """Attention head size along ``cat_dim``: TP must give every rank whole heads of each part."""

    def describe(self) -> str:
        bits = [f"pattern '{self.pattern}'", f"cat_dim={self.cat_dim}"]
        if self.parts:
            bits.append(f"parts={list(self.parts)}")
        if self.head_dim:
            bits.append(f"head_dim={self.head_dim}")
        if self.vocab:
            bits.append("vocab")
        if self.average:
            bits.append("average")
        return "rule(" + ", ".join(bits) + ")"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pattern": self.pattern, "cat_dim": self.cat_dim}
        if self.parts:
            out["parts"] = list(self.parts)
        if self.head_dim:
            out["head_dim"] = self.head_dim
        if self.vocab:
            out["vocab"] = True
        if self.average:
            out["average"] = True
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> ReshapeRule:
        if not isinstance(data, Mapping) or not isinstance(data.get("pattern"), str):
            raise LayoutError(f"{where}: a rule needs a 'pattern' string, got {data!r}")
        unknown = set(data) - {"pattern", "cat_dim", "parts", "vocab", "average", "head_dim"}
        if unknown:
            raise LayoutError(f"{where}: rule {data['pattern']!r} has unknown keys {sorted(unknown)}")
        try:
            re.compile(data["pattern"])
        except re.error as exc:
            raise LayoutError(f"{where}: rule pattern {data['pattern']!r} is not a regex ({exc})") from None
        cat_dim = data.get("cat_dim")
        if cat_dim is not None and (not isinstance(cat_dim, int) or isinstance(cat_dim, bool) or cat_dim < 0):
            raise LayoutError(f"{where}: rule {data['pattern']!r}: cat_dim must be a dimension index or null")
        parts = data.get("parts")
        if parts is not None:
            if (
                not isinstance(parts, list)
                or not parts
                or not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in parts)
            ):
                raise LayoutError(f"{where}: rule {data['pattern']!r}: parts must list positive sizes")
            parts = tuple(parts)
        head_dim = data.get("head_dim")
        if head_dim is not None and (
            not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1
        ):
            raise LayoutError(f"{where}: rule {data['pattern']!r}: head_dim must be a positive size")
        rule = cls(
            data["pattern"],
            cat_dim,
            parts,
            bool(data.get("vocab", False)),
            bool(data.get("average")),
            head_dim,
        )
        if (rule.parts or rule.vocab or rule.head_dim) and rule.cat_dim is None:
            raise LayoutError(
                f"{where}: {rule.describe()}: parts and vocab need a cat_dim (so does head_dim)"
            )
        if rule.parts and rule.vocab:
            raise LayoutError(f"{where}: {rule.describe()}: a fused parameter cannot be a vocabulary")
        return rule


REPLICATED = ReshapeRule(pattern="(default)")

FUSED_NAME = re.compile(
    r"(qkv|query_key_value|c_attn|in_proj|kv_proj|wkv|gate_up|up_gate|w13|w1w3|fc1_fc3)", re.IGNORECASE
)
"""Names of parameters that usually fuse sub-parameters (QKV, gate/up): TP splits each part."""


def check_fused(name: str, rule: ReshapeRule, tp: int, split_dim: int | None) -> None:
    """Refuse a fused-looking parameter that TP splits under a rule without ``parts``."""
    match = FUSED_NAME.search(name)
    if tp <= 1 or split_dim is None or rule.parts or match is None:
        return
    pattern = rule.pattern if rule.pattern != "(default)" else re.escape(name)
    raise LayoutError(
        f"{name}: looks fused ({match.group(0)!r}) and tensor parallelism (degree {tp}) splits dim "
        f"{split_dim}, but {rule.describe()} has no 'parts': each TP rank holds its slice of every "
        f"sub-parameter, so it would be stored rank-interleaved. Fix: give its rule the sub-parameter "
        f'sizes, e.g. {{"pattern": "{pattern}", "cat_dim": {split_dim}, "parts": [q, k, v], '
        f'"head_dim": h}}, or "parts": [<dim size>] if it is one matrix'
    )


@dataclass(frozen=True)
class ReshapeSpec:
    rules: tuple[ReshapeRule, ...] = ()
    layer_pattern: str = r"layers\.(\d+)\."
    first_stage: tuple[str, ...] = ()
    ties: tuple[tuple[str, str], ...] = ()
    """(alias, canonical) pairs of parameters that share one tensor."""
    _compiled: tuple[re.Pattern[str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", tuple(re.compile(r.pattern) for r in self.rules))
        aliases = dict(self.ties)
        for alias, canonical in self.ties:
            if alias == canonical or canonical in aliases or len(aliases) != len(self.ties):
                raise LayoutError(
                    f"ties: {alias} -> {canonical}: an alias names one other parameter that is not itself "
                    f"an alias, once"
                )

    def canonical(self, name: str) -> str:
        """The name ``name``'s tensor is saved under (itself unless it is a tied alias)."""
        return dict(self.ties).get(name, name)

    def with_aliases(self, shapes: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """``shapes`` (checkpoint names) plus each tied alias with its canonical's shape."""
        out = {n: tuple(s) for n, s in shapes.items()}
        for alias, canonical in self.ties:
            if canonical in out:
                out.setdefault(alias, out[canonical])
        return out

    def check_tie(self, alias: str, shape: Sequence[int], tp: int) -> None:
        """A tied alias held as the canonical's very tensor: under TP both rules must split it alike."""
        canonical = self.canonical(alias)
        mine, theirs = self.check_rule(alias, shape), self.check_rule(canonical, shape)
        if tp > 1 and (mine.cat_dim, mine.parts, mine.vocab) != (theirs.cat_dim, theirs.parts, theirs.vocab):
            raise LayoutError(
                f"{alias}: tied to {canonical}, but {mine.describe()} splits it otherwise than "
                f"{canonical}'s {theirs.describe()}; one tensor cannot be split two ways at TP degree {tp} "
                f"(untie them, or give both the same rule)"
            )

    def rule(self, name: str) -> ReshapeRule:
        for rule, compiled in zip(self.rules, self._compiled, strict=True):
            if compiled.fullmatch(name):
                return rule
        return REPLICATED

    def layer_index(self, name: str) -> tuple[int, int, int] | None:
        """(layer, start, end) of the layer number in ``name``, or None."""
        match = re.search(self.layer_pattern, name)
        if not match:
            return None
        return int(match.group(1)), match.start(1), match.end(1)

    def on_first_stage(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.first_stage)

    def check_rule(self, name: str, shape: Sequence[int]) -> ReshapeRule:
        """The rule for ``name``, checked against the parameter's logical ``shape``."""
        rule = self.rule(name)
        if rule.cat_dim is not None and rule.cat_dim >= len(shape):
            raise LayoutError(f"{name}: {rule.describe()} but the parameter has {len(shape)} dimensions")
        if rule.parts and sum(rule.parts) != shape[rule.cat_dim or 0]:
            raise LayoutError(
                f"{name}: {rule.describe()}: the parts add up to {sum(rule.parts)}, "
                f"dim {rule.cat_dim} has {shape[rule.cat_dim or 0]}"
            )
        if rule.head_dim:
            for part in rule.parts or (shape[rule.cat_dim or 0],):
                if part % rule.head_dim:
                    raise LayoutError(
                        f"{name}: {rule.describe()}: a part of size {part} is not whole heads of "
                        f"{rule.head_dim}; fix head_dim or parts"
                    )
        return rule

    def to_hash(self) -> str:
        """SHA-256 of the spec's canonical JSON (recorded with a checkpoint next to the spec)."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "rules": [r.to_json() for r in self.rules],
            "layer_pattern": self.layer_pattern,
            "first_stage": list(self.first_stage),
            **({"ties": dict(self.ties)} if self.ties else {}),
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "spec") -> ReshapeSpec:
        if not isinstance(data, Mapping) or not isinstance(data.get("rules", []), list):
            raise LayoutError(f"{where}: expected an object with a 'rules' list")
        unknown = set(data) - {"rules", "layer_pattern", "first_stage", "ties"}
        if unknown:
            raise LayoutError(f"{where}: unknown keys {sorted(unknown)}")
        layer_pattern = data.get("layer_pattern", r"layers\.(\d+)\.")
        first_stage = data.get("first_stage", [])
        if not isinstance(layer_pattern, str) or not isinstance(first_stage, list):
            raise LayoutError(f"{where}: layer_pattern must be a string and first_stage a list")
        try:
            if re.compile(layer_pattern).groups < 1:
                raise LayoutError(f"{where}: layer_pattern needs one group capturing the layer number")
        except re.error as exc:
            raise LayoutError(f"{where}: layer_pattern is not a regex ({exc})") from None
        ties = data.get("ties", {})
        if not isinstance(ties, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in ties.items()
        ):
            raise LayoutError(f"{where}: ties must map alias names to canonical names")
        rules = tuple(ReshapeRule.from_json(r, where) for r in data.get("rules", []))
        return cls(rules, layer_pattern, tuple(str(p) for p in first_stage), tuple(sorted(ties.items())))

    @classmethod
    def load(cls, path: Path) -> ReshapeSpec:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LayoutError(f"{path}: cannot read the reshape spec ({exc})") from None
        return cls.from_json(data, str(path))


def spec_of_checkpoint(global_state: Mapping[str, Any]) -> ReshapeSpec | None:
    """The spec a checkpoint was written with (``extra["universal"]["spec"]``), or None."""
    extra = global_state.get("extra")
    universal = extra.get("universal") if isinstance(extra, Mapping) else None
    if not isinstance(universal, Mapping) or "spec" not in universal:
        return None
    return ReshapeSpec.from_json(universal["spec"], "global.json extra.universal.spec")


def check_compatible(saved: ReshapeSpec, target: ReshapeSpec, names: Sequence[str]) -> None:
    """A target spec must split fused parameters the way they were saved, and tie the same names."""
    if dict(saved.ties) != dict(target.ties):
        raise LayoutError(
            f"the checkpoint was saved with tied parameters {dict(saved.ties)}, the target spec ties "
            f"{dict(target.ties)}; a tie decides which names share one saved tensor"
        )
    for name in names:
        before, after = saved.rule(name), target.rule(name)
        if before.parts != after.parts:
            raise LayoutError(
                f"{name}: saved with sub-parameter rule {before.describe()}, the target spec has "
                f"{after.describe()}; a fused parameter needs the same parts to be split correctly "
                f"(fix: give the target rule parts={list(before.parts or ())} or load without a spec)"
            )
        if before.head_dim and after.head_dim and before.head_dim != after.head_dim:
            raise LayoutError(
                f"{name}: saved with {before.describe()}, the target spec has {after.describe()}; "
                f"the head size is the model's (fix: head_dim={before.head_dim})"
            )
