"""Layout of a run's DAG for drawing: grandalf's Sugiyama (layered) layout, top to bottom.

Pure: task names and dependencies in, boxes and edge polylines out — no I/O, no state. Each
connected part of the DAG is laid out on its own and the parts are placed left to right in
the order of their first task. Coordinates are SVG user units with the origin at the top left:
a node's ``x``/``y`` is its box's top-left corner; an edge runs from the bottom centre of its
upstream box, through grandalf's bend points (its dummy vertices on the layers it crosses),
to the top centre of its downstream box.

grandalf 0.8's horizontal placement (Brandes & Köpf) does not always keep a layer's vertices
``xspace`` apart: it can put two of them on the same spot, so each layer is spread afterwards
(:func:`separate`) and the edges are routed again through the moved vertices. The same DAG
always gets the same drawing (grandalf's own edge order would follow memory addresses).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Protocol

from grandalf.graphs import Edge, Graph, Vertex
from grandalf.layouts import SugiyamaLayout
from grandalf.utils.poset import Poset

#: Above this many tasks the layout is refused: grandalf needs seconds beyond it.
MAX_TASKS = 500
NODE_HEIGHT = 36.0
MIN_NODE_WIDTH = 96.0
MAX_NODE_WIDTH = 220.0
#: A rough width of one label character at the stylesheet's font size (no font metrics here).
CHAR_WIDTH = 7.5
LABEL_PADDING = 24.0
ELLIPSIS = "\u2026"
X_SPACE = 36.0  # between boxes of one layer
Y_SPACE = 48.0  # between layers
COMPONENT_GAP = 48.0
MARGIN = 16.0
DECIMALS = 1
#: How many distinct DAG shapes a :class:`LayoutCache` keeps.
CACHE_SIZE = 256

Point = tuple[float, float]
Shape = tuple[tuple[str, tuple[str, ...]], ...]


class TooLargeError(ValueError):
    """The DAG has more tasks than :data:`MAX_TASKS`."""


@dataclass(frozen=True)
class NodeBox:
    """A task's box; ``label`` is the name, shortened with an ellipsis to fit the box."""

    name: str
    label: str
    x: float
    y: float
    width: float
    height: float


@dataclass(frozen=True)
class EdgePath:
    """A dependency ``source`` → ``target`` as a polyline (at least two points)."""

    source: str
    target: str
    points: tuple[Point, ...]


@dataclass(frozen=True)
class Layout:
    """The drawing: its overall size, one box per task (input order), one path per edge
    (sorted by source, then target)."""

    width: float
    height: float
    nodes: tuple[NodeBox, ...]
    edges: tuple[EdgePath, ...]


class _Box:
    """The view grandalf reads (``w``, ``h``) and writes (``xy``, the centre)."""

    def __init__(self, w: float, h: float) -> None:
        self.w = w
        self.h = h
        self.xy: Point = (0.0, 0.0)


class _View(Protocol):
    """What :func:`separate` needs of a vertex view: ours (:class:`_Box`) or a grandalf dummy's."""

    w: float
    xy: Point


class _Route:
    """Receives an edge's points from grandalf (centres of its ends and bends)."""

    def __init__(self) -> None:
        self.points: list[Point] = []

    def setpath(self, pts: Sequence[Point]) -> None:
        self.points = [(float(x), float(y)) for x, y in pts]


def shape_of(tasks: Iterable[tuple[str, Sequence[str]]]) -> Shape:
    """A hashable description of the DAG (what a layout depends on)."""
    return tuple((name, tuple(deps)) for name, deps in tasks)


def node_width(name: str) -> float:
    return min(MAX_NODE_WIDTH, max(MIN_NODE_WIDTH, CHAR_WIDTH * len(name) + LABEL_PADDING))


