"""`feddomain report` logic on fake run directories written by hand."""

from __future__ import annotations

import base64
import csv
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from matplotlib.ticker import MaxNLocator
from PIL import Image

from feddomain.errors import ConfigError, DataError
from feddomain.evaluation.report import (
    _plot_curves,
    _plot_reliability,
    build_report,
    pool_confidence_hist,
    pool_reliability,
    write_html,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TARGETS = ("photo", "sketch")

# Values at the source-validation round (round 10, highest id_acc) per (method, target):
# (ood_acc, id_acc, ood_ece) for seed 0 and seed 1.
AT_SOURCE_VAL = {
    ("fedavg", "photo"): [(0.70, 0.90, 0.10), (0.74, 0.92, 0.06)],
    ("fedavg", "sketch"): [(0.40, 0.80, 0.20), (0.50, 0.80, 0.20)],
    ("hfedf", "photo"): [(0.76, 0.94, 0.05), (0.80, 0.96, 0.07)],
    ("hfedf", "sketch"): [(0.50, 0.85, 0.12), (0.56, 0.87, 0.10)],
}


def _rounds(ood: float, id_acc: float, ece: float) -> list[dict]:
    # round 5: highest ood, lowest id -> oracle; round 10: highest id -> source_val;
    # round 15: last.
    rows = [
        (5, ood + 0.10, id_acc - 0.20, ece + 0.05),
        (10, ood, id_acc, ece),
        (15, ood - 0.02, id_acc - 0.01, ece + 0.01),
    ]
    return [
        {"round": r, "ood_acc": o, "id_acc": i, "ood_ece": e, "per_domain": {"x": o}}
        for r, o, i, e in rows
    ]


def write_run(
    root: Path,
    algo: str,
    target: str,
    seed: int,
    values: tuple[float, float, float],
    *,
    extras: bool = True,
) -> Path:
    """A finished run whose summary, like the simulator's, describes the last round."""
    run = root / f"{algo}_{target}_s{seed}"
    run.mkdir(parents=True)
    records = _rounds(*values)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.yaml").write_text(f"algorithm: {algo}\nseed: {seed}\n")
    last = records[-1]
    summary = {
        "algorithm": algo,
        "dataset": "pacs",
        "target_domains": [target],
        "seed": seed,
        "rounds": 15,
        "id_acc": last["id_acc"],
        "ood_acc": last["ood_acc"],
        "ood_ece": last["ood_ece"],
        "ood_nll": 1.0,
        "per_domain": {target: last["ood_acc"]},
        "selection": "last",
        "wall_time_s": 1.0,
    }
    if extras:
        summary["reliability"] = {
            "ood": {"count": [0, 3, 1, 1], "conf": [0, 0.4, 0.6, 0.9], "acc": [0, 0.3, 0.7, 1.0]}
        }
        summary["confidence_hist"] = {
            split: {"correct": [0, 1, 2, 5], "incorrect": [1, 2, 1, 0]} for split in ("id", "ood")
        }
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def write_runs(root: Path) -> Path:
    """Finished runs of ``AT_SOURCE_VAL``: 2 methods x 2 targets x 2 seeds under ``root``."""
    for (algo, target), per_seed in AT_SOURCE_VAL.items():
        for seed, values in enumerate(per_seed):
            write_run(root, algo, target, seed, values)
    return root


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    return write_runs(tmp_path / "runs")


def table(markdown: str, title: str) -> dict[str, list[str]]:
    """Rows of the markdown table under heading ``title``: {first cell: other cells}."""
    lines = markdown.splitlines()
    start = lines.index(title) + 1
    while not lines[start].startswith("|"):  # a blank line, or a legend, before the table
        start += 1
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_source_val_table_mean_and_sample_std(runs_root: Path):
    md = build_report([runs_root]).to_markdown()
    assert "model selection: source_val" in md.splitlines()[0]
    ood = table(md, "## pacs — ood accuracy (%)")
    # fedavg photo: mean(.70, .74) = .72; sample std = |.74 - .70| / sqrt(2) = .0283 -> 2.8
    # fedavg sketch: mean(.40, .50) = .45; std .10 / sqrt 2 = .0707 -> 7.1; avg (72 + 45)/2
    # hfedf photo: mean(.76, .80) = .78, std 2.8; sketch: mean(.50, .56) = .53, std .06/sqrt2
    assert ood["method"] == ["photo", "sketch", "avg", "seeds", "budget", "round"]
    assert ood["fedavg"] == ["72.0 ± 2.8", "45.0 ± 7.1", "58.5", "2", "15×1", "10"]
    assert ood["hfedf"] == ["78.0 ± 2.8", "53.0 ± 4.2", "65.5", "2", "15×1", "10"]
    ident = table(md, "## pacs — id accuracy (%)")
    # fedavg: photo (.90, .92) -> 91.0 ± 1.4; sketch (.80, .80) -> 80.0 ± 0.0; avg 85.5
    assert ident["fedavg"][:4] == ["91.0 ± 1.4", "80.0 ± 0.0", "85.5", "2"]
    assert ident["hfedf"][:4] == ["95.0 ± 1.4", "86.0 ± 1.4", "90.5", "2"]
    ece = table(md, "## pacs — ood ECE (%)")
    # fedavg photo (.10, .06) -> 8.0 ± 2.8; hfedf sketch (.12, .10) -> 11.0 ± 1.4
    assert ece["fedavg"][0] == "8.0 ± 2.8"
    assert ece["hfedf"][1] == "11.0 ± 1.4"


def test_selection_rule_changes_the_numbers(runs_root: Path):
    last = table(
        build_report([runs_root], selection="last").to_markdown(), "## pacs — ood accuracy (%)"
    )
    # round 15 = source_val value - .02: fedavg photo (.68, .72) -> 70.0 ± 2.8
    assert last["fedavg"][0] == "70.0 ± 2.8"
    oracle_md = build_report([runs_root], selection="oracle").to_markdown()
    assert "ORACLE" in oracle_md.splitlines()[0]
    oracle = table(oracle_md, "## pacs — ood accuracy (%)")
    # round 5 = source_val value + .10: fedavg photo (.80, .84) -> 82.0 ± 2.8
    assert oracle["fedavg"][0] == "82.0 ± 2.8"


def test_a_single_seed_shows_its_value_without_a_spread(tmp_path: Path):
    """Catches a '± 0.0' for one seed, which reads as a measured zero spread (issue 17)."""
    write_run(tmp_path, "fedavg", "photo", 3, (0.61, 0.9, 0.1))
    md = build_report([tmp_path]).to_markdown()
    assert table(md, "## pacs — ood accuracy (%)")["fedavg"] == ["61.0", "61.0", "1", "15×1", "10"]


def test_standard_error_is_selectable(runs_root: Path):
    """Catches `spread="se"` still printing the sample std: fedavg sketch (.40, .50) has std
    .0707 and standard error .0707 / sqrt(2) = .05."""
    md = build_report([runs_root], spread="se").to_markdown()
    assert table(md, "## pacs — ood accuracy (%)")["fedavg"][1] == "45.0 ± 5.0"
    assert "standard error of the mean" in md
    with pytest.raises(ConfigError, match="unknown spread 'iqr'"):
        build_report([runs_root], spread="iqr")


def test_runs_with_different_configs_or_budgets_are_never_mixed_silently(runs_root: Path):
    """Catches seeds of different settings averaged into one cell (they get labels of their
    own), and methods trained for different budgets compared without a word; a different data
    root or thread count is the same setting and must not raise a note."""
    (runs_root / "fedavg_photo_s1" / "config.yaml").write_text(
        "algorithm: fedavg\nseed: 1\nthreads: 4\ndataset: {root: /elsewhere}\n"
    )
    assert build_report([runs_root]).warnings == []
    (runs_root / "fedavg_photo_s1" / "config.yaml").write_text(
        "algorithm: fedavg\nseed: 1\ntrain: {local_epochs: 2}\n"
    )
    (runs_root / "fedavg_photo_s0" / "config.yaml").write_text(
        "algorithm: fedavg\nseed: 0\ntrain: {local_epochs: 1}\n"
    )
    report = build_report([runs_root])
    # the two settings are labelled apart (never one cell), and the budgets are named
    labels = {r.algorithm for r in report.runs if r.algorithm.startswith("fedavg")}
    assert labels == {"fedavg (train.local_epochs=1)", "fedavg (train.local_epochs=2)"}
    assert report.warnings == [
        "pacs: methods were trained with different budgets (fedavg (train.local_epochs=1) "
        "15×1, fedavg (train.local_epochs=2) 15×2, hfedf 15×1)"
    ]
    ood = table(report.to_markdown(), "## pacs — ood accuracy (%)")
    assert ood["fedavg (train.local_epochs=2)"][4] == "15×2"


def test_missing_cell_leaves_avg_blank(tmp_path: Path):
    write_run(tmp_path, "fedavg", "photo", 0, (0.6, 0.9, 0.1))
    write_run(tmp_path, "fedavg", "sketch", 0, (0.4, 0.9, 0.1))
    write_run(tmp_path, "hfedf", "photo", 0, (0.7, 0.9, 0.1))
    ood = table(build_report([tmp_path]).to_markdown(), "## pacs — ood accuracy (%)")
    assert ood["fedavg"][2] == "50.0"
    assert ood["hfedf"][1:3] == ["—", "—"]


def test_outputs_csv_rows_and_png_plots(runs_root: Path, tmp_path: Path):
    out = tmp_path / "report"
    report = build_report([runs_root], out=out)
    with (out / "report.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    runs = [r for r in rows if r["kind"] == "run"]
    groups = {(r["algorithm"], r["target"]): r for r in rows if r["kind"] == "group"}
    assert len(runs) == 8 and len(groups) == 4
    assert {r["selected_round"] for r in runs} == {"10"}
    assert {r["selection"] for r in rows} == {"source_val"}
    seed1 = next(
        r
        for r in runs
        if r["algorithm"] == "hfedf" and r["target"] == "sketch" and r["seed"] == "1"
    )
    assert float(seed1["ood_acc"]) == pytest.approx(0.56)
    assert Path(seed1["path"]) == runs_root / "hfedf_sketch_s1"
    g = groups[("fedavg", "sketch")]
    assert g["n_seeds"] == "2" and g["seed"] == ""
    assert float(g["ood_acc"]) == pytest.approx(0.45)
    assert float(g["ood_acc_std"]) == pytest.approx(0.1 / 2**0.5)
    assert float(g["id_acc_std"]) == pytest.approx(0.0, abs=1e-12)

    assert (out / "report.md").read_text() == report.to_markdown()
    tex = (out / "report.tex").read_text()
    # fedavg's ood row: mean ± sample std with LaTeX's \pm, budget with \times, 7 columns
    assert "fedavg & 72.0 $\\pm$ 2.8 & 45.0 $\\pm$ 7.1 & 58.5 & 2 & 15$\\times$1 & 10 \\\\" in tex
    assert tex.count("\\begin{tabular}{lrrrrrr}") == 3 and tex.count("\\bottomrule") == 3
    assert {r["rounds"] for r in runs} == {"15"} and {r["local_epochs"] for r in runs} == {"1"}
    stems = [f"{k}_pacs_{t}" for k in ("curves", "reliability", "confidence") for t in TARGETS]
    for stem in [*stems, "overview_pacs"]:
        png, pdf = out / f"{stem}.png", out / f"{stem}.pdf"
        assert png in report.files and pdf in report.files
        assert png.read_bytes()[:8] == PNG_MAGIC and pdf.read_bytes()[:5] == b"%PDF-"
        with Image.open(png) as im:
            assert im.width > 100 and im.height > 100


def test_runs_without_reliability_get_no_calibration_plots(tmp_path: Path):
    write_run(tmp_path / "runs", "fedavg", "photo", 0, (0.6, 0.9, 0.1), extras=False)
    report = build_report([tmp_path / "runs"], out=tmp_path / "out")
    assert sorted(p.name for p in report.files) == [
        "curves_pacs_photo.pdf",
        "curves_pacs_photo.png",
        "overview_pacs.pdf",
        "overview_pacs.png",
        "report.csv",
        "report.md",
        "report.tex",
    ]


def test_table_comes_from_metrics_not_summary(runs_root: Path):
    # The summaries describe round 15 ("last"); tamper with one and report under "last".
    path = runs_root / "fedavg_photo_s0" / "summary.json"
    summary = json.loads(path.read_text())
    summary["ood_acc"] = 0.99
    path.write_text(json.dumps(summary))
    report = build_report([runs_root], selection="last")
    assert len(report.warnings) == 1
    assert "fedavg_photo_s0" in report.warnings[0] and "ood_acc=0.99" in report.warnings[0]
    ood = table(report.to_markdown(), "## pacs — ood accuracy (%)")
    assert ood["fedavg"][0] == "70.0 ± 2.8"
    assert build_report([runs_root]).warnings == []  # summary's rule differs: nothing to compare


def test_unfinished_run_is_skipped_with_a_note(runs_root: Path):
    unfinished = runs_root / "hfedf_photo_s2"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text("seed: 2\n")
    (unfinished / "metrics.jsonl").write_text(json.dumps({"round": 5, "id_acc": 1.0}) + "\n")
    report = build_report([runs_root])
    assert report.warnings == [f"skipped unfinished run {unfinished} (no summary.json)"]
    assert len(report.runs) == 8
    assert f"- skipped unfinished run {unfinished}" in report.to_markdown()


def test_duplicate_seed_is_an_error(runs_root: Path, tmp_path: Path):
    write_run(tmp_path / "more", "fedavg", "photo", 1, (0.5, 0.5, 0.5))
    with pytest.raises(DataError, match=r"fedavg on pacs/photo with seed 1"):
        build_report([runs_root, tmp_path / "more"])


def test_corrupt_summary_names_the_file(runs_root: Path):
    path = runs_root / "hfedf_photo_s0" / "summary.json"
    path.write_text("{not json")
    with pytest.raises(DataError, match=r"hfedf_photo_s0/summary.json: cannot read JSON"):
        build_report([runs_root])


def test_summary_missing_key_names_file_and_key(runs_root: Path):
    path = runs_root / "hfedf_photo_s0" / "summary.json"
    summary = json.loads(path.read_text())
    del summary["seed"]
    path.write_text(json.dumps(summary))
    with pytest.raises(DataError, match=r"hfedf_photo_s0/summary.json: missing key 'seed'"):
        build_report([runs_root])


def test_bad_metrics_line_names_file_and_line(runs_root: Path):
    path = runs_root / "fedavg_sketch_s1" / "metrics.jsonl"
    path.write_text(path.read_text().replace('"round": 10', '"round": 10,,'))
    with pytest.raises(DataError, match=r"fedavg_sketch_s1/metrics.jsonl:2: not valid JSON"):
        build_report([runs_root])


def test_metrics_missing_selected_value(runs_root: Path):
    path = runs_root / "fedavg_sketch_s1" / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    del lines[1]["ood_ece"]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(DataError, match=r"metrics.jsonl: round 10 has no numeric 'ood_ece'"):
        build_report([runs_root])


def test_summary_without_metrics_is_an_error(runs_root: Path):
    (runs_root / "hfedf_photo_s1" / "metrics.jsonl").unlink()
    with pytest.raises(DataError, match=r"hfedf_photo_s1 has summary.json but no metrics.jsonl"):
        build_report([runs_root])


def test_bad_inputs(tmp_path: Path):
    with pytest.raises(DataError, match="is not a directory"):
        build_report([tmp_path / "nope"])
    with pytest.raises(DataError, match="no finished runs"):
        build_report([tmp_path])
    with pytest.raises(ConfigError, match="unknown selection rule 'best'"):
        build_report([tmp_path], selection="best")


def _set_summary(run: Path, **fields) -> None:
    path = run / "summary.json"
    summary = json.loads(path.read_text())
    summary.update(fields)
    path.write_text(json.dumps(summary))


def test_calibration_data_is_pooled_over_seeds(tmp_path: Path):
    a = write_run(tmp_path, "fedavg", "photo", 0, (0.6, 0.9, 0.1))
    b = write_run(tmp_path, "fedavg", "photo", 1, (0.6, 0.9, 0.1))
    _set_summary(
        a,
        reliability={"ood": {"count": [2, 0], "conf": [0.3, 0.0], "acc": [0.5, 0.0]}},
        confidence_hist={"ood": {"correct": [1, 2], "incorrect": [3, 0]}},
    )
    _set_summary(
        b,
        reliability={"ood": {"count": [2, 2], "conf": [0.4, 0.8], "acc": [0.0, 1.0]}},
        confidence_hist={"ood": {"correct": [0, 5], "incorrect": [1, 1]}},
    )
    (group,) = build_report([tmp_path]).groups
    pooled = pool_reliability(group)
    # counts [2+2, 0+2]; conf bin 0 = (2*.3 + 2*.4)/4 = .35, acc bin 0 = (2*.5 + 2*0)/4 = .25
    assert pooled["count"].tolist() == [4, 2]
    assert pooled["conf"].tolist() == pytest.approx([0.35, 0.8])
    assert pooled["acc"].tolist() == pytest.approx([0.25, 1.0])
    hist = pool_confidence_hist(group)
    assert hist["ood"]["correct"].tolist() == [1, 7]
    assert hist["ood"]["incorrect"].tolist() == [4, 1]


def test_calibration_bins_must_agree_across_seeds(tmp_path: Path):
    a = write_run(tmp_path, "fedavg", "photo", 0, (0.6, 0.9, 0.1))
    b = write_run(tmp_path, "fedavg", "photo", 1, (0.6, 0.9, 0.1))
    _set_summary(a, confidence_hist={"ood": {"correct": [1, 2], "incorrect": [3, 0]}})
    _set_summary(b, confidence_hist={"ood": {"correct": [1, 2, 3], "incorrect": [3, 0, 1]}})
    (group,) = build_report([tmp_path]).groups
    with pytest.raises(
        DataError,
        match=r"fedavg_photo_s1/summary.json: confidence_hist.ood."
        r"correct must be a list of 2 numbers",
    ):
        pool_confidence_hist(group)
    _set_summary(a, reliability={"ood": {"count": [1, 1], "conf": [0.3], "acc": [0.5, 1.0]}})
    (group,) = build_report([tmp_path]).groups
    with pytest.raises(DataError, match=r"reliability.ood.conf must be a list of 2 numbers"):
        pool_reliability(group)


def test_curves_are_in_percent_with_a_seed_band_and_the_selected_round_starred(runs_root: Path):
    """Catches accuracy plotted as a fraction, a curve without the spread of its seeds, no
    mark of the round the table reports, and fractional round ticks."""
    report = build_report([runs_root])
    fedavg_photo = [g for g in report.groups if (g.algorithm, g.target) == ("fedavg", "photo")]
    fig = _plot_curves(fedavg_photo)
    _id_ax, ood_ax = fig.axes
    mean_line, star = ood_ax.lines
    # rounds 5, 10, 15; seeds (.70, .74) at round 10, +.10 at round 5, -.02 at round 15
    assert list(mean_line.get_xdata()) == [5, 10, 15]
    assert list(mean_line.get_ydata()) == pytest.approx([82.0, 72.0, 70.0])
    assert (list(star.get_xdata()), star.get_marker()) == ([10], "*")
    assert list(star.get_ydata()) == pytest.approx([72.0])
    (band,) = ood_ax.collections
    lows_highs = band.get_paths()[0].vertices[:, 1]
    assert min(lows_highs) == pytest.approx(68.0) and max(lows_highs) == pytest.approx(84.0)
    assert isinstance(ood_ax.xaxis.get_major_locator(), MaxNLocator)
    assert all(float(t).is_integer() for t in ood_ax.get_xticks())
    assert ood_ax.get_ylabel() == "ood accuracy (%)"


def test_reliability_panels_state_their_ece(runs_root: Path):
    """Catches a reliability diagram without its calibration error: the bins (count, conf,
    acc) = (3, .4, .3), (1, .6, .7), (1, .9, 1.0) give ECE (3 * .1 + .1 + .1) / 5 = 10%."""
    report = build_report([runs_root])
    photo = [g for g in report.groups if g.target == "photo"]
    fig = _plot_reliability(photo)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts == ["ECE 10.0%", "ECE 10.0%"]
    assert [ax.get_title() for ax in fig.axes] == ["fedavg", "hfedf"]


def test_a_one_panel_figure_title_fits_its_figure(runs_root: Path):
    """Catches a figure title wider than a one-panel figure (it was clipped at both sides):
    the rendered title's extent lies within the figure's."""
    report = build_report([runs_root])
    fig = _plot_reliability([g for g in report.groups if g.target == "photo"][:1])
    fig.canvas.draw()  # Agg, no display
    title = fig._suptitle.get_window_extent()
    assert title.x0 >= 0 and title.x1 <= fig.bbox.width


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.sources: list[str] = []
        self.cells: list[str] = []
        self._in_cell = False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        self.sources += [attrs[k] for k in ("src", "href") if k in attrs]
        self._in_cell = tag in ("td", "th")

    def handle_data(self, data):
        if self._in_cell:
            self.cells.append(data)
            self._in_cell = False


def test_html_page_is_self_contained_with_tables_and_every_figure(runs_root: Path, tmp_path):
    """Catches a page that links to files beside it (it breaks when mailed or moved), drops a
    figure, or loses the table's numbers."""
    report = build_report([runs_root], out=tmp_path / "out")
    page = write_html(report, tmp_path / "out" / "report.html")
    parser = _Page()
    parser.feed(page.read_text())
    assert parser.tags.count("table") == 3  # ood, id, ECE tables of pacs
    assert "72.0 ± 2.8" in parser.cells and "15×1" in parser.cells
    pngs = [f for f in report.files if f.suffix == ".png"]
    assert len(parser.sources) == len(pngs) == 7
    for src in parser.sources:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == PNG_MAGIC
    assert "script" not in parser.tags and "link" not in parser.tags


def _add_record_values(run: Path, by_round: dict[int, dict[str, float]]) -> None:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for record in records:
        record.update(by_round[record["round"]])
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_optional_metric_tables_use_the_selected_round(runs_root: Path, tmp_path: Path):
    """Catches: the worst-domain/NLL/Brier tables taken from another round than the one the
    selection rule chose (round 10 under source_val), NLL printed as a percentage, and the CSV
    without their columns. fedavg/photo: NLL 1.2 and 1.6 at round 10 -> 1.400 ± 0.283."""
    for seed, nll in ((0, 1.2), (1, 1.6)):
        _add_record_values(
            runs_root / f"fedavg_photo_s{seed}",
            {
                5: {"ood_nll": 9.0, "ood_brier": 0.9, "worst_domain_acc": 0.9},
                10: {"ood_nll": nll, "ood_brier": nll / 4, "worst_domain_acc": nll / 2},
                15: {"ood_nll": 7.0, "ood_brier": 0.7, "worst_domain_acc": 0.7},
            },
        )
    constant = {"ood_nll": 2.0, "ood_brier": 0.5, "worst_domain_acc": 0.25}
    for run in runs_root.iterdir():
        if not run.name.startswith("fedavg_photo"):
            _add_record_values(run, {rnd: constant for rnd in (5, 10, 15)})
    extra = ("ood_nll", "ood_brier", "worst_domain_acc")
    report = build_report([runs_root], extra_metrics=extra, out=tmp_path / "out")
    md = report.to_markdown()
    nll = table(md, "## pacs — ood NLL (nats)")
    # std of (1.2, 1.6) with ddof 1: 0.4 / sqrt(2) = 0.2828; avg over targets (1.4 + 2.0) / 2
    assert nll["fedavg"][:3] == ["1.400 ± 0.283", "2.000 ± 0.000", "1.700"]
    brier = table(md, "## pacs — ood Brier score")
    assert brier["fedavg"][0] == "0.350 ± 0.071"
    worst = table(md, "## pacs — worst target-domain accuracy (%)")
    assert worst["fedavg"][0] == "70.0 ± 14.1" and worst["hfedf"][0] == "25.0 ± 0.0"
    with (tmp_path / "out" / "report.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    run_row = next(r for r in rows if r["kind"] == "run" and r["path"].endswith("fedavg_photo_s1"))
    assert float(run_row["ood_nll"]) == 1.6 and float(run_row["worst_domain_acc"]) == 0.8
    assert "ood NLL" not in build_report([runs_root]).to_markdown()  # only when asked


def test_an_optional_metric_a_run_lacks_is_named_with_its_file(runs_root: Path):
    """Catches: a run written before a metric existed silently reported as 0 or skipped."""
    with pytest.raises(DataError, match=r"metrics\.jsonl: round 10 has no numeric 'ood_brier'"):
        build_report([runs_root], extra_metrics=("ood_brier",))
    with pytest.raises(ConfigError, match=r"unknown metric\(s\) \['ood_f1'\]"):
        build_report([runs_root], extra_metrics=("ood_f1",))


def test_time_per_round_is_averaged_over_rounds_then_runs(runs_root: Path):
    """Catches: the time table summing instead of averaging, a phase one run lacks dropped from
    its mean (it counts as 0 s there), a server part listed before the round's phases, and a
    run without rounds.jsonl ignored though its summary keeps its phase totals (the campaign's)
    or counted as 0 s when it has neither. fedavg/photo seed 0: train (2 + 4) / 2 = 3,
    server_merge (0.5 + 0) / 2; seed 1: train 5."""
    rounds = {
        "fedavg_photo_s0": [{"train": 2.0, "aggregate": 0.2, "server_merge": 0.5},
                            {"train": 4.0, "aggregate": 0.4}],
        "fedavg_photo_s1": [{"train": 5.0, "aggregate": 0.3}],
    }  # fmt: skip
    for run, times in rounds.items():
        lines = [json.dumps({"round": r + 1, "time": t}) for r, t in enumerate(times)]
        (runs_root / run / "rounds.jsonl").write_text("\n".join(lines) + "\n")
    summary_path = runs_root / "hfedf_photo_s0" / "summary.json"
    summary = json.loads(summary_path.read_text())  # no rounds.jsonl: the summary's totals
    summary |= {"rounds": 10, "phase_seconds": {"train": 20.0, "aggregate": 2.0}}
    summary_path.write_text(json.dumps(summary))
    md = build_report([runs_root]).to_markdown()
    timing = table(md, "## pacs — time per round (s, mean over rounds and runs)")
    assert timing["method"] == ["train", "aggregate", "server_merge"]
    # fedavg: train mean(3, 5) = 4; aggregate mean(0.3, 0.3) = 0.3; merge mean(0.25, 0) = 0.125
    assert timing["fedavg"] == ["4", "0.3", "0.125"]
    # hfedf: 20 s and 2 s over 10 rounds, its other runs (neither log nor totals) left out
    assert timing["hfedf"] == ["2", "0.2", "0"]


def test_accuracies_below_chance_are_marked_with_the_chance_level(tmp_path):
    """Catches a report that prints a below-chance accuracy like any other (the demo flagged
    such targets; `report` did not), marks one above chance, or uses the wrong chance level:
    7 PACS classes make chance 14.3%, so 12% is marked and 15% is not; ECE is never marked."""
    write_run(tmp_path, "fedavg", "sketch", 0, (0.12, 0.9, 0.1))
    write_run(tmp_path, "fedavg", "photo", 0, (0.15, 0.9, 0.1))
    md = build_report([tmp_path]).to_markdown()  # source_val: round 10, the values given
    ood = table(md, "## pacs — ood accuracy (%)")
    assert ood["fedavg"][:2] == ["15.0", "12.0†"]
    assert "† below chance (14.3% = 1 / 7 classes)." in md.split("## pacs — id accuracy")[0]
    assert "†" not in md.split("## pacs — id accuracy")[1]
