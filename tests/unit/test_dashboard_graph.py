"""The DAG layout of the run page (flowforge/dashboard/graph.py): grandalf's layered layout,
turned into boxes and edge polylines — pure, no database.

Proven here: every task gets a box and every dependency a path from the bottom of its upstream
box to the top of its downstream box, layers go down the page, boxes never overlap (not even
where grandalf's own placement puts two on one spot) and stay inside the drawing, bends never
sit on a box, separate parts sit side by side, long names are shortened, bad input is refused,
the result is deterministic (not hostage to memory addresses), and the cache lays each shape
out once.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import pytest
from grandalf.layouts import SugiyamaLayout
from hypothesis import example, given, settings
from hypothesis import strategies as st

from flowforge.dashboard import graph
from flowforge.dashboard.graph import (
    Layout,
    LayoutCache,
    NodeBox,
    TooLargeError,
    layout,
    separate,
)

Tasks = list[tuple[str, tuple[str, ...]]]

DIAMOND: Tasks = [("a", ()), ("b", ("a",)), ("c", ("a",)), ("d", ("b", "c"))]
#: Found by hypothesis: grandalf 0.8 centred t1 66 units right of t5 on one layer, both 96 wide.
OVERLAPPING_IN_GRANDALF: Tasks = [
    ("t0", ()),
    ("t1", ("t0",)),
    ("t2", ("t0", "t1")),
    ("t3", ("t0", "t1", "t2")),
    ("t4", ()),
    ("t5", ("t0",)),
    ("t6", ()),
    ("t7", ("t1",)),
    ("t8", ("t0", "t1", "t2", "t3")),
    ("t9", ("t3",)),
]


def boxes(drawn: Layout) -> dict[str, NodeBox]:
    return {n.name: n for n in drawn.nodes}


def overlap(one: NodeBox, other: NodeBox) -> bool:
    return not (
        one.x + one.width <= other.x
        or other.x + other.width <= one.x
        or one.y + one.height <= other.y
        or other.y + other.height <= one.y
    )


def check_layout(tasks: Sequence[tuple[str, Sequence[str]]], drawn: Layout) -> None:
    """The properties every layout has, whatever the DAG."""
    found = boxes(drawn)
    assert [n.name for n in drawn.nodes] == [name for name, _ in tasks]
    wanted = sorted((dep, name) for name, deps in tasks for dep in deps)
    assert [(e.source, e.target) for e in drawn.edges] == wanted
    for box in drawn.nodes:
        assert box.x >= 0 and box.y >= 0
        assert box.x + box.width <= drawn.width and box.y + box.height <= drawn.height
    nodes = list(drawn.nodes)
    for i, one in enumerate(nodes):
        for other in nodes[i + 1 :]:
            assert not overlap(one, other), (one, other)
    for edge in drawn.edges:
        up, down = found[edge.source], found[edge.target]
        assert len(edge.points) >= 2
        assert edge.points[0] == (up.x + up.width / 2, up.y + up.height)
        assert edge.points[-1] == (down.x + down.width / 2, down.y)
        assert down.y > up.y  # a dependency is always drawn above what waits for it
        for x, y in edge.points:
            assert 0 <= x <= drawn.width and 0 <= y <= drawn.height
        # a bend is grandalf's dummy vertex, spread with the boxes of its layer: it keeps the
        # gap from them (a bend not routed again after the spreading would not)
        for bend_x, bend_y in edge.points[1:-1]:
            for box in drawn.nodes:
                if box.y <= bend_y <= box.y + box.height:
                    room = abs(bend_x - (box.x + box.width / 2)) - box.width / 2
                    assert room >= graph.X_SPACE, (edge, box)


def test_an_empty_dag_is_an_empty_drawing() -> None:
    assert layout([]) == Layout(0.0, 0.0, (), ())


def test_a_single_task_sits_at_the_margin() -> None:
    drawn = layout([("only", ())])
    (box,) = drawn.nodes
    assert (box.x, box.y) == (graph.MARGIN, graph.MARGIN)
    assert (box.width, box.height) == (graph.MIN_NODE_WIDTH, graph.NODE_HEIGHT)
    assert drawn.width == box.width + 2 * graph.MARGIN
    assert drawn.height == box.height + 2 * graph.MARGIN
    assert drawn.edges == ()


def test_a_diamond_has_three_layers_and_four_edges() -> None:
    drawn = layout(DIAMOND)
    check_layout(DIAMOND, drawn)
    found = boxes(drawn)
    assert found["a"].y < found["b"].y == found["c"].y < found["d"].y
    assert found["b"].x != found["c"].x
    assert [(e.source, e.target) for e in drawn.edges] == [
        ("a", "b"),
        ("a", "c"),
        ("b", "d"),
        ("c", "d"),
    ]


def test_an_edge_that_skips_layers_bends_through_grandalfs_dummy_vertex() -> None:
    tasks: Tasks = [("a", ()), ("b", ("a",)), ("c", ("b", "a"))]
    drawn = layout(tasks)
    check_layout(tasks, drawn)
    skip = next(e for e in drawn.edges if (e.source, e.target) == ("a", "c"))
    direct = next(e for e in drawn.edges if (e.source, e.target) == ("a", "b"))
    assert len(skip.points) == 3 and len(direct.points) == 2
    found = boxes(drawn)
    assert found["a"].y < skip.points[1][1] < found["c"].y


def test_separate_parts_sit_side_by_side_in_task_order() -> None:
    tasks: Tasks = [("x", ()), ("y", ("x",)), ("lonely", ()), ("z", ())]
    drawn = layout(tasks)
    check_layout(tasks, drawn)
    found = boxes(drawn)
    assert found["x"].x + found["x"].width <= found["lonely"].x
    assert found["lonely"].x + found["lonely"].width <= found["z"].x
    assert found["x"].y == found["lonely"].y == found["z"].y == graph.MARGIN


def test_long_names_get_wider_boxes_up_to_a_cap_and_an_ellipsis() -> None:
    short, medium, long = "s", "charge-the-customer", "x" * 200
    drawn = boxes(layout([(short, ()), (medium, ()), (long, ())]))
    assert drawn[short].width == graph.MIN_NODE_WIDTH and drawn[short].label == short
    assert graph.MIN_NODE_WIDTH < drawn[medium].width < graph.MAX_NODE_WIDTH
    assert drawn[medium].label == medium
    assert drawn[long].width == graph.MAX_NODE_WIDTH
    assert drawn[long].label.endswith(graph.ELLIPSIS) and len(drawn[long].label) < len(long)
    assert long.startswith(drawn[long].label[:-1])


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        ([("a", ()), ("a", ())], "duplicate task name 'a'"),
        ([("a", ("ghost",))], "unknown task 'ghost'"),
    ],
)
def test_inconsistent_input_is_refused(tasks: Tasks, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layout(tasks)


def test_more_tasks_than_the_cap_are_refused() -> None:
    tasks: Tasks = [(f"t{i}", ()) for i in range(graph.MAX_TASKS + 1)]
    with pytest.raises(TooLargeError, match="too many"):
        layout(tasks)


def test_the_layout_is_deterministic() -> None:
    assert layout(DIAMOND) == layout(list(DIAMOND))
    # grandalf orders a part's edges by their memory addresses (graph.py restores the input
    # order): allocate between the calls so that the edges land at other addresses
    ballast: list[list[object]] = []
    drawings = set()
    for i in range(30):
        ballast.append([object() for _ in range(7 * i)])
        drawings.add(layout(OVERLAPPING_IN_GRANDALF))
    assert len(drawings) == 1


def test_the_cache_lays_each_shape_out_once_and_forgets_the_least_recent() -> None:
    cache = LayoutCache(size=2)
    first = cache.get(DIAMOND)
    assert cache.get(list(DIAMOND)) is first
    other: Tasks = [("x", ())]
    third: Tasks = [("y", ())]
    cache.get(other)
    cache.get(DIAMOND)  # most recent again
    cache.get(third)  # evicts `other`, the least recently used
    assert cache.get(DIAMOND) is first
    assert cache.get(other) == layout(other)


def test_the_dag_grandalf_overlaps_gets_its_boxes_spread_by_the_gap() -> None:
    drawn = layout(OVERLAPPING_IN_GRANDALF)
    check_layout(OVERLAPPING_IN_GRANDALF, drawn)
    found = boxes(drawn)
    t5, t1 = found["t5"], found["t1"]
    assert t5.y == t1.y
    assert t1.x - (t5.x + t5.width) == graph.X_SPACE  # pushed apart just enough
    # ... each by half, around where grandalf centred the pair (t5 at 196, t1 at 262)
    assert (t5.x + t5.width / 2 + t1.x + t1.width / 2) / 2 == (196 + 262) / 2


def test_a_layer_grandalf_piles_on_one_spot_is_spread_and_its_edges_follow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worst grandalf could do: every vertex of every layer, dummies too, at x = 0."""
    setxy = SugiyamaLayout.setxy

    def pile_up(sugiyama: SugiyamaLayout) -> None:
        setxy(sugiyama)
        for layer in sugiyama.layers:
            for vertex in layer:
                vertex.view.xy = (0.0, vertex.view.xy[1])

    monkeypatch.setattr(SugiyamaLayout, "setxy", pile_up)
    tasks: Tasks = [
        ("a", ()),
        ("b", ("a",)),
        ("c", ("a",)),
        ("d", ("a",)),
        ("e", ("b",)),
        ("f", ("e", "a", "c")),  # a -> f and c -> f bend through dummies beside e
    ]
    drawn = layout(tasks)
    check_layout(tasks, drawn)
    found = boxes(drawn)
    assert found["b"].x < found["c"].x < found["d"].x  # grandalf's order is kept
    assert any(len(e.points) > 2 for e in drawn.edges)


