//! Hostile inputs: every decoding entry point (`validate`, `read_header`, `decompress` for the
//! three types, `decompress_into_bytes`, `Codes::from_frame`) must return `Err` or a valid
//! decode, never panic, never allocate what the input does not hold.
//!
//! Covers every truncation of several valid frames, random byte mutations (proptest), a table
//! of crafted frames each expected to fail with a given error, and the regression corpus in
//! `tests/hostile/` (regenerate the generated part with `CFC_WRITE_HOSTILE_CORPUS=1`).

mod common;

use cfc::format::{FIXED_HEADER_LEN, MAX_NDIM};
use cfc::{
    compress, compress_lossless_bytes, decompress, decompress_into_bytes, read_header, validate,
    Bound, BoundMode, Codec, Coder, Codes, CompressOptions, DType, Error, FormatError, Header,
    LosslessOptions,
};
use common::{gen, hex, Dist};
use half::{bf16, f16};
use proptest::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Runs every decoder on `input` and checks they agree with each other. Returns what
/// `validate` said. A panic inside (a decoder's or a failed consistency check's) becomes a
/// test failure that prints the input as hex.
fn probe(input: &[u8]) -> Result<Header, Error> {
    match catch_unwind(AssertUnwindSafe(|| probe_inner(input))) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!(
                "panic on hostile input ({msg}); input ({} bytes): {}",
                input.len(),
                hex(input)
            )
        }
    }
}

fn probe_inner(input: &[u8]) -> Result<Header, Error> {
    let v = validate(input);
    let rh = read_header(input);
    let df = decompress::<f32>(input);
    let db = decompress::<bf16>(input);
    let dh = decompress::<f16>(input);
    let codes = Codes::from_frame(input);
    match &v {
        Ok(h) => {
            assert_eq!(
                rh.as_ref().ok(),
                Some(h),
                "read_header disagrees with validate"
            );
            let lens = [
                df.as_ref().map(|(_, y)| y.len()).ok(),
                db.as_ref().map(|(_, y)| y.len()).ok(),
                dh.as_ref().map(|(_, y)| y.len()).ok(),
            ];
            let want = match h.dtype {
                DType::F32 => [Some(h.n as usize), None, None],
                DType::BF16 => [None, Some(h.n as usize), None],
                DType::F16 => [None, None, Some(h.n as usize)],
                _ => [None, None, None],
            };
            assert_eq!(
                lens, want,
                "decompress of the frame's own dtype must succeed, others fail"
            );
            let mut out = vec![0u8; h.decoded_len() as usize];
            decompress_into_bytes(input, &mut out, 2).expect("validated frame must decode");
            if !h.dtype.is_quantizable() {
                assert!(codes.is_err(), "codes of a {} frame", h.dtype.name());
                return v;
            }
            let c = codes.as_ref().expect("validated frame must give its codes");
            assert_eq!(c.codes.len() as u64, h.n);
            assert!(c.exceptions.len() as u64 <= h.n);
            let typed: Vec<u8> = match h.dtype {
                DType::F32 => bytemuck::cast_slice(&df.as_ref().expect("ok").1).to_vec(),
                DType::BF16 => bytemuck::cast_slice(&db.as_ref().expect("ok").1).to_vec(),
                _ => bytemuck::cast_slice(&dh.as_ref().expect("ok").1).to_vec(),
            };
            assert!(
                out == typed,
                "decompress_into_bytes disagrees with decompress"
            );
        }
        Err(_) => {
            assert!(
                df.is_err() && db.is_err() && dh.is_err(),
                "decompress accepted what validate refused"
            );
            assert!(
                codes.is_err(),
                "Codes::from_frame accepted what validate refused"
            );
            // (it validates before it looks at the output's size: refused for the frame, not for
            // a buffer of the wrong size)
            let mut out = vec![0u8; 64];
            let r = decompress_into_bytes(input, &mut out, 1);
            assert!(
                r.is_err() && !matches!(r, Err(Error::OutputSize { .. })),
                "decompress_into_bytes did not refuse the frame itself: {r:?}"
            );
        }
    }
    v
}

