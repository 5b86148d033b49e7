//! Hostile bytes at one of the engine's TCP links: the accepting side of the handshake, then
//! the messages after it (`cfc::engine::transport::tcp::read_hostile_link`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    cfc::engine::transport::tcp::read_hostile_link(data);
});
