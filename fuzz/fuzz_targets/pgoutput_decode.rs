//! Fuzzes `bloomgate::feed::pgoutput::decode`, which reads every message the
//! WAL feed receives: it must never panic, and a message it accepts must
//! decode the same way again (no hidden state).
#![no_main]

use bloomgate::feed::pgoutput::decode;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let first = decode(data);
    assert_eq!(first, decode(data));
});
