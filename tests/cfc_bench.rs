//! The `cfc-bench` binary: it runs, prints a row per method and writes the JSON it promises,
//! with every error within the bound; bad options are refused with a clear message.

use std::process::Command;

fn bench() -> Command {
    Command::new(env!("CARGO_BIN_EXE_cfc-bench"))
}

/// Runs `cmd` and fails the test, with its stderr, unless it succeeds.
fn succeed(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().expect("cfc-bench runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn a_small_run_prints_every_method_and_writes_json() {
    let json = std::env::temp_dir().join(format!("cfc-bench-{}.json", std::process::id()));
    let out = succeed(
        bench()
            .args([
                "--ranks", "1,3", "--sizes", "64K", "--bounds", "0.3", "--iters", "2",
            ])
            .arg("--json")
            .arg(&json),
    );
    let table = String::from_utf8_lossy(&out.stdout);
    for method in ["plain", "cfc-rs@0.3", "cfc-ag@0.3"] {
        for ranks in [1, 3] {
            assert!(
                table.contains(&format!("| {ranks} | 64KB | {method} |")),
                "{method} x {ranks} missing:\n{table}"
            );
        }
    }
    let text = std::fs::read_to_string(&json).expect("json written");
    std::fs::remove_file(&json).ok();
    assert_eq!(text.matches("\"method\"").count(), 6, "{text}");
    // every compressed row reports its error, and it is within the bound
    let mut numbers = 0;
    for part in text.split("\"max_err_over_eps\": ").skip(1) {
        let value = part.split('}').next().unwrap().trim();
        if value != "null" {
            let e: f64 = value.parse().expect("a number");
            assert!((0.0..=1.0 + 1e-9).contains(&e), "error over eps {e}");
            numbers += 1;
        }
    }
    assert!(numbers > 0, "no row reports its error: {text}");
}

#[test]
fn bad_options_are_refused() {
    for args in [
        &["--ranks", "0"][..],
        &["--sizes", "2"],
        &["--bounds", "-1"],
        &["--iters", "0"],
        &["--frobnicate", "1"],
        &["--ranks"],
    ] {
        let out = bench().args(args).output().expect("cfc-bench runs");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).starts_with("cfc-bench: "),
            "{args:?}"
        );
    }
}

/// Whether the interpreter `--png` runs (`CFC_PYTHON`, else `python3`) has the cfc package
/// and matplotlib, as in the environment `scripts/test.sh` makes.
fn python_can_plot() -> bool {
    Command::new(std::env::var("CFC_PYTHON").unwrap_or_else(|_| "python3".into()))
        .args(["-c", "import cfc.bench, matplotlib"])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn png_is_drawn_from_the_json_by_the_python_package() {
    if !python_can_plot() {
        eprintln!("skipped: python3 lacks cfc or matplotlib (scripts/test.sh installs both)");
        return;
    }
    let png = std::env::temp_dir().join(format!("cfc-bench-{}.png", std::process::id()));
    let json = png.with_extension("json");
    succeed(
        bench()
            .args([
                "--ranks", "2", "--sizes", "64K,128K", "--bounds", "0.3", "--iters", "1",
            ])
            .arg("--png")
            .arg(&png),
    );
    let head = std::fs::read(&png).expect("png written");
    assert!(head.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(json.is_file(), "the JSON goes next to the PNG");
    std::fs::remove_file(&png).ok();
    std::fs::remove_file(&json).ok();
}

#[test]
fn a_png_that_cannot_be_drawn_is_an_error_that_keeps_the_json() {
    let png = std::env::temp_dir().join(format!("cfc-bench-nopy-{}.png", std::process::id()));
    let json = png.with_extension("json");
    let out = bench()
        .env("CFC_PYTHON", "/nonexistent/python3")
        .args([
            "--ranks", "1", "--sizes", "64K", "--bounds", "0.3", "--iters", "1",
        ])
        .arg("--png")
        .arg(&png)
        .output()
        .expect("cfc-bench runs");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot draw") && err.contains("/nonexistent/python3"),
        "{err}"
    );
    assert!(json.is_file(), "the figures are still in the JSON");
    std::fs::remove_file(&json).ok();
}
