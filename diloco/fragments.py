"""Splitting a model into fragments.

A fragment is an ordered list of named parameters that syncs as one flat float32
vector. The model's repeated blocks (the first ``nn.ModuleList`` found, or the one
named) are assigned to fragments ``strided`` (block i goes to fragment i % P) or
``sequential`` (runs of consecutive blocks). Parameters outside the blocks join
fragment 0, or form a fragment of their own (counted in P) with ``separate_rest``.
Explicit lists of parameter names are accepted too.

With ``split`` the fragments hold equal shares instead: the parameters, in the order
the whole-tensor plan gives them (fragment 0's, then fragment 1's, ...), form one
virtual vector of N values, cut at ``c_i = floor(i * N / P / B) * B`` (B the block
size), so every fragment holds N / P values to within one block and a tensor may
end in one fragment and go on in the next. A piece of a tensor is a ``ParamSpec``
with a ``[start, stop)`` range of the flattened parameter.

The plan's ``describe()`` output is what the run manifest stores, so a worker whose
model does not match the run fails with a message naming the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamSpec:
    """A parameter, or the ``[start, stop)`` piece of it (flattened) a fragment holds."""

    name: str
    shape: tuple[int, ...]
    start: int = 0
    stop: int | None = None  # None: to the end

    @property
    def size(self) -> int:
        """Values in the whole parameter."""
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.size if self.stop is None else self.stop

    @property
    def numel(self) -> int:
        """Values in this piece (the whole parameter unless sliced)."""
        return self.end - self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == self.size

    def describe(self) -> dict:
        """Manifest entry; ``slice`` only for a partial piece, so whole-tensor plans
        describe exactly as they did before tensors could be split."""
        out: dict = {"name": self.name, "shape": list(self.shape)}
        if not self.whole:
            out["slice"] = [self.start, self.end]
        return out


@dataclass(frozen=True)
class Fragment:
    """One fragment: parameters in a fixed order, flattened into one vector."""

    index: int
    params: tuple[ParamSpec, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]


class FragmentPlan:
    """The fragments of one model, with flatten / unflatten helpers."""

    def __init__(self, fragments: Sequence[Fragment]):
        self.fragments = list(fragments)

    def __len__(self) -> int:
        return len(self.fragments)

    def __getitem__(self, index: int) -> Fragment:
        return self.fragments[index]

    def describe(self) -> list[dict]:
        """JSON-able description for the run manifest."""
        return [
            {
                "index": f.index,
                "numel": f.numel,
                "params": [p.describe() for p in f.params],
            }
            for f in self.fragments
        ]

    def check_against(self, described: list[dict]) -> None:
        """Raise ValueError naming the first difference from a manifest's fragment map."""
        mine = self.describe()
        if len(mine) != len(described):
            raise ValueError(
                f"the model has {len(mine)} fragments but the run has {len(described)}"
            )
        for a, b in zip(mine, described, strict=True):
            pa = [_label(p) for p in a["params"]]
            pb = [_label(p) for p in b["params"]]
            if pa == pb:
                continue
            for x, y in zip(pa, pb, strict=False):
                if x != y:
                    raise ValueError(
                        f"fragment {a['index']}: the model has parameter {x} where the run "
                        f"has {y}"
                    )
            if len(pa) > len(pb):
                raise ValueError(
                    f"fragment {a['index']}: the model has parameter {pa[len(pb)]} that "
                    f"the run lacks"
                )
            raise ValueError(
                f"fragment {a['index']}: the run has parameter {pb[len(pa)]} that the "
                f"model lacks"
            )

    def param_names(self) -> list[str]:
        """Every parameter the plan covers, once, in plan order (a parameter split over
        two fragments appears once): what an island broadcasts after a full sync."""
        return list(dict.fromkeys(p.name for f in self.fragments for p in f.params))

    def gather(self, model: nn.Module, index: int, out: torch.Tensor | None = None,
               on_device: bool = False) -> torch.Tensor:
        """Fragment ``index`` of ``model`` as a flat float32 CPU vector. From a CUDA
        model the pieces are copied without waiting, into pinned memory, and the stream
        is synchronised once at the end (on the CPU the same copies, in order).
        ``on_device``: the vector stays on the model's device instead (the outer state
        kept there, ``sync.outer.device: device``): no host copy, no wait."""
        frag = self.fragments[index]
        named = dict(model.named_parameters())
        device = named[frag.params[0].name].device if frag.params else torch.device("cpu")
        if on_device and device.type != "cpu":
            out = torch.empty(frag.numel, dtype=torch.float32, device=device)
            offset = 0
            with torch.no_grad():
                for spec in frag.params:
                    out[offset : offset + spec.numel].copy_(_flat(named[spec.name], spec))
                    offset += spec.numel
            return out
        cuda = device.type == "cuda"
        if out is None:
            out = torch.empty(frag.numel, dtype=torch.float32, pin_memory=cuda)
        offset = 0
        with torch.no_grad():
            for spec in frag.params:
                n = spec.numel
                out[offset : offset + n].copy_(_flat(named[spec.name], spec),
                                               non_blocking=cuda and out.is_pinned())
                offset += n
        if cuda:
            torch.cuda.current_stream(device).synchronize()  # before the caller reads out
        return out

    def scatter(self, model: nn.Module, index: int, flat: torch.Tensor) -> None:
        """Write a flat vector into fragment ``index`` of ``model`` (any device/dtype).
        To a CUDA model the vector goes through pinned memory without blocking the
        host (the copies are ordered before the next kernels on the stream)."""
        frag = self.fragments[index]
        named = dict(model.named_parameters())
        cuda = bool(frag.params) and named[frag.params[0].name].device.type == "cuda"
        if cuda and flat.device.type == "cpu" and not flat.is_pinned():
            flat = flat.pin_memory()
        offset = 0
        with torch.no_grad():
            for spec in frag.params:
                n = spec.numel
                p = named[spec.name]
                if spec.whole:
                    p.copy_(flat[offset : offset + n].view(spec.shape), non_blocking=cuda)
                else:
                    _flat(p, spec).copy_(flat[offset : offset + n], non_blocking=cuda)
                offset += n


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU (itself if it is there): from CUDA through pinned memory
    without blocking, then one wait on the stream before the caller reads it."""
    if t.device.type != "cuda":
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the CPU) on ``device`` (itself for the CPU): to CUDA from pinned
    memory without blocking the host; the copy is ordered before the next kernels
    on the stream, and the pinned buffer is held until it is done (torch's caching
    host allocator records the stream)."""
    if device.type != "cuda":
        return t.to(device)
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _label(p: dict) -> str:
    """``name [shape]``, plus ``[start:stop]`` for a piece: how errors name a parameter."""
    out = f"{p['name']} {list(p['shape'])}"
    if p.get("slice") is not None:
        out += f" [{p['slice'][0]}:{p['slice'][1]}]"
    return out


