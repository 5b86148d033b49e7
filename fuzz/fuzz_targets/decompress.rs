//! Feeds arbitrary bytes to every decoding entry point of cfc. None may panic; they must
//! agree on whether the frame is valid, and a valid frame must decode to `n` elements of its
//! own dtype and give back codes that survive `to_frame` / `from_frame` unchanged, as bit planes
//! and as Rice codes (with their block scales, where they have them).
//!
//! Run: `cargo +nightly fuzz run decompress` (seed corpus: `tests/hostile/`).

#![no_main]

use cfc::{decompress, decompress_into_bytes, read_header, validate, Coder, Codes, DType};
use half::{bf16, f16};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let valid = validate(data);
    let header = read_header(data);
    let f = decompress::<f32>(data);
    let b = decompress::<bf16>(data);
    let h = decompress::<f16>(data);
    let codes = Codes::from_frame(data);
    match valid {
        Ok(hd) => {
            assert_eq!(header.ok().as_ref(), Some(&hd));
            let n = hd.n as usize;
            match hd.dtype {
                DType::F32 => assert_eq!(f.expect("own dtype decodes").1.len(), n),
                DType::BF16 => assert_eq!(b.expect("own dtype decodes").1.len(), n),
                DType::F16 => assert_eq!(h.expect("own dtype decodes").1.len(), n),
                // Lossless-only dtypes (integers, bool, float64) decode as bytes only.
                _ => assert!(f.is_err() && b.is_err() && h.is_err()),
            }
            let mut out = vec![0u8; hd.decoded_len() as usize];
            decompress_into_bytes(data, &mut out, 2).expect("validated frame decodes");
            if !hd.dtype.is_quantizable() {
                assert!(codes.is_err());
                return;
            }
            let c = codes.expect("validated frame has codes");
            assert_eq!(c.codes.len(), n);
            for coder in [Coder::Planes, Coder::Rice] {
                let packed = c.to_frame_as(coder, None).expect("packs");
                assert_eq!(Codes::from_frame(&packed).expect("reads"), c);
            }
            // Adding a frame to itself may overflow, but must not panic.
            let _ = Codes::sum(&[c.clone(), c]);
        }
        Err(_) => {
            assert!(header.is_err() || data.len() >= 64);
            assert!(f.is_err() && b.is_err() && h.is_err() && codes.is_err());
        }
    }
});
