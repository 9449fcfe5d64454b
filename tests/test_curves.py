"""curves.png: loss, error on a linear axis (epochs at 0% error stay in the picture) and the
learning rate, at a size readable on a laptop screen."""

from __future__ import annotations

import itertools
import math

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.transforms import Bbox
from PIL import Image

from cnnkit.train.metrics import curves_figure, plot_curves


def history(epochs: int = 6) -> list[dict[str, float]]:
    """Rows as metrics.csv holds them; validation reaches 0% error from epoch 3 on."""
    return [
        {"epoch": e, "train_loss": 1.0 / e, "train_top1": min(1.0, 0.5 + 0.1 * e),
         "val_loss": 0.8 / e, "val_top1": 1.0 if e >= 3 else 0.7, "val_top5": 1.0,
         "lr": 0.1 * 0.5**e, "images_per_second": 100.0, "seconds": 1.0}
        for e in range(1, epochs + 1)
    ]  # fmt: skip


def test_every_point_is_drawn_even_at_zero_error():
    rows = history()
    loss, error, lr = curves_figure(rows).axes
    assert error.get_yscale() == "linear"
    lo, hi = error.get_ylim()
    for line in error.get_lines():
        ys = list(line.get_ydata())
        assert len(ys) == len(rows) and all(lo < y < hi for y in ys), (line.get_label(), ys)
    val = next(line for line in error.get_lines() if line.get_label() == "val")
    assert list(val.get_ydata())[2:] == [0.0] * 4  # the 0% epochs, in percent
    assert "best 0.0% at epoch 3" in error.get_title()  # best.pt's: the first of a tie
    assert list(lr.get_lines()[0].get_ydata()) == pytest.approx([r["lr"] for r in rows])
    # the training loss is smoothed or mixed where the run says so: not called cross-entropy
    legend = [t.get_text() for t in loss.get_legend().get_texts()]
    assert legend == ["train (as optimised)", "val (cross-entropy)"]
    assert loss.get_ylabel() == "loss"


def test_the_epoch_axis_has_whole_epochs_only():
    for epochs in (2, 3, 7):
        for ax in curves_figure(history(epochs)).axes:
            assert all(float(t).is_integer() for t in ax.get_xticks()), (epochs, ax.get_xticks())


def test_one_epoch_has_one_whole_epoch_tick_with_room_around_it():
    """Not 0.945 to 1.065 in overlapping hundredths: 0.5 to 1.5, a tick at 1 alone."""
    for ax in curves_figure(history(1)).axes:
        low, high = ax.get_xlim()
        shown = [t for t in ax.get_xticks() if low <= t <= high]
        assert (low, high) == (0.5, 1.5) and shown == [1.0], (ax.get_xlim(), ax.get_xticks())
    for epochs in (2, 7, 90):  # longer runs: whole epochs, every point inside the axis
        for ax in curves_figure(history(epochs)).axes:
            low, high = ax.get_xlim()
            assert low < 1 and high > epochs
            assert all(float(t).is_integer() for t in ax.get_xticks())


def test_curves_png_is_laptop_sized(tmp_path):
    path = tmp_path / "curves.png"
    plot_curves(history(1), path)  # one epoch: no division by zero, no empty axes
    assert Image.open(path).size == (1320, 440)
    rows = history(3)
    del rows[0]["lr"]  # a row without a learning rate (older runs): a gap, not an error
    _, _, lr = curves_figure(rows).axes
    assert math.isnan(lr.get_lines()[0].get_ydata()[0])


def test_the_weights_moving_average_is_drawn_and_the_run_named(tmp_path):
    """metrics.csv's val_*_ema columns (best_ema.pt's choice) were left out of the picture,
    and nothing in it named the run (a mining run's curves.png is its chosen round's)."""
    from cnnkit.train.metrics import run_title

    rows = history(4)
    for r in rows[1:]:  # (turned on at a resume: no value for the first epoch)
        r.update(val_loss_ema=0.5 / r["epoch"], val_top1_ema=0.6)
    fig = curves_figure(rows, "digits-20261208-0900")
    loss, error, _ = fig.axes
    ema = next(line for line in error.get_lines() if line.get_label() == "val, weights' EMA")
    assert math.isnan(ema.get_ydata()[0]) and list(ema.get_ydata())[1:] == pytest.approx([40.0] * 3)
    assert [t.get_text() for t in loss.get_legend().get_texts()][-1] == "val, weights' EMA"
    assert fig._suptitle.get_text() == "digits-20261208-0900"
    assert len(curves_figure(history(4)).axes[1].get_lines()) == 2  # none kept: none drawn
    assert run_title(tmp_path / "faces-1" / "round-4") == "faces-1 round-4"
    assert run_title(tmp_path / "digits-1") == "digits-1"


@pytest.mark.parametrize("title", [None, "a-run-directory-20261208-090000"])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 2e3])
def test_labels_stay_inside_the_fixed_margins(scale, title):
    """Tiny and huge losses and learning rates: every panel's tick labels, axis labels and
    title are drawn inside the picture, clear of the neighbouring panel's (and the run's
    name above them all)."""
    rows = [{**r, "train_loss": scale * r["train_loss"], "val_loss": scale * r["val_loss"],
             "lr": scale * r["lr"] / 3} for r in history(120)]  # fmt: skip
    fig = curves_figure(rows, title)
    canvas = FigureCanvasAgg(fig)  # as savefig draws it
    canvas.draw()
    renderer = canvas.get_renderer()
    panels = [Bbox.union([ax.bbox, ax.xaxis.get_tightbbox(renderer),
                          ax.yaxis.get_tightbbox(renderer)]) for ax in fig.axes]  # fmt: skip
    titles = [ax.title.get_window_extent(renderer) for ax in fig.axes]
    page = fig.bbox
    for box in panels + titles:
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
    for boxes in (panels, titles):
        for left, right in itertools.pairwise(boxes):
            assert left.x1 < right.x0
    if title:  # above the panels' titles, inside the picture
        top = fig._suptitle.get_window_extent(renderer)
        assert top.y1 <= page.y1 and all(top.y0 > box.y1 for box in titles)
