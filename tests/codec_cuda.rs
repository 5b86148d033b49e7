//! The CUDA codec against the CPU codec on frames that cross ranks: rice frames with block
//! scales written on the device are the CPU's bytes, and frames from peers (bit planes with block
//! scales, rice with and without) are checked on the device as the CPU's reader checks them,
//! then decoded or summed to the CPU's bits.
//!
//! Ignored by a plain `cargo test`, as `tests/engine_cuda.rs`: the GPU machine runs them with
//! `--include-ignored` and `CFC_REQUIRE_GPU=1` (`.carry/codec-cuda-tests`).
#![cfg(feature = "cuda")]

use cfc::{Coder, DType};
use cudarc::driver::{CudaSlice, DevicePtr};

mod gpu_common;
use gpu_common::{bytes_of, gpus, grads};

/// The device's checks of rice frames from peers: valid frames give `decode_sum`'s values, and a
/// frame broken anywhere the CPU's reader would refuse it (its header, a block head, a unary
/// stream, an exception index, its length, another codec) sets the status, naming the frame, and
/// nothing is written.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the GPU machine (scripts/gpu_run.sh)"]
fn rice_frames_from_peers_are_checked_on_the_device() {
    if gpus() == 0 {
        return;
    }
    let n = 5000;
    let rice = cfc::CompressOptions {
        coder: Coder::Rice,
        ..cfc::CompressOptions::new(cfc::Bound::Abs(1e-4))
    };
    let frames: Vec<Vec<u8>> = (0..3)
        .map(|r| {
            let mut x = grads(r, 0, n);
            x[10 + r] = f32::NAN; // an exception in each
            cfc::compress(&x, &[n], &rice).unwrap()
        })
        .collect();
    let mut want = vec![0f32; n];
    for (p, f) in frames.iter().enumerate() {
        let (_, v) = cfc::decompress::<f32>(f).unwrap();
        for (a, v) in want.iter_mut().zip(v) {
            *a = if p == 0 { v } else { *a + v };
        }
    }
    let want: Vec<u32> = want
        .iter()
        .map(|a| {
            let r = a * (1.0 / 3.0);
            if r.is_nan() {
                0x7fc0_0000
            } else {
                r.to_bits()
            }
        })
        .collect();
    let ctx = cfc::cuda::context(0).unwrap();
    let s = ctx.new_stream().unwrap();
    // (`short`: frame 1's length is that many bytes less than its bytes)
    let run = |frames: &[Vec<u8>], short: u64| -> (Vec<u32>, Vec<u32>) {
        let dev: Vec<CudaSlice<u8>> = frames.iter().map(|f| s.clone_htod(f).unwrap()).collect();
        let addrs: Vec<u64> = dev.iter().map(|d| d.device_ptr(&s).0).collect();
        let lens: Vec<u64> = frames
            .iter()
            .enumerate()
            .map(|(p, f)| f.len() as u64 - if p == 1 { short } else { 0 })
            .collect();
        let out = s.alloc_zeros::<u32>(n).unwrap();
        let ws_len = cfc::cuda::rice_decode_sum_workspace_len(n as u64, DType::F32);
        let ws = s.alloc_zeros::<u8>(ws_len as usize).unwrap();
        let status = s.alloc_zeros::<u32>(2).unwrap();
        let args = cfc::cuda::DecodeSumArgs {
            block_log2: 0,
            device: 0,
            stream: s.cu_stream() as usize,
            frames: &addrs,
            frame_lens: &lens,
            lens_before: 0,
            n: n as u64,
            dtype: DType::F32,
            ndim: 1,
            scale: 1.0 / 3.0,
            out: out.device_ptr(&s).0,
            out_dtype: DType::F32,
            workspace: ws.device_ptr(&s).0,
            workspace_len: ws_len,
            status: status.device_ptr(&s).0,
        };
        // SAFETY: every buffer lives until the synchronize below.
        unsafe { cfc::cuda::rice_decode_sum(&args) }.unwrap();
        s.synchronize().unwrap();
        (s.clone_dtoh(&out).unwrap(), s.clone_dtoh(&status).unwrap())
    };
    let (got, status) = run(&frames, 0);
    assert_eq!(status, [0, 0]);
    assert!(
        got == want,
        "the device's sum of rice frames is decode_sum's"
    );
    // Frame 1 broken in one place at a time. Its layout: header 72 bytes, 5 block heads, data.
    let f = &frames[1];
    let head0 = u64::from_le_bytes(f[72..80].try_into().unwrap());
    let (mask, k, u) = (head0 as u32, (head0 >> 32) & 63, (head0 >> 48) as usize);
    let unary = 72 + 40 + 4 * (k as usize * mask.count_ones() as usize);
    let exc_at = f.len() - 4 - 4; // the only exception's index (u32), then its value
    let flip = |at: usize, bits: u8| {
        let mut g = f.clone();
        g[at] ^= bits;
        g
    };
    let planes = cfc::CompressOptions::new(cfc::Bound::Abs(1e-4));
    let planes = cfc::compress(&grads(1, 0, n), &[n], &planes).unwrap();
    for (what, broken, short) in [
        ("magic", flip(0, 1), 0),
        ("a head's reserved bit", flip(72 + 4, 0x40), 0),
        ("a stop bit", flip(unary + 4 * (u / 2), 0x10), 0),
        ("the unary words", flip(72 + 6, 1), 0),
        ("an exception index", flip(exc_at + 1, 0x80), 0),
        ("a byte short", f.clone(), 1),
        ("a bit-plane frame", planes.clone(), 0),
    ] {
        let mut set = frames.clone();
        set[1] = broken;
        let (got, status) = run(&set, short);
        assert_eq!(status, [1, 2], "{what}: status");
        assert!(got.iter().all(|&v| v == 0), "{what}: something was written");
    }
}