/// A collection of valid frames of every kind: quantized with exceptions, zstd, raw, raw with
/// zstd, fixed rate, sums with wide codes, empty and scalar tensors.
fn valid_frames() -> &'static [(&'static str, Vec<u8>)] {
    static FRAMES: OnceLock<Vec<(&'static str, Vec<u8>)>> = OnceLock::new();
    FRAMES.get_or_init(|| {
        let mut x: Vec<f32> = gen(Dist::Laplace, 300, 1.0, 1);
        x[7] = f32::NAN;
        x[100] = f32::INFINITY;
        x[299] = -f32::NAN;
        let abs = CompressOptions::new(Bound::Abs(0.01));
        let z = |o: CompressOptions| CompressOptions {
            zstd_level: Some(3),
            ..o
        };
        let rice = |o: CompressOptions| CompressOptions {
            coder: Coder::Rice,
            ..o
        };
        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let rep: Vec<f32> = (0..200).map(|i| [0.1f32, 7.0, -2.5][i % 3]).collect();
        let wide = Codes {
            scales: None,
            dtype: DType::BF16,
            shape: vec![2, 20],
            step: 0.5,
            eps: 0.25,
            codes: (0..40)
                .map(|i| if i % 3 == 0 { 0 } else { (i as i64) << 40 })
                .collect(),
            exceptions: vec![(3, 0x7fc0), (39, 0xff80)],
        };
        let frames = vec![
            ("f32 quantized, exceptions", compress(&x, &[3, 100], &abs)),
            ("f32 quantized, zstd", compress(&x, &[300], &z(abs))),
            (
                "f32 raw",
                compress(&x[..64], &[64], &CompressOptions::new(Bound::Abs(1e-30))),
            ),
            (
                "f32 raw, zstd",
                compress(&rep, &[200], &z(CompressOptions::new(Bound::Abs(1e-30)))),
            ),
            (
                "bf16 bits mode",
                compress(&xb[..100], &[100], &CompressOptions::new(Bound::Bits(5))),
            ),
            (
                "f16 rel, zstd",
                compress(&xh, &[300], &z(CompressOptions::new(Bound::Rel(1e-3)))),
            ),
            ("bf16 sum, wide codes", wide.to_frame(None)),
            ("bf16 sum, wide codes, zstd", wide.to_frame(Some(3))),
            ("lossless, every method", Ok(l_frame())),
            (
                "lossless bf16 weights, zstd",
                compress_lossless_bytes(
                    bytemuck::cast_slice(
                        &(0..3000)
                            .map(|i| bf16::from_f32((i % 60) as f32 * 0.01 - 0.3))
                            .collect::<Vec<_>>(),
                    ),
                    DType::BF16,
                    &[3000],
                    &LosslessOptions {
                        zstd_level: Some(3),
                        threads: 1,
                    },
                ),
            ),
            (
                "lossless int64, raw",
                compress_lossless_bytes(
                    bytemuck::cast_slice(&x),
                    DType::I64,
                    &[150],
                    &LosslessOptions::default(),
                ),
            ),
            (
                "lossless bool",
                compress_lossless_bytes(
                    &(0..5000).map(|i| (i % 3 == 0) as u8).collect::<Vec<_>>(),
                    DType::Bool,
                    &[5000],
                    &LosslessOptions::default(),
                ),
            ),
            ("f32 rice, exceptions", compress(&x, &[300], &rice(abs))),
            ("bf16 rice", compress(&xb, &[300], &rice(abs))),
            (
                "f32 rice, zstd",
                compress(
                    &(0..5000)
                        .map(|i| [0.1f32, 7.0, -2.5][i % 3])
                        .collect::<Vec<_>>(),
                    &[5000],
                    &z(rice(abs)),
                ),
            ),
            ("rice, three blocks", Ok(r_frame())),
            (
                "bf16 sum, wide codes, rice",
                wide.to_frame_as(Coder::Rice, None),
            ),
            ("empty", compress::<f32>(&[], &[0, 3], &abs)),
            ("scalar", compress(&[0.0f32], &[], &abs)),
            ("f32 block scales, exceptions", Ok(s_frame())),
            (
                "bf16 block scales, rice, zstd",
                compress(
                    &xb,
                    &[300],
                    &z(rice(CompressOptions::new(Bound::Rms {
                        k: 0.1,
                        block_log2: 5,
                    }))),
                ),
            ),
            (
                "block scales, sum",
                cfc::sum_frames(&[&s_frame(), &s_frame()], None),
            ),
        ];
        frames
            .into_iter()
            .map(|(name, f)| (name, f.expect("valid frame")))
            .collect()
    })
}

#[test]
fn valid_frames_are_valid() {
    let frames = valid_frames();
    for (name, f) in frames {
        let h = probe(f).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(f.len() as u64, h.len() as u64 + h.body_len, "{name}");
    }
    // They cover what they claim to.
    let hs: Vec<Header> = frames
        .iter()
        .map(|(_, f)| validate(f).expect("ok"))
        .collect();
    assert!(hs.iter().any(|h| h.codec == Codec::Raw && h.zstd));
    assert!(hs.iter().any(|h| h.codec == Codec::Raw && !h.zstd));
    assert!(hs
        .iter()
        .any(|h| h.codec == Codec::Quantized && h.zstd && h.n_exceptions > 0));
    assert!(hs
        .iter()
        .any(|h| h.codec == Codec::Quantized && !h.zstd && h.n_exceptions > 0));
    assert!(hs.iter().any(|h| h.mode == BoundMode::Sum && h.zstd));
    assert!(hs.iter().any(|h| h.codec == Codec::Lossless && h.zstd));
    assert!(hs.iter().any(|h| h.codec == Codec::Rice && h.zstd));
    assert!(hs
        .iter()
        .any(|h| h.codec == Codec::Rice && h.n_exceptions > 0));
    assert!(hs
        .iter()
        .any(|h| h.codec == Codec::Rice && h.mode == BoundMode::Sum));
    assert!(hs.iter().any(|h| h.codec == Codec::Lossless && !h.zstd));
    assert!(hs
        .iter()
        .any(|h| h.codec == Codec::Raw && h.mode == BoundMode::Lossless));
}

#[test]
fn every_truncation_is_an_error() {
    for (name, f) in valid_frames() {
        for len in 0..f.len() {
            assert!(
                probe(&f[..len]).is_err(),
                "{name} truncated to {len} bytes was accepted"
            );
        }
        let mut longer = f.clone();
        longer.push(0);
        assert!(
            probe(&longer).is_err(),
            "{name} with a trailing byte accepted"
        );
    }
}

// ---- Random mutations ----

#[derive(Debug, Clone)]
enum Mutation {
    Set(prop::sample::Index, u8),
    Flip(prop::sample::Index, u8),
    Delete(prop::sample::Index),
    Insert(prop::sample::Index, u8),
    /// Overwrites one of the header's 64-bit fields (n, step, eps, n_exc, body_len, raw_len,
    /// first dim) with an interesting value.
    Field(prop::sample::Index, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let interesting = prop::sample::select(vec![
        0u64,
        1,
        2,
        31,
        32,
        33,
        255,
        1 << 32,
        (1 << 32) + 1,
        1 << 40,
        1 << 62,
        u64::MAX,
        u64::MAX / 2,
        f64::NAN.to_bits(),
        f64::INFINITY.to_bits(),
        (-1.0f64).to_bits(),
        0.5f64.to_bits(),
        f64::MIN_POSITIVE.to_bits(),
        1, // subnormal f64
    ]);
    prop_oneof![
        4 => (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        4 => (any::<prop::sample::Index>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        1 => any::<prop::sample::Index>().prop_map(Mutation::Delete),
        1 => (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        2 => (any::<prop::sample::Index>(), interesting).prop_map(|(i, v)| Mutation::Field(i, v)),
    ]
}

/// Applies mutations to `frame`; `body_only` keeps byte edits out of the header so that the
/// body checks are reached, `fix_lengths` rewrites body_len (and raw_body_len without zstd)
/// to the bytes present afterwards.
fn mutate(frame: &[u8], muts: &[Mutation], body_only: bool, fix_lengths: bool) -> Vec<u8> {
    let mut f = frame.to_vec();
    let header_len = read_header(frame).map(|h| h.len()).unwrap_or(0);
    for m in muts {
        let (lo, hi) = if body_only && f.len() > header_len {
            (header_len, f.len())
        } else {
            (0, f.len())
        };
        let pos = |i: &prop::sample::Index| lo + i.index((hi - lo).max(1));
        match m {
            Mutation::Set(i, b) if hi > lo => f[pos(i)] = *b,
            Mutation::Flip(i, bit) if hi > lo => f[pos(i)] ^= 1 << bit,
            Mutation::Delete(i) if hi > lo => {
                f.remove(pos(i));
            }
            Mutation::Insert(i, b) => {
                let p = lo + i.index(hi - lo + 1);
                f.insert(p, *b);
            }
            Mutation::Field(i, v) => {
                let off = [16usize, 24, 32, 40, 48, 56, 64][i.index(7)];
                if f.len() >= off + 8 {
                    f[off..off + 8].copy_from_slice(&v.to_le_bytes());
                }
            }
            _ => {}
        }
    }
    if fix_lengths && f.len() >= FIXED_HEADER_LEN && (f[9] as usize) <= MAX_NDIM {
        let hl = FIXED_HEADER_LEN + 8 * f[9] as usize;
        if f.len() >= hl {
            let body = (f.len() - hl) as u64;
            f[48..56].copy_from_slice(&body.to_le_bytes());
            if f[7] & 1 == 0 {
                f[56..64].copy_from_slice(&body.to_le_bytes());
            }
        }
    }
    f
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20_000, ..ProptestConfig::default() })]

    /// Mutated frames: Ok or Err, never a panic; when Ok, every decoder agrees on `n`.
    #[test]
    fn mutations_never_panic(
        which in any::<prop::sample::Index>(),
        muts in prop::collection::vec(mutation(), 1..6),
        body_only in any::<bool>(),
        fix_lengths in any::<bool>(),
    ) {
        let frames = valid_frames();
        let (_, frame) = &frames[which.index(frames.len())];
        let input = mutate(frame, &muts, body_only, fix_lengths);
        if let Ok(h) = probe(&input) {
            // `probe` checked the decoders; the frame must also describe itself consistently.
            prop_assert_eq!(input.len() as u64, h.len() as u64 + h.body_len);
            prop_assert_eq!(h.shape.iter().product::<u64>(), h.n);
        }
    }

    /// Arbitrary bytes behind a valid header prefix.
    #[test]
    fn random_bodies_never_panic(
        which in any::<prop::sample::Index>(),
        body in prop::collection::vec(any::<u8>(), 0..400),
        zstd_flag in any::<bool>(),
    ) {
        let frames = valid_frames();
        let (_, frame) = &frames[which.index(frames.len())];
        let h = read_header(frame).expect("valid");
        let mut f = frame[..h.len()].to_vec();
        f[7] = zstd_flag as u8;
        f[48..56].copy_from_slice(&(body.len() as u64).to_le_bytes());
        if !zstd_flag {
            f[56..64].copy_from_slice(&(body.len() as u64).to_le_bytes());
        }
        f.extend_from_slice(&body);
        let _ = probe(&f);
    }
}

/// The random mutations above are only worth something if they get past the header: with a
/// fixed seed, check that they reach each of the body checks and also produce valid frames.
#[test]
fn mutations_reach_the_body_checks() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (
        any::<prop::sample::Index>(),
        prop::collection::vec(mutation(), 1..4),
    );
    let frames = valid_frames();
    let mut seen = std::collections::BTreeMap::<String, u32>::new();
    for _ in 0..4000 {
        let (which, muts) = strategy.new_tree(&mut runner).expect("generates").current();
        let (_, frame) = &frames[which.index(frames.len())];
        let input = mutate(frame, &muts, true, true);
        let key = match probe(&input) {
            Ok(_) => "ok".to_string(),
            Err(Error::Format(e)) => format!("{e:?}")
                .split([' ', '('])
                .next()
                .unwrap_or("")
                .to_string(),
            Err(e) => format!("{e:?}"),
        };
        *seen.entry(key).or_default() += 1;
    }
    eprintln!("outcomes of 4000 body mutations: {seen:?}");
    for want in [
        "ok",
        "BadWidth",
        "BadExceptionIndex",
        "LengthMismatch",
        "Zstd",
    ] {
        assert!(
            seen.contains_key(want),
            "mutations never produced {want}: {seen:?}"
        );
    }
}

// ---- Crafted frames ----

/// Writes a header and a body, with the header's lengths as given (no fixing up).
fn write(h: &Header, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    h.write(&mut f);
    f.extend_from_slice(body);
    f
}

/// A header for `n` elements of shape `[n]` whose lengths match `body` (without zstd).
fn header(dtype: DType, n: u64, n_exceptions: u64, body: &[u8]) -> Header {
    Header {
        codec: Codec::Quantized,
        dtype,
        zstd: false,
        mode: BoundMode::Abs,
        bits: 0,
        n,
        step: 1.0,
        eps: 0.5,
        n_exceptions,
        body_len: body.len() as u64,
        raw_body_len: body.len() as u64,
        shape: vec![n],
        block_log2: 0,
    }
}

/// A quantized body: widths, a recognisable plane pattern, 4-byte indices and the values.
fn qbody(dtype: DType, widths: &[u8], exc: &[(u64, u32)]) -> Vec<u8> {
    let mut b = widths.to_vec();
    let words: usize = widths.iter().map(|&w| w as usize).sum();
    for k in 0..words {
        b.extend_from_slice(&(0x9e37_79b9u32.wrapping_mul(k as u32 + 1)).to_le_bytes());
    }
    for &(i, _) in exc {
        b.extend_from_slice(&(i as u32).to_le_bytes());
    }
    for &(_, v) in exc {
        b.extend_from_slice(&v.to_le_bytes()[..dtype.size()]);
    }
    b
}

/// 70 float32 elements in 3 groups (widths 2, 0, 5) with exceptions at 3, 40 and 69.
fn q_parts() -> (Vec<u8>, Vec<(u64, u32)>) {
    (
        vec![2, 0, 5],
        vec![
            (3, f32::NAN.to_bits()),
            (40, f32::INFINITY.to_bits()),
            (69, 1.5f32.to_bits()),
        ],
    )
}

fn q_frame_with(widths: &[u8], exc: &[(u64, u32)]) -> Vec<u8> {
    let body = qbody(DType::F32, widths, exc);
    write(&header(DType::F32, 70, exc.len() as u64, &body), &body)
}

/// The valid baseline every quantized crafted case starts from.
/// A frame with block scales (blocks of 64) and exceptions: its scales are the first
/// `ceil(300 / 64) = 5` bytes of the body.
fn s_frame() -> Vec<u8> {
    let mut x: Vec<f32> = gen(Dist::Laplace, 300, 1.0, 2);
    for (i, v) in x.iter_mut().enumerate() {
        *v *= [1.0, 1e-3, 1e-6, 1.0, 0.5][i / 64];
    }
    x[70] = f32::NAN;
    let o = CompressOptions::new(Bound::Rms {
        k: 0.2,
        block_log2: 6,
    });
    compress(&x, &[300], &o).expect("a frame with block scales")
}

fn q_frame() -> Vec<u8> {
    let (w, e) = q_parts();
    q_frame_with(&w, &e)
}

/// The valid baseline of the rice crafted cases: 2100 float32 values in three blocks of 1024,
/// a NaN (an exception) in block 0, block 1 all zero (an empty head), block 2 short.
fn r_frame() -> Vec<u8> {
    let mut x: Vec<f32> = gen(Dist::Laplace, 2100, 1.0, 17);
    x[1024..2048].fill(0.0);
    x[9] = f32::NAN;
    let opts = CompressOptions {
        coder: Coder::Rice,
        ..CompressOptions::new(Bound::Abs(0.05))
    };
    compress(&x, &[2100], &opts).expect("rice frame")
}

/// Where the parts of `r_frame` sit: its three block heads, and block 0's unary stream.
struct ROffsets {
    heads: usize,
    unary0: usize,
    unary0_words: usize,
}

fn r_offsets(f: &[u8]) -> ROffsets {
    let heads = 72;
    let head =
        |b: usize| u64::from_le_bytes(f[heads + 8 * b..heads + 8 * b + 8].try_into().unwrap());
    assert_eq!(f[5], 3, "a rice frame");
    assert_eq!(head(1), 0, "block 1 is empty");
    let (mask, k, u) = (
        head(0) as u32,
        (head(0) >> 32) & 63,
        (head(0) >> 48) as usize,
    );
    assert_eq!(mask, u32::MAX, "block 0 codes every group");
    ROffsets {
        heads,
        unary0: heads + 24 + 4 * (32 * k as usize),
        unary0_words: u,
    }
}

/// A valid raw float16 frame of 10 elements.
fn raw_frame() -> Vec<u8> {
    let body: Vec<u8> = (0..20u8).collect();
    let h = Header {
        codec: Codec::Raw,
        ..header(DType::F16, 10, 0, &body)
    };
    write(&h, &body)
}

/// A header whose zstd-stage body is `stored`, announcing `raw_len` bytes once inflated.
fn zstd_frame(mut h: Header, stored: &[u8], raw_len: u64) -> Vec<u8> {
    h.zstd = true;
    h.body_len = stored.len() as u64;
    h.raw_body_len = raw_len;
    write(&h, stored)
}

fn zst(data: &[u8]) -> Vec<u8> {
    zstd::bulk::compress(data, 3).expect("zstd compresses")
}

fn set(mut f: Vec<u8>, off: usize, bytes: &[u8]) -> Vec<u8> {
    f[off..off + bytes.len()].copy_from_slice(bytes);
    f
}

fn set_u64(f: Vec<u8>, off: usize, v: u64) -> Vec<u8> {
    set(f, off, &v.to_le_bytes())
}

/// The valid baseline of the lossless crafted cases: 4196 float32 elements in two chunks.
/// Chunk 0 (4096 weights, three of them far larger) is packed with 13 exceptions; chunk 1
/// (100 values, half zero, the others close to 1) is sparse + pack.
fn l_frame() -> Vec<u8> {
    let mut x: Vec<f32> = gen(Dist::Laplace, 4196, 0.02, 31);
    x[5] = 1e30;
    x[77] = f32::NAN;
    x[4000] = -3e20;
    for (i, v) in x[4096..].iter_mut().enumerate() {
        *v = if i % 2 == 0 {
            0.0
        } else {
            1.0 + i as f32 / 1024.0
        };
    }
    compress_lossless_bytes(
        bytemuck::cast_slice(&x),
        DType::F32,
        &[4196],
        &LosslessOptions::default(),
    )
    .expect("lossless")
}

/// Offsets in `l_frame`: chunk table, chunk 0's pack header, its exception indices, chunk 1.
struct LOffsets {
    table: usize,
    /// Chunk 0's exception count.
    x0: usize,
    pack0: usize,
    exc0: usize,
    chunk1: usize,
}

fn l_offsets(f: &[u8]) -> LOffsets {
    let table = 72;
    let entry =
        |c: usize| u32::from_le_bytes(f[table + 4 * c..table + 4 * c + 4].try_into().unwrap());
    assert_eq!(
        (entry(0) >> 28, entry(1) >> 28),
        (1, 3),
        "chunk methods of the baseline"
    );
    assert_eq!(
        u16::from_le_bytes([f[table + 8], f[table + 9]]) % 2,
        1,
        "odd exception count"
    );
    let pack0 = table + 8;
    let k = u64::from_le_bytes(f[pack0 + 4..pack0 + 12].try_into().unwrap()).count_ones() as usize;
    LOffsets {
        table,
        x0: u16::from_le_bytes([f[pack0], f[pack0 + 1]]) as usize,
        pack0,
        exc0: pack0 + 20 + 4 * 128 * k,
        chunk1: pack0 + (entry(0) & 0x0fff_ffff) as usize,
    }
}

/// Pseudo-random bytes (a fixed LCG), for bodies that do not compress.
fn noise(n: usize, seed: u32) -> Vec<u8> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 24) as u8
        })
        .collect()
}