def _flat(param: torch.Tensor, spec: ParamSpec) -> torch.Tensor:
    """The values of ``spec`` in ``param`` as a 1-D view (writes reach the parameter).

    A piece of a non-contiguous parameter would be a copy, and scatter would write
    into the copy and lose the update, so it is refused.
    """
    if spec.whole:
        return param.detach().reshape(-1)
    if not param.is_contiguous():
        raise ValueError(
            f"parameter {spec.name} is not contiguous, so fragments cannot hold a piece of "
            f"it: make it contiguous or set sync.schedule.split_tensors: false"
        )
    return param.detach().view(-1)[spec.start : spec.end]


def find_blocks(model: nn.Module, attr: str | None = None) -> tuple[str, nn.ModuleList] | None:
    """The model's repeated blocks: the ModuleList at ``attr``, or the first one found."""
    if attr is not None:
        mod = model.get_submodule(attr)
        if not isinstance(mod, nn.ModuleList):
            raise ValueError(f"blocks attribute {attr!r} is not an nn.ModuleList")
        return attr, mod
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            return name, mod
    return None


def plan_fragments(
    model: nn.Module,
    num_fragments: int,
    *,
    pattern: str = "strided",
    separate_rest: bool = False,
    blocks_attr: str | None = None,
    explicit: Sequence[Sequence[str]] | None = None,
    split: bool = False,
    block_size: int = 128,
) -> FragmentPlan:
    """Split ``model`` into ``num_fragments`` fragments (see the module docstring).

    ``split`` cuts the whole-tensor plan's order into equal shares (whole blocks of
    ``block_size`` values); explicit plans and P = 1 are never split."""
    named = dict(model.named_parameters())
    order = {name: i for i, name in enumerate(named)}

    def spec(name: str) -> ParamSpec:
        return ParamSpec(name, tuple(named[name].shape))

    if explicit is not None:
        if len(explicit) != num_fragments:
            raise ValueError(
                f"explicit fragments: {len(explicit)} lists given for fragments (P) = "
                f"{num_fragments}"
            )
        seen: set[str] = set()
        frags = []
        for i, names in enumerate(explicit):
            for n in names:
                if n not in named:
                    raise ValueError(f"explicit fragments: no parameter named {n!r}")
                if n in seen:
                    raise ValueError(f"explicit fragments: parameter {n!r} listed twice")
                seen.add(n)
            if not names:
                raise ValueError(f"explicit fragments: fragment {i} is empty")
            frags.append(Fragment(i, tuple(spec(n) for n in names)))
        missing = [n for n in named if n not in seen]
        if missing:
            raise ValueError(f"explicit fragments: parameters in no fragment: {missing}")
        return FragmentPlan(frags)

    if pattern not in ("strided", "sequential"):
        raise ValueError(f"pattern must be 'strided' or 'sequential', got {pattern!r}")
    found = find_blocks(model, blocks_attr)
    block_groups: list[list[str]] = []
    in_blocks: set[str] = set()
    if found is not None:
        prefix, blocks = found
        for i, block in enumerate(blocks):
            head = f"{prefix}.{i}." if prefix else f"{i}."
            names = [head + n for n, _ in block.named_parameters()]
            names = [n for n in names if n in named]  # tied/shared params appear once
            block_groups.append(names)
            in_blocks.update(names)
    rest = [n for n in named if n not in in_blocks]

    n_block_frags = num_fragments - (1 if separate_rest else 0)
    if n_block_frags < 1 or (block_groups and n_block_frags > len(block_groups)):
        raise ValueError(
            f"fragments (P) = {num_fragments} does not fit a model with "
            f"{len(block_groups)} repeated blocks"
            + (" and a separate rest fragment" if separate_rest else "")
        )
    if not block_groups and num_fragments != 1:
        raise ValueError(
            f"the model has no repeated blocks (nn.ModuleList), so fragments (P) must be 1 "
            f"or explicit lists; got {num_fragments}"
        )

    groups: list[list[str]] = [[] for _ in range(n_block_frags)]
    nb = len(block_groups)
    for i, names in enumerate(block_groups):
        if pattern == "strided":
            f = i % n_block_frags
        else:
            f = i * n_block_frags // nb
        groups[f].extend(names)
    if separate_rest:
        groups.insert(0, rest)
    else:
        groups[0] = rest + groups[0] if block_groups else rest
    frags = []
    for i, names in enumerate(groups):
        if not names:
            raise ValueError(f"fragment {i} would be empty")
        names = sorted(names, key=order.__getitem__)
        frags.append(Fragment(i, tuple(spec(n) for n in names)))
    if split and num_fragments > 1:
        return FragmentPlan(split_evenly(frags, block_size))
    return FragmentPlan(frags)


