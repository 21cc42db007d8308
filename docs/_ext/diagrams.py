"""A ``diagram`` directive: boxes and arrows drawn with matplotlib into an SVG at build time.

No ``dot`` binary, no JavaScript: the picture is computed while the page is read and written
next to the other images of the HTML build. The directive's content is a small description,
one statement per line (``#`` starts a comment)::

    ```{diagram}
    :alt: what the picture shows, for screen readers and text builds
    :caption: a caption under the picture (optional)
    :width: 10          picture width in inches (default 9); the height follows from the boxes

    box  job    0 1  "Job\\nepoch group"           a box with its centre at (0, 1)
    box  graph  4 1  "Dask graph" color=task w=2.6  w, h: size in grid units; color: a palette name
    note n1     2 0  "a free-standing label"
    arrow job -> graph "lowered"                    an arrow between two boxes, with a label
    arrow graph -> job "results" style=dashed bend=0.3
    ```

Coordinates are grid units (the picture is scaled to ``:width:``); y grows upwards. Boxes are
rounded rectangles sized ``w`` x ``h`` (default 2.2 x 0.8); ``\\n`` in a label breaks the line.
Arrows start and end at the boxes' edges.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

PALETTE = {
    "model": ("#e8f1fb", "#2f6db5"),
    "task": ("#eaf6ec", "#2e8540"),
    "store": ("#fdf3e1", "#b7791f"),
    "dask": ("#f3ecfa", "#6b46c1"),
    "warn": ("#fdecea", "#c53030"),
    "plain": ("#f7f7f7", "#4a5568"),
}


@dataclass
class Box:
    name: str
    x: float
    y: float
    label: str
    w: float = 2.2
    h: float = 0.8
    color: str = "plain"
    note: bool = False


@dataclass
class Arrow:
    start: str
    end: str
    label: str = ""
    style: str = "solid"
    bend: float = 0.0


@dataclass
class Picture:
    boxes: dict[str, Box] = field(default_factory=dict)
    arrows: list[Arrow] = field(default_factory=list)


class DiagramError(ValueError):
    """A statement of a diagram that cannot be drawn."""


_OPTION = re.compile(r"(color|w|h|style|bend)=(.+)")


def _options(words: list[str]) -> tuple[list[str], dict[str, str]]:
    """Positional words and ``name=value`` options (only the known names: a label may hold ``=``)."""
    plain, named = [], {}
    for word in words:
        match = _OPTION.fullmatch(word)
        if match:
            named[match[1]] = match[2]
        else:
            plain.append(word)
    return plain, named


def parse(lines: list[str]) -> Picture:
    """The boxes and arrows of a diagram's description."""
    picture = Picture()
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip() if not line.lstrip().startswith(('"', "'")) else line.strip()
        if not text:
            continue
        try:
            words = shlex.split(text)
        except ValueError as exc:
            raise DiagramError(f"line {number}: {exc}: {line!r}") from None
        kind, rest = words[0], words[1:]
        plain, named = _options(rest)
        if kind in ("box", "note"):
            if len(plain) != 4:
                raise DiagramError(f"line {number}: expected '{kind} NAME X Y \"LABEL\"', got {line!r}")
            name, x, y, label = plain
            color = named.get("color", "plain")
            if color not in PALETTE:
                raise DiagramError(f"line {number}: unknown color {color!r}; use one of {sorted(PALETTE)}")
            picture.boxes[name] = Box(
                name,
                float(x),
                float(y),
                label.replace("\\n", "\n"),
                w=float(named.get("w", 2.2)),
                h=float(named.get("h", 0.8)),
                color=color,
                note=kind == "note",
            )
        elif kind == "arrow":
            if len(plain) not in (3, 4) or plain[1] != "->":
                raise DiagramError(f"line {number}: expected 'arrow A -> B [\"LABEL\"]', got {line!r}")
            start, end = plain[0], plain[2]
            for name in (start, end):
                if name not in picture.boxes:
                    raise DiagramError(f"line {number}: no box named {name!r} before this arrow")
            picture.arrows.append(
                Arrow(
                    start,
                    end,
                    plain[3].replace("\\n", "\n") if len(plain) == 4 else "",
                    style=named.get("style", "solid"),
                    bend=float(named.get("bend", 0.0)),
                )
            )
        else:
            raise DiagramError(f"line {number}: unknown statement {kind!r} (box, note, arrow)")
    if not picture.boxes:
        raise DiagramError("a diagram needs at least one box")
    return picture


