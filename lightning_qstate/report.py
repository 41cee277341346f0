"""``lightning-qstate report RUN_DIR``: one page a person can look at, from a run's TensorBoard event files.

Writes ``report.png`` (one figure, a panel per story the run logged) and ``report.html`` (the figure embedded, a
sentence per panel, the final values and the precision advisor's report) into ``RUN_DIR`` or ``--out``::

    lightning-qstate report runs/gpt_demo/version_0
    python -m lightning_qstate.report runs/gpt_demo/version_0 --out /tmp/report

Panels, each where its tags were logged: the loss; the optimizer-state memory (``QuantizedOptimizerStates``); the
stall rate of each state, measured against predicted, with the resets (``StallMonitor``, ``StateResetScheduler``);
the adaptive plan's average bits against its target (``AdaptiveBitWidth``); the quantization probe
(``QuantizationProbe``). The figures the callbacks logged (the adaptive plan, the probe's ABC decomposition) are shown
as last logged, and the advisor's report (``PrecisionAdvisor``) is quoted. Monitors that were not in the run
are named, with the callback that adds them. Needs the ``lightning`` extra (matplotlib, tensorboard, and the tags'
descriptions of :mod:`lightning_qstate.callbacks.tensorboard`).
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

Series = list[tuple[int, float]]  # (step, value)


def event_files(run_dir: Path) -> list[Path]:
    """The TensorBoard event files under ``run_dir`` (recursively), oldest first."""
    return sorted(run_dir.rglob("events.out.tfevents.*"), key=lambda path: path.stat().st_mtime)


def _accumulators(run_dir: Path) -> list:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as error:  # pragma: no cover - tensorboard comes with the lightning extra
        raise ImportError("lightning-qstate report needs tensorboard: pip install 'lightning-qstate[lightning]'") from error
    accumulators = []
    for path in event_files(run_dir):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0, "images": 1})
        accumulator.Reload()
        accumulators.append(accumulator)
    return accumulators


def load_scalars(run_dir: str | Path) -> dict[str, Series]:
    """Every scalar tag of the run: ``{tag: [(step, value), ...]}`` by step (a step logged twice keeps its last value)."""
    merged: dict[str, dict[int, float]] = {}
    for accumulator in _accumulators(Path(run_dir)):
        for tag in accumulator.Tags()["scalars"]:
            merged.setdefault(tag, {}).update({event.step: event.value for event in accumulator.Scalars(tag)})
    return {tag: sorted(values.items()) for tag, values in merged.items()}


def load_texts(run_dir: str | Path) -> dict[str, str]:
    """The last value of every text tag (e.g. ``qstate/precision_advice``)."""
    texts: dict[str, str] = {}
    for accumulator in _accumulators(Path(run_dir)):
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
    for accumulator in _accumulators(Path(run_dir)):
        for tag in accumulator.Tags()["images"]:
            images[tag] = accumulator.Images(tag)[-1].encoded_image_string
    return images


@dataclass(frozen=True)
class Panel:
    """One chart of the report: which tags it needs, how it draws them, and what it shows (a sentence for the page)."""

    title: str
    wants: str  # a regex: the panel is drawn if any scalar tag matches it
    draw: Callable  # draw(axis, scalars)
    explains: str
    monitor: str  # the callback that logs its tags


def _plot(axis, series: Series, label: str, scale: float = 1.0, **style) -> None:
    if series:
        steps, values = zip(*series, strict=True)
        axis.plot(steps, [value * scale for value in values], label=label, **style)


def _matching(scalars: dict[str, Series], pattern: str) -> list[str]:
    return sorted(tag for tag in scalars if re.fullmatch(pattern, tag))


def draw_loss(axis, scalars: dict[str, Series]) -> None:
    for tag in _matching(scalars, r"(train|val)_loss.*"):
        _plot(axis, scalars[tag], tag, marker="o" if tag.startswith("val") else None, markersize=3)
    axis.set_ylabel("loss")


def draw_memory(axis, scalars: dict[str, Series]) -> None:
    _plot(axis, scalars.get("qstate/state_bytes", []), "optimizer states", scale=1e-6)
    saving = scalars.get("qstate/saving_vs_fp32")
    if saving:
        fp32 = [(step, value / (1 - saved)) for (step, value), (_, saved) in zip(scalars["qstate/state_bytes"], saving, strict=False)]
        _plot(axis, fp32, "the same states in fp32", scale=1e-6, linestyle="--")
    axis.set_ylabel("MB")
    axis.set_ylim(bottom=0)


def draw_stalls(axis, scalars: dict[str, Series]) -> None:
    for index, tag in enumerate(_matching(scalars, r"qstate/stall/[^/]+")):
        state, colour = tag.rsplit("/", 1)[1], f"C{index}"
        _plot(axis, scalars[tag], f"{state} measured", color=colour)
        _plot(axis, scalars.get(f"qstate/stall_predicted/{state}", []), f"{state} predicted", color=colour, linestyle="--")
    for step, layers in scalars.get("qstate/reset/layers", []):
        if layers > 0:
            axis.axvline(step, color="grey", linewidth=0.8, alpha=0.6)
    axis.set_ylabel("stalled / moved entries")
    axis.set_ylim(0, 1.02)


def draw_bits(axis, scalars: dict[str, Series]) -> None:
    _plot(axis, scalars.get("qstate/adaptive/avg_bits", []), "average bits (plan)")
    _plot(axis, scalars.get("qstate/adaptive/target_bits", []), "target_bits", linestyle="--", color="black")
    _plot(axis, scalars.get("qstate/bits_per_value", []), "bits per stored value (all states)", linestyle=":")
    axis.set_ylabel("bits per state value")
    axis.set_ylim(bottom=0)


def draw_probe(axis, scalars: dict[str, Series]) -> None:
    _plot(axis, scalars.get("qstate/probe/ptq_loss_increase", []), "PTQ loss increase", marker="o", markersize=3)
    _plot(axis, scalars.get("qstate/probe/R_L", []), "R_L (relative error, last block)", marker="s", markersize=3)
    axis.set_ylabel("nats (increase), ratio (R_L)")


PANELS: tuple[Panel, ...] = (
    Panel("Loss", r"(train|val)_loss.*", draw_loss, "Training and validation loss as logged by the LightningModule.", "your module"),
    Panel(
        "Optimizer-state memory",
        r"qstate/state_bytes",
        draw_memory,
        "Bytes of all optimizer states against the same states in fp32.",
        "QuantizedOptimizerStates(log_stats=True)",
    ),
    Panel(
        "Stalled state updates: measured (solid) vs predicted (dashed), resets (grey lines)",
        r"qstate/stall/[^/]+",
        draw_stalls,
        "The fraction of state entries whose update was lost to rounding, measured and as the theory predicts it; a "
        "rising rate means stale states, and a reset (grey) zeroes them.",
        "StallMonitor and StateResetScheduler",
    ),
    Panel(
        "Adaptive bit-widths",
        r"qstate/adaptive/avg_bits|qstate/bits_per_value",
        draw_bits,
        "The average bits per stored state value against the budget.",
        "AdaptiveBitWidth",
    ),
    Panel(
        "Quantization probe (W4A4 PTQ by default)",
        r"qstate/probe/.+",
        draw_probe,
        "How much post-training quantization would cost the model at each validation, and R_L, which predicts it.",
        "QuantizationProbe",
    ),
)


def _final_values(scalars: dict[str, Series]) -> list[tuple[str, int, float]]:
    keep = r"(train|val)_loss.*|qstate/(state_bytes|bits_per_value|saving_vs_fp32|stall/[^/]+|stall_predicted/[^/]+|reset/total|" \
           r"adaptive/(avg_bits|target_bits)|probe/(ptq_loss_increase|R_L|mmr|kurtosis))"  # fmt: skip
    return [(tag, scalars[tag][-1][0], scalars[tag][-1][1]) for tag in _matching(scalars, keep)]


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Render the report of ``run_dir`` into ``out_dir`` (default ``run_dir``); returns the path of ``report.html``.

    Raises:
        FileNotFoundError: ``run_dir`` holds no TensorBoard event files.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from .callbacks.tensorboard import describe

    run_dir = Path(run_dir)
    if not event_files(run_dir):
        raise FileNotFoundError(f"{run_dir}: no TensorBoard event files (events.out.tfevents.*) here or below; pass a run's log_dir")
    out = Path(out_dir) if out_dir is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    scalars, texts = load_scalars(run_dir), load_texts(run_dir)
    drawn = [panel for panel in PANELS if any(re.fullmatch(panel.wants, tag) for tag in scalars)]
    missing = [panel for panel in PANELS if panel not in drawn]
    figure, axes = plt.subplots(max(len(drawn), 1), 1, figsize=(10, 2.8 * max(len(drawn), 1)), sharex=True, squeeze=False)
    for axis, panel in zip(axes[:, 0], drawn, strict=False):
        panel.draw(axis, scalars)
        axis.set_title(panel.title, fontsize=10)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(f"lightning_qstate run report: {run_dir}", fontsize=11)
    figure.tight_layout()
    png = out / "report.png"
    figure.savefig(png, dpi=100)
    plt.close(figure)
    page = _html(run_dir, png, drawn, missing, _final_values(scalars), texts, load_images(run_dir), describe)
    (out / "report.html").write_text(page)
    return out / "report.html"


def _html(
    run_dir: Path, png: Path, drawn: Sequence[Panel], missing: Sequence[Panel], finals, texts: dict[str, str], images, describe
) -> str:
    image = base64.b64encode(png.read_bytes()).decode()
    figures = "".join(
        f"<h2>{html.escape(tag)} (last)</h2><img alt='{html.escape(tag)}' style='max-width:100%' "
        f"src='data:image/png;base64,{base64.b64encode(data).decode()}'>"
        for tag, data in sorted(images.items())
    )
    rows = "".join(
        f"<tr><td><code>{html.escape(tag)}</code></td><td>{step}</td><td>{value:.6g}</td><td>{html.escape(describe(tag) or '')}</td></tr>"
        for tag, step, value in finals
        if math.isfinite(value)
    )
    panels = "".join(f"<li><b>{html.escape(panel.title)}</b>: {html.escape(panel.explains)}</li>" for panel in drawn)
    absent = "".join(f"<li>{html.escape(panel.title)}: add {html.escape(panel.monitor)}</li>" for panel in missing)
    advice = "".join(f"<h2>{html.escape(tag)}</h2><pre>{html.escape(text)}</pre>" for tag, text in sorted(texts.items()))
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>lightning_qstate report: {html.escape(str(run_dir))}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}} td,th{{padding:2px 8px;text-align:left}}</style></head>
<body><h1>lightning_qstate run report</h1><p>Run: <code>{html.escape(str(run_dir))}</code></p>
<ul>{panels}</ul>
<img alt="report" src="data:image/png;base64,{image}" style="max-width:100%">
<h2>Final values</h2><table><tr><th>tag</th><th>step</th><th>value</th><th>what it is</th></tr>{rows}</table>
{figures}
{advice}
{f"<h2>Not in this run</h2><ul>{absent}</ul>" if absent else ""}
</body></html>
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-qstate report RUN_DIR [--out DIR]``; returns the exit status (2 for a run without event files)."""
    parser = argparse.ArgumentParser(
        prog="lightning-qstate report", description="Write report.png and report.html from a run's TensorBoard event files."
    )
    parser.add_argument("run_dir", type=Path, help="a run's log directory (e.g. runs/gpt_demo/version_0)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the report (default: RUN_DIR)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.run_dir, args.out)
    except FileNotFoundError as error:
        print(f"lightning-qstate report: error: {error}", file=sys.stderr)
        return 2
    print(f"report: {path} (and {path.with_name('report.png')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
