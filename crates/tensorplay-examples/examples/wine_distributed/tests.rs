//! The program's own tests: its plot, its plot paths and its arguments.

use std::path::Path;
use std::time::Duration;

use tensorplay_examples::plot;

use crate::COMPARE_STEPS;
use crate::report::{Report, plot};

/// Plot paths that cannot be written are refused when the arguments are read.
#[test]
fn bad_plot_paths_are_refused_up_front() {
    let dir = std::env::temp_dir();
    assert!(plot::check_path(Path::new("")).is_err());
    assert!(plot::check_path(&dir).unwrap_err().contains("directory"));
    let svg_dir = dir.join(format!("tp-dir-{}.svg", std::process::id()));
    std::fs::create_dir_all(&svg_dir).unwrap();
    let refused = plot::check_path(&svg_dir);
    std::fs::remove_dir(&svg_dir).unwrap();
    assert!(refused.unwrap_err().contains("directory"));
    assert!(
        plot::check_path(Path::new("loss.png"))
            .unwrap_err()
            .contains(".svg")
    );
    let missing = dir
        .join(format!("tp-no-such-dir-{}", std::process::id()))
        .join("l.svg");
    assert!(
        plot::check_path(&missing)
            .unwrap_err()
            .contains("does not exist")
    );
    // a folder where no file can be made (procfs) is found before the training
    assert!(
        plot::check_path(Path::new("/proc/tp-loss.svg"))
            .unwrap_err()
            .contains("cannot write")
    );
    let probe = dir.join(format!("tp-probe-{}.svg", std::process::id()));
    assert!(plot::check_path(&probe).is_ok());
    assert!(!probe.exists(), "the try left {}", probe.display());
    assert!(plot::check_path(Path::new("loss.svg")).is_ok());
}

