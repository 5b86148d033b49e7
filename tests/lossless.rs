//! The lossless codec: every bit pattern of every dtype comes back exactly, whatever method each
//! chunk took, at every awkward length, with any thread count; each method is really chosen
//! where it wins; and the frame is never larger than a raw one.

mod common;

use cfc::lossless::CHUNK;
use cfc::{
    compress_lossless_bytes, decompress, decompress_into_bytes, validate, BoundMode, Codec, DType,
    LosslessOptions,
};
use common::{gen, Dist};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};

fn opts() -> LosslessOptions {
    LosslessOptions::default()
}

/// Compresses, checks the header, decodes through `decompress_into_bytes` and compares bits.
fn roundtrip(bytes: &[u8], dtype: DType, o: &LosslessOptions) -> Vec<u8> {
    let n = bytes.len() / dtype.size();
    let frame = compress_lossless_bytes(bytes, dtype, &[n], o).expect("compresses");
    let h = validate(&frame).expect("valid");
    assert_eq!(
        (h.dtype, h.n, h.eps, h.mode),
        (dtype, n as u64, 0.0, BoundMode::Lossless)
    );
    assert!(matches!(h.codec, Codec::Lossless | Codec::Raw));
    // Never larger than a raw frame of the same tensor.
    assert!(
        h.body_len as usize <= bytes.len(),
        "{} > {}",
        h.body_len,
        bytes.len()
    );
    let mut out = vec![0xa5u8; bytes.len()];
    decompress_into_bytes(&frame, &mut out, 0).expect("decodes");
    assert!(
        out == bytes,
        "{dtype:?} x {n}: bits differ after the round trip"
    );
    frame
}

/// Method of each chunk, read from the chunk table of a lossless frame.
fn methods(frame: &[u8]) -> Vec<u32> {
    let h = validate(frame).expect("valid");
    assert_eq!(h.codec, Codec::Lossless);
    assert!(!h.zstd);
    let body = &frame[h.len()..];
    (0..(h.n as usize).div_ceil(CHUNK))
        .map(|c| u32::from_le_bytes(body[4 * c..4 * c + 4].try_into().expect("4 bytes")) >> 28)
        .collect()
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen()).collect()
}

