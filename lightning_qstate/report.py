"""``lightning-qstate report RUN_DIR``: one page a person can look at, from a run's TensorBoard event files.

Writes ``report.png`` (one figure, a panel per story the run logged) and ``report.html`` (self-contained: the figure
embedded, a sentence per panel, the final values with each tag's description, the precision advisor's table and the
callbacks' own figures) into ``RUN_DIR`` or ``--out``::

    lightning-qstate report runs/gpt_demo/version_0
    python -m lightning_qstate.report runs/gpt_demo/version_0 --out /tmp/report

The panels (:data:`PANELS`), each drawn where its tags were logged: the loss; the optimizer-state memory
(``QuantizedOptimizerStates(log_stats=True)``); the stall rate of each state, measured against predicted, with the
resets (``StallMonitor``, ``StateResetScheduler``, the weights' rate also from ``PrecisionAdvisor``); the bits per
stored state value against the adaptive plan's target and the plan's zones (``AdaptiveBitWidth``); the quantization
probe's PTQ cost and outlier metrics (``QuantizationProbe``). The monitors that were not in the run
(:data:`MONITORS`) are named with the callback that adds them. Only reads event files: needs the ``lightning`` extra
for tensorboard and matplotlib (and the tags' descriptions, :mod:`lightning_qstate.callbacks.tensorboard`).
"""

from __future__ import annotations

import argparse
import base64
import html
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

Series = list[tuple[int, float]]  # (step, value), by step
Scalars = dict[str, Series]  # tag -> series
_EXTRA = "pip install 'lightning-qstate[lightning]'"


def event_files(run_dir: str | Path) -> list[Path]:
    """The TensorBoard event files under ``run_dir`` (recursively), oldest first."""
    return sorted(Path(run_dir).rglob("events.out.tfevents.*"), key=lambda path: path.stat().st_mtime)


def _accumulators(run_dir: str | Path) -> list:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as error:  # pragma: no cover - tensorboard comes with the lightning extra
        raise ImportError(f"lightning-qstate report reads event files with tensorboard: {_EXTRA}") from error
    accumulators = []
    for path in event_files(run_dir):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0, "images": 1})
        accumulator.Reload()
        accumulators.append(accumulator)
    return accumulators


def load_scalars(run_dir: str | Path) -> Scalars:
    """Every scalar tag of the run: ``{tag: [(step, value), ...]}`` by step (a step logged twice keeps its last value)."""
    merged: dict[str, dict[int, float]] = {}
    for accumulator in _accumulators(run_dir):
        for tag in accumulator.Tags()["scalars"]:
            merged.setdefault(tag, {}).update({event.step: event.value for event in accumulator.Scalars(tag)})
    return {tag: sorted(values.items()) for tag, values in merged.items()}


def load_texts(run_dir: str | Path) -> dict[str, str]:
    """The last value of every text tag, e.g. ``qstate/precision_advice`` (``PrecisionAdvisor``'s markdown report)."""
    texts: dict[str, str] = {}
    for accumulator in _accumulators(run_dir):
        for tag in accumulator.Tags().get("tensors", []):
            if accumulator.SummaryMetadata(tag).plugin_data.plugin_name != "text":
                continue
            events = accumulator.Tensors(tag)
            if events and events[-1].tensor_proto.string_val:
                texts[tag.removesuffix("/text_summary")] = events[-1].tensor_proto.string_val[0].decode()
    return texts


def load_images(run_dir: str | Path) -> dict[str, bytes]:
    """The last image of every image tag (PNG bytes), e.g. the adaptive plan ``qstate/adaptive/bit_widths`` and the
    probe's ABC figure ``qstate/probe/abc``."""
    images: dict[str, bytes] = {}
    for accumulator in _accumulators(run_dir):
        for tag in accumulator.Tags()["images"]:
            images[tag] = accumulator.Images(tag)[-1].encoded_image_string
    return images


def _matching(scalars: Scalars, pattern: str) -> list[str]:
    return sorted(tag for tag in scalars if re.fullmatch(pattern, tag))


def _plot(axis, series: Series, label: str, scale: float = 1.0, **style) -> None:
    if series:
        steps, values = zip(*series, strict=True)
        axis.plot(steps, [value * scale for value in values], label=label, **style)


# --- the panels: draw(axis, scalars) plots what it reads and labels the y axis with its unit ---


def draw_loss(axis, scalars: Scalars) -> None:
    """Reads ``train_loss*`` and ``val_loss*`` (the module's own ``self.log``); validation points marked."""
    for tag in _matching(scalars, r"(train|val)_loss.*"):
        _plot(axis, scalars[tag], tag, marker="o" if tag.startswith("val") else None, markersize=3)
    axis.set_ylabel("loss (as logged)")


