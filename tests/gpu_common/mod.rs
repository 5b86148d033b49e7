//! What the GPU integration tests share: whether a GPU and NCCL are here (required under
//! `CFC_REQUIRE_GPU=1`), their test gradients, and a CUDA engine per rank.
#![allow(dead_code)] // (each test file uses a part)

use cfc::engine::transport::local::LocalLinks;
use cfc::engine::transport::Links;
use cfc::engine::{Engine, Options};
use cfc::nccl::{Communicator, UniqueId};
use cfc::DType;

/// Runs `f(rank, device, engine)` on a thread per rank of `world` CUDA engines with options
/// `o`: over NCCL with a GPU each, or (`shared`) over host links with every rank on GPU 0;
/// closes each engine after.
pub fn on_cuda_ranks<R: Send>(
    world: usize,
    shared: bool,
    o: &Options,
    f: impl Fn(usize, usize, &Engine) -> R + Sync,
) -> Vec<R> {
    let links = LocalLinks::group(world, o.timeout);
    let id = UniqueId::new().unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(rank, l)| {
                let (o, id, f) = (o.clone(), &id, &f);
                s.spawn(move || {
                    let device = if shared { 0 } else { rank };
                    let e = if shared {
                        Engine::on_cuda_links(device, l, o, 0, &[]).unwrap()
                    } else {
                        let comm = Communicator::new(device, id, rank, world).unwrap();
                        let control = l.control().clone();
                        Engine::on_cuda_nccl(device, comm, control, Some(Box::new(l)), o, 0, &[])
                            .unwrap()
                    };
                    let out = f(rank, device, &e);
                    e.close().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// GPUs usable here (0 where there are none: the tests then return, unless required).
pub fn gpus() -> usize {
    let required = std::env::var("CFC_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let n = if cfc::cuda::supported(0) {
        cfc::cuda::device_count()
    } else {
        0
    };
    if n == 0 {
        assert!(
            !required,
            "CFC_REQUIRE_GPU=1 but no GPU cfc supports is visible"
        );
        eprintln!("skipped: no GPU");
    }
    n
}

pub fn nccl() -> bool {
    match cfc::nccl::library() {
        Ok(_) => true,
        Err(e) => {
            let required = std::env::var("CFC_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(!required, "CFC_REQUIRE_GPU=1 but NCCL does not load: {e}");
            eprintln!("skipped: no NCCL ({e})");
            false
        }
    }
}

/// Gradient-like values of a rank at a step.
/// Test gradients; 4x larger at step 2 (and 9, the second bucket's step 2), so that frames
/// outgrow the slots sized at the step before and send their tails in a second round.
pub fn grads(rank: usize, step: usize, n: usize) -> Vec<f32> {
    let grow = if step % 7 == 2 { 4.0 } else { 1.0 };
    (0..n)
        .map(|i| {
            let t = (i * 7919 + rank * 104_729 + step * 15_485_863) % 100_003;
            // (a scale that drops 10x every 3000 values over 4 decades: block scales differ)
            let decade = 10f32.powi(-(((i / 3000) % 4) as i32));
            let v = ((t as f32 / 100_003.0) - 0.5) * 1e-2 * (1.0 + (i % 13) as f32) * decade * grow;
            if i == 77 && step == 1 {
                f32::NAN
            } else {
                v
            }
        })
        .collect()
}

pub fn bytes_of(x: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => x
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => x
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
    }
}