def split_evenly(frags: Sequence[Fragment], block: int) -> list[Fragment]:
    """Re-cut ``frags`` (their parameters in order, as one vector of N values) at
    ``c_i = floor(i * N / P / block) * block``: P fragments of N / P values to within
    one block, a parameter cut where a boundary falls inside it."""
    if block < 1:
        raise ValueError(f"block_size must be >= 1, got {block}")
    order = [p for f in frags for p in f.params]
    total = sum(p.numel for p in order)
    n_frags = len(frags)
    cuts = [i * total // (n_frags * block) * block for i in range(n_frags)] + [total]
    out: list[Fragment] = []
    for i in range(n_frags):
        lo, hi = cuts[i], cuts[i + 1]
        if hi <= lo:
            raise ValueError(
                f"fragment {i} would be empty: {total} parameters do not fill fragments "
                f"(P) = {n_frags} blocks of {block}"
            )
        out.append(Fragment(i, tuple(_pieces(order, lo, hi))))
    return out


def _pieces(order: Sequence[ParamSpec], lo: int, hi: int) -> list[ParamSpec]:
    """The parts of ``order`` (whole parameters laid end to end) in ``[lo, hi)``."""
    pieces = []
    offset = 0
    for p in order:
        a, b = max(lo, offset), min(hi, offset + p.size)
        if a < b:
            start, stop = a - offset, b - offset
            whole = start == 0 and stop == p.size
            pieces.append(p if whole else ParamSpec(p.name, p.shape, start, stop))
        offset += p.size
        if offset >= hi:
            break
    return pieces