def label_for(name: str, width: float) -> str:
    """``name`` if it fits ``width``, else its start and an ellipsis."""
    fits = max(1, int((width - LABEL_PADDING) // CHAR_WIDTH))
    return name if len(name) <= fits else name[: fits - 1] + ELLIPSIS


def layout(tasks: Sequence[tuple[str, Sequence[str]]]) -> Layout:
    """Lay out tasks given as (name, names it depends on), in the order they should be listed.

    Raises ValueError for a dependency on an unknown task or a duplicate name, and
    :class:`TooLargeError` above :data:`MAX_TASKS` tasks.
    """
    if len(tasks) > MAX_TASKS:
        raise TooLargeError(f"{len(tasks)} tasks are too many to draw (at most {MAX_TASKS})")
    vertices: dict[str, Vertex] = {}
    for name, _deps in tasks:
        if name in vertices:
            raise ValueError(f"duplicate task name {name!r}")
        vertex = Vertex(name)
        vertex.view = _Box(node_width(name), NODE_HEIGHT)
        vertices[name] = vertex
    edges = []
    for name, deps in tasks:
        for dep in deps:
            if dep not in vertices:
                raise ValueError(f"task {name!r} depends on unknown task {dep!r}")
            edge = Edge(vertices[dep], vertices[name])
            edge.view = _Route()
            edges.append(edge)
    if not vertices:
        return Layout(0.0, 0.0, (), ())
    order = {name: index for index, name in enumerate(vertices)}
    graph = Graph(list(vertices.values()), edges)
    parts = sorted(graph.C, key=lambda part: min(order[v.data] for v in part.sV))
    # grandalf gathers each part's edges in a set, ordered by memory address, and its ranking
    # and ordering follow that order: the same DAG could come out differently from one call to
    # the next. The input order makes the drawing a function of the DAG.
    place = {edge: index for index, edge in enumerate(edges)}
    for part in parts:
        part.sE = Poset(sorted(part.sE, key=place.__getitem__))
    left = MARGIN
    height = 0.0
    for part in parts:
        min_x, max_x, max_y = _lay_out_part(part)
        _shift(part, left - min_x, MARGIN)
        left += (max_x - min_x) + COMPONENT_GAP
        height = max(height, max_y)
    return Layout(
        width=_round(left - COMPONENT_GAP + MARGIN),
        height=_round(height + 2 * MARGIN),
        nodes=tuple(_node(v) for v in vertices.values()),
        edges=tuple(sorted((_edge(e) for e in edges), key=lambda e: (e.source, e.target))),
    )


def _lay_out_part(part: Any) -> tuple[float, float, float]:
    """Run grandalf on one connected part; return its extent (min x, max x, max y)."""
    sugiyama = SugiyamaLayout(part)
    sugiyama.xspace = X_SPACE
    sugiyama.yspace = Y_SPACE
    sugiyama.init_all()
    sugiyama.draw()
    for layer in sugiyama.layers:  # dummy vertices included: they keep room for the edges
        separate([vertex.view for vertex in layer], X_SPACE)
    sugiyama.draw_edges()  # again, so that the bends follow the dummy vertices moved above
    xs: list[float] = []
    max_y = 0.0
    for vertex in part.sV:
        (x, y), box = vertex.view.xy, vertex.view
        xs += [x - box.w / 2, x + box.w / 2]
        max_y = max(max_y, y + box.h / 2)
    for edge in part.sE:
        xs += [x for x, _y in edge.view.points]
    return min(xs), max(xs), max_y


def separate(views: Sequence[_View], gap: float) -> None:
    """Move the centres of one layer's views (given left to right) sideways as little as
    possible so that neighbours are at least ``gap`` apart, keeping their order.

    Moves nothing when they already are (grandalf's placement almost always is). Otherwise the
    least-squares shift under those constraints: with ``offset[i]`` the distance view ``i``
    must keep from view 0, the views' ``x - offset`` must be non-decreasing, an isotonic
    regression solved by pooling adjacent violators — a run of views pushed together is placed
    as one block, centred on where its members wanted to be.
    """
    offsets = [0.0]
    for left, right in pairwise(views):
        offsets.append(offsets[-1] + gap + (left.w + right.w) / 2)
    blocks: list[tuple[int, float, int]] = []  # (first view, sum of wanted x - offset, views)
    for i, view in enumerate(views):
        first, total, size = i, view.xy[0] - offsets[i], 1
        while blocks and blocks[-1][1] / blocks[-1][2] > total / size:
            first, before_total, before_size = blocks.pop()
            total, size = total + before_total, size + before_size
        blocks.append((first, total, size))
    for first, total, size in blocks:
        if size == 1:
            continue  # not pushed by a neighbour: left exactly where grandalf put it
        for i in range(first, first + size):
            views[i].xy = (total / size + offsets[i], views[i].xy[1])


def _shift(part: Any, dx: float, dy: float) -> None:
    for vertex in part.sV:
        x, y = vertex.view.xy
        vertex.view.xy = (x + dx, y + dy)
    for edge in part.sE:
        edge.view.points = [(x + dx, y + dy) for x, y in edge.view.points]


def _node(vertex: Vertex) -> NodeBox:
    box: _Box = vertex.view
    x, y = box.xy
    return NodeBox(
        name=vertex.data,
        label=label_for(vertex.data, box.w),
        x=_round(x - box.w / 2),
        y=_round(y - box.h / 2),
        width=box.w,
        height=box.h,
    )


def _edge(edge: Edge) -> EdgePath:
    """grandalf's polyline, its ends moved from the box centres to the box borders."""
    source, target = edge.v[0].view, edge.v[1].view
    bends = edge.view.points[1:-1]
    start = (source.xy[0], source.xy[1] + source.h / 2)
    end = (target.xy[0], target.xy[1] - target.h / 2)
    points = tuple((_round(x), _round(y)) for x, y in (start, *bends, end))
    return EdgePath(edge.v[0].data, edge.v[1].data, points)


def _round(value: float) -> float:
    return round(value, DECIMALS)


class LayoutCache:
    """Layouts by DAG shape, the most recently used :data:`CACHE_SIZE` kept.

    A run's DAG never changes, and every run of one workflow version has the same shape, so
    a dashboard polling a run lays it out once. Safe to share between threads.
    """

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self._size = size
        self._entries: OrderedDict[Shape, Layout] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, tasks: Sequence[tuple[str, Sequence[str]]]) -> Layout:
        key = shape_of(tasks)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found
        drawn = layout(tasks)  # outside the lock: a slow layout must not stall other requests
        with self._lock:
            self._entries[key] = drawn
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return drawn
