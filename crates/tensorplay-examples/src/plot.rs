//! The main jobs' loss plots (`--plot PATH.svg`): two panels side by side, the compared first
//! steps of each distributed run over its single-process reference on the left, whole-run
//! curves on the right, every curve with a coloured swatch in its panel's legend.
//!
//! Curves that coincide (a distributed run equal to its single-process twin, two runs equal to
//! each other) all stay visible: a reference is a wide pale solid line, drawn under every run;
//! a run is a thin dashed line whose dash pattern is its own ([`DASHES`], dash and gap lengths of
//! different periods), so where two dashed runs lie on each other the gaps of one show the
//! other. The legend swatches carry the same patterns.

use std::path::Path;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Refuses plot paths that cannot be written, when the arguments are read (not after training).
pub fn check_path(p: &Path) -> Result<(), String> {
    if p.as_os_str().is_empty() {
        return Err("--plot needs a file name, e.g. --plot loss.svg".into());
    }
    if p.is_dir() {
        return Err(format!(
            "--plot {}: is a directory; give a file name",
            p.display()
        ));
    }
    if p.extension().and_then(|e| e.to_str()) != Some("svg") {
        return Err(format!(
            "--plot {}: the plot is an SVG drawing; give a name ending in .svg",
            p.display()
        ));
    }
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(format!(
            "--plot {}: the folder {} does not exist",
            p.display(),
            dir.display()
        ));
    }
    // try it now rather than after the training (a file made only for the try is removed)
    let existed = p.exists();
    if let Err(e) = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(p)
    {
        return Err(format!("--plot {}: cannot write it: {e}", p.display()));
    }
    if !existed {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

/// The dash patterns of the dashed curves, `(dash, gap)` in pixels, taken in turn: the left
/// panel's runs and the right panel's curves after the first (the first is solid).
pub const DASHES: [(u32, u32); 3] = [(12, 6), (5, 5), (2, 4)];

/// A panel's title and axis names.
pub struct Panel<'a> {
    /// The panel's title.
    pub caption: &'a str,
    /// The x axis's name.
    pub x_desc: &'a str,
    /// The y axis's name.
    pub y_desc: &'a str,
}

/// One distributed run on the left panel: `(name, single-process reference, the run)`, both
/// indexed by step from 0.
pub type Compared<'a> = (&'a str, Vec<f64>, Vec<f64>);

/// One curve on the right panel: `(name, points)`.
pub type Curve<'a> = (&'a str, Vec<(usize, f64)>);

fn range(vals: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (lo, hi) = vals
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    if lo.is_finite() && hi > lo {
        let pad = (hi - lo) * 0.05;
        (lo - pad)..(hi + pad)
    } else {
        0.0..1.0
    }
}

/// Draws the two panels into the SVG file `path` (1200 x 520): on the left each run of `left`
/// (a thin dashed line, labelled `"<name>, 2 workers"`) over the references (wide pale solid
/// lines of the runs' colours, `"<name>, one process"`, all drawn before the runs); on the right
/// the curves of `right`, the first solid (the single-process run, where there is one) and the
/// others dashed. The k-th dashed line of a panel has the dash pattern `DASHES[k % 3]`.
pub fn two_panels(
    path: &Path,
    left_panel: Panel<'_>,
    left: &[Compared<'_>],
    right_panel: Panel<'_>,
    right: &[Curve<'_>],
) -> Res<()> {
    use plotters::element::DashedPathElement;
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1200, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let (l_area, r_area) = root.split_horizontally(600);
    // a darker green than plotters' GREEN, legible as a thin line on white; purple for a fourth run
    let colours = [RED, BLUE, RGBColor(0, 140, 0), RGBColor(150, 0, 170)];

    let steps = left
        .iter()
        .map(|(_, a, b)| a.len().max(b.len()))
        .max()
        .unwrap_or(1)
        .max(1);
    let y = range(left.iter().flat_map(|(_, a, b)| a.iter().chain(b)).copied());
    let mut chart = ChartBuilder::on(&l_area)
        .caption(left_panel.caption, ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0..steps, y)?;
    chart
        .configure_mesh()
        .x_desc(left_panel.x_desc)
        .y_desc(left_panel.y_desc)
        .draw()?;
    // every reference first, so that no pale line covers a run
    for (i, (name, reference, _)) in left.iter().enumerate() {
        let wide = colours[i % colours.len()].mix(0.35).stroke_width(6);
        chart
            .draw_series(LineSeries::new(reference.iter().copied().enumerate(), wide))?
            .label(format!("{name}, one process"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], wide));
    }
    for (i, (name, _, run)) in left.iter().enumerate() {
        let thin = colours[i % colours.len()].stroke_width(2);
        let (dash, gap) = DASHES[i % DASHES.len()];
        chart
            .draw_series(DashedLineSeries::new(
                run.iter().copied().enumerate(),
                dash,
                gap,
                thin,
            ))?
            .label(format!("{name}, 2 workers"))
            .legend(move |(x, y)| {
                DashedPathElement::new(vec![(x, y), (x + 24, y)], dash, gap, thin)
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;

    let last = right
        .iter()
        .flat_map(|(_, p)| p.iter().map(|(x, _)| *x))
        .max()
        .unwrap_or(1)
        .max(1);
    let y = range(right.iter().flat_map(|(_, p)| p.iter().map(|(_, y)| *y)));
    let mut chart = ChartBuilder::on(&r_area)
        .caption(right_panel.caption, ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0..last, y)?;
    chart
        .configure_mesh()
        .x_desc(right_panel.x_desc)
        .y_desc(right_panel.y_desc)
        .draw()?;
    for (i, (name, points)) in right.iter().enumerate() {
        let style = colours[i % colours.len()].stroke_width(2);
        if i == 0 {
            chart
                .draw_series(LineSeries::new(points.iter().copied(), style))?
                .label(name.to_string())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
            continue;
        }
        let (dash, gap) = DASHES[(i - 1) % DASHES.len()];
        chart
            .draw_series(DashedLineSeries::new(
                points.iter().copied(),
                dash,
                gap,
                style,
            ))?
            .label(name.to_string())
            .legend(move |(x, y)| {
                DashedPathElement::new(vec![(x, y), (x + 24, y)], dash, gap, style)
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
