"""The panel's charts: grouping, ticks, scales, best values and the SVG they make."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest

from nbddp._panel.chart import (
    best,
    chart_svg,
    charts_html,
    compact,
    direction,
    group_metrics,
    group_name,
    log_ticks,
    nice_ticks,
    tick_labels,
    use_log,
    value_ticks,
)

pytestmark = pytest.mark.fast  # the fast lane: bash scripts/test.sh --fast

SVG = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def polylines(root: ET.Element) -> dict[str, list[tuple[float, float]]]:
    return {p.get("data-metric", ""): [tuple(map(float, xy.split(",")))  # type: ignore[misc]
                                       for xy in (p.get("points") or "").split()]
            for p in root.iter(f"{SVG}polyline")}


def texts(root: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]


# --- ticks ---------------------------------------------------------------------------


@pytest.mark.parametrize("lo, hi", [(0, 39), (0.525, 1.5), (-3.2, 7.9), (1e-4, 3e-4),
                                    (1000.1, 1000.5), (0, 1_000_000), (-1, -0.5)])
def test_ticks_are_round_evenly_spaced_and_cover_the_range(lo, hi):
    ticks = nice_ticks(lo, hi, 5)
    assert ticks[0] <= lo and ticks[-1] >= hi
    assert 3 <= len(ticks) <= 8
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:], strict=False)}
    (step,) = {float(f"{s:.6g}") for s in steps}
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert round(mantissa, 9) in (1, 2, 5)
    assert all(abs(t / step - round(t / step)) < 1e-6 for t in ticks)  # multiples of it


def test_examples_of_ticks():
    assert nice_ticks(0, 39, 5) == [0, 10, 20, 30, 40]
    assert nice_ticks(0.525, 1.5, 4) == [0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6]
    assert nice_ticks(0, 3, 5, integer=True) == [0, 1, 2, 3]  # no step 0.5 on a step axis


def test_log_ticks_are_powers_of_ten_covering_the_range():
    assert log_ticks(0.004, 2.3) == [0.001, 0.01, 0.1, 1.0, 10.0]
    wide = log_ticks(1e-8, 10)
    assert len(wide) <= 7 and wide[0] <= 1e-8 and wide[-1] >= 10


def test_labels_are_compact():
    assert [compact(v) for v in (0, 0.525, 0.01, 2e-4, 1000, 1500, 2.5e6, 999.96, -0.5)] == [
        "0", "0.525", "0.01", "2e-4", "1k", "1.5k", "2.5M", "1k", "-0.5"]
    assert compact(float("nan")) == "nan" and compact(float("inf")) == "inf"
    # Ticks close together get the digits that tell them apart.
    assert tick_labels([1000.1, 1000.2, 1000.3]) == ["1.0001k", "1.0002k", "1.0003k"]


# --- names ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["loss", "train_loss", "eval_loss", "train/loss", "val_loss",
                                  "validation/loss", "loss_epoch", "loss_step", "test-loss",
                                  "val.loss", "train_loss_step"])
def test_losses_go_in_one_chart(name):
    assert group_name(name) == "loss"


def test_other_names_keep_their_own_chart():
    assert group_name("learning_rate") == "learning_rate"
    assert group_name("val_acc") == "acc"
    assert group_name("train") == "train"  # nothing is left to name the chart otherwise
    assert group_name("epoch") == "epoch"
    assert group_metrics(["loss", "lr", "eval_loss", "Train/Loss", "acc", "val_acc"]) == {
        "loss": ["loss", "eval_loss", "Train/Loss"], "lr": ["lr"], "acc": ["acc", "val_acc"]}


def test_best_is_the_minimum_of_losses_and_the_maximum_of_accuracies():
    points = [(0, 2.0), (1, 0.5), (2, 0.7)]
    assert [direction(n) for n in ("eval_loss", "val_error", "ppl", "train/wer", "acc",
                                   "eval_accuracy", "f1", "bleu", "auc", "learning_rate",
                                   "grad_norm", "epoch", "lower")] == [
        "min", "min", "min", "min", "max", "max", "max", "max", "max", None, None, None, None]
    assert best("loss", points) == (1, 0.5)
    assert best("accuracy", points) == (0, 2.0)
    assert best("lr", points) is None


def test_log_scale_for_positive_values_over_more_than_two_decades():
    assert use_log([2.3, 0.01])
    assert not use_log([1.5, 0.525])
    assert not use_log([2.3, 0.0])  # zero: no log
    assert not use_log([-2.3, 0.01])
    assert value_ticks([2.3, 0.01]) == ([0.01, 0.1, 1.0, 10.0], True)


# --- SVG -----------------------------------------------------------------------------


def test_a_chart_has_axes_a_line_per_metric_and_a_legend():
    series = {"loss": [(s, 1 / (s + 1) + 0.5) for s in range(40)],
              "eval_loss": [(0, 1.6), (20, 0.7), (39, 0.6)]}
    root = parse(chart_svg("loss", series))
    assert root.get("class") == "nbddp-chart"
    assert root.get("data-metrics") == "loss eval_loss"
    assert root.get("data-scale") == "linear"
    lines = polylines(root)
    assert [len(lines["loss"]), len(lines["eval_loss"])] == [40, 3]
    assert len({p.get("stroke") for p in root.iter(f"{SVG}polyline")}) == 2
    words = texts(root)
    assert {"0", "10", "20", "30", "step"} <= set(words)  # the step axis
    assert {"0.6", "1", "1.4"} <= set(words)  # the value axis
    assert "loss 0.525 min 0.525 @ 39" in words
    assert "eval_loss 0.6 min 0.6 @ 39" in words
    # Higher values are drawn higher up.
    (x0, y0), (x1, y1) = lines["loss"][0], lines["loss"][-1]
    assert x0 < x1 and y0 < y1


def test_a_loss_over_decades_is_drawn_on_a_log_scale():
    root = parse(chart_svg("loss", {"loss": [(s, 2.3 * 0.9 ** s) for s in range(60)]}))
    assert root.get("data-scale") == "log"
    assert "log scale" in texts(root)
    assert {"0.01", "0.1", "1", "10"} <= set(texts(root))


def test_values_that_are_not_finite_are_skipped_marked_and_counted():
    points = [(0, 1.0), (1, float("nan")), (2, 0.5), (3, float("inf")), (4, float("nan"))]
    svg = chart_svg("loss", {"loss": points})
    root = parse(svg)
    assert len(polylines(root)["loss"]) == 2
    assert len([p for p in root.iter(f"{SVG}path") if p.get("class") == "nbddp-nonfinite"]) == 3
    assert "loss nan min 0.5 @ 2 3 nan/inf" in texts(root)  # the latest value is nan
    assert "nan," not in svg and ",nan" not in svg and "inf," not in svg
    only_nan = parse(chart_svg("loss", {"loss": [(0, float("nan"))]}))
    assert polylines(only_nan) == {} and "loss nan 1 nan/inf" in texts(only_nan)


def test_a_single_point_and_constant_values_draw_a_visible_mark():
    one = parse(chart_svg("acc", {"acc": [(5, 0.3)]}))
    assert len(polylines(one)["acc"]) == 1
    assert len(list(one.iter(f"{SVG}circle"))) == 1  # the latest value's dot
    assert "5" in texts(one)
    flat = parse(chart_svg("lr", {"lr": [(s, 1e-3) for s in range(10)]}))
    (ys,) = {y for _, y in polylines(flat)["lr"]}
    assert math.isfinite(ys)
    assert "lr 0.001" in texts(flat)  # no best for a learning rate


def test_names_are_escaped_and_every_group_gets_a_chart():
    html = charts_html({"loss": [(0, 1.0)], "eval_loss": [(0, 2.0)], "a<b&c": [(0, 1.0)],
                        "empty": []})
    root = ET.fromstring(html)
    charts = [svg for svg in root if svg.get("class") == "nbddp-chart"]
    assert [c.get("data-metrics") for c in charts] == ["loss eval_loss", "a<b&c"]
    assert charts_html({}) == ""