class View:
    def __init__(self, x: float, w: float) -> None:
        self.w = w
        self.xy = (x, 7.0)


def test_separate_leaves_separated_views_alone_and_centres_a_crowd_on_its_wish() -> None:
    apart = [View(0.0, 10.0), View(20.0, 10.0), View(100.0, 30.0)]  # edges exactly 10 apart
    separate(apart, 10.0)
    assert [v.xy for v in apart] == [(0.0, 7.0), (20.0, 7.0), (100.0, 7.0)]
    crowd = [View(50.0, 10.0), View(50.0, 10.0), View(50.0, 30.0), View(200.0, 10.0)]
    separate(crowd, 10.0)
    # offsets 0, 20, 50 from the first: the three pile-up views are placed as one block whose
    # wanted positions (50, 30, 0) average 80/3; the far view is not touched
    first = 80 / 3
    assert [v.xy[0] for v in crowd] == pytest.approx([first, first + 20, first + 50, 200.0])
    assert {v.xy[1] for v in crowd} == {7.0}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-500, 500), st.sampled_from([96.0, 120.0, 220.0])),
        max_size=12,
    ),
)
def test_separate_keeps_the_order_and_at_least_the_gap(wanted: list[tuple[int, float]]) -> None:
    wanted.sort(key=lambda xw: xw[0])  # a layer comes in left-to-right order
    views = [View(float(x), w) for x, w in wanted]
    separate(views, graph.X_SPACE)
    for left, right in pairwise(views):
        room = (right.xy[0] - right.w / 2) - (left.xy[0] + left.w / 2)
        assert room >= graph.X_SPACE - 1e-9
    if all(
        (right[0] - right[1] / 2) - (left[0] + left[1] / 2) >= graph.X_SPACE
        for left, right in pairwise(wanted)
    ):
        assert [v.xy[0] for v in views] == [x for x, _w in wanted]


@st.composite
def dags(draw: st.DrawFn) -> Tasks:
    """Random DAGs: each task may depend on any earlier one."""
    size = draw(st.integers(min_value=1, max_value=14))
    tasks: Tasks = []
    for i in range(size):
        earlier = [f"t{j}" for j in range(i)]
        deps = draw(st.lists(st.sampled_from(earlier), unique=True)) if earlier else []
        tasks.append((f"t{i}", tuple(deps)))
    return tasks


@settings(max_examples=60, deadline=None)
@given(dags())
@example(OVERLAPPING_IN_GRANDALF)
def test_every_dag_gets_a_box_per_task_and_a_downward_path_per_dependency(tasks: Tasks) -> None:
    check_layout(tasks, layout(tasks))
