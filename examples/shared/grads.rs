//! Reading the real gradient vectors (`.npy` files), shared by the examples and the tests
//! (included with `#[path]`, so that it is not an example target of its own).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// Reads a little-endian float32 `.npy` file (format 1.0 / 2.0 / 3.0, C order).
pub fn read_npy_f32(path: &Path) -> Result<Vec<f32>, String> {
    let b = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if b.len() < 10 || &b[..6] != b"\x93NUMPY" {
        return Err(format!("{}: not a .npy file", path.display()));
    }
    let (hlen, start) = if b[6] == 1 {
        (u16::from_le_bytes([b[8], b[9]]) as usize, 10)
    } else {
        if b.len() < 12 {
            return Err(format!("{}: truncated .npy header", path.display()));
        }
        (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12)
    };
    let header = b
        .get(start..start + hlen)
        .map(String::from_utf8_lossy)
        .ok_or_else(|| format!("{}: truncated .npy header", path.display()))?;
    if !header.contains("'<f4'") || header.contains("'fortran_order': True") {
        return Err(format!(
            "{}: expected C-order <f4, got {header}",
            path.display()
        ));
    }
    let data = &b[start + hlen..];
    if data.len() % 4 != 0 {
        return Err(format!("{}: data is not whole float32s", path.display()));
    }
    Ok(data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Every `.npy` file of `dir`, sorted by name, as `(stem, values)`.
pub fn read_grads(dir: &Path) -> Result<Vec<(String, Vec<f32>)>, String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("gradient vectors not found in {} ({e})", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "npy"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| {
            let name = p
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            Ok((name, read_npy_f32(p)?))
        })
        .collect()
}

/// Root-mean-square of a vector, in `f64`.
pub fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64).sqrt()
}

/// The folder given on the command line (`--grads DIR`, as the Python scripts take it, or
/// `DIR` alone), else `../shared/data/grads`.
pub fn grads_dir_from_args() -> PathBuf {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let given = match args.first().map(String::as_str) {
        Some("--grads") => match args.get(1) {
            Some(dir) => Some(dir),
            None => {
                eprintln!("--grads needs a folder");
                std::process::exit(2);
            }
        },
        _ => args.first(),
    };
    given
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data/grads"))
}