def draw_memory(axis, scalars: Scalars) -> None:
    """Reads ``qstate/state_bytes`` and ``qstate/saving_vs_fp32`` (the same states in fp32: bytes / (1 - saving))."""
    stored = scalars.get("qstate/state_bytes", [])
    _plot(axis, stored, "optimizer states as stored", scale=1e-6)
    saving = dict(scalars.get("qstate/saving_vs_fp32", []))
    fp32 = [(step, value / (1 - saving[step])) for step, value in stored if step in saving and saving[step] < 1]
    _plot(axis, fp32, "the same states in fp32", scale=1e-6, linestyle="--")
    axis.set_ylabel("MB (10⁶ bytes)")
    axis.set_ylim(bottom=0)


def draw_stalls(axis, scalars: Scalars) -> None:
    """Reads ``qstate/stall/<state>`` (solid) and ``qstate/stall_predicted/<state>`` (dashed, same colour) per state,
    ``qstate/weight_stall`` (PrecisionAdvisor) where StallMonitor did not measure the weights, and the resets as grey
    lines: ``qstate/reset/layers`` (StateResetScheduler), else the measurements with ``qstate/stall_resets`` > 0."""
    states = {tag.rsplit("/", 1)[1]: tag for tag in _matching(scalars, r"qstate/stall/[^/]+")}
    if "weights" not in states and "qstate/weight_stall" in scalars:
        states["weights"] = "qstate/weight_stall"
    for index, (state, tag) in enumerate(sorted(states.items())):
        colour = f"C{index}"
        _plot(axis, scalars[tag], f"{state} measured", color=colour, marker=".", markersize=4)
        _plot(axis, scalars.get(f"qstate/stall_predicted/{state}", []), f"{state} predicted", color=colour, linestyle="--")
    resets = scalars.get("qstate/reset/layers") or scalars.get("qstate/stall_resets", [])
    for number, step in enumerate(step for step, layers in resets if layers > 0):
        axis.axvline(step, color="grey", linewidth=1, alpha=0.6, label=None if number else "reset")
    axis.set_ylabel("stalled / moved\n(fraction 0–1)")
    axis.set_ylim(0, 1.02)


def draw_bits(axis, scalars: Scalars) -> None:
    """Reads ``qstate/adaptive/avg_bits`` and ``qstate/adaptive/target_bits`` (AdaptiveBitWidth) and
    ``qstate/bits_per_value`` (QuantizedOptimizerStates: what is stored, scales included)."""
    _plot(axis, scalars.get("qstate/bits_per_value", []), "stored (all states)", linewidth=3, alpha=0.4)
    _plot(axis, scalars.get("qstate/adaptive/avg_bits", []), "adaptive plan (m and v)", marker=".")
    _plot(axis, scalars.get("qstate/adaptive/target_bits", []), "target_bits", linestyle="--", color="black")
    axis.set_ylabel("bits per value")
    shown = [value for tag in _matching(scalars, r"qstate/(adaptive/(avg|target)_bits|bits_per_value)") for _, value in scalars[tag]]
    axis.set_ylim(0, max(shown, default=8.0) * 1.15 + 0.5)


def draw_zones(axis, scalars: Scalars) -> None:
    """Reads ``qstate/adaptive/zone_<zone>`` (layers per zone of the plan) and ``qstate/adaptive/transitions``
    (states re-encoded so far), AdaptiveBitWidth."""
    for tag in _matching(scalars, r"qstate/adaptive/zone_.+"):
        _plot(axis, scalars[tag], f"{tag.rsplit('_', 1)[1]} layers", drawstyle="steps-post")
    transitions = scalars.get("qstate/adaptive/transitions", [])
    _plot(axis, transitions, "states re-encoded (total)", color="black", linestyle=":", drawstyle="steps-post")
    axis.set_ylabel("count")
    axis.set_ylim(bottom=0)


def draw_probe_cost(axis, scalars: Scalars) -> None:
    """Reads ``qstate/probe/ptq_loss_increase`` and ``qstate/probe/R_L`` (QuantizationProbe)."""
    _plot(axis, scalars.get("qstate/probe/ptq_loss_increase", []), "PTQ loss increase (loss units)", marker="o", markersize=3)
    _plot(axis, scalars.get("qstate/probe/R_L", []), "R_L (relative squared error)", marker="s", markersize=3)
    axis.axhline(0, color="black", linewidth=0.6)
    axis.set_ylabel("loss units / ratio")