/// Frames with block scales from elsewhere: the device decodes and sums what the CPU codec
/// wrote (a raw part among them), to the CPU's bits, and refuses frames without the expected
/// scales or with a shift that leaves no normal step, writing nothing.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the GPU machine (scripts/gpu_run.sh)"]
fn frames_with_block_scales_are_summed_and_checked_on_the_device() {
    if gpus() == 0 {
        return;
    }
    let (n, log2) = (9000usize, 8u8);
    let xs: Vec<Vec<f32>> = (0..3).map(|r| grads(r, 0, n)).collect();
    let exps: Vec<u8> = (0..n.div_ceil(256))
        .map(|b| {
            xs.iter()
                .map(|x| {
                    cfc::scales::block_exponents(&x[b * 256..((b + 1) * 256).min(n)], None, log2)[0]
                })
                .max()
                .unwrap()
        })
        .collect();
    let (eps, scales) = cfc::scales::BlockScales::from_exponents(0.3, &exps, log2);
    let o = cfc::CompressOptions::new(cfc::Bound::Abs(eps));
    let mut frames: Vec<Vec<u8>> = xs
        .iter()
        .map(|x| cfc::compress_scaled(x, &[n], &o, &scales).unwrap())
        .collect();
    // rank 2's frame went raw (its bytes kept, as an encoder falls back)
    // (a raw frame keeps the step and bound it was asked for: those of the others here)
    let mut raw = cfc::compress(
        &xs[2],
        &[n],
        &cfc::CompressOptions::new(cfc::Bound::Abs(1e-30)),
    )
    .unwrap();
    assert_eq!(cfc::read_header(&raw).unwrap().codec, cfc::Codec::Raw);
    raw[24..32].copy_from_slice(&(2.0 * eps).to_le_bytes());
    raw[32..40].copy_from_slice(&eps.to_le_bytes());
    frames[2] = raw;
    let parts: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
    let want_sum = cfc::sum_frames(&parts, None).unwrap();
    let ctx = cfc::cuda::context(0).unwrap();
    let s = ctx.new_stream().unwrap();
    let upload = |frames: &[Vec<u8>]| -> Vec<CudaSlice<u8>> {
        frames.iter().map(|f| s.clone_htod(f).unwrap()).collect()
    };
    // The exact sum, on the device.
    let dev = upload(&frames);
    let addrs: Vec<u64> = dev.iter().map(|d| d.device_ptr(&s).0).collect();
    let lens: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
    let cap = cfc::cuda::sum_capacity(n as u64, DType::F32, 1);
    let out = s.alloc_zeros::<u8>(cap as usize).unwrap();
    let ws_len = cfc::cuda::sum_workspace_len(n as u64, 3);
    let ws = s.alloc_zeros::<u8>(ws_len as usize).unwrap();
    let args = cfc::cuda::SumArgs {
        device: 0,
        stream: s.cu_stream() as usize,
        frames: &addrs,
        frame_lens: &lens,
        n: n as u64,
        dtype: DType::F32,
        shape: &[n as u64],
        out: out.device_ptr(&s).0,
        out_len: cap,
        block_log2: log2,
        workspace: ws.device_ptr(&s).0,
        workspace_len: ws_len,
    };
    // SAFETY: every buffer lives until the synchronize below.
    unsafe { cfc::cuda::sum(&args) }.unwrap();
    s.synchronize().unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    assert!(
        got[..want_sum.len()] == want_sum[..],
        "the device's sum is the CPU's, byte for byte"
    );
    // The decoded average, on the device; then broken frames.
    let mut want = vec![0f32; n];
    for (p, f) in frames.iter().enumerate() {
        let (_, v) = cfc::decompress::<f32>(f).unwrap();
        for (a, v) in want.iter_mut().zip(v) {
            *a = if p == 0 { v } else { *a + v };
        }
    }
    let want: Vec<u32> = want.iter().map(|a| (a * (1.0 / 3.0)).to_bits()).collect();
    let run = |frames: &[Vec<u8>]| -> (Vec<u32>, Vec<u32>) {
        let dev = upload(frames);
        let addrs: Vec<u64> = dev.iter().map(|d| d.device_ptr(&s).0).collect();
        let lens: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
        let out = s.alloc_zeros::<u32>(n).unwrap();
        let ws_len = cfc::cuda::decode_sum_workspace_len(n as u64, 3);
        let ws = s.alloc_zeros::<u8>(ws_len as usize).unwrap();
        let status = s.alloc_zeros::<u32>(2).unwrap();
        let args = cfc::cuda::DecodeSumArgs {
            device: 0,
            stream: s.cu_stream() as usize,
            frames: &addrs,
            frame_lens: &lens,
            lens_before: 0,
            n: n as u64,
            dtype: DType::F32,
            ndim: 1,
            scale: 1.0 / 3.0,
            out: out.device_ptr(&s).0,
            out_dtype: DType::F32,
            block_log2: log2,
            workspace: ws.device_ptr(&s).0,
            workspace_len: ws_len,
            status: status.device_ptr(&s).0,
        };
        // SAFETY: every buffer lives until the synchronize below.
        unsafe { cfc::cuda::decode_sum(&args) }.unwrap();
        s.synchronize().unwrap();
        (s.clone_dtoh(&out).unwrap(), s.clone_dtoh(&status).unwrap())
    };
    let (got, status) = run(&frames);
    assert_eq!(status, [0, 0]);
    assert!(got == want, "the device's decoded average is the CPU's");
    let f = &frames[1];
    let with = |at: usize, v: u8| {
        let mut g = f.clone();
        g[at] = v;
        g
    };
    let plain = cfc::compress(&xs[1], &[n], &o).unwrap();
    let mut tiny = with(24 + 7, 0x01); // step's exponent byte: a step near 2^-1000
    tiny[72] = 200; // and block 0's shift past what a normal step allows
    for (what, broken) in [
        ("no scales", plain),
        ("scales of another block size", with(12, 9)),
        ("the scales flag cleared", with(7, 0)),
        ("a shift past the normal numbers", tiny),
    ] {
        let mut set = frames.clone();
        set[1] = broken;
        let (got, status) = run(&set);
        assert_eq!(status, [1, 2], "{what}: status");
        assert!(got.iter().all(|&v| v == 0), "{what}: something was written");
    }
}

