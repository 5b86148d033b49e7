//! The CUDA codec's tests: compilation of every kernel family (no GPU needed), and on a GPU
//! the operations against the CPU codec.

use super::*;

/// Every kernel family compiles with NVRTC for the oldest and the newest architecture cfc
/// runs on: a kernel that does not compile would otherwise show only on a GPU machine.
/// NVRTC needs no GPU. Skipped (with a message) where NVRTC or CUDA's headers are missing,
/// unless `CFC_NVRTC_CHECK=1` (set by `scripts/env.sh` where the Python environment has
/// them), which makes their absence a failure.
#[test]
fn every_kernel_family_compiles_with_nvrtc() {
    let required = std::env::var("CFC_NVRTC_CHECK").is_ok_and(|v| v == "1");
    // SAFETY: only probes whether the shared library can be opened.
    let nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !nvrtc || cuda_include_dir().is_err() {
        assert!(
            !required,
            "CFC_NVRTC_CHECK=1 but NVRTC ({nvrtc}) or cuda_fp16.h ({:?}) is missing",
            cuda_include_dir().err()
        );
        eprintln!("skipped: NVRTC or CUDA's headers are not installed");
        return;
    }
    for family in [Family::Codec, Family::Scan, Family::Lossless] {
        for arch in ["sm_80", "sm_90"] {
            let cubin = compile(family, arch)
                .unwrap_or_else(|e| panic!("{} for {arch}: {e}", family.name()));
            assert!(cubin.starts_with(b"\x7fELF"), "a CUBIN is an ELF file");
        }
    }
}

/// More than [`MAX_ELEMENTS`] elements are refused before a size is computed from them or
/// a device is touched (with sizes that wrap, buffers of any length could pass their checks).
#[test]
fn entry_points_refuse_counts_past_max_elements() {
    let n = MAX_ELEMENTS + 1;
    let shape = [n];
    let frames = [0x1000u64];
    let lens = [u64::MAX];
    let refused = |r: Result<()>, what: &str| match r {
        Err(Error::Cuda(m)) if m.contains("at most 281474976710656") => {}
        other => panic!("{what}: {other:?}"),
    };
    // SAFETY: each call must fail on its arguments before any address is read.
    unsafe {
        refused(
            compress(&CompressArgs {
                scales: 0,
                block_log2: 0,
                device: 0,
                stream: 0,
                input: 0x1000,
                n,
                dtype: DType::F32,
                shape: &shape,
                bound: Bound::Abs(1e-3),
                out: 0x1000,
                out_len: u64::MAX,
                workspace: 0x1000,
                workspace_len: u64::MAX,
                residual: 0,
                size_to: 0,
                max_error_to: 0,
            }),
            "compress",
        );
        refused(
            compress_lossless(&LosslessCompressArgs {
                device: 0,
                stream: 0,
                input: 0x1000,
                n,
                dtype: DType::F32,
                shape: &shape,
                out: 0x1000,
                out_len: u64::MAX,
                workspace: 0x1000,
                workspace_len: u64::MAX,
            }),
            "compress_lossless",
        );
        for codec in [crate::Codec::Quantized, crate::Codec::Lossless] {
            refused(
                decompress(&DecompressArgs {
                    device: 0,
                    stream: 0,
                    frame: 0x1000,
                    n,
                    dtype: DType::F32,
                    codec,
                    ndim: 1,
                    out: 0x1000,
                    workspace: 0x1000,
                    workspace_len: u64::MAX,
                }),
                "decompress",
            );
        }
        refused(
            sum(&SumArgs {
                block_log2: 0,
                device: 0,
                stream: 0,
                frames: &frames,
                frame_lens: &lens,
                n,
                dtype: DType::F32,
                shape: &shape,
                out: 0x1000,
                out_len: u64::MAX,
                workspace: 0x1000,
                workspace_len: u64::MAX,
            }),
            "sum",
        );
        refused(
            decode_sum(&DecodeSumArgs {
                block_log2: 0,
                device: 0,
                stream: 0,
                frames: &frames,
                frame_lens: &lens,
                lens_before: 0,
                n,
                dtype: DType::F32,
                ndim: 1,
                scale: 1.0,
                out: 0x1000,
                out_dtype: DType::F32,
                workspace: 0x1000,
                workspace_len: u64::MAX,
                status: 0,
            }),
            "decode_sum",
        );
    }
}

/// A grid past what one launch takes is refused rather than clamped: every kernel maps fixed
/// work to each block, so a clamped grid would leave elements undone without an error (one
/// block per 4096-byte lossless chunk reaches 2^31 blocks below `MAX_ELEMENTS`).
#[test]
fn grids_past_the_device_limit_are_refused() {
    let fits = launch_cfg(u64::from(MAX_GRID_X) * 256, 256);
    assert_eq!(fits.grid_dim, (MAX_GRID_X, 1, 1));
    assert!(check_grid("k", &fits).is_ok());
    let too_many = launch_cfg(u64::from(MAX_GRID_X) * 256 + 1, 256);
    assert!(too_many.grid_dim.0 > MAX_GRID_X);
    let huge = launch_cfg(MAX_ELEMENTS, 1);
    assert_eq!(huge.grid_dim.0, u32::MAX);
    for cfg in [too_many, huge] {
        match check_grid("decode_w1", &cfg) {
            Err(Error::Cuda(m)) if m.contains("decode_w1") && m.contains("grid") => {}
            other => panic!("{:?}: {other:?}", cfg.grid_dim),
        }
    }
    let mut tall = launch_cfg(1, 256);
    tall.grid_dim.1 = 65536;
    assert!(check_grid("k", &tall).is_err());
    assert_eq!(launch_cfg(0, 256).grid_dim, (1, 1, 1));
}