def draw_probe_outliers(axis, scalars: Scalars) -> None:
    """Reads ``qstate/probe/mmr``, ``qstate/probe/kurtosis`` and ``qstate/probe/kurtosis_channel_rms`` (QuantizationProbe:
    means over the linear layers' inputs)."""
    _plot(axis, scalars.get("qstate/probe/mmr", []), "MMR (max / median |x| per token)", marker="o", markersize=3)
    _plot(axis, scalars.get("qstate/probe/kurtosis", []), "excess kurtosis (0 = Gaussian)", marker="s", markersize=3)
    _plot(axis, scalars.get("qstate/probe/kurtosis_channel_rms", []), "excess kurtosis of channel RMS", marker="^", markersize=3)
    axis.set_ylabel("no unit")


@dataclass(frozen=True)
class Panel:
    """One chart of the report: the tags it needs, how it draws them, and what it shows (a sentence for the page)."""

    title: str
    wants: str  # a regex: the panel is drawn if any scalar tag matches it
    draw: Callable  # draw(axis, scalars)
    explains: str


PANELS: tuple[Panel, ...] = (
    Panel("Loss", r"(train|val)_loss.*", draw_loss, "Training and validation loss as the LightningModule logged them."),
    Panel(
        "Optimizer-state memory",
        r"qstate/state_bytes",
        draw_memory,
        "Bytes of all optimizer states (codes, scales and plain states) against the same states in fp32.",
    ),
    Panel(
        "Stalled state updates: measured (solid) vs predicted (dashed)",
        r"qstate/stall/[^/]+|qstate/weight_stall",
        draw_stalls,
        "Per state, the fraction of entries whose update was lost to rounding on the measured step, measured and as "
        "theory.stall_probability predicts it (same colour). A rate that creeps up means stale states; a reset (grey "
        "line) zeroes them.",
    ),
    Panel(
        "Bits per stored state value",
        r"qstate/adaptive/avg_bits|qstate/bits_per_value",
        draw_bits,
        "The average bits per stored optimizer-state value (scales included) and, with AdaptiveBitWidth, its plan's "
        "average against the budget target_bits.",
    ),
    Panel(
        "Adaptive plan: layers per zone",
        r"qstate/adaptive/zone_.+",
        draw_zones,
        "How many layers AdaptiveBitWidth puts in each zone (each zone has its formats), and how many states it has re-encoded so far.",
    ),
    Panel(
        "Quantization probe: PTQ loss increase and R_L",
        r"qstate/probe/(ptq_loss_increase|R_L)",
        draw_probe_cost,
        "What post-training quantization (W4A4 by default) would cost the model at each validation, and R_L, the "
        "relative error of the last block's output, which predicts it. Lower is more quantizable.",
    ),
    Panel(
        "Quantization probe: outliers of the linear layers' inputs",
        r"qstate/probe/(mmr|kurtosis.*)",
        draw_probe_outliers,
        "Outlier metrics of the linear layers' inputs (means over layers): large values make activations hard to quantize.",
    ),
)


@dataclass(frozen=True)
class Monitor:
    """A callback whose tags the report reads: named under "Not in this run" when none of its tags is there."""

    callback: str
    tags: str  # a regex over scalar and text tags
    adds: str


MONITORS: tuple[Monitor, ...] = (
    Monitor("QuantizedOptimizerStates(log_stats=True)", r"qstate/state_bytes", "the optimizer-state memory and bits per stored value"),
    Monitor("StallMonitor", r"qstate/stall/.+", "the measured and predicted stall rates of each state"),
    # StallMonitor logs qstate/stall_resets only beside a StateResetScheduler: the scheduler was there before its first reset
    Monitor("StateResetScheduler", r"qstate/(reset/.+|stall_resets)", "scheduled state resets (grey lines on the stall panel)"),
    Monitor("AdaptiveBitWidth", r"qstate/adaptive/.+", "the adaptive plan's bits against its target, its zones and figure"),
    Monitor("QuantizationProbe", r"qstate/probe/.+", "the PTQ loss increase, R_L, outlier metrics and the ABC figure"),
    Monitor("PrecisionAdvisor", r"qstate/(precision_advice|weight_stall)(/.*)?", "the precision advice table and the weights' stall rates"),
)