def render(picture: Picture, width: float) -> str:
    """The picture as SVG text ``width`` inches wide, as high as its boxes need (text kept as text,
    deterministic ids)."""
    import matplotlib
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    boxes = picture.boxes.values()
    left = min(b.x - b.w / 2 for b in boxes) - 0.2
    right = max(b.x + b.w / 2 for b in boxes) + 0.2
    bottom = min(b.y - b.h / 2 for b in boxes) - 0.2
    top = max(b.y + b.h / 2 for b in boxes) + 0.2
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "daskjobs-docs", "font.size": 10}):
        figure = Figure(figsize=(width, width * (top - bottom) / (right - left)))
        FigureCanvasSVG(figure)
        axes = figure.add_axes((0, 0, 1, 1))
        axes.set_xlim(left, right)
        axes.set_ylim(bottom, top)
        axes.axis("off")
        patches = {}
        for box in boxes:
            fill, edge = PALETTE[box.color]
            patch = FancyBboxPatch(
                (box.x - box.w / 2, box.y - box.h / 2),
                box.w,
                box.h,
                boxstyle="round,pad=0.02,rounding_size=0.12",
                facecolor="none" if box.note else fill,
                edgecolor="none" if box.note else edge,
                linewidth=1.4,
            )
            axes.add_patch(patch)
            patches[box.name] = patch
            axes.text(
                box.x,
                box.y,
                box.label,
                ha="center",
                va="center",
                color="#1a202c" if not box.note else "#4a5568",
                style="italic" if box.note else "normal",
                linespacing=1.3,
            )
        for arrow in picture.arrows:
            a, b = picture.boxes[arrow.start], picture.boxes[arrow.end]
            patch = FancyArrowPatch(
                (a.x, a.y),
                (b.x, b.y),
                patchA=patches[a.name],
                patchB=patches[b.name],
                arrowstyle="-|>,head_length=6,head_width=3",
                connectionstyle=f"arc3,rad={arrow.bend}",
                linestyle="--" if arrow.style == "dashed" else "-",
                linewidth=1.3,
                color="#2d3748",
                shrinkA=2,
                shrinkB=2,
            )
            axes.add_patch(patch)
            if arrow.label:
                # beside the arrow's middle, on its left (above a rightward arrow, right of a downward one)
                dx, dy = b.x - a.x, b.y - a.y
                length = max((dx * dx + dy * dy) ** 0.5, 1e-9)
                mx = (a.x + b.x) / 2 - arrow.bend * dy / 2 - dy / length * 0.08
                my = (a.y + b.y) / 2 + arrow.bend * dx / 2 + dx / length * 0.08
                horizontal = abs(dx) >= abs(dy)
                axes.text(
                    mx,
                    my,
                    arrow.label,
                    ha="center" if horizontal else ("left" if dy < 0 else "right"),
                    va="bottom" if horizontal and dx > 0 else ("top" if horizontal else "center"),
                    fontsize=8.5,
                    color="#2d3748",
                    linespacing=1.2,
                )
        out = io.StringIO()
        figure.savefig(out, format="svg", metadata={"Date": None, "Creator": None})
    return out.getvalue()


class diagram(nodes.General, nodes.Element):
    """A rendered diagram: ``svg`` (text), ``alt``, ``caption``."""


class DiagramDirective(SphinxDirective):
    has_content = True
    option_spec = {
        "alt": directives.unchanged_required,
        "caption": directives.unchanged,
        "width": directives.unchanged,
    }

    def run(self) -> list[nodes.Node]:
        if "alt" not in self.options:
            raise self.error("a diagram needs an :alt: text (what it shows, in words)")
        try:
            picture = parse(list(self.content))
            width = float(self.options.get("width", 9))
            svg = render(picture, width)
        except (DiagramError, ValueError) as exc:
            raise self.error(f"diagram: {exc}") from None
        node = diagram()
        node["svg"] = svg
        node["alt"] = self.options["alt"]
        node["caption"] = self.options.get("caption", "")
        node["digest"] = hashlib.sha256(svg.encode()).hexdigest()[:16]
        self.set_source_info(node)
        return [node]


def visit_diagram_html(self: Any, node: diagram) -> None:
    name = f"diagram-{node['digest']}.svg"
    folder = os.path.join(self.builder.outdir, self.builder.imagedir)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w", encoding="utf-8") as file:
        file.write(node["svg"])
    source = f"{self.builder.imgpath}/{name}"
    alt = self.encode(node["alt"])
    self.body.append(f'<figure class="daskjobs-diagram"><img src="{source}" alt="{alt}" style="max-width: 100%;"/>')
    if node["caption"]:
        self.body.append(f"<figcaption><p>{self.encode(node['caption'])}</p></figcaption>")
    self.body.append("</figure>\n")
    raise nodes.SkipNode


def skip_diagram(self: Any, node: diagram) -> None:
    """Other builders leave the picture out (the prose around a diagram never depends on it)."""
    raise nodes.SkipNode


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_node(
        diagram,
        html=(visit_diagram_html, None),
        latex=(skip_diagram, None),
        text=(skip_diagram, None),
        man=(skip_diagram, None),
        texinfo=(skip_diagram, None),
    )
    app.add_directive("diagram", DiagramDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
