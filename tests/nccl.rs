//! NCCL: loading the library, its unique ids, refusing bad ranks (no GPU needed). The engine
//! over NCCL is tested in `tests/engine_cuda.rs`.
#![cfg(feature = "cuda")]

use cfc::nccl::{Communicator, Library, UniqueId};
use cfc::Error;

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