def render(scalars: Scalars, title: str = "lightning_qstate run report"):
    """The report's figure (a ``matplotlib.figure.Figure``, no pyplot state) and the panels drawn, in order; each panel's
    axis carries the panel's title."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - matplotlib comes with the lightning extra
        raise ImportError(f"lightning-qstate report draws with matplotlib: {_EXTRA}") from error
    drawn = [panel for panel in PANELS if any(re.fullmatch(panel.wants, tag) for tag in scalars)]
    rows = max(len(drawn), 1)
    figure = Figure(figsize=(11, 2.4 * rows + 0.6), layout="constrained")
    axes = figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for axis, panel in zip(axes, drawn, strict=False):
        panel.draw(axis, scalars)
        axis.set_title(panel.title, fontsize=10, loc="left")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[-1].set_xlabel("step")
    figure.suptitle(title, fontsize=11)
    return figure, drawn


def _per_layer(tag: str) -> bool:
    return re.fullmatch(r"qstate/(stall|stall_predicted)/[^/]+/.+|qstate/weight_stall/.+", tag) is not None


def final_values(scalars: Scalars) -> list[tuple[str, int, float]]:
    """``(tag, step, value)`` of the last value of every tag but the per-layer ones, ``epoch`` and ``hp_metric``."""
    return [(tag, series[-1][0], series[-1][1]) for tag, series in sorted(scalars.items())
            if series and tag not in ("epoch", "hp_metric") and not _per_layer(tag)]  # fmt: skip


def non_finite(scalars: Scalars) -> list[tuple[str, int, int, int]]:
    """``(tag, first step, values, of)`` for every tag that logged NaN or ±inf: the first step it did, how many of its
    values are non-finite, and how many it logged (per-layer tags included)."""
    found = []
    for tag, series in sorted(scalars.items()):
        bad = [step for step, value in series if not math.isfinite(value)]
        if bad:
            found.append((tag, bad[0], len(bad), len(series)))
    return found


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Render the report of ``run_dir`` into ``out_dir`` (default ``run_dir``): ``report.png`` and ``report.html``;
    returns the path of ``report.html``.

    Raises:
        FileNotFoundError: ``run_dir`` does not exist, or holds no TensorBoard event files.
        NotADirectoryError: ``run_dir`` is a file.
        ValueError: its event files lie in several directories (several runs: their series would mix), none holds a
            value (damaged, or not TensorBoard's), or ``out_dir`` is a file.
    """
    from .callbacks.tensorboard import describe

    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise NotADirectoryError(f"{run_dir} is a file, not a directory; pass a run's log_dir (e.g. runs/gpt_demo/version_0)")
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such directory; pass a run's log_dir (e.g. runs/gpt_demo/version_0)")
    files = event_files(run_dir)
    if not files:
        raise FileNotFoundError(f"{run_dir}: no TensorBoard event files (events.out.tfevents.*) here or below; pass a run's log_dir")
    runs = sorted({str(path.parent) for path in files})
    if len(runs) > 1:
        raise ValueError(f"{run_dir} holds the event files of {len(runs)} runs ({', '.join(runs)}); pass one of them")
    out = Path(out_dir) if out_dir is not None else run_dir
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a directory (made if missing)")
    scalars, texts = load_scalars(run_dir), load_texts(run_dir)
    if not scalars and not texts:
        names = ", ".join(path.name for path in files)
        raise ValueError(f"{run_dir}: its event files ({names}) hold no values: damaged, or not TensorBoard's")
    out.mkdir(parents=True, exist_ok=True)
    figure, drawn = render(scalars, f"lightning_qstate run report: {run_dir}")
    png = out / "report.png"
    figure.savefig(png, dpi=100)
    present = [*scalars, *texts]
    missing = [monitor for monitor in MONITORS if not any(re.fullmatch(monitor.tags, tag) for tag in present)]
    page = _html(run_dir, png.read_bytes(), drawn, missing, final_values(scalars), scalars, texts, load_images(run_dir), describe)
    (out / "report.html").write_text(page, encoding="utf-8")
    return out / "report.html"


def _bold(text: str) -> str:
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(text))


def markdown_html(text: str) -> str:
    """The advisor's markdown (bold lines, pipe tables, numbered notes) as HTML: tables as ``<table>``, other lines as
    paragraphs."""
    parts: list[str] = []
    for is_table, block in _blocks(text.splitlines()):
        if not is_table:
            parts.extend(f"<p>{_bold(line)}</p>" for line in block if line.strip())
            continue
        cells = [[_bold(cell.strip()) for cell in line.strip().strip("|").split("|")] for line in block]
        parts.append(_table(cells[0], [row for row in cells[1:] if not all(re.fullmatch(r":?-+:?", cell) for cell in row)]))
    return "\n".join(parts)


