//! The CUDA C sources of `kernels/`, embedded, and the one place kernel names are built.

use crate::format::DType;

/// The headers of `kernels/`, by the name their `#include` lines give them.
const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("../common.cuh", include_str!("../kernels/common.cuh")),
    ("codec.cuh", include_str!("../kernels/codec/codec.cuh")),
    ("codes.cuh", include_str!("../kernels/codec/codes.cuh")),
];

/// A kernel family: compiled and cached as one module per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Family {
    /// `kernels/codec/`: bounds and statistics, encode, decode, sums of frames, decoded sums.
    Codec,
    /// `kernels/scan.cu`: exclusive prefix sums on the device.
    Scan,
    /// `kernels/lossless.cu`: the lossless codec's decoder.
    Lossless,
}

impl Family {
    /// The family's name and its source files, in the order they are spliced together.
    fn files(self) -> (&'static str, &'static [&'static str]) {
        match self {
            Family::Codec => (
                "codec",
                &[
                    include_str!("../kernels/codec/bounds.cu"),
                    include_str!("../kernels/codec/encode.cu"),
                    include_str!("../kernels/codec/decode.cu"),
                    include_str!("../kernels/codec/sum.cu"),
                    include_str!("../kernels/codec/decode_sum.cu"),
                    include_str!("../kernels/codec/rice.cu"),
                ],
            ),
            Family::Scan => ("scan", &[include_str!("../kernels/scan.cu")]),
            Family::Lossless => ("lossless", &[include_str!("../kernels/lossless.cu")]),
        }
    }

    /// The family's name as used in kernel names (`cfc_<family>_...`).
    pub(crate) fn name(self) -> &'static str {
        self.files().0
    }

    /// One source for NVRTC: the family's files in order, each of cfc's headers inlined where
    /// it is first included and left out after (as `#pragma once` would), so NVRTC needs no
    /// include path of cfc's own.
    pub(crate) fn source(self) -> String {
        let mut done: Vec<&str> = Vec::new();
        let mut out = String::new();
        for file in self.files().1 {
            splice(file, &mut done, &mut out);
        }
        out
    }
}

