//! NCCL: loading the library, the transport of `collective::allreduce` over it, and the GPU
//! all-reduce.
//!
//! The tests that need two GPUs and NCCL return early (printing why) where there are none,
//! unless `CFC_REQUIRE_GPU=1` is set, as on the GPU machine (`scripts/gpu_rust.sh`):
//! there a missing GPU or NCCL fails them instead of skipping them.
#![cfg(feature = "cuda")]

use cfc::collective::{allreduce, AllReduceOptions, InProcess, Transport};
use cfc::gpu_allreduce::{Fallback, GpuAllReduceOptions, GpuAllReducer};
use cfc::nccl::{Communicator, Library, NcclTransport, UniqueId};
use cfc::{Bound, DType, Error};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::sync::Arc;
use std::time::Duration;

// ---- without a GPU ----

#[test]
fn a_missing_library_is_an_error_naming_the_path() {
    let e = Library::open("/nonexistent/dir/libnccl.so.2").unwrap_err();
    assert!(matches!(e, Error::NcclUnavailable(_)), "{e:?}");
    assert!(
        e.to_string().contains("/nonexistent/dir/libnccl.so.2"),
        "{e}"
    );
}

#[test]
fn a_library_that_is_not_nccl_is_an_error_naming_the_entry_point() {
    // libc is on every Linux machine and has no NCCL entry points.
    let e = Library::open("libc.so.6").unwrap_err();
    assert!(matches!(e, Error::NcclUnavailable(_)), "{e:?}");
    assert!(e.to_string().contains("ncclGetVersion"), "{e}");
}

