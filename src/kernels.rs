//! The CUDA C sources of `kernels/`, embedded, and the one place kernel names are built.

use crate::format::DType;

/// `kernels/common.cuh`, spliced in front of each family (NVRTC gets a single source).
const COMMON: &str = include_str!("../kernels/common.cuh");

/// A kernel family: one `.cu` file, compiled and cached as one module per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Family {
    /// `kernels/codec.cu`: quantize, pack, decode.
    Codec,
    /// `kernels/scan.cu`: exclusive prefix sums on the device.
    Scan,
}

impl Family {
    fn file(self) -> (&'static str, &'static str) {
        match self {
            Family::Codec => ("codec", include_str!("../kernels/codec.cu")),
            Family::Scan => ("scan", include_str!("../kernels/scan.cu")),
        }
    }

    /// The family's name as used in kernel names (`cfc_<family>_...`).
    pub(crate) fn name(self) -> &'static str {
        self.file().0
    }

    /// Source ready for NVRTC: `common.cuh` inlined in place of its `#include`.
    pub(crate) fn source(self) -> String {
        self.file()
            .1
            .replace("#include \"common.cuh\"", COMMON)
            .replace("#pragma once", "")
    }
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
            }
        ),
        None => format!("cfc_{}_{op}", family.name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_built_here_is_defined_in_its_source() {
        let ops: &[(Family, &str, bool)] = &[
            (Family::Codec, "max_abs", true),
            (Family::Codec, "reset", false),
            (Family::Codec, "params", false),
            (Family::Codec, "encode_groups", true),
            (Family::Codec, "finish", false),
            (Family::Codec, "pack", true),
            (Family::Codec, "widths_to_words", false),
            (Family::Codec, "decode_groups", true),
            (Family::Codec, "scatter_exceptions", true),
            (Family::Scan, "block", false),
            (Family::Scan, "add", false),
        ];
        for &(family, op, per_dtype) in ops {
            let src = family.source();
            assert!(!src.contains("#include \"common.cuh\""));
            let names: Vec<String> = if per_dtype {
                [DType::F32, DType::BF16, DType::F16]
                    .iter()
                    .map(|&d| kernel_name(family, op, Some(d)))
                    .collect()
            } else {
                vec![kernel_name(family, op, None)]
            };
            for name in names {
                // Per-dtype kernels are stamped by a macro from `cfc_<family>_<op>_##name`.
                let stem = name.rsplit_once('_').map_or(name.as_str(), |(s, _)| s);
                let found = src.contains(&format!("{name}("))
                    || (per_dtype && src.contains(&format!("{stem}_##name(")));
                assert!(
                    found,
                    "{name} is not defined in kernels/{}.cu",
                    family.name()
                );
            }
        }
    }
}