/// A lossless frame of `bytes` compressed as uint8 and then labelled `bool`: valid as uint8, so
/// its only fault is elements above 1. `chunk0` is the method chunk 0 must be stored by (`None`:
/// the encoder must have written a raw frame).
fn uint8_as_bool(bytes: &[u8], chunk0: Option<u32>) -> Vec<u8> {
    let f = compress_lossless_bytes(
        bytes,
        DType::U8,
        &[bytes.len()],
        &LosslessOptions::default(),
    )
    .expect("lossless");
    validate(&f).expect("valid as uint8");
    match chunk0 {
        None => assert_eq!(f[5], 1, "a raw frame (codec byte 1)"),
        Some(m) => {
            assert_eq!(f[5], 2, "a lossless frame (codec byte 2)");
            let entry = u32::from_le_bytes(f[72..76].try_into().unwrap());
            assert_eq!(entry >> 28, m, "chunk 0's method");
        }
    }
    set(f, 6, &[9]) // dtype byte 9: bool
}

/// Offset of the exception indices in `q_frame` (header 72 + widths 3 + planes 4 x 7).
const Q_EXC: usize = 72 + 3 + 28;

fn fmt_err(e: &Error) -> Option<&FormatError> {
    match e {
        Error::Format(f) => Some(f),
        _ => None,
    }
}

