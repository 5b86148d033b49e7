//! The frame layout of `docs/FORMAT.md`, pinned down byte for byte: header field offsets,
//! small frames computed by hand (codes, width bytes, bit planes, exceptions), the raw codec
//! fallback and the zstd flag.

mod common;

use cfc::format::{FIXED_HEADER_LEN, GROUP, GROUP_LOG2, MAGIC, MAX_NDIM, MAX_WIDTH, VERSION};
use cfc::{
    compress, decompress, fixed_rate_size, read_header, Bound, BoundMode, Codec, Codes,
    CompressOptions, DType, Header,
};
use common::{gen, Dist};
use half::bf16;

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

fn f64_at(b: &[u8], off: usize) -> f64 {
    f64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

/// The expected header bytes, written out field by field (independently of `Header::write`).
#[allow(clippy::too_many_arguments)]
fn header_bytes(
    codec: u8,
    dtype: u8,
    flags: u8,
    mode: u8,
    bits: u8,
    n: u64,
    step: f64,
    eps: f64,
    n_exc: u64,
    body_len: u64,
    raw_body_len: u64,
    shape: &[u64],
) -> Vec<u8> {
    let mut h = b"CFCF".to_vec();
    h.extend_from_slice(&[1, codec, dtype, flags, mode, shape.len() as u8, 5, bits]);
    h.extend_from_slice(&[0, 0, 0, 0]);
    h.extend_from_slice(&n.to_le_bytes());
    h.extend_from_slice(&step.to_le_bytes());
    h.extend_from_slice(&eps.to_le_bytes());
    h.extend_from_slice(&n_exc.to_le_bytes());
    h.extend_from_slice(&body_len.to_le_bytes());
    h.extend_from_slice(&raw_body_len.to_le_bytes());
    for d in shape {
        h.extend_from_slice(&d.to_le_bytes());
    }
    h
}

#[test]
fn constants() {
    assert_eq!(&MAGIC, b"CFCF");
    assert_eq!(VERSION, 1);
    assert_eq!(FIXED_HEADER_LEN, 64);
    assert_eq!(MAX_NDIM, 8);
    assert_eq!(GROUP, 32);
    assert_eq!(1usize << GROUP_LOG2, GROUP);
    assert_eq!(MAX_WIDTH, 64);
}

#[test]
fn header_field_offsets() {
    let x: Vec<f32> = gen(Dist::Gaussian, 24, 1.0, 1);
    let f = compress(&x, &[2, 3, 4], &CompressOptions::new(Bound::Abs(0.25))).expect("ok");
    let h = read_header(&f).expect("header");
    assert_eq!(&f[0..4], b"CFCF", "magic at 0");
    assert_eq!(f[4], 1, "version at 4");
    assert_eq!(f[5], 0, "codec at 5: quantized");
    assert_eq!(f[6], 0, "dtype at 6: float32");
    assert_eq!(f[7], 0, "flags at 7");
    assert_eq!(f[8], 0, "mode at 8: abs");
    assert_eq!(f[9], 3, "ndim at 9");
    assert_eq!(f[10], 5, "log2 group at 10");
    assert_eq!(f[11], 0, "bits at 11");
    assert_eq!(&f[12..16], &[0, 0, 0, 0], "reserved 12..16");
    assert_eq!(u64_at(&f, 16), 24, "n at 16");
    assert_eq!(f64_at(&f, 24), 0.5, "step at 24");
    assert_eq!(f64_at(&f, 32), 0.25, "eps at 32");
    assert_eq!(u64_at(&f, 40), h.n_exceptions, "n_exceptions at 40");
    assert_eq!(u64_at(&f, 48), (f.len() - 88) as u64, "body_len at 48");
    assert_eq!(u64_at(&f, 56), u64_at(&f, 48), "raw_body_len at 56");
    assert_eq!(
        [u64_at(&f, 64), u64_at(&f, 72), u64_at(&f, 80)],
        [2, 3, 4],
        "dims from 64"
    );
    assert_eq!(h.len(), 88);

    // The other enumerations and the flag.
    let xb: Vec<bf16> = gen(Dist::Sparse, 4096, 1.0, 2);
    let f = compress(
        &xb,
        &[4096],
        &CompressOptions {
            zstd_level: Some(3),
            ..CompressOptions::new(Bound::Rel(0.01))
        },
    )
    .expect("ok");
    assert_eq!(f[6], 1, "bfloat16");
    assert_eq!(f[7], 1, "zstd flag");
    assert_eq!(f[8], 1, "rel mode");
    assert!(
        u64_at(&f, 48) < u64_at(&f, 56),
        "zstd body shorter than raw body"
    );
    let xh: Vec<half::f16> = gen(Dist::Gaussian, 64, 1.0, 3);
    let f = compress(&xh, &[64], &CompressOptions::new(Bound::Bits(7))).expect("ok");
    assert_eq!((f[6], f[8], f[11]), (2, 2, 7), "float16, bits mode, 7 bits");
    let noise: Vec<f32> = gen(Dist::AnyBits, 64, 1.0, 4);
    let f = compress(&noise, &[64], &CompressOptions::new(Bound::Abs(1e-30))).expect("ok");
    assert_eq!(f[5], 1, "raw codec");
    let s = Codes::from_frame(&f)
        .expect("codes")
        .to_frame(None)
        .expect("frame");
    assert_eq!(s[8], 3, "sum mode");
}

/// Three float32 values at eps 0.5 (step 1): codes 1, -2, 0; zigzag 2, 3, 0; width 2;
/// plane 0 = bit 0 of each code = 0b010, plane 1 = 0b011.
#[test]
fn tiny_frame_by_hand() {
    let x = [1.0f32, -2.0, 0.3];
    let f = compress(&x, &[3], &CompressOptions::new(Bound::Abs(0.5))).expect("ok");
    let mut want = header_bytes(0, 0, 0, 0, 0, 3, 1.0, 0.5, 0, 9, 9, &[3]);
    want.extend_from_slice(&[2, 2, 0, 0, 0, 3, 0, 0, 0]);
    assert_eq!(f, want);
    let h = read_header(&f).expect("header");
    assert_eq!(
        h,
        Header {
            codec: Codec::Quantized,
            dtype: DType::F32,
            zstd: false,
            mode: BoundMode::Abs,
            bits: 0,
            n: 3,
            step: 1.0,
            eps: 0.5,
            n_exceptions: 0,
            body_len: 9,
            raw_body_len: 9,
            shape: vec![3],
            block_log2: 0,
        }
    );
    let (_, y) = decompress::<f32>(&f).expect("decodes");
    assert_eq!(y, vec![1.0, -2.0, 0.0]);
}

/// Forty values in two groups, with a NaN and a -Inf stored as exceptions.
///
/// Group 0 (indices 0..32): code 1 at index 1 (zigzag 2), NaN at 5 -> width 2, planes 0, 0b10.
/// Group 1 (indices 32..40): -Inf at 33, code 3 at 34 (zigzag 0b110, lane 2) -> width 3,
/// planes 0, 0b100, 0b100. Then indices 5, 33 (u32) and the values' bits.
#[test]
fn exceptions_layout_by_hand() {
    let mut x = [0.0f32; 40];
    x[1] = 1.0;
    x[5] = f32::NAN;
    x[33] = f32::NEG_INFINITY;
    x[34] = 3.0;
    let f = compress(&x, &[5, 8], &CompressOptions::new(Bound::Abs(0.5))).expect("ok");
    let mut body = vec![2u8, 3];
    for w in [0u32, 0b10, 0, 0b100, 0b100] {
        body.extend_from_slice(&w.to_le_bytes());
    }
    body.extend_from_slice(&5u32.to_le_bytes());
    body.extend_from_slice(&33u32.to_le_bytes());
    body.extend_from_slice(&f32::NAN.to_bits().to_le_bytes());
    body.extend_from_slice(&f32::NEG_INFINITY.to_bits().to_le_bytes());
    assert_eq!(body.len(), 38);
    let mut want = header_bytes(0, 0, 0, 0, 0, 40, 1.0, 0.5, 2, 38, 38, &[5, 8]);
    want.extend_from_slice(&body);
    assert_eq!(f, want);
    let (h, y) = decompress::<f32>(&f).expect("decodes");
    assert_eq!(h.n_exceptions, 2);
    assert_eq!(y[5].to_bits(), f32::NAN.to_bits());
    assert_eq!(y[33], f32::NEG_INFINITY);
    assert_eq!((y[1], y[34]), (1.0, 3.0));

    // bfloat16: the same codes, with 2-byte exception values.
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let f = compress(&xb, &[40], &CompressOptions::new(Bound::Abs(0.5))).expect("ok");
    let mut body = vec![2u8, 3];
    for w in [0u32, 0b10, 0, 0b100, 0b100] {
        body.extend_from_slice(&w.to_le_bytes());
    }
    body.extend_from_slice(&5u32.to_le_bytes());
    body.extend_from_slice(&33u32.to_le_bytes());
    body.extend_from_slice(&[0xc0, 0x7f, 0x80, 0xff]); // NaN 0x7fc0, -Inf 0xff80
    let mut want = header_bytes(0, 1, 0, 0, 0, 40, 1.0, 0.5, 2, 34, 34, &[40]);
    want.extend_from_slice(&body);
    assert_eq!(f, want);
    let c = Codes::from_frame(&f).expect("codes");
    assert_eq!(c.exceptions, vec![(5, 0x7fc0), (33, 0xff80)]);
    assert_eq!(
        (c.codes[1], c.codes[34], c.codes[5], c.codes[33]),
        (1, 3, 0, 0)
    );
}

/// Fixed rate, 2 bits, max 1: step 1; codes 1, -1, 0 (0.5 rounds to even), 0; zigzag 2, 1, 0, 0;
/// plane 0 = 0b10, plane 1 = 0b01; the measured bound is 0.5.
#[test]
fn fixed_rate_frame_by_hand() {
    let x = [1.0f32, -1.0, 0.5, 0.0];
    let f = compress(&x, &[4], &CompressOptions::new(Bound::Bits(2))).expect("ok");
    let mut want = header_bytes(0, 0, 0, 2, 2, 4, 1.0, 0.5, 0, 9, 9, &[4]);
    want.extend_from_slice(&[2, 0b10, 0, 0, 0, 0b01, 0, 0, 0]);
    assert_eq!(f, want);
    assert_eq!(f.len() as u64, fixed_rate_size(&[4], 2).expect("fits"));
    let (_, y) = decompress::<f32>(&f).expect("decodes");
    assert_eq!(y, vec![1.0, -1.0, 0.0, 0.0]);
}

/// A sum frame from hand-made codes 3, -1: zigzag 6, 1; width 3; planes 0b10, 0b01, 0b01.
#[test]
fn sum_frame_by_hand() {
    let c = Codes {
        scales: None,
        dtype: DType::F32,
        shape: vec![2],
        step: 0.25,
        eps: 0.125,
        codes: vec![3, -1],
        exceptions: vec![],
    };
    let f = c.to_frame(None).expect("packs");
    let mut want = header_bytes(0, 0, 0, 3, 0, 2, 0.25, 0.125, 0, 13, 13, &[2]);
    want.extend_from_slice(&[3, 0b10, 0, 0, 0, 0b01, 0, 0, 0, 0b01, 0, 0, 0]);
    assert_eq!(f, want);
    let (h, y) = decompress::<f32>(&f).expect("decodes");
    assert_eq!(h.mode, BoundMode::Sum);
    assert_eq!(y, vec![0.75, -0.25]);
}

#[test]
fn empty_and_scalar_frames_by_hand() {
    // No elements: the quantized body (empty) is not smaller than the raw one (empty): raw.
    let f = compress::<f32>(&[], &[0], &CompressOptions::new(Bound::Abs(0.5))).expect("ok");
    assert_eq!(f, header_bytes(1, 0, 0, 0, 0, 0, 1.0, 0.5, 0, 0, 0, &[0]));
    let (h, y) = decompress::<f32>(&f).expect("decodes");
    assert_eq!((h.codec, h.n, y.len()), (Codec::Raw, 0, 0));

    // A scalar has no dims. Code 2 (zigzag 4) costs a width byte and 3 planes: 13 bytes > 4 raw.
    let f = compress(&[2.0f32], &[], &CompressOptions::new(Bound::Abs(0.5))).expect("ok");
    let mut want = header_bytes(1, 0, 0, 0, 0, 1, 1.0, 0.5, 0, 4, 4, &[]);
    want.extend_from_slice(&2.0f32.to_le_bytes());
    assert_eq!(f, want);
    assert_eq!(read_header(&f).expect("header").len(), 64);
    // A zero scalar fits in a width byte alone.
    let f = compress(&[0.0f32], &[], &CompressOptions::new(Bound::Abs(0.5))).expect("ok");
    let mut want = header_bytes(0, 0, 0, 0, 0, 1, 1.0, 0.5, 0, 1, 1, &[]);
    want.push(0);
    assert_eq!(f, want);
}

#[test]
fn raw_codec_fallback() {
    for n in [1usize, 33, 1000, 10_000] {
        let x: Vec<f32> = gen(Dist::Gaussian, n, 1.0, n as u64);
        let f = compress(&x, &[n], &CompressOptions::new(Bound::Abs(1e-30))).expect("ok");
        let (h, y) = decompress::<f32>(&f).expect("decodes");
        assert_eq!(h.codec, Codec::Raw, "n {n}");
        assert_eq!(h.n_exceptions, 0);
        assert_eq!(h.eps, 1e-30, "raw frames keep the requested bound");
        assert_eq!(h.raw_body_len, 4 * n as u64);
        assert_eq!(&f[h.len()..], bytemuck::cast_slice::<f32, u8>(&x));
        let xb: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
        let yb: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
        assert_eq!(xb, yb);
        // Codes of a raw frame: every element is an exception, every code 0.
        let c = Codes::from_frame(&f).expect("codes");
        assert!(c.codes.iter().all(|&q| q == 0));
        assert_eq!(c.exceptions.len(), n);
        assert!(c
            .exceptions
            .iter()
            .enumerate()
            .all(|(i, &(j, b))| j == i as u64 && b == xb[i]));
    }
    // Raw bytes that repeat go through zstd, and come back exactly.
    let x: Vec<f32> = (0..4000).map(|i| [0.1f32, 0.7, -3.3][i % 3]).collect();
    let opts = CompressOptions {
        zstd_level: Some(1),
        ..CompressOptions::new(Bound::Abs(1e-30))
    };
    let f = compress(&x, &[4000], &opts).expect("ok");
    let (h, y) = decompress::<f32>(&f).expect("decodes");
    assert_eq!((h.codec, h.zstd), (Codec::Raw, true));
    assert_eq!(h.raw_body_len, 16_000);
    assert!(h.body_len < 1000);
    assert_eq!(y, x);
}

#[test]
fn header_write_parse_round_trip() {
    let h = Header {
        codec: Codec::Quantized,
        dtype: DType::F16,
        zstd: false,
        mode: BoundMode::Bits,
        bits: 12,
        n: 6,
        step: 0.125,
        eps: 0.0625,
        n_exceptions: 1,
        body_len: 0,
        raw_body_len: 0,
        shape: vec![2, 3],
        block_log2: 0,
    };
    // One group at width 1 plus one exception: 1 + 4 + 4 + 2 bytes.
    let body = [1u8, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0x7c];
    let h = Header {
        body_len: body.len() as u64,
        raw_body_len: body.len() as u64,
        ..h
    };
    let mut f = Vec::new();
    h.write(&mut f);
    assert_eq!(f.len(), h.len());
    assert_eq!(
        f,
        header_bytes(0, 2, 0, 2, 12, 6, 0.125, 0.0625, 1, 11, 11, &[2, 3])
    );
    f.extend_from_slice(&body);
    let (parsed, stored) = Header::parse(&f).expect("parses");
    assert_eq!(parsed, h);
    assert_eq!(stored, &body);
    let (_, y) = decompress::<half::f16>(&f).expect("decodes");
    assert_eq!(y[4], half::f16::INFINITY);
    assert!(y
        .iter()
        .enumerate()
        .all(|(i, v)| i == 4 || v.to_f32() == 0.0));
}

/// `format::min_frame_len`, the shortest size an exchange of frames accepts from a peer, is
/// never more than a frame the codec writes: quantized frames of every kind of data and bound
/// (all zeros, one value, gradient-like values, non-finite ones) and raw ones, in 1 and 3
/// dimensions, at sizes around a group's edges.
#[test]
fn every_frame_is_at_least_the_minimum_frame_length() {
    use cfc::format::min_frame_len;
    assert_eq!(min_frame_len(0, 1), FIXED_HEADER_LEN as u64 + 8);
    assert_eq!(min_frame_len(1, 1), FIXED_HEADER_LEN as u64 + 9);
    assert_eq!(min_frame_len(33, 3), FIXED_HEADER_LEN as u64 + 24 + 2);
    for n in [0usize, 1, 31, 32, 33, 1000, 4097] {
        for (seed, dist) in [Dist::Zero, Dist::Gaussian, Dist::Cauchy]
            .into_iter()
            .enumerate()
        {
            let mut x: Vec<f32> = gen(dist, n, 1.0, seed as u64);
            if seed == 2 && n > 1 {
                x[0] = f32::NAN;
                x[n - 1] = f32::INFINITY;
            }
            for bound in [
                Bound::Abs(1e3),
                Bound::Abs(0.1),
                Bound::Abs(1e-30),
                Bound::Bits(3),
            ] {
                for shape in [vec![n], vec![1, n, 1]] {
                    let f = compress(&x, &shape, &CompressOptions::new(bound)).expect("compresses");
                    assert!(
                        f.len() as u64 >= min_frame_len(n as u64, shape.len()),
                        "n {n}, {dist:?}, {bound:?}: a frame of {} bytes",
                        f.len()
                    );
                }
            }
        }
    }
}