/// Block scales of `xs` as the engine agrees them (each block's largest exponent over the
/// ranks), for blocks of `2^log2`, at `k` times each block's RMS: the absolute bound and scales.
fn agreed_scales(xs: &[Vec<f32>], log2: u8, k: f64) -> (f64, cfc::scales::BlockScales) {
    let (n, size) = (xs[0].len(), 1usize << log2);
    let exps: Vec<u8> = (0..n.div_ceil(size))
        .map(|b| {
            xs.iter()
                .map(|x| {
                    cfc::scales::block_exponents(&x[b * size..((b + 1) * size).min(n)], None, log2)
                        [0]
                })
                .max()
                .unwrap()
        })
        .collect();
    cfc::scales::BlockScales::from_exponents(k, &exps, log2)
}

/// A rice frame with block scales written on the device is the CPU codec's, byte for byte, and
/// so is the residual error feedback leaves, over three steps (the residual carried), for block
/// sizes whose scales leave the heads at every alignment.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the GPU machine (scripts/gpu_run.sh)"]
fn rice_frames_with_block_scales_are_the_cpu_bytes() {
    if gpus() == 0 {
        return;
    }
    let ctx = cfc::cuda::context(0).unwrap();
    let s = ctx.new_stream().unwrap();
    for (n, log2) in [(9001usize, 8u8), (70_001, 5), (70_001, 12), (16_384, 8)] {
        let mut r_cpu = vec![0f32; n];
        let r_dev = s.alloc_zeros::<f32>(n).unwrap();
        for step in 0..3 {
            let x = grads(0, step, n);
            let (eps, scales) = agreed_scales(std::slice::from_ref(&x), log2, 0.3);
            let o = cfc::CompressOptions {
                coder: Coder::Rice,
                ..cfc::CompressOptions::new(cfc::Bound::Abs(eps))
            };
            let want = cfc::compress_with_feedback_scaled(&x, &mut r_cpu, &[n], &o, Some(&scales))
                .unwrap();
            let x_dev = s.clone_htod(&x).unwrap();
            let shifts = s.clone_htod(&scales.shifts).unwrap();
            let cap = cfc::cuda::rice_capacity(n as u64, DType::F32, 1);
            let out = s.alloc_zeros::<u8>(cap as usize).unwrap();
            let ws_len = cfc::cuda::rice_workspace_len(n as u64);
            let ws = s.alloc_zeros::<u8>(ws_len as usize).unwrap();
            let size = s.alloc_zeros::<u64>(1).unwrap();
            let args = cfc::cuda::CompressArgs {
                device: 0,
                stream: s.cu_stream() as usize,
                input: x_dev.device_ptr(&s).0,
                n: n as u64,
                dtype: DType::F32,
                shape: &[n as u64],
                bound: cfc::Bound::Abs(eps),
                out: out.device_ptr(&s).0,
                out_len: cap,
                workspace: ws.device_ptr(&s).0,
                workspace_len: ws_len,
                residual: r_dev.device_ptr(&s).0,
                size_to: size.device_ptr(&s).0,
                max_error_to: 0,
                scales: shifts.device_ptr(&s).0,
                block_log2: log2,
            };
            // SAFETY: every buffer lives until the synchronize below.
            unsafe { cfc::cuda::compress_rice(&args) }.unwrap();
            s.synchronize().unwrap();
            let len = s.clone_dtoh(&size).unwrap()[0] as usize;
            let got = s.clone_dtoh(&out).unwrap();
            let what = format!("n {n}, blocks of 2^{log2}, step {step}");
            assert_eq!(
                cfc::read_header(&want).unwrap().codec,
                cfc::Codec::Rice,
                "{what}"
            );
            assert!(
                got[..len] == want[..],
                "{what}: the frame differs from the CPU's"
            );
            let r_got = s.clone_dtoh(&r_dev).unwrap();
            assert!(
                bytes_of(&r_got, DType::F32) == bytes_of(&r_cpu, DType::F32),
                "{what}: the residual differs"
            );
        }
    }
}