fn bad_field(e: &Error, name: &str) -> bool {
    matches!(fmt_err(e), Some(FormatError::BadField { field, .. }) if *field == name)
}

fn mismatch(e: &Error, name: &str) -> bool {
    matches!(fmt_err(e), Some(FormatError::LengthMismatch { part, .. }) if *part == name)
}

/// A zstd body that inflated to `n` bytes, not the length its frame announced.
fn zstd_body_found(e: &Error, n: u64) -> bool {
    matches!(
        fmt_err(e),
        Some(FormatError::LengthMismatch { part: "zstd-decoded body", found, .. }) if *found == n
    )
}

/// One crafted hostile input.
struct Case {
    /// File name in `tests/hostile/` (without `.bin`).
    name: &'static str,
    input: Vec<u8>,
    /// What `validate` must answer.
    expect: fn(&Error) -> bool,
}

fn case(name: &'static str, input: Vec<u8>, expect: fn(&Error) -> bool) -> Case {
    Case {
        name,
        input,
        expect,
    }
}

/// Every crafted case. The same table writes the regression corpus.
fn crafted() -> Vec<Case> {
    let q = q_frame();
    let (widths, exc) = q_parts();
    let huge = |n: u64| Header {
        shape: vec![n],
        n,
        ..header(DType::F32, 0, 0, &[0; 10])
    };
    let zero_widths = vec![0u8; 1000];
    let l = l_frame();
    let lo = l_offsets(&l);
    let lhead = |h: Header| {
        let mut f = Vec::new();
        h.write(&mut f);
        f.extend_from_slice(&l[72..]);
        f
    };
    let lh = validate(&l).expect("baseline");
    let r = r_frame();
    let ro = r_offsets(&r);
    let mut cases = vec![
        case(
            "rice_head_reserved",
            set(r.clone(), ro.heads + 4, &[r[ro.heads + 4] | 0x40]),
            |e| bad_field(e, "rice block head"),
        ),
        case(
            "rice_empty_head_with_k",
            set(r.clone(), ro.heads + 8 + 4, &[1]),
            |e| bad_field(e, "rice block head"),
        ),
        case(
            "rice_stop_bit_flipped",
            {
                let at = ro.unary0 + 4 * (ro.unary0_words / 2);
                set(r.clone(), at, &[r[at] ^ 0x10])
            },
            |e| bad_field(e, "rice unary stream"),
        ),
        case(
            "rice_unary_words_short",
            set(
                r.clone(),
                ro.heads + 6,
                &((ro.unary0_words - 1) as u16).to_le_bytes(),
            ),
            |e| bad_field(e, "rice unary stream"),
        ),
        case(
            "rice_unary_words_past_body",
            set(r.clone(), ro.heads + 6, &1024u16.to_le_bytes()),
            |e| {
                matches!(
                    fmt_err(e),
                    Some(FormatError::Truncated {
                        part: "rice block data",
                        ..
                    })
                )
            },
        ),
        case(
            "rice_bits_mode",
            set(set(r.clone(), 8, &[2]), 11, &[8]),
            |e| bad_field(e, "bits"),
        ),
        case("rice_int32", set(r.clone(), 6, &[7]), |e| {
            bad_field(e, "codec")
        }),
        case(
            "lossless_bad_method",
            set(l.clone(), lo.table + 3, &[0x70]),
            |e| bad_field(e, "chunk method"),
        ),
        case(
            "lossless_chunk_longer",
            {
                let entry = u32::from_le_bytes(l[lo.table..lo.table + 4].try_into().unwrap());
                set(l.clone(), lo.table, &(entry + 4).to_le_bytes())
            },
            |e| mismatch(e, "pack block"),
        ),
        case(
            "lossless_chunk_past_body",
            set(
                l.clone(),
                lo.table + 4,
                &(0x3000_0000u32 | 0x0fff_fff0).to_le_bytes(),
            ),
            |e| mismatch(e, "chunk payloads"),
        ),
        case(
            "lossless_reserved",
            set(l.clone(), lo.pack0 + 2, &[1]),
            |e| bad_field(e, "pack reserved bytes"),
        ),
        case(
            "lossless_mask_too_wide",
            set(l.clone(), lo.pack0 + 4 + 5, &[0x01]),
            |e| bad_field(e, "pack mask"),
        ),
        case(
            "lossless_base_overlaps_mask",
            {
                let mask = u64::from_le_bytes(l[lo.pack0 + 4..lo.pack0 + 12].try_into().unwrap());
                let base = u64::from_le_bytes(l[lo.pack0 + 12..lo.pack0 + 20].try_into().unwrap());
                let bit = mask & mask.wrapping_neg();
                set(l.clone(), lo.pack0 + 12, &(base | bit).to_le_bytes())
            },
            |e| bad_field(e, "pack base"),
        ),
        case(
            "lossless_exception_count",
            set(l.clone(), lo.pack0, &5000u16.to_le_bytes()),
            |e| bad_field(e, "pack exception count"),
        ),
        case(
            "lossless_exception_out_of_range",
            set(l.clone(), lo.exc0 + 4, &4096u16.to_le_bytes()),
            |e| {
                matches!(
                    fmt_err(e),
                    Some(FormatError::BadExceptionIndex {
                        position: 2,
                        index: 4096
                    })
                )
            },
        ),
        case(
            "lossless_exceptions_unordered",
            set(l.clone(), lo.exc0 + 2, &5u16.to_le_bytes()),
            |e| {
                matches!(
                    fmt_err(e),
                    Some(FormatError::BadExceptionIndex {
                        position: 1,
                        index: 5
                    })
                )
            },
        ),
        case(
            "lossless_padding",
            // An odd number of 2-byte indices ends with 2 bytes of padding, which must be zero.
            set(l.clone(), lo.exc0 + 2 * lo.x0, &[1]),
            |e| bad_field(e, "padding"),
        ),
        case(
            "lossless_bitmask_past_end",
            // Chunk 1 holds 100 elements: bits 4..31 of its fourth bitmask word must be clear.
            set(l.clone(), lo.chunk1 + 12 + 3, &[0x80]),
            |e| bad_field(e, "sparse bitmask"),
        ),
        case(
            "lossless_field_past_last_word",
            {
                // Chunk 1's pack block (after its 4 bitmask words) packs 50 nonzero words: its
                // second group holds 18, so the top bit of that group's last field word is unused.
                let p1 = lo.chunk1 + 16;
                let k1 = u64::from_le_bytes(l[p1 + 4..p1 + 12].try_into().unwrap()).count_ones()
                    as usize;
                let top = p1 + 20 + 4 * (2 * k1 - 1) + 3;
                set(l.clone(), top, &[l[top] | 0x80])
            },
            |e| bad_field(e, "pack fields"),
        ),
        case(
            "lossless_trailing_bytes",
            {
                let mut h = lh.clone();
                h.body_len += 4;
                h.raw_body_len += 4;
                let mut f = lhead(h);
                f.extend_from_slice(&[0; 4]);
                f
            },
            |e| mismatch(e, "lossless body"),
        ),
        case(
            "lossless_table_longer_than_body",
            lhead(Header {
                n: 1 << 40,
                shape: vec![1 << 40],
                ..lh.clone()
            }),
            |e| mismatch(e, "raw body"),
        ),
        case(
            "lossless_eps",
            lhead(Header {
                eps: 0.5,
                ..lh.clone()
            }),
            |e| bad_field(e, "eps"),
        ),
        case(
            "lossless_step",
            lhead(Header {
                step: 2.0,
                ..lh.clone()
            }),
            |e| bad_field(e, "lossless header"),
        ),
        case(
            "lossless_mode_abs",
            lhead(Header {
                mode: BoundMode::Abs,
                ..lh.clone()
            }),
            |e| bad_field(e, "mode"),
        ),
        case(
            "bool_raw_frame_byte_above_1",
            uint8_as_bool(&noise(64, 1), None),
            |e| bad_field(e, "bool element"),
        ),
        case(
            "bool_raw_chunk_byte_above_1",
            {
                let mut b = noise(4096, 2);
                b.extend_from_slice(&[0u8; 4096]);
                uint8_as_bool(&b, Some(0))
            },
            |e| bad_field(e, "bool element"),
        ),
        case(
            "bool_pack_mask_past_bit_0",
            uint8_as_bool(
                &(0..4096).map(|i| (i % 4) as u8).collect::<Vec<_>>(),
                Some(1),
            ),
            |e| bad_field(e, "bool element"),
        ),
        case(
            "bool_pack_exception_above_1",
            {
                let mut b: Vec<u8> = (0..4096).map(|i| (i % 3 == 0) as u8).collect();
                for i in [5, 900, 3000] {
                    b[i] = 200;
                }
                uint8_as_bool(&b, Some(1))
            },
            |e| bad_field(e, "bool element"),
        ),
        case(
            "bool_sparse_value_above_1",
            {
                let b: Vec<u8> = noise(4096, 3)
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| if i % 2 == 0 { 0 } else { v.max(1) })
                    .collect();
                uint8_as_bool(&b, Some(2))
            },
            |e| bad_field(e, "bool element"),
        ),
        case("quantized_mode_lossless", set(q.clone(), 8, &[4]), |e| {
            bad_field(e, "mode")
        }),
        case("quantized_int32", set(q.clone(), 6, &[7]), |e| {
            bad_field(e, "codec")
        }),
    ];
    cases.extend(vec![
        case("empty", vec![], |e| {
            matches!(
                fmt_err(e),
                Some(FormatError::Truncated { part: "header", .. })
            )
        }),
        case("truncated_header", q[..63].to_vec(), |e| {
            matches!(
                fmt_err(e),
                Some(FormatError::Truncated {
                    part: "header",
                    needed: 64,
                    available: 63
                })
            )
        }),
        case("truncated_shape", set(q[..70].to_vec(), 9, &[1]), |e| {
            matches!(
                fmt_err(e),
                Some(FormatError::Truncated {
                    part: "shape",
                    needed: 72,
                    ..
                })
            )
        }),
        case(
            "bad_magic",
            set(q.clone(), 0, b"CFCG"),
            |e| matches!(fmt_err(e), Some(FormatError::BadMagic(m)) if m == b"CFCG"),
        ),
        case("version_0", set(q.clone(), 4, &[0]), |e| {
            matches!(fmt_err(e), Some(FormatError::UnsupportedVersion(0)))
        }),
        case("version_2", set(q.clone(), 4, &[2]), |e| {
            matches!(fmt_err(e), Some(FormatError::UnsupportedVersion(2)))
        }),
        case("unknown_codec", set(q.clone(), 5, &[4]), |e| {
            bad_field(e, "codec")
        }),
        case("unknown_dtype", set(q.clone(), 6, &[10]), |e| {
            bad_field(e, "dtype")
        }),
        case("unknown_flags", set(q.clone(), 7, &[0x04]), |e| {
            bad_field(e, "flags")
        }),
        case("scales_flag_no_block", set(q.clone(), 7, &[0x02]), |e| {
            bad_field(e, "block size (log2)")
        }),
        case("scales_block_too_small", set(s_frame(), 12, &[4]), |e| {
            bad_field(e, "block size (log2)")
        }),
        case("scales_block_too_large", set(s_frame(), 12, &[25]), |e| {
            bad_field(e, "block size (log2)")
        }),
        case("scales_block_without_flag", set(q.clone(), 12, &[8]), |e| {
            bad_field(e, "block scales")
        }),
        case(
            "scales_rms_mode_without_flag",
            set(q.clone(), 8, &[5]),
            |e| bad_field(e, "block scales"),
        ),
        case(
            "scales_in_bits_mode",
            set(set(s_frame(), 8, &[2]), 11, &[8]),
            |e| bad_field(e, "flags"),
        ),
        case("scales_in_raw_frame", set(raw_frame(), 7, &[0x02]), |e| {
            bad_field(e, "flags")
        }),
        case(
            "scales_shift_too_deep",
            {
                // step 2^-1000: 255 halvings leave no normal number
                let f = set(s_frame(), 24, &(2f64.powi(-1000)).to_le_bytes());
                let f = set(f, 32, &(2f64.powi(-1001)).to_le_bytes());
                set(f, FIXED_HEADER_LEN + 8 + 2, &[255])
            },
            |e| bad_field(e, "block shift"),
        ),
        case(
            "scales_missing",
            {
                // the body one block of scales short: the widths and planes no longer add up
                let f = s_frame();
                let at = FIXED_HEADER_LEN + 8;
                let mut g = f[..at].to_vec();
                g.extend_from_slice(&f[at + 1..]);
                let len = (f.len() - at - 1) as u64;
                set_u64(set_u64(g, 48, len), 56, len)
            },
            |e| fmt_err(e).is_some(),
        ),
        case("unknown_flags_high", set(q.clone(), 7, &[0x81]), |e| {
            bad_field(e, "flags")
        }),
        case("unknown_mode", set(q.clone(), 8, &[6]), |e| {
            bad_field(e, "mode")
        }),
        case(
            "ndim_9",
            {
                let h = Header {
                    shape: vec![1; 9],
                    n: 1,
                    ..header(DType::F32, 1, 0, &[0])
                };
                write(&h, &[0])
            },
            |e| bad_field(e, "ndim"),
        ),
        case("ndim_255", set(q.clone(), 9, &[255]), |e| {
            bad_field(e, "ndim")
        }),
        case("group_log2_6", set(q.clone(), 10, &[6]), |e| {
            bad_field(e, "group size (log2)")
        }),
        case("bits_33", set(set(q.clone(), 8, &[2]), 11, &[33]), |e| {
            bad_field(e, "bits")
        }),
        case("bits_1", set(set(q.clone(), 8, &[2]), 11, &[1]), |e| {
            bad_field(e, "bits")
        }),
        case("bits_mode_zero_bits", set(q.clone(), 8, &[2]), |e| {
            bad_field(e, "bits")
        }),
        case("bits_without_bits_mode", set(q.clone(), 11, &[5]), |e| {
            bad_field(e, "bits")
        }),
        case("reserved_nonzero", set(q.clone(), 14, &[1]), |e| {
            bad_field(e, "reserved bytes")
        }),
        case(
            "shape_product_overflow",
            {
                let h = Header {
                    shape: vec![1 << 33, 1 << 33],
                    n: 0,
                    ..header(DType::F32, 0, 0, &[])
                };
                write(&h, &[])
            },
            |e| bad_field(e, "shape"),
        ),
        case(
            "shape_mismatch",
            {
                let h = Header {
                    shape: vec![7, 11],
                    ..header(DType::F32, 70, 0, &[])
                };
                write(&h, &[])
            },
            |e| bad_field(e, "shape"),
        ),
        case(
            "step_nan",
            set_u64(q.clone(), 24, f64::NAN.to_bits()),
            |e| bad_field(e, "step"),
        ),
        case("step_zero", set_u64(q.clone(), 24, 0), |e| {
            bad_field(e, "step")
        }),
        case(
            "step_negative_zero",
            set_u64(q.clone(), 24, (-0.0f64).to_bits()),
            |e| bad_field(e, "step"),
        ),
        case(
            "step_inf",
            set_u64(q.clone(), 24, f64::INFINITY.to_bits()),
            |e| bad_field(e, "step"),
        ),
        case(
            "step_negative",
            set_u64(q.clone(), 24, (-1.0f64).to_bits()),
            |e| bad_field(e, "step"),
        ),
        case(
            "eps_negative",
            set_u64(q.clone(), 32, (-0.5f64).to_bits()),
            |e| bad_field(e, "eps"),
        ),
        case("eps_nan", set_u64(q.clone(), 32, f64::NAN.to_bits()), |e| {
            bad_field(e, "eps")
        }),
        case(
            "eps_inf",
            set_u64(q.clone(), 32, f64::INFINITY.to_bits()),
            |e| bad_field(e, "eps"),
        ),
        case("huge_n_tiny_body", write(&huge(1 << 60), &[0; 10]), |e| {
            mismatch(e, "raw body")
        }),
        case("max_n_tiny_body", write(&huge(u64::MAX), &[0; 10]), |e| {
            // The largest possible body (2^59 groups x 257 bytes) overflows: refused as such.
            bad_field(e, "element count")
        }),
        case(
            "max_n_raw_codec",
            {
                let h = Header {
                    codec: Codec::Raw,
                    ..huge(u64::MAX)
                };
                write(&h, &[0; 10])
            },
            |e| bad_field(e, "element count"),
        ),
        case("n_exceptions_gt_n", set_u64(q.clone(), 40, 71), |e| {
            bad_field(e, "exception count")
        }),
        case(
            // (n = 3 x 2^59 leaves the body's other sizes in range, its widest planes at 8 bytes
            // an element among them, so that only the exceptions' 12 bytes each overflow;
            // without them the 10-byte body is a length mismatch)
            "n_exceptions_overflow",
            {
                let h = Header {
                    n_exceptions: (3 << 59) - 1,
                    ..huge(3 << 59)
                };
                write(&h, &[0; 10])
            },
            |e| bad_field(e, "element count"),
        ),
        case(
            "raw_codec_with_exceptions",
            set_u64(raw_frame(), 40, 1),
            |e| bad_field(e, "exception count"),
        ),
        case(
            "raw_codec_len_mismatch",
            {
                let body = [0u8; 22];
                let h = Header {
                    codec: Codec::Raw,
                    ..header(DType::F16, 10, 0, &body)
                };
                write(&h, &body)
            },
            |e| mismatch(e, "raw body"),
        ),
        case(
            "body_len_too_large",
            set_u64(q.clone(), 48, (q.len() - 72 + 1) as u64),
            |e| mismatch(e, "body"),
        ),
        case(
            "body_len_too_small",
            set_u64(q.clone(), 48, (q.len() - 72 - 1) as u64),
            |e| mismatch(e, "body"),
        ),
        case("body_len_max", set_u64(q.clone(), 48, u64::MAX), |e| {
            mismatch(e, "body")
        }),
        case("truncated_body", q[..q.len() - 1].to_vec(), |e| {
            mismatch(e, "body")
        }),
        case("trailing_byte", [q.as_slice(), &[0]].concat(), |e| {
            mismatch(e, "body")
        }),
        case(
            "raw_len_ne_body_len",
            set_u64(q.clone(), 56, (q.len() - 72 + 4) as u64),
            |e| mismatch(e, "raw body"),
        ),
        case(
            "raw_len_below_minimum",
            {
                // A consistent frame whose body cannot even hold the width bytes.
                let body = [0u8; 2];
                write(&header(DType::F32, 70, 0, &body), &body)
            },
            |e| mismatch(e, "raw body"),
        ),
        case("width_65", set(q.clone(), 73, &[65]), |e| {
            matches!(
                fmt_err(e),
                Some(FormatError::BadWidth {
                    group: 1,
                    width: 65
                })
            )
        }),
        case("width_255", set(q.clone(), 72, &[255]), |e| {
            matches!(
                fmt_err(e),
                Some(FormatError::BadWidth {
                    group: 0,
                    width: 255
                })
            )
        }),
        case("plane_len_mismatch_wider", set(q.clone(), 72, &[3]), |e| {
            mismatch(e, "bit planes")
        }),
        case(
            "plane_len_mismatch_narrower",
            set(q.clone(), 74, &[4]),
            |e| mismatch(e, "bit planes"),
        ),
        case(
            "exception_index_out_of_range",
            set(q.clone(), Q_EXC + 8, &70u32.to_le_bytes()),
            |e| {
                matches!(
                    fmt_err(e),
                    Some(FormatError::BadExceptionIndex {
                        position: 2,
                        index: 70
                    })
                )
            },
        ),
        case(
            "exception_index_max",
            set(q.clone(), Q_EXC, &u32::MAX.to_le_bytes()),
            |e| {
                matches!(
                    fmt_err(e),
                    Some(FormatError::BadExceptionIndex { position: 0, .. })
                )
            },
        ),
        case(
            "exception_indices_decreasing",
            {
                let mut e = exc.clone();
                e.swap(0, 1);
                q_frame_with(&widths, &e)
            },
            |e| {
                matches!(
                    fmt_err(e),
                    Some(FormatError::BadExceptionIndex {
                        position: 1,
                        index: 3
                    })
                )
            },
        ),
        case(
            "exception_index_duplicated",
            {
                let mut e = exc.clone();
                e[2].0 = 40;
                q_frame_with(&widths, &e)
            },
            |e| {
                matches!(
                    fmt_err(e),
                    Some(FormatError::BadExceptionIndex {
                        position: 2,
                        index: 40
                    })
                )
            },
        ),
        case(
            "zstd_raw_len_absurd",
            zstd_frame(header(DType::F32, 70, 3, &[]), &zst(&q[72..]), u64::MAX),
            |e| mismatch(e, "raw body"),
        ),
        case(
            "zstd_huge_n_small_body",
            zstd_frame(huge(1 << 40), &zst(&[0u8; 100]), 1 << 35),
            |e| zstd_body_found(e, 100),
        ),
        case(
            "zstd_raw_codec_huge_n",
            {
                let h = Header {
                    codec: Codec::Raw,
                    dtype: DType::F16,
                    ..huge(1 << 60)
                };
                zstd_frame(h, &zst(&[7u8; 64]), 1 << 61)
            },
            |e| mismatch(e, "zstd-decoded body"),
        ),
        case(
            "zstd_raw_body_len_max",
            {
                // A raw uint8 frame of 3 x (2^64 - 1) / 3 elements announces a raw body of
                // u64::MAX bytes, the one length with no byte past it: the decoder reads one
                // byte more than announced to tell a longer body apart, and must not wrap to
                // reading none. The body inflates to 100 bytes.
                let h = Header {
                    codec: Codec::Raw,
                    dtype: DType::U8,
                    mode: BoundMode::Lossless,
                    eps: 0.0,
                    shape: vec![3, u64::MAX / 3],
                    ..huge(u64::MAX)
                };
                zstd_frame(h, &zst(&[0u8; 100]), u64::MAX)
            },
            |e| zstd_body_found(e, 100),
        ),
        case(
            "zstd_inflates_past_announced",
            {
                let mut inner = q[72..].to_vec();
                inner.extend_from_slice(&[0u8; 1000]);
                zstd_frame(
                    header(DType::F32, 70, 3, &[]),
                    &zst(&inner),
                    (q.len() - 72) as u64,
                )
            },
            |e| {
                matches!(
                    fmt_err(e),
                    Some(FormatError::LengthMismatch {
                        part: "zstd-decoded body",
                        expected: 55,
                        found: 56
                    })
                )
            },
        ),
        case(
            "zstd_bomb",
            {
                // 16 MiB of zeros in a few hundred bytes, announced as 1000 zero widths.
                let bomb = zst(&vec![0u8; 16 << 20]);
                zstd_frame(header(DType::F32, 32_000, 0, &[]), &bomb, 1000)
            },
            |e| {
                matches!(
                    fmt_err(e),
                    Some(FormatError::LengthMismatch {
                        part: "zstd-decoded body",
                        expected: 1000,
                        found: 1001
                    })
                )
            },
        ),
        case(
            "zstd_short",
            zstd_frame(
                header(DType::F32, 32_000, 0, &[]),
                &zst(&zero_widths[..999]),
                1000,
            ),
            |e| zstd_body_found(e, 999),
        ),
        case(
            "zstd_garbage",
            zstd_frame(
                header(DType::F32, 70, 3, &[]),
                &[0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4],
                55,
            ),
            |e| matches!(fmt_err(e), Some(FormatError::Zstd(_))),
        ),
        case(
            "zstd_truncated",
            {
                let z = zst(&(0..=255u8).cycle().take(4000).collect::<Vec<_>>());
                let h = Header {
                    codec: Codec::Raw,
                    dtype: DType::F16,
                    ..huge(2000)
                };
                zstd_frame(h, &z[..z.len() / 2], 4000)
            },
            |e| {
                matches!(
                    fmt_err(e),
                    Some(FormatError::Zstd(_) | FormatError::LengthMismatch { .. })
                )
            },
        ),
        case(
            "zstd_valid_body_bad_widths",
            {
                let mut inner = q[72..].to_vec();
                inner[0] = 200;
                zstd_frame(
                    header(DType::F32, 70, 3, &[]),
                    &zst(&inner),
                    inner.len() as u64,
                )
            },
            |e| {
                matches!(
                    fmt_err(e),
                    Some(FormatError::BadWidth {
                        group: 0,
                        width: 200
                    })
                )
            },
        ),
    ]);
    cases
}