#[test]
fn unique_ids_round_trip_through_hex_and_bad_ones_are_refused() {
    let mut raw = [0u8; 128];
    for (i, b) in raw.iter_mut().enumerate() {
        *b = (i * 37 % 256) as u8;
    }
    let id = UniqueId(raw);
    assert_eq!(UniqueId::from_hex(&id.to_hex()).unwrap(), id);
    for bad in ["", "00", &"zz".repeat(128), &"0".repeat(255)] {
        assert!(
            matches!(UniqueId::from_hex(bad), Err(Error::Transport(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn a_rank_outside_the_world_is_refused_before_anything_loads() {
    let id = UniqueId([0; 128]);
    for (rank, world) in [(2, 2), (0, 0)] {
        let e = Communicator::new(0, &id, rank, world).unwrap_err();
        assert!(matches!(e, Error::Transport(_)), "{e:?}");
    }
}

// ---- on two GPUs ----

/// Whether the GPU tests can run: two devices and NCCL (or a failure under CFC_REQUIRE_GPU).
fn two_gpus() -> bool {
    let required = std::env::var("CFC_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let why = if cfc::cuda::device_count() < 2 {
        Some(format!("{} CUDA devices", cfc::cuda::device_count()))
    } else {
        cfc::nccl::library().err().map(|e| e.to_string())
    };
    match why {
        None => true,
        Some(w) if required => panic!("CFC_REQUIRE_GPU=1 but {w}"),
        Some(w) => {
            eprintln!("skipped: needs 2 GPUs and NCCL ({w})");
            false
        }
    }
}

/// Runs `f(rank, communicator)` on one thread per GPU of a fresh 2-rank communicator.
fn on_two_gpus<R: Send>(f: impl Fn(usize, Communicator) -> R + Sync) -> Vec<R> {
    let id = UniqueId::new().expect("NCCL id");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let f = &f;
                s.spawn(move || {
                    let mut comm = Communicator::new(rank, &id, rank, 2).expect("communicator");
                    comm.set_timeout(Duration::from_secs(60));
                    f(rank, comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Gradient-like values: a smooth part and a heavy-tailed part, different on each rank.
fn rank_data(rank: usize, n: usize, scale: f32) -> Vec<f32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ (rank as u64 + 1).wrapping_mul(0x1234_5678_9ABC_DEF1);
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            let tail = -(1.0 - u).ln() * if s & 1 == 0 { 1.0 } else { -1.0 };
            scale * ((i as f32 * 0.001).sin() + 0.3 * tail as f32)
        })
        .collect()
}

#[test]
fn the_nccl_transport_gives_the_bits_of_the_in_process_transport() {
    if !two_gpus() {
        return;
    }
    let n = 100_003;
    let opts = AllReduceOptions {
        bound: Bound::Abs(0.01),
        average: true,
        zstd_level: None,
        algorithm: None,
    };
    // Three calls with error feedback: results and residuals, by rank and call.
    let run = |t: &mut dyn Transport| {
        let x = rank_data(t.rank(), n, 1.0);
        let mut r = vec![0f32; n];
        let mut out = Vec::new();
        for _ in 0..3 {
            let (y, report) = allreduce(t, &x, Some(&mut r), &opts).unwrap();
            assert!(report.bytes_sent > 0 && report.bytes_sent < report.bytes_uncompressed);
            out.push((y, r.clone()));
        }
        out
    };
    let over_nccl = on_two_gpus(|_, comm| run(&mut NcclTransport::new(comm).unwrap()));
    let over_threads: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = InProcess::group(2, Duration::from_secs(60))
            .into_iter()
            .map(|mut t| s.spawn(move || run(&mut t)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for rank in 0..2 {
        for call in 0..3 {
            let (a, b) = (&over_nccl[rank][call], &over_threads[rank][call]);
            assert!(
                a.0.iter()
                    .map(|v| v.to_bits())
                    .eq(b.0.iter().map(|v| v.to_bits())),
                "rank {rank} call {call}: results differ"
            );
            assert!(
                a.1.iter()
                    .map(|v| v.to_bits())
                    .eq(b.1.iter().map(|v| v.to_bits())),
                "rank {rank} call {call}: residuals differ"
            );
        }
    }
}

#[test]
fn the_nccl_transport_reports_disagreeing_ranks_on_every_rank() {
    if !two_gpus() {
        return;
    }
    let got = on_two_gpus(|rank, comm| {
        let mut t = NcclTransport::new(comm).unwrap();
        let x = rank_data(rank, 1000 + rank, 1.0);
        let opts = AllReduceOptions {
            bound: Bound::Abs(0.01),
            average: true,
            zstd_level: None,
            algorithm: None,
        };
        allreduce(&mut t, &x, None, &opts).map(|_| ())
    });
    for g in got {
        assert!(matches!(g, Err(Error::RankMismatch { .. })), "{g:?}");
    }
}

/// The device copy of `x` in `dtype`.
fn upload(stream: &Arc<cudarc::driver::CudaStream>, x: &[f32], dtype: DType) -> CudaSlice<u8> {
    let bytes: Vec<u8> = match dtype {
        DType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => x
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => x
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
    };
    stream.clone_htod(&bytes).unwrap()
}

fn download(stream: &Arc<cudarc::driver::CudaStream>, d: &CudaSlice<u8>, dtype: DType) -> Vec<f64> {
    let b = stream.clone_dtoh(d).unwrap();
    match dtype {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        _ => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
    }
}

/// `reducer.allreduce` over the device buffer `d` (`n` elements of `dtype`) on `stream`.
fn reduce(
    reducer: &mut GpuAllReducer,
    stream: &Arc<cudarc::driver::CudaStream>,
    d: &CudaSlice<u8>,
    dtype: DType,
    opts: &GpuAllReduceOptions,
) -> cfc::Result<cfc::collective::AllReduceReport> {
    let n = (d.len() / dtype.size()) as u64;
    let (ptr, _sync) = d.device_ptr(stream);
    // SAFETY: `d` holds `n` elements of `dtype` on the communicator's device and outlives the
    // call; the caller downloads it on the same stream, after the queued decoding.
    unsafe { reducer.allreduce(stream.cu_stream() as usize, ptr, n, dtype, opts) }
}

/// The element of `dtype` nearest `v`, as f64 (what the inputs really are).
fn as_dtype(v: f32, dtype: DType) -> f64 {
    match dtype {
        DType::F32 => v as f64,
        DType::BF16 => half::bf16::from_f32(v).to_f64(),
        _ => half::f16::from_f32(v).to_f64(),
    }
}

/// Half a unit in the last place of `dtype` at `v` (the result's own rounding).
fn half_ulp(v: f64, dtype: DType) -> f64 {
    let mant = match dtype {
        DType::F32 => 23,
        DType::BF16 => 7,
        _ => 10,
    };
    let e = v.abs().max(1e-30).log2().floor();
    0.5 * 2f64.powf(e - mant as f64) * 1.0001
}

#[test]
fn the_gpu_allreduce_is_within_eps_of_the_average_and_alike_on_every_rank() {
    if !two_gpus() {
        return;
    }
    // Several chunks (the last one short), every dtype; the second and third calls use the
    // slots the first one sized, and the third's frames outgrow them (larger values): sent again.
    let n = 250_007;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let eps = 0.02;
        let scales = [1.0f32, 1.0, 8.0];
        let got = on_two_gpus(|rank, comm| {
            let stream = comm.context().new_stream().unwrap();
            let mut reducer = GpuAllReducer::new(comm).unwrap();
            let opts = GpuAllReduceOptions {
                chunk_numel: 100_000,
                feedback: false,
                ..GpuAllReduceOptions::new(eps)
            };
            let mut out = Vec::new();
            for &scale in &scales {
                let d = upload(&stream, &rank_data(rank, n, scale), dtype);
                let report = reduce(&mut reducer, &stream, &d, dtype, &opts).unwrap();
                out.push((download(&stream, &d, dtype), report));
            }
            out
        });
        for (call, &scale) in scales.iter().enumerate() {
            let (a, b) = (&got[0][call], &got[1][call]);
            assert!(
                a.0.iter()
                    .map(|v| v.to_bits())
                    .eq(b.0.iter().map(|v| v.to_bits())),
                "{dtype:?} call {call}: ranks differ"
            );
            let (x0, x1) = (rank_data(0, n, scale), rank_data(1, n, scale));
            for i in 0..n {
                let exact = (as_dtype(x0[i], dtype) + as_dtype(x1[i], dtype)) / 2.0;
                let err = (a.0[i] - exact).abs();
                assert!(
                    err <= eps * 1.0001 + half_ulp(exact.abs() + eps, dtype) + 1e-6 * exact.abs(),
                    "{dtype:?} call {call} element {i}: {} against {exact} (eps {eps})",
                    a.0[i]
                );
            }
            // The first call sends heads, then frames; the second fits its slots. (The third
            // sends twice, and at that scale a bfloat16 frame is about as big as the input.)
            let r = &a.1;
            assert!(
                call == 2 || r.bytes_sent < r.bytes_uncompressed,
                "{dtype:?} call {call}: {r:?}"
            );
        }
        // The third call's frames outgrew the slots of the second: every chunk went twice.
        assert!(
            got[0][2].1.bytes_sent > got[0][1].1.bytes_sent * 3 / 2,
            "{dtype:?}: {:?} then {:?}",
            got[0][1].1,
            got[0][2].1
        );
    }
}

#[test]
fn error_feedback_makes_the_running_mean_converge_on_the_gpu() {
    if !two_gpus() {
        return;
    }
    let (n, eps, calls) = (50_000, 0.05, 16);
    let got = on_two_gpus(|rank, comm| {
        let stream = comm.context().new_stream().unwrap();
        let mut reducer = GpuAllReducer::new(comm).unwrap();
        let x = rank_data(rank, n, 1.0);
        let mut sum = vec![0f64; n];
        let mut first_err = 0f64;
        for call in 0..calls {
            let d = upload(&stream, &x, DType::F32);
            // A bound that changes from call to call (as a multiple of the RMS would) keeps
            // the residuals: were they reset, every call would give the same rounded values.
            let opts = GpuAllReduceOptions::new(eps * (1.0 - 0.05 * (call % 2) as f64));
            reduce(&mut reducer, &stream, &d, DType::F32, &opts).unwrap();
            let y = download(&stream, &d, DType::F32);
            for (s, v) in sum.iter_mut().zip(&y) {
                *s += v;
            }
            if call == 0 {
                let (x0, x1) = (rank_data(0, n, 1.0), rank_data(1, n, 1.0));
                first_err = (0..n)
                    .map(|i| (y[i] - (x0[i] as f64 + x1[i] as f64) / 2.0).abs())
                    .fold(0.0, f64::max);
            }
        }
        (sum, first_err)
    });
    let (x0, x1) = (rank_data(0, n, 1.0), rank_data(1, n, 1.0));
    let (sum, first_err) = &got[0];
    let worst = (0..n)
        .map(|i| (sum[i] / calls as f64 - (x0[i] as f64 + x1[i] as f64) / 2.0).abs())
        .fold(0.0, f64::max);
    // One call is off by up to eps; the mean of 16 by about eps / 16 (what the residuals still
    // hold), plus float32 rounding.
    assert!(
        *first_err > eps / 4.0,
        "the first call should show its rounding: {first_err}"
    );
    assert!(
        worst < eps / calls as f64 * 1.5 + 1e-5,
        "running mean off by {worst}"
    );
}

#[test]
fn disagreeing_ranks_get_an_error_on_every_gpu() {
    if !two_gpus() {
        return;
    }
    let got = on_two_gpus(|rank, comm| {
        let stream = comm.context().new_stream().unwrap();
        let mut reducer = GpuAllReducer::new(comm).unwrap();
        let n = 1000 + 24 * rank;
        let d = upload(&stream, &rank_data(rank, n, 1.0), DType::F32);
        let opts = GpuAllReduceOptions::new(0.01);
        reduce(&mut reducer, &stream, &d, DType::F32, &opts).map(|_| ())
    });
    for g in got {
        let e = g.unwrap_err();
        assert!(matches!(e, Error::RankMismatch { .. }), "{e:?}");
        assert!(e.to_string().contains("1000 x float32"), "{e}");
    }
}

#[test]
fn a_peer_that_never_comes_is_an_error_after_the_timeout() {
    if !two_gpus() {
        return;
    }
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let got = on_two_gpus(|rank, mut comm| {
        if rank == 1 {
            // Never joins the all-reduce; leaves once rank 0 has given up.
            rx.lock().unwrap().recv().unwrap();
            comm.abort();
            return None;
        }
        comm.set_timeout(Duration::from_secs(3));
        let stream = comm.context().new_stream().unwrap();
        let mut reducer = GpuAllReducer::new(comm).unwrap();
        let d = upload(&stream, &rank_data(0, 1000, 1.0), DType::F32);
        let opts = GpuAllReduceOptions::new(0.01);
        let t0 = std::time::Instant::now();
        let r = reduce(&mut reducer, &stream, &d, DType::F32, &opts);
        let waited = t0.elapsed();
        tx.send(()).unwrap();
        // The communicator is aborted: later calls fail at once.
        let again = reduce(&mut reducer, &stream, &d, DType::F32, &opts);
        Some((r.map(|_| ()), waited, again.map(|_| ())))
    });
    let (r, waited, again) = got[0].as_ref().unwrap();
    let e = r.as_ref().unwrap_err();
    assert!(matches!(e, Error::Nccl(_)), "{e:?}");
    assert!(e.to_string().contains("no progress"), "{e}");
    assert!(*waited >= Duration::from_secs(3) && *waited < Duration::from_secs(30));
    let e = again.as_ref().unwrap_err();
    assert!(e.to_string().contains("aborted"), "{e}");
}

#[test]
fn an_uncompressed_call_sends_what_the_compressed_ones_dropped() {
    if !two_gpus() {
        return;
    }
    // Fallback::Auto's trial alternates compressed and plain calls, compressed first. The plain
    // call adds the residuals of the compressed one to its input, so the two results together
    // are the exact sum of the two averages (but for float32 rounding), not off by the first
    // call's rounding; and after the trial both ranks go the same way.
    let (n, eps) = (60_001, 0.05);
    let scale = |call: usize| 1.0 + 0.25 * call as f32;
    let got = on_two_gpus(|rank, comm| {
        let stream = comm.context().new_stream().unwrap();
        let mut reducer = GpuAllReducer::new(comm).unwrap();
        let opts = GpuAllReduceOptions {
            fallback: Fallback::Auto { trials: 2 },
            ..GpuAllReduceOptions::new(eps)
        };
        let mut out = Vec::new();
        for call in 0..5 {
            if call < 4 {
                assert_eq!(reducer.compressing(), None, "call {call}: still trying");
            }
            let d = upload(&stream, &rank_data(rank, n, scale(call)), DType::F32);
            let report = reduce(&mut reducer, &stream, &d, DType::F32, &opts).unwrap();
            out.push((download(&stream, &d, DType::F32), report));
        }
        (out, reducer.compressing())
    });
    assert!(got[0].1.is_some(), "no choice after the trial");
    assert_eq!(got[0].1, got[1].1, "the ranks chose differently");
    let exact = |call: usize| -> Vec<f64> {
        let (x0, x1) = (rank_data(0, n, scale(call)), rank_data(1, n, scale(call)));
        (0..n)
            .map(|i| (x0[i] as f64 + x1[i] as f64) / 2.0)
            .collect()
    };
    let out = &got[0].0;
    for (call, (y, report)) in out.iter().enumerate().take(4) {
        let plain = call % 2 == 1;
        assert_eq!(report.eps == 0.0, plain, "call {call}: {report:?}");
        // (The first compressed call sends the frame sizes, then the frames.)
        assert!(
            plain || report.bytes_sent < report.bytes_uncompressed / 2,
            "{report:?}"
        );
        let e = exact(call);
        let worst = (0..n).map(|i| (y[i] - e[i]).abs()).fold(0.0, f64::max);
        if plain {
            // Off by what the call before dropped, which this one makes up for.
            assert!(worst <= eps * 1.001 + 1e-5, "call {call}: {worst}");
        } else {
            assert!(
                worst > eps / 4.0 && worst <= eps * 1.001 + 1e-5,
                "call {call}: {worst}"
            );
        }
    }
    for pair in [0, 2] {
        let (e0, e1) = (exact(pair), exact(pair + 1));
        let worst = (0..n)
            .map(|i| (out[pair].0[i] + out[pair + 1].0[i] - e0[i] - e1[i]).abs())
            .fold(0.0, f64::max);
        assert!(
            worst < 2e-5,
            "calls {pair} and {}: the sum is off by {worst}",
            pair + 1
        );
    }
    for rank in 0..2 {
        assert!(
            got[rank].0[4]
                .0
                .iter()
                .map(|v| v.to_bits())
                .eq(got[0].0[4].0.iter().map(|v| v.to_bits())),
            "ranks differ after the choice"
        );
    }
}

#[test]
fn fallback_always_is_ncclallreduce_and_ranks_must_agree_on_it() {
    if !two_gpus() {
        return;
    }
    let n = 30_011;
    for dtype in [DType::F32, DType::BF16] {
        let got = on_two_gpus(|rank, comm| {
            let stream = comm.context().new_stream().unwrap();
            let mut reducer = GpuAllReducer::new(comm).unwrap();
            let x = rank_data(rank, n, 1.0);
            let (d, plain) = (upload(&stream, &x, dtype), upload(&stream, &x, dtype));
            let opts = GpuAllReduceOptions {
                fallback: Fallback::Always,
                ..GpuAllReduceOptions::new(0.01)
            };
            let report = reduce(&mut reducer, &stream, &d, dtype, &opts).unwrap();
            let (ptr, _sync) = plain.device_ptr(&stream);
            // SAFETY: `plain` holds `n` elements of `dtype` on this device, downloaded below
            // on the same stream.
            unsafe {
                reducer
                    .communicator()
                    .all_reduce(ptr, ptr, n, dtype, true, stream.cu_stream())
                    .unwrap()
            };
            (
                stream.clone_dtoh(&d).unwrap(),
                stream.clone_dtoh(&plain).unwrap(),
                report,
                reducer.compressing(),
            )
        });
        for (rank, (y, plain, report, way)) in got.iter().enumerate() {
            assert!(y == plain, "{dtype:?} rank {rank}: not NCCL's result");
            assert_eq!(report.eps, 0.0);
            assert_eq!(*way, Some(false));
        }
    }
    // One rank compressing and the other not would exchange nonsense: both are told.
    let got = on_two_gpus(|rank, comm| {
        let stream = comm.context().new_stream().unwrap();
        let mut reducer = GpuAllReducer::new(comm).unwrap();
        let d = upload(&stream, &rank_data(rank, 1000, 1.0), DType::F32);
        let opts = GpuAllReduceOptions {
            fallback: [Fallback::Never, Fallback::Auto { trials: 2 }][rank],
            ..GpuAllReduceOptions::new(0.01)
        };
        reduce(&mut reducer, &stream, &d, DType::F32, &opts).map(|_| ())
    });
    for g in got {
        let e = g.unwrap_err();
        assert!(matches!(e, Error::RankMismatch { .. }), "{e:?}");
        assert!(e.to_string().contains("fallback=auto (2 trials)"), "{e}");
    }
}