/// Rice frames with block scales from elsewhere: the device decodes and averages what the CPU
/// codec wrote (a raw part among them) to the CPU's bits, and refuses frames without the expected
/// scales, of another block size, or with a shift that leaves no normal step, writing nothing.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the GPU machine (scripts/gpu_run.sh)"]
fn rice_frames_with_block_scales_from_peers_are_checked_on_the_device() {
    if gpus() == 0 {
        return;
    }
    let (n, log2) = (9000usize, 8u8);
    let xs: Vec<Vec<f32>> = (0..3).map(|r| grads(r, 0, n)).collect();
    let (eps, scales) = agreed_scales(&xs, log2, 0.3);
    let o = cfc::CompressOptions {
        coder: Coder::Rice,
        ..cfc::CompressOptions::new(cfc::Bound::Abs(eps))
    };
    let mut frames: Vec<Vec<u8>> = xs
        .iter()
        .map(|x| cfc::compress_scaled(x, &[n], &o, &scales).unwrap())
        .collect();
    assert_eq!(
        cfc::read_header(&frames[1]).unwrap().codec,
        cfc::Codec::Rice
    );
    // rank 2's frame went raw, keeping the step and bound it was asked for
    let mut raw = cfc::compress(
        &xs[2],
        &[n],
        &cfc::CompressOptions::new(cfc::Bound::Abs(1e-30)),
    )
    .unwrap();
    assert_eq!(cfc::read_header(&raw).unwrap().codec, cfc::Codec::Raw);
    raw[24..32].copy_from_slice(&(2.0 * eps).to_le_bytes());
    raw[32..40].copy_from_slice(&eps.to_le_bytes());
    frames[2] = raw;
    let mut want = vec![0f32; n];
    for (p, f) in frames.iter().enumerate() {
        let (_, v) = cfc::decompress::<f32>(f).unwrap();
        for (a, v) in want.iter_mut().zip(v) {
            *a = if p == 0 { v } else { *a + v };
        }
    }
    let want: Vec<u32> = want.iter().map(|a| (a * (1.0 / 3.0)).to_bits()).collect();
    let ctx = cfc::cuda::context(0).unwrap();
    let s = ctx.new_stream().unwrap();
    let run = |frames: &[Vec<u8>]| -> (Vec<u32>, Vec<u32>) {
        let dev: Vec<CudaSlice<u8>> = frames.iter().map(|f| s.clone_htod(f).unwrap()).collect();
        let addrs: Vec<u64> = dev.iter().map(|d| d.device_ptr(&s).0).collect();
        let lens: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
        let out = s.alloc_zeros::<u32>(n).unwrap();
        let ws_len = cfc::cuda::rice_decode_sum_workspace_len(n as u64, DType::F32);
        let ws = s.alloc_zeros::<u8>(ws_len as usize).unwrap();
        let status = s.alloc_zeros::<u32>(2).unwrap();
        let args = cfc::cuda::DecodeSumArgs {
            block_log2: log2,
            device: 0,
            stream: s.cu_stream() as usize,
            frames: &addrs,
            frame_lens: &lens,
            lens_before: 0,
            n: n as u64,
            dtype: DType::F32,
            ndim: 1,
            scale: 1.0 / 3.0,
            out: out.device_ptr(&s).0,
            out_dtype: DType::F32,
            workspace: ws.device_ptr(&s).0,
            workspace_len: ws_len,
            status: status.device_ptr(&s).0,
        };
        // SAFETY: every buffer lives until the synchronize below.
        unsafe { cfc::cuda::rice_decode_sum(&args) }.unwrap();
        s.synchronize().unwrap();
        (s.clone_dtoh(&out).unwrap(), s.clone_dtoh(&status).unwrap())
    };
    let (got, status) = run(&frames);
    assert_eq!(status, [0, 0]);
    assert!(got == want, "the device's decoded average is the CPU's");
    let f = &frames[1];
    let with = |at: usize, v: u8| {
        let mut g = f.clone();
        g[at] = v;
        g
    };
    let unscaled = cfc::compress(&xs[1], &[n], &o).unwrap();
    let mut tiny = with(24 + 7, 0x01); // step's exponent byte: a step near 2^-1000
    tiny[72] = 200; // and block 0's shift past what a normal step allows
    for (what, broken) in [
        ("no scales", unscaled),
        ("scales of another block size", with(12, 9)),
        ("the scales flag cleared", with(7, 0)),
        ("a shift past the normal numbers", tiny),
    ] {
        let mut set = frames.clone();
        set[1] = broken;
        let (got, status) = run(&set);
        assert_eq!(status, [1, 2], "{what}: status");
        assert!(got.iter().all(|&v| v == 0), "{what}: something was written");
    }
}