#[test]
fn crafted_baselines_are_valid() {
    // The crafted cases are single changes to these: they must themselves be accepted.
    for f in [q_frame(), raw_frame(), l_frame(), r_frame()] {
        probe(&f).unwrap_or_else(|e| panic!("baseline refused: {e}; {}", hex(&f)));
    }
    let (_, y) = decompress::<f32>(&q_frame()).expect("decodes");
    assert!(y[3].is_nan() && y[40] == f32::INFINITY && y[69] == 1.5);
    // 3 width bytes, 7 plane words, 3 indices, 3 values: the crafted cases rely on this layout.
    let inner = q_frame()[72..].to_vec();
    assert_eq!(inner.len(), 3 + 28 + 12 + 12);
    assert_eq!(&inner[..3], &[2, 0, 5]);
    assert_eq!(&inner[Q_EXC - 72..Q_EXC - 72 + 4], &3u32.to_le_bytes());
    let h = header(DType::F32, 70, 3, &[]);
    probe(&zstd_frame(h, &zst(&inner), inner.len() as u64)).expect("zstd baseline");
}

#[test]
fn crafted_frames_give_the_expected_error() {
    let cases = crafted();
    let mut names = std::collections::HashSet::new();
    for c in &cases {
        assert!(names.insert(c.name), "duplicate case name {}", c.name);
        let t = Instant::now();
        match probe(&c.input) {
            Ok(h) => panic!("{} was accepted: {h:?}; {}", c.name, hex(&c.input)),
            Err(e) => assert!((c.expect)(&e), "{}: unexpected error {e:?}", c.name),
        }
        // Nothing announced by a header (huge n, huge raw_body_len) is allocated or inflated
        // before it is checked, so each of these fails at once.
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{} took {:?}",
            c.name,
            t.elapsed()
        );
    }
}