#[test]
fn every_16_bit_pattern_comes_back() {
    // All 65536 patterns (NaN payloads, -0.0, subnormals, infinities), in order and shuffled
    // among structured data so chunks take the pack path with exceptions.
    let all: Vec<u16> = (0..=u16::MAX).collect();
    for dtype in [DType::BF16, DType::F16, DType::I16] {
        roundtrip(bytemuck::cast_slice(&all), dtype, &opts());
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut mixed: Vec<bf16> = gen(Dist::Gaussian, 1 << 21, 0.02, 3);
    for p in all.iter() {
        let i = rng.gen_range(0..mixed.len());
        mixed[i] = bf16::from_bits(*p);
    }
    let f = roundtrip(bytemuck::cast_slice(&mixed), DType::BF16, &opts());
    assert!(methods(&f).contains(&1), "no chunk packed");
}

#[test]
fn random_bit_patterns_of_every_dtype_come_back() {
    for (k, &dtype) in DType::ALL.iter().enumerate() {
        let w = dtype.size();
        for n in [
            0usize,
            1,
            31,
            32,
            33,
            CHUNK - 1,
            CHUNK,
            CHUNK + 1,
            3 * CHUNK + 7,
        ] {
            let mut bytes = random_bytes(n * w, (k * 100 + n) as u64);
            if dtype == DType::Bool {
                bytes.iter_mut().for_each(|b| *b &= 1);
            }
            roundtrip(&bytes, dtype, &opts());
            // Mostly zeros with random words, and constant runs.
            let mut sparse = vec![0u8; n * w];
            for (i, c) in sparse.chunks_mut(w).enumerate() {
                if i % 5 == 0 {
                    c.copy_from_slice(&bytes[i * w..(i + 1) * w]);
                }
            }
            roundtrip(&sparse, dtype, &opts());
            // A constant run (a bool's bytes are 0 or 1).
            let fill = if dtype == DType::Bool { 1 } else { 0x3c };
            roundtrip(&vec![fill; n * w], dtype, &opts());
        }
    }
}

#[test]
fn float32_specials_and_nan_payloads_come_back() {
    let mut x: Vec<f32> = gen(Dist::Laplace, 3 * CHUNK + 5, 1e-3, 5);
    let specials = [
        f32::NAN.to_bits(),
        0x7f80_0001, // signalling NaN with a payload
        0xffc1_2345, // negative quiet NaN with a payload
        0x8000_0000, // -0.0
        0x0000_0001, // smallest subnormal
        0x7f80_0000,
        0xff80_0000,
        f32::MAX.to_bits(),
    ];
    for (i, &b) in specials.iter().enumerate() {
        x[i * 977] = f32::from_bits(b);
    }
    let f = roundtrip(bytemuck::cast_slice(&x), DType::F32, &opts());
    let (_, y) = decompress::<f32>(&f).expect("typed decode of a float32 frame");
    assert!(x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn each_method_is_chosen_where_it_wins() {
    let n = CHUNK;
    // raw: random bits. pack: weights with shared exponent bits. sparse: random words among
    // zeros. sparse + pack: ReLU output (positive, shared exponent bits, half zero).
    let raw = random_bytes(4 * n, 1);
    let w: Vec<f32> = gen(Dist::Gaussian, n, 0.02, 2);
    let mut sparse = vec![0u8; 4 * n];
    for i in (0..n).step_by(3) {
        sparse[4 * i..4 * i + 4].copy_from_slice(&raw[4 * i..4 * i + 4]);
    }
    let relu: Vec<f32> = gen::<f32>(Dist::Gaussian, n, 1.0, 4)
        .into_iter()
        .map(|v| v.max(0.0))
        .collect();
    let mut all = raw.clone();
    all.extend_from_slice(bytemuck::cast_slice(&w));
    all.extend_from_slice(&sparse);
    all.extend_from_slice(bytemuck::cast_slice(&relu));
    let f = roundtrip(&all, DType::F32, &opts());
    assert_eq!(methods(&f), vec![0, 1, 2, 3]);
}

#[test]
fn bytes_do_not_depend_on_threads_and_zstd_round_trips() {
    let x: Vec<bf16> = gen(Dist::Gaussian, 40 * CHUNK + 3, 0.05, 9);
    let bytes: &[u8] = bytemuck::cast_slice(&x);
    let one = roundtrip(
        bytes,
        DType::BF16,
        &LosslessOptions {
            zstd_level: None,
            threads: 1,
        },
    );
    for threads in [2, 3, 7] {
        let o = LosslessOptions {
            zstd_level: None,
            threads,
        };
        assert!(
            roundtrip(bytes, DType::BF16, &o) == one,
            "{threads} threads"
        );
    }
    // zstd finds what packing cannot: here, a block of weights repeated.
    let rep: Vec<u8> = bytes[..2000]
        .iter()
        .copied()
        .cycle()
        .take(bytes.len())
        .collect();
    let plain = roundtrip(&rep, DType::BF16, &opts());
    let z = roundtrip(
        &rep,
        DType::BF16,
        &LosslessOptions {
            zstd_level: Some(3),
            threads: 0,
        },
    );
    assert!(validate(&z).expect("valid").zstd);
    assert!(z.len() * 10 < plain.len(), "{} vs {}", z.len(), plain.len());
}

#[test]
fn incompressible_data_gives_a_raw_frame() {
    let bytes = random_bytes(4 * 5000, 11);
    let f = roundtrip(&bytes, DType::I32, &opts());
    let h = validate(&f).expect("valid");
    assert_eq!((h.codec, h.mode), (Codec::Raw, BoundMode::Lossless));
    assert_eq!(h.body_len as usize, bytes.len());
}

#[test]
fn ratios_on_weights_and_activations() {
    // The targets: bf16 weights at least 1.3x, 50%-sparse float32 ReLU output at least
    // 1.8x. Weights: normal with std 0.02, as initialised transformer weights.
    let w: Vec<bf16> = gen::<f32>(Dist::Gaussian, 1 << 20, 0.02, 21)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let f = roundtrip(bytemuck::cast_slice(&w), DType::BF16, &opts());
    let r = (2 * w.len()) as f64 / f.len() as f64;
    assert!(r >= 1.3, "bf16 weights: {r:.3}x");
    let a: Vec<f32> = gen::<f32>(Dist::Gaussian, 1 << 20, 1.0, 22)
        .into_iter()
        .map(|v| v.max(0.0))
        .collect();
    let f = roundtrip(bytemuck::cast_slice(&a), DType::F32, &opts());
    let r = (4 * a.len()) as f64 / f.len() as f64;
    assert!(r >= 1.8, "relu activations: {r:.3}x");
    let h: Vec<f16> = a.iter().map(|&v| f16::from_f32(v)).collect();
    roundtrip(bytemuck::cast_slice(&h), DType::F16, &opts());
}

#[test]
fn the_error_bounded_codec_refuses_integer_dtypes() {
    let bytes = vec![0u8; 64];
    let o = cfc::CompressOptions::new(cfc::Bound::Abs(0.1));
    for dtype in [DType::I32, DType::F64, DType::Bool] {
        let e = cfc::compress_bytes(&bytes, dtype, &[64 / dtype.size()], &o).unwrap_err();
        assert!(e.to_string().contains("cannot be quantized"), "{e}");
    }
    let f = compress_lossless_bytes(&bytes, DType::I64, &[8], &opts()).expect("lossless");
    assert!(cfc::Codes::from_frame(&f).is_err());
}

#[test]
fn bool_elements_other_than_0_and_1_are_refused() {
    let mut bytes = vec![0u8, 1, 1, 0, 1];
    compress_lossless_bytes(&bytes, DType::Bool, &[5], &opts()).expect("0 and 1");
    bytes[3] = 2;
    let e = compress_lossless_bytes(&bytes, DType::Bool, &[5], &opts()).unwrap_err();
    assert!(
        matches!(e, cfc::Error::InvalidBool { index: 3, byte: 2 }),
        "{e}"
    );
    // The same bytes as uint8 are fine.
    compress_lossless_bytes(&bytes, DType::U8, &[5], &opts()).expect("uint8");
}

#[test]
fn shape_and_alignment_are_checked() {
    let e = compress_lossless_bytes(&[0u8; 6], DType::F32, &[1], &opts()).unwrap_err();
    assert!(matches!(e, cfc::Error::MisalignedInput { .. }), "{e}");
    let e = compress_lossless_bytes(&[0u8; 8], DType::F32, &[3], &opts()).unwrap_err();
    assert!(matches!(e, cfc::Error::ShapeMismatch { .. }), "{e}");
}