/// Appends `text` to `out` with its includes of cfc's headers inlined (see [`Family::source`]).
fn splice(text: &str, done: &mut Vec<&'static str>, out: &mut String) {
    for line in text.lines() {
        let included = line
            .strip_prefix("#include \"")
            .and_then(|rest| rest.strip_suffix('"'))
            .and_then(|name| HEADERS.iter().find(|(n, _)| *n == name));
        match included {
            Some(&(_, header)) => {
                if !done.contains(&header) {
                    done.push(header);
                    splice(header, done, out);
                }
            }
            None if line.trim() == "#pragma once" => {}
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
}

/// The C type of a kernel parameter, as cfc passes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ty {
    /// Any device pointer (passed as a u64 address).
    Ptr,
    /// `u64`.
    U64,
    /// `u32`.
    U32,
    /// `double`.
    F64,
    /// `Dims` (eight u64, by value).
    Dims,
}

use Ty::{Dims, Ptr, F64, U32, U64};

/// Every kernel cfc launches: family, op, whether it is stamped per dtype, and its parameters in
/// order. Launches are checked against this table (`cuda::launch`), and a test checks the table
/// against the `.cu` sources, so an argument list can never silently disagree with a kernel.
pub(crate) const SIGNATURES: &[(Family, &str, bool, &[Ty])] = &[
    (Family::Codec, "max_abs", true, &[Ptr, U64, Ptr, Ptr]),
    (Family::Codec, "fold_residual", true, &[Ptr, U64, Ptr]),
    (
        Family::Codec,
        "encode_groups",
        true,
        &[Ptr, U64, U32, F64, U32, Ptr, Ptr, Ptr, Ptr, U32],
    ),
    (
        Family::Codec,
        "pack_chunks",
        true,
        &[
            Ptr, U64, U32, U32, U32, U32, Dims, Ptr, Ptr, Ptr, U32, Ptr, Ptr, Ptr, U32,
        ],
    ),
    (
        Family::Codec,
        "decode_offsets",
        false,
        &[Ptr, U64, U64, Ptr],
    ),
    (
        Family::Codec,
        "decode_chunks",
        true,
        &[Ptr, U64, U64, Ptr, Ptr],
    ),
    (
        Family::Codec,
        "scatter_exceptions",
        true,
        &[Ptr, U64, U64, U64, Ptr, Ptr],
    ),
    (Family::Codec, "sum_table", false, &[Ptr, Dims, U32]),
    (Family::Codec, "sum_lens", false, &[Ptr, U32, U64]),
    (
        Family::Codec,
        "sum_offsets",
        false,
        &[Ptr, U64, U64, Ptr, U64, U32],
    ),
    (
        Family::Codec,
        "sum_chunks",
        true,
        &[Ptr, U32, U64, U64, Ptr, U64, Ptr, Ptr, Ptr, Ptr, U32],
    ),
    (
        Family::Codec,
        "check_frames",
        false,
        &[
            Ptr, U32, U64, U64, U32, U32, U32, Dims, U32, Ptr, U64, Ptr, U32, U32,
        ],
    ),
    (
        Family::Codec,
        "sum_values",
        true,
        &[Ptr, U32, U64, U64, Ptr, U64, Ptr, Ptr, Ptr, U32],
    ),
    (
        Family::Codec,
        "decode_sum_to_f32",
        true,
        &[Ptr, U32, U64, U64, Ptr, U64, F64, Ptr, Ptr, U32],
    ),
    (
        Family::Codec,
        "decode_sum_to_bf16",
        true,
        &[Ptr, U32, U64, U64, Ptr, U64, F64, Ptr, Ptr, U32],
    ),
    (
        Family::Codec,
        "decode_sum_to_f16",
        true,
        &[Ptr, U32, U64, U64, Ptr, U64, F64, Ptr, Ptr, U32],
    ),
    (
        Family::Codec,
        "sum_pack",
        true,
        &[Ptr, Ptr, U64, U32, U32, Dims, Ptr, Ptr, Ptr, Ptr, U32, U32],
    ),
    (Family::Codec, "stats", true, &[Ptr, U64, Ptr, Ptr]),
    (
        Family::Codec,
        "block_exponents",
        true,
        &[Ptr, U64, Ptr, U32, Ptr],
    ),
    (
        Family::Codec,
        "stats_total",
        false,
        &[Ptr, U32, Ptr, U64, U32],
    ),
    (Family::Lossless, "lengths", false, &[Ptr, U64, U64, Ptr]),
    (
        Family::Lossless,
        "decode_w1",
        false,
        &[Ptr, U64, U64, Ptr, Ptr, U64, U64],
    ),
    (
        Family::Lossless,
        "decode_w2",
        false,
        &[Ptr, U64, U64, Ptr, Ptr, U64, U64],
    ),
    (
        Family::Lossless,
        "decode_w4",
        false,
        &[Ptr, U64, U64, Ptr, Ptr, U64, U64],
    ),
    (
        Family::Lossless,
        "decode_w8",
        false,
        &[Ptr, U64, U64, Ptr, Ptr, U64, U64],
    ),
    (Family::Lossless, "encode_w1", false, &[Ptr, U64, Ptr, Ptr]),
    (Family::Lossless, "encode_w2", false, &[Ptr, U64, Ptr, Ptr]),
    (Family::Lossless, "encode_w4", false, &[Ptr, U64, Ptr, Ptr]),
    (Family::Lossless, "encode_w8", false, &[Ptr, U64, Ptr, Ptr]),
    (Family::Lossless, "entry_lengths", false, &[Ptr, U64, Ptr]),
    (
        Family::Lossless,
        "finish",
        false,
        &[Ptr, U64, U64, U32, U32, U32, Dims, Ptr, Ptr, Ptr],
    ),
    (
        Family::Lossless,
        "gather",
        false,
        &[Ptr, U64, U32, U64, Ptr, Ptr, Ptr, Ptr, Ptr],
    ),
    (
        Family::Codec,
        "rice_size",
        true,
        &[Ptr, U64, U32, F64, Ptr, Ptr, Ptr, U32],
    ),
    (
        Family::Codec,
        "rice_write",
        true,
        &[
            Ptr, U64, U32, U32, U32, Dims, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32,
        ],
    ),
    (Family::Codec, "rice_offsets", false, &[Ptr, U64, U64, Ptr]),
    (
        Family::Codec,
        "rice_decode",
        true,
        &[Ptr, U64, U64, Ptr, Ptr, Ptr],
    ),
    (
        Family::Codec,
        "rice_scatter",
        true,
        &[Ptr, U64, U64, Ptr, Ptr, Ptr],
    ),
    (
        Family::Codec,
        "rice_check_heads",
        false,
        &[Ptr, U64, U64, U32, U32, U32, Ptr, Ptr, U32, U32, U32],
    ),
    (
        Family::Codec,
        "rice_check_blocks",
        false,
        &[Ptr, U64, U32, U32, Ptr, Ptr, U32, U32],
    ),
    (
        Family::Codec,
        "rice_accumulate",
        true,
        &[Ptr, U64, Ptr, U32, Ptr],
    ),
    (
        Family::Codec,
        "rice_finish",
        true,
        &[Ptr, U64, F64, Ptr, Ptr],
    ),
    (Family::Scan, "block", false, &[Ptr, U64, Ptr]),
    (Family::Scan, "add", false, &[Ptr, U64, Ptr]),
];

/// The parameter types of `op` in `family`.
pub(crate) fn signature(family: Family, op: &str) -> Option<&'static [Ty]> {
    SIGNATURES
        .iter()
        .find(|(f, o, _, _)| *f == family && *o == op)
        .map(|(_, _, _, sig)| *sig)
}