// ---- The regression corpus in tests/hostile/ ----

fn corpus_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/hostile"))
}

/// Every crafted case is in the corpus (`CFC_WRITE_HOSTILE_CORPUS=1` writes them), and the
/// README describes every file there.
#[test]
fn hostile_corpus_is_complete() {
    let dir = corpus_dir();
    let write = std::env::var_os("CFC_WRITE_HOSTILE_CORPUS").is_some();
    for c in crafted() {
        let path = dir.join(format!("{}.bin", c.name));
        if write {
            std::fs::write(&path, &c.input).expect("writes corpus file");
        }
        // The file must hold the case as crafted here: a case edited without writing the
        // corpus again would leave the old bytes tested under the new name.
        assert!(
            std::fs::read(&path).is_ok_and(|b| b == c.input),
            "{} missing or out of date: run CFC_WRITE_HOSTILE_CORPUS=1 cargo test --test hostile",
            path.display()
        );
    }
    let readme = std::fs::read_to_string(dir.join("README.md")).expect("tests/hostile/README.md");
    for entry in std::fs::read_dir(&dir).expect("corpus dir") {
        let name = entry
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        if name.ends_with(".bin") {
            assert!(
                readme.contains(&format!("`{name}`")),
                "tests/hostile/README.md does not describe {name}"
            );
        }
    }
}