/// The plot shows every epoch of the run (not only the compared steps) and gives each of
/// its nine curves a legend entry with a coloured swatch.
#[test]
fn plot_has_a_swatch_per_curve_and_every_epoch() {
    let dir = std::env::temp_dir().join(format!("tp-wine-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("loss.svg");
    let report = |shift: f64| Report {
        accuracy: 0.6,
        losses: (0..COMPARE_STEPS)
            .map(|i| 1.8 - i as f64 * 1e-3 + shift)
            .collect(),
        reference: (0..COMPARE_STEPS)
            .map(|i| 1.8 - i as f64 * 1e-3 + shift)
            .collect(),
        epoch_losses: (0..437).map(|e| 1.5 / (1.0 + e as f64) + shift).collect(),
        wall: Duration::ZERO,
        collective_bytes: 0,
        rpc_bytes: 0,
    };
    let (a, b, c) = (report(0.0), report(0.1), report(0.2));
    plot(
        &path,
        &[
            ("tensor-parallel", &a),
            ("parameter-server", &b),
            ("data-parallel", &c),
        ],
    )
    .unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    for label in [
        "tensor-parallel, 2 workers",
        "tensor-parallel, one process",
        "parameter-server, 2 workers",
        "parameter-server, one process",
        "data-parallel, 2 workers",
        "data-parallel, one process",
        "all 437 epochs",
        "first 200 steps",
    ] {
        assert!(svg.contains(label), "{label} missing");
    }
    // nine curves and nine legend swatches, in the runs' three colours
    assert!(svg.matches("<polyline").count() >= 18, "{svg}");
    assert!(
        svg.contains("#FF0000") && svg.contains("#0000FF") && svg.contains("#008C00"),
        "colours"
    );
    // the right panel's axis reaches the last epochs (the left one stops at step 200)
    let texts: Vec<&str> = svg.split(['<', '>']).map(str::trim).collect();
    assert!(texts.contains(&"400"), "epoch axis: {texts:?}");
}

/// Curves that coincide all stay visible: over a single-process twin equal to it (and to
/// each other), each distributed run is a dashed line of its own pattern, drawn after the
/// wide pale references; on the right the first curve is solid and the others dashed; every
/// legend entry is there.
#[test]
fn coinciding_curves_stay_visible() {
    let dir = std::env::temp_dir().join(format!("tp-plot-twins-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("loss.svg");
    let losses: Vec<f64> = (0..100).map(|i| 4.2 - (i as f64 / 30.0).sin()).collect();
    let smooth: Vec<(usize, f64)> = (1..=30).map(|i| (i * 20, 4.0 / i as f64)).collect();
    let panel = |caption| plot::Panel {
        caption,
        x_desc: "step",
        y_desc: "loss",
    };
    plot::two_panels(
        &path,
        panel("compared"),
        &[
            ("tensor-parallel", losses.clone(), losses.clone()),
            ("data-parallel", losses.clone(), losses.clone()),
        ],
        panel("whole run"),
        &[
            ("single-process", smooth.clone()),
            ("tensor-parallel", smooth.clone()),
            ("data-parallel", smooth),
        ],
    )
    .unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    // (stroke colour, stroke width, number of points) of every polyline
    let lines: Vec<(&str, &str, usize)> = svg
        .split("<polyline")
        .skip(1)
        .map(|l| {
            let l = &l[..l.find("/>").unwrap_or(l.len())];
            let attr = |name: &str| {
                let key = format!(" {name}=\"");
                let from = l.find(&key).map(|i| i + key.len()).unwrap_or(l.len());
                &l[from..from + l[from..].find('"').unwrap_or(0)]
            };
            (
                attr("stroke"),
                attr("stroke-width"),
                attr("points").split_whitespace().count(),
            )
        })
        .collect();
    let count = |colour: &str, width: &str, min_points: usize| {
        lines
            .iter()
            .filter(|(c, w, n)| *c == colour && *w == width && *n >= min_points)
            .count()
    };
    type Check = (&'static str, bool, String);
    let mut checks: Vec<Check> = [
        "tensor-parallel, 2 workers",
        "tensor-parallel, one process",
        "data-parallel, 2 workers",
        "data-parallel, one process",
        "single-process",
    ]
    .iter()
    .map(|l| (*l, svg.contains(l), format!("legend entry {l:?} missing")))
    .collect();
    // a solid curve is one polyline (and one legend swatch); a dashed one is a polyline per
    // dash: 100 steps across ~500 px give dozens
    let (red, blue, green) = ("#FF0000", "#0000FF", "#008C00");
    let dashed = [
        ("tensor-parallel run dashed (red, left)", count(red, "2", 2)),
        (
            "data-parallel run dashed (blue, left) and tensor-parallel curve (blue, right)",
            count(blue, "2", 2),
        ),
        (
            "data-parallel curve dashed (green, right)",
            count(green, "2", 2),
        ),
    ];
    for (name, n) in dashed {
        checks.push((name, n >= 20, format!("{n} thin segments")));
    }
    // the references stay wide solid lines; the first right curve is solid (one polyline of
    // all 30 points)
    for (name, colour) in [("tensor-parallel", red), ("data-parallel", blue)] {
        let n = count(colour, "6", 100);
        checks.push((
            name,
            n == 1,
            format!("{n} wide reference lines of 100 points"),
        ));
    }
    let n = count(red, "2", 30);
    checks.push((
        "single-process solid",
        n == 1,
        format!("{n} solid red lines"),
    ));
    // every reference (not its legend swatch) is drawn before the first run, so no pale line
    // covers a run
    let last_wide = lines.iter().rposition(|(_, w, n)| *w == "6" && *n >= 100);
    let first_run = lines.iter().position(|(c, w, _)| *c == red && *w == "2");
    checks.push((
        "references under the runs",
        matches!((last_wide, first_run), (Some(w), Some(r)) if w < r),
        format!("last reference at {last_wide:?}, first run segment at {first_run:?}"),
    ));
    // the two runs' dash patterns differ, so one does not hide the other
    checks.push((
        "distinct patterns",
        plot::DASHES[0] != plot::DASHES[1],
        format!("{:?}", plot::DASHES),
    ));
    let failed: Vec<String> = checks
        .into_iter()
        .filter(|(_, ok, _)| !ok)
        .map(|(name, _, why)| format!("{name}: {why}"))
        .collect();
    assert!(failed.is_empty(), "{failed:#?}");
}

/// The command line: accepted spellings and values, and what clap refuses.
#[test]
fn arguments_are_parsed_by_clap() {
    use crate::args::parse_from;
    let parse = |args: &[&str]| {
        parse_from(
            std::iter::once("wine_distributed")
                .chain(args.iter().copied())
                .map(String::from),
        )
    };
    // (arguments, accepted)
    let cases: &[(&[&str], bool)] = &[
        (&[], true),
        (&["--seed", "3", "--epochs=5"], true),
        (&["--", "--seed", "3"], true),
        (
            &["--checkpoint-dir", "ckpt-dir", "--checkpoint-every", "7"],
            true,
        ),
        (&["--checkpoint-dir=ckpt-dir"], true),
        (&["--epochs", "0"], false),
        (&["--epochs", "many"], false),
        (&["--seed", "-1"], false),
        (&["--checkpoint-every", "5"], false),
        (
            &["--checkpoint-dir", "ckpt-dir", "--checkpoint-every", "0"],
            false,
        ),
        (&["--checkpoint-dir", ""], false),
        (&["--plot", "loss.png"], false),
        (&["--bogus"], false),
    ];
    for (args, ok) in cases {
        let r = parse(args);
        assert_eq!(r.is_ok(), *ok, "{args:?}: {r:?}");
    }
    let help = parse(&["--help"]).unwrap_err();
    assert_eq!(help.kind(), clap::error::ErrorKind::DisplayHelp);
    for flag in [
        "--seed",
        "--epochs",
        "--plot",
        "--checkpoint-dir",
        "--checkpoint-every",
    ] {
        assert!(
            help.to_string().contains(flag),
            "{flag} missing from --help"
        );
    }
}