def _blocks(lines: list[str]) -> list[tuple[bool, list[str]]]:
    blocks: list[tuple[bool, list[str]]] = []
    for line in lines:
        is_table = line.lstrip().startswith("|")
        if blocks and blocks[-1][0] == is_table:
            blocks[-1][1].append(line)
        else:
            blocks.append((is_table, [line]))
    return blocks


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """An HTML table of cells already escaped."""
    head = "".join(f"<th>{cell}</th>" for cell in header)
    return f"<table><tr>{head}</tr>" + "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows) + "</table>"


def _image(data: bytes, alt: str) -> str:
    return f"<img alt='{html.escape(alt)}' style='max-width:100%' src='data:image/png;base64,{base64.b64encode(data).decode()}'>"


def _what_it_is(tag: str, describe: Callable[[str], str | None]) -> str:
    description = describe(tag)
    if description:
        return description
    return "" if tag.startswith("qstate/") else "logged by the LightningModule or another callback (not a lightning_qstate tag)"


def _html(run_dir: Path, png: bytes, drawn, missing, finals, scalars: Scalars, texts, images, describe) -> str:
    panels = "".join(f"<li><b>{html.escape(panel.title)}</b>: {html.escape(panel.explains)}</li>" for panel in drawn)
    rows = [(f"<code>{html.escape(tag)}</code>", step, f"{value:.6g}", html.escape(_what_it_is(tag, describe)))
            for tag, step, value in finals]  # fmt: skip
    broken = "".join(f"<li><code>{html.escape(tag)}</code>: first at step {first}; {count} of its {total} logged values</li>"
                     for tag, first, count, total in non_finite(scalars))  # fmt: skip
    advice = "".join(f"<h3><code>{html.escape(tag)}</code></h3>{markdown_html(text)}" for tag, text in sorted(texts.items()))
    layers = [(f"<code>{html.escape(tag.removeprefix('qstate/weight_stall/'))}</code>", *scalars[tag][-1])
              for tag in _matching(scalars, r"qstate/weight_stall/.+")]  # fmt: skip
    if layers:
        advice += "<h3>Weights' stall rate per layer (PrecisionAdvisor, last measurement)</h3>"
        advice += _table(("layer", "step", "stalled / moved"), [(name, step, f"{value:.4g}") for name, step, value in layers])
    figures = "".join(f"<h3><code>{html.escape(tag)}</code> (last logged)</h3>{_image(data, tag)}" for tag, data in sorted(images.items()))
    absent = "".join(f"<li>{html.escape(monitor.adds)}: add <code>{html.escape(monitor.callback)}</code></li>" for monitor in missing)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>lightning_qstate report: {html.escape(str(run_dir))}</title>
<style>body{{font-family:sans-serif;max-width:1150px;margin:auto;padding:0 1em}} table{{border-collapse:collapse;margin:0.5em 0}}
td,th{{padding:2px 8px;text-align:left;border-bottom:1px solid #ddd}} th{{background:#f3f3f3}}</style></head>
<body><h1>lightning_qstate run report</h1><p>Run: <code>{html.escape(str(run_dir))}</code></p>
{f"<h2>Non-finite values (NaN or inf)</h2><ul>{broken}</ul>" if broken else ""}
<h2>What the panels show</h2><ul>{panels}</ul>
{_image(png, "report")}
<h2>Final values</h2>{_table(("tag", "step", "value", "what it is"), rows)}
{f"<h2>Precision advisor</h2>{advice}" if advice else ""}
{f"<h2>The callbacks' figures</h2>{figures}" if figures else ""}
{f"<h2>Not in this run</h2><ul>{absent}</ul>" if absent else ""}
</body></html>
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-qstate report RUN_DIR [--out DIR]``; returns the exit status: 0, or 2 for a usage error (a RUN_DIR
    that is missing or a file, holds no event files, none with values, or several runs' files; an OUT that is a file; bad
    arguments)."""
    parser = argparse.ArgumentParser(
        prog="lightning-qstate report", description="Write report.png and report.html from a run's TensorBoard event files."
    )
    parser.add_argument("run_dir", type=Path, help="a run's log directory (e.g. runs/gpt_demo/version_0), searched recursively")
    parser.add_argument("--out", type=Path, default=None, help="where to write the report (default: RUN_DIR)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse printed the usage and the error (or the help)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        path = write_report(args.run_dir, args.out)
    except (FileNotFoundError, NotADirectoryError, ValueError) as error:
        print(f"lightning-qstate report: error: {error}", file=sys.stderr)
        return 2
    print(f"report: {path} (and {path.with_name('report.png')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
