//! Error feedback: what quantization drops is carried to the next step, so the running sum of
//! what was sent tracks the running sum of the inputs within one bound, not one bound per step.

use cfc::{
    compress_bytes_with_feedback, compress_with_feedback, decompress, Bound, Codec,
    CompressOptions, DType, Error,
};
use half::bf16;
use rand::{Rng, SeedableRng};

fn steps(n: usize, count: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..count)
        .map(|_| (0..n).map(|_| rng.gen_range(-1e-3f32..1e-3)).collect())
        .collect()
}

#[test]
fn running_sum_error_stays_within_one_bound() {
    let eps = 2e-4;
    let opts = CompressOptions::new(Bound::Abs(eps));
    let xs = steps(4096, 100, 1);
    let mut residual = vec![0f32; 4096];
    let mut sent = vec![0f64; 4096];
    let mut truth = vec![0f64; 4096];
    let mut no_feedback = vec![0f64; 4096];
    for x in &xs {
        let frame = compress_with_feedback(x, &mut residual, &[4096], &opts).expect("compress");
        let (_, y) = decompress::<f32>(&frame).expect("decompress");
        let plain = cfc::compress(x, &[4096], &opts).expect("compress");
        let (_, z) = decompress::<f32>(&plain).expect("decompress");
        for i in 0..4096 {
            sent[i] += y[i] as f64;
            truth[i] += x[i] as f64;
            no_feedback[i] += z[i] as f64;
        }
    }
    let drift = |a: &[f64]| {
        a.iter()
            .zip(&truth)
            .map(|(s, t)| (s - t).abs())
            .fold(0.0, f64::max)
    };
    // sum(sent) = sum(x) - residual, and |residual| <= eps (+ f32 rounding of the sums).
    assert!(
        drift(&sent) <= eps * 1.01,
        "with feedback: {}",
        drift(&sent)
    );
    assert!(residual.iter().all(|r| r.abs() as f64 <= eps * 1.0001));
    // Without feedback the same data drifts well past one bound.
    assert!(
        drift(&no_feedback) > 3.0 * eps,
        "without feedback: {}",
        drift(&no_feedback)
    );
}

#[test]
fn residual_is_what_the_frame_does_not_give_back() {
    let x: Vec<f32> = steps(1000, 1, 2).remove(0);
    let mut residual: Vec<f32> = steps(1000, 1, 3).remove(0);
    let before = residual.clone();
    let frame = compress_with_feedback(
        &x,
        &mut residual,
        &[1000],
        &CompressOptions::new(Bound::Abs(1e-4)),
    )
    .expect("compress");
    let (_, y) = decompress::<f32>(&frame).expect("decompress");
    for i in 0..1000 {
        let c = x[i] + before[i];
        assert_eq!(residual[i].to_bits(), (c - y[i]).to_bits(), "element {i}");
        assert!((y[i] as f64 - c as f64).abs() <= 1e-4);
    }
}

#[test]
fn non_finite_values_reset_the_residual_and_travel_exactly() {
    // Enough finite values for the frame to be quantized (a raw frame would zero every
    // residual, non-finite or not), with NaN, infinity and a NaN residual among them.
    let mut x: Vec<bf16> = (0..4096)
        .map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 64.0))
        .collect();
    let mut residual: Vec<f32> = (0..4096).map(|i| ((i % 7) as f32 - 3.0) * 1e-3).collect();
    x[1] = bf16::NAN;
    x[2] = bf16::INFINITY;
    x[3] = bf16::from_f32(-2.0);
    residual[1] = 0.5;
    residual[2] = 0.5;
    residual[3] = f32::NAN;
    let before = residual.clone();
    let frame = compress_with_feedback(
        &x,
        &mut residual,
        &[4096],
        &CompressOptions::new(Bound::Abs(0.01)),
    )
    .expect("compress");
    let header = cfc::validate(&frame).expect("valid");
    assert_eq!(header.codec, Codec::Quantized);
    assert!(header.n_exceptions >= 2, "{header:?}");
    let (_, y) = decompress::<bf16>(&frame).expect("decompress");
    // NaN and infinity travel bit-exactly (NaN payload included) and reset their residual.
    assert_eq!(y[1].to_bits(), bf16::NAN.to_bits());
    assert!(y[2] == bf16::INFINITY);
    assert_eq!(residual[1..3], [0.0, 0.0]);
    // A NaN residual counts as 0 instead of poisoning the value.
    assert!((y[3].to_f32() + 2.0).abs() <= 0.01 && residual[3].abs() <= 0.01);
    // The finite others keep what their rounding dropped: x + old residual - sent.
    let mut kept = 0;
    for i in (0..4096).filter(|i| !(1..=3).contains(i)) {
        let c = x[i].to_f32() + before[i];
        let slack = 0.01 + c.abs() as f64 / 256.0; // eps, and bf16's rounding of what is sent
        assert!((y[i].to_f64() - c as f64).abs() <= slack, "element {i}");
        assert!((residual[i] as f64).abs() <= slack, "element {i}");
        kept += (residual[i] != 0.0) as usize;
    }
    assert!(kept > 2000, "only {kept} residuals are nonzero");
}

#[test]
fn bad_residuals_are_refused() {
    let x = vec![0f32; 8];
    let opts = CompressOptions::new(Bound::Abs(0.1));
    let mut short = vec![0f32; 7];
    assert!(matches!(
        compress_with_feedback(&x, &mut short, &[8], &opts),
        Err(Error::ShapeMismatch { .. })
    ));
    let bytes = bytemuck::cast_slice::<f32, u8>(&x).to_vec();
    let mut odd = vec![0u8; 31];
    assert!(matches!(
        compress_bytes_with_feedback(&bytes, DType::F32, &mut odd, &[8], &opts),
        Err(Error::MisalignedInput { .. })
    ));
}