/// Every file in `tests/hostile/` is refused by every decoder, without a panic.
#[test]
fn hostile_corpus_is_rejected() {
    let mut count = 0;
    for entry in std::fs::read_dir(corpus_dir()).expect("corpus dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "bin") {
            continue;
        }
        let bytes = std::fs::read(&path).expect("readable");
        let t = Instant::now();
        if let Ok(h) = probe(&bytes) {
            panic!("{} was accepted: {h:?}", path.display());
        }
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{} slow",
            path.display()
        );
        count += 1;
    }
    assert!(count >= 40, "only {count} corpus files");
}

/// A zstd stage whose announced size is plausible for its stored bytes (at most 256 bytes per
/// stored byte, plus 1 MiB: allocated up front) but past the memory at hand is an
/// [`Error::Allocation`], not an abort of the process. It runs again in a child process whose
/// address space `ulimit -v` caps at 1.5 GB, below the 2.1 GB the frame announces; there the
/// infallible allocation this replaced aborted.
#[test]
fn an_inflated_size_past_the_memory_at_hand_is_an_error() {
    const CHILD: &str = "CFC_HOSTILE_ALLOCATION_CHILD";
    if std::env::var_os(CHILD).is_none() {
        let exe = std::env::current_exe().expect("the test binary");
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg("ulimit -v 1500000 && exec \"$0\" --exact an_inflated_size_past_the_memory_at_hand_is_an_error --nocapture")
            .arg(exe)
            .env(CHILD, "1")
            .output()
            .expect("sh runs");
        let said = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{:?}: {said}", out.status);
        assert!(said.contains("refused: "), "{said}");
        return;
    }
    // 8 MiB that zstd cannot shrink (stored as they are), announced as the largest plausible
    // body; a quantized header of 0 exceptions takes any body of 1 to 257 bytes per group.
    let mut noise = vec![0u8; 8 << 20];
    rand::RngCore::fill_bytes(
        &mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(7),
        &mut noise,
    );
    let stored = zst(&noise);
    let raw_len = 256 * stored.len() as u64 + (1 << 20);
    let n = 32 * raw_len;
    let frame = zstd_frame(header(DType::F32, n, 0, &[]), &stored, raw_len);
    match validate(&frame) {
        Err(e @ Error::Allocation { .. }) => println!("refused: {e}"),
        other => panic!("expected Error::Allocation, got {other:?}"),
    }
}
