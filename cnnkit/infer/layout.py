"""A layered (Sugiyama-style) drawing of a DAG, as graphviz's dot makes: longest-path layers,
dummy nodes on edges that span layers, barycentre sweeps against crossings, priority placement
of x; every edge runs through its dummies, so a skip connection passes beside the chain."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate, pairwise

Point = tuple[float, float]


@dataclass
class Layout:
    """Boxes by name: (x centre, y centre, width, height), y down the page as negative numbers;
    edges: (source, target, polyline from the source's bottom edge to the target's top edge).
    Every box of a layer has the same height, and between layers edges only cross the gaps."""

    boxes: dict[str, tuple[float, float, float, float]]
    edges: list[tuple[str, str, list[Point]]]
    width: float
    height: float


def layered_layout(
    nodes: list[str], edges: list[tuple[str, str]], widths: dict[str, float],
    box_height: float, gap_x: float, gap_y: float, sweeps: int = 12,
) -> Layout:  # fmt: skip
    """Lay out `nodes` (in a topological order) joined by `edges` (source, target)."""
    rank, order = {n: 0 for n in nodes}, {n: i for i, n in enumerate(nodes)}
    for u, v in sorted(edges, key=lambda e: order[e[1]]):
        rank[v] = max(rank[v], rank[u] + 1)
    layers: list[list] = [[] for _ in range(max(rank.values()) + 1)]
    for n in nodes:
        layers[rank[n]].append(n)
    paths = []  # each edge as its chain of nodes, one per layer
    for k, (u, v) in enumerate(edges):
        dummies = [("dummy", k, r) for r in range(rank[u] + 1, rank[v])]
        for d in dummies:
            layers[d[2]].append(d)
        paths.append([u, *dummies, v])
    up: dict = {n: [] for layer in layers for n in layer}
    down: dict = {n: [] for layer in layers for n in layer}
    for path in paths:
        for a, b in pairwise(path):
            down[a].append(b)
            up[b].append(a)
    layers = _order(layers, up, down, sweeps)
    width_of = {n: widths[n] if isinstance(n, str) else 0.0 for n in up}
    x = _place(layers, up, down, width_of, gap_x, sweeps)
    left = min(x[n] - width_of[n] / 2 for n in x)
    x = {n: v - left for n, v in x.items()}
    row = box_height + gap_y
    y = {n: -r * row for r, layer in enumerate(layers) for n in layer}
    boxes = {n: (x[n], y[n], widths[n], box_height) for n in nodes}
    routed = [(p[0], p[-1], _route(p, x, y, box_height)) for p in paths]
    _spread_ports(routed, boxes)
    total = max(x[n] + width_of[n] / 2 for n in x)
    return Layout(boxes, routed, total, len(layers) * row - gap_y)


def crossings(upper: list, lower: list, down: dict) -> int:
    """How many edge pairs cross between two adjacent layers: with the edges sorted by their
    upper end, the pairs whose lower ends come in the other order (strictly: edges sharing an
    end do not cross), counted with a Fenwick tree in O(E log E)."""
    at = {n: i for i, n in enumerate(lower)}
    ends = sorted((i, at[b]) for i, a in enumerate(upper) for b in down[a] if b in at)
    tree, count = [0] * (len(lower) + 1), 0
    for seen, (_, b) in enumerate(ends):
        k, at_most_b = b + 1, 0  # edges seen so far whose lower end is <= b
        while k > 0:
            at_most_b += tree[k]
            k -= k & -k
        count += seen - at_most_b
        k = b + 1
        while k < len(tree):
            tree[k] += 1
            k += k & -k
    return count


def _order(layers: list[list], up: dict, down: dict, sweeps: int) -> list[list]:
    """Barycentre sweeps, down then up: each layer sorted by the mean position of its
    neighbours in the layer just swept; the order with the fewest crossings is kept."""

    def total(ls):
        return sum(crossings(a, b, down) for a, b in pairwise(ls))

    best, best_count = [list(layer) for layer in layers], total(layers)
    current = [list(layer) for layer in layers]
    for sweep in range(sweeps):
        downward = sweep % 2 == 0
        indices = range(1, len(current)) if downward else range(len(current) - 2, -1, -1)
        for i in indices:
            fixed = current[i - 1] if downward else current[i + 1]
            pos = {n: j for j, n in enumerate(fixed)}
            near = up if downward else down
            key = {}
            for j, n in enumerate(current[i]):
                ps = [pos[m] for m in near[n] if m in pos]
                key[n] = sum(ps) / len(ps) if ps else j
            current[i].sort(key=lambda n: key[n])  # stable: ties keep their order
        count = total(current)
        if count < best_count:
            best, best_count = [list(layer) for layer in current], count
    return best


def _place(layers, up, down, width_of, gap_x: float, sweeps: int) -> dict:
    """x of every node: sweeps in which each node moves towards the median x of its neighbours
    in the layer before, real nodes before dummies (so that the main chain stays straight and
    long edges step aside), never closer to its neighbours in the layer than `gap_x`."""
    x = {}
    for layer in layers:
        at = 0.0
        for n in layer:
            x[n] = at + width_of[n] / 2
            at += width_of[n] + gap_x
    for sweep in range(sweeps + 1):  # odd count: the last sweep goes down the page
        downward = sweep % 2 == 0
        near = up if downward else down
        for layer in layers if downward else layers[::-1]:
            wanted = {n: _median(x, n, near[n]) for n in layer}
            _spread_ties(layer, wanted, width_of, gap_x)
            _settle(layer, x, wanted, width_of, gap_x, near)
    return x


def _median(x: dict, node, neighbours: list) -> float:
    real = [m for m in neighbours if isinstance(m, str)] if isinstance(node, str) else []
    values = sorted(x[m] for m in (real or neighbours))
    if not values:
        return x[node]
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _spread_ties(layer: list, wanted: dict, width_of: dict, gap_x: float) -> None:
    """Side-by-side real nodes that want one x (branches of one fork) share it: spread them
    evenly around it, so that a fork is centred under its source instead of drifting right."""
    i = 0
    while i < len(layer):
        j = i + 1
        while (j < len(layer) and isinstance(layer[j], str) and isinstance(layer[i], str)
               and abs(wanted[layer[j]] - wanted[layer[i]]) < 1e-9):  # fmt: skip
            j += 1
        if j - i > 1:
            offsets = [0.0]
            for a, b in pairwise(layer[i:j]):
                offsets.append(offsets[-1] + (width_of[a] + width_of[b]) / 2 + gap_x)
            centre = wanted[layer[i]] - offsets[-1] / 2
            for n, offset in zip(layer[i:j], offsets, strict=True):
                wanted[n] = centre + offset
        i = j


def _settle(layer: list, x: dict, wanted: dict, width_of: dict, gap_x: float, near: dict) -> None:
    """Place a layer's nodes by priority (real, then most neighbours), each as close to where
    it wants to be as the nodes already placed allow, pushing the unplaced aside.

    Neighbours in a layer are always at least their separation apart, so a push stops at the
    first node that need not move, and the nearest placed nodes are found by bisection: about
    linear per layer, not quadratic (a net whose every block reads the input has layers
    hundreds of dummies wide)."""
    sep = [(width_of[a] + width_of[b]) / 2 + gap_x for a, b in pairwise(layer)]
    packed = list(accumulate(sep, initial=0.0))  # packed[k] - packed[j]: the least j..k span
    pos = [x[n] for n in layer]
    placed: list[int] = []  # indices, sorted
    order = sorted(range(len(layer)), key=lambda i: (isinstance(layer[i], str), len(near[layer[i]])),
                   reverse=True)  # fmt: skip
    for i in order:
        k = bisect_left(placed, i)
        left, right = (placed[k - 1] if k else None), (placed[k] if k < len(placed) else None)
        lo = -float("inf") if left is None else pos[left] + packed[i] - packed[left]
        hi = float("inf") if right is None else pos[right] - (packed[right] - packed[i])
        pos[i] = min(max(wanted[layer[i]], lo), hi)
        placed.insert(k, i)
        for j in range(i + 1, len(layer) if right is None else right):  # push right
            if pos[j] >= pos[j - 1] + sep[j - 1]:
                break
            pos[j] = pos[j - 1] + sep[j - 1]
        for j in range(i - 1, -1 if left is None else left, -1):  # push left
            if pos[j] <= pos[j + 1] - sep[j]:
                break
            pos[j] = pos[j + 1] - sep[j]
    x.update(zip(layer, pos, strict=True))


def _route(path: list, x: dict, y: dict, h: float) -> list[Point]:
    """The source's bottom, down each dummy's layer as a vertical line, the target's top."""
    points = [(x[path[0]], y[path[0]] - h / 2)]
    for d in path[1:-1]:
        points += [(x[d], y[d] + h / 2), (x[d], y[d] - h / 2)]
    return [*points, (x[path[-1]], y[path[-1]] + h / 2)]


def _spread_ports(routed: list, boxes: dict) -> None:
    """Edges leaving (entering) one box start (end) at points spread along its bottom (top),
    left to right as their other ends lie, so that no two arrows share a line."""
    for side, end in ((0, 0), (1, -1)):  # (which box, which end of the line)
        by_box: dict[str, list] = {}
        for edge in routed:
            by_box.setdefault(edge[side], []).append(edge[2])
        for name, lines in by_box.items():
            if len(lines) < 2:
                continue
            cx, _, w, _ = boxes[name]
            lines.sort(key=lambda pts: pts[1 if end == 0 else -2][0])
            step = min(w / (len(lines) + 1), 0.12)
            for i, pts in enumerate(lines):
                pts[end] = (cx + (i - (len(lines) - 1) / 2) * step, pts[end][1])