/// Name of a kernel entry point: `cfc_<family>_<op>` plus `_<dtype>` for per-dtype kernels.
pub(crate) fn kernel_name(family: Family, op: &str, dtype: Option<DType>) -> String {
    match dtype {
        Some(d) => format!(
            "cfc_{}_{op}_{}",
            family.name(),
            match d {
                DType::F32 => "f32",
                DType::BF16 => "bf16",
                DType::F16 => "f16",
                // Only the float types have per-dtype kernels; the name then finds none.
                other => other.name(),
            }
        ),
        None => format!("cfc_{}_{op}", family.name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parameter list of `name(` in `src` (macro line continuations removed).
    fn params(src: &str, name: &str) -> Option<Vec<String>> {
        let start = src.find(&format!("{name}("))? + name.len() + 1;
        let end = start + src[start..].find(')')?;
        let list = src[start..end].replace("\\\n", " ").replace('\\', " ");
        Some(list.split(',').map(|p| p.trim().to_string()).collect())
    }

    fn ty_of(param: &str) -> Ty {
        if param.contains('*') {
            Ty::Ptr
        } else if param.starts_with("u64") {
            Ty::U64
        } else if param.starts_with("u32") {
            Ty::U32
        } else if param.starts_with("double") {
            Ty::F64
        } else if param.starts_with("Dims") {
            Ty::Dims
        } else {
            panic!("unknown parameter type in {param:?}")
        }
    }

    #[test]
    fn signatures_match_the_kernel_sources() {
        for &(family, op, per_dtype, sig) in SIGNATURES {
            let src = family.source();
            assert!(
                !src.contains(".cuh\""),
                "a header of cfc's was left to NVRTC"
            );
            // Per-dtype kernels are stamped by a macro as `cfc_<family>_<op>_##name(`.
            let name = if per_dtype {
                format!("{}_##name", kernel_name(family, op, None))
            } else {
                kernel_name(family, op, None)
            };
            let found = params(&src, &format!("void {name}")).unwrap_or_else(|| {
                panic!("{name} is not defined in the {} kernels", family.name())
            });
            let types: Vec<Ty> = found.iter().map(|p| ty_of(p)).collect();
            assert_eq!(types, sig, "{name}: sources say {found:?}");
        }
    }

    #[test]
    fn every_kernel_in_the_sources_has_a_signature() {
        for family in [Family::Codec, Family::Scan, Family::Lossless] {
            let src = family.source();
            for (i, _) in src.match_indices("__global__ ") {
                // `__global__ [__launch_bounds__(...)] void name(`
                let rest = &src[i..];
                let rest = &rest[rest.find("void ").expect("a kernel returns void") + 5..];
                let name = &rest[..rest.find('(').expect("a parameter list")];
                let op = name
                    .trim_start_matches(&format!("cfc_{}_", family.name()))
                    .trim_end_matches("_##name");
                assert!(
                    signature(family, op).is_some(),
                    "{name} has no entry in SIGNATURES"
                );
            }
        }
    }

    #[test]
    fn dtype_kernels_are_named_after_the_dtype() {
        assert_eq!(
            kernel_name(Family::Codec, "decode_chunks", Some(DType::BF16)),
            "cfc_codec_decode_chunks_bf16"
        );
        assert_eq!(kernel_name(Family::Scan, "add", None), "cfc_scan_add");
    }
}
