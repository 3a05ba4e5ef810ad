//! Fuzzes `bloomgate::feed::wal::pgoutput::decode_in`, which reads every message
//! the WAL feed receives, inside a streamed block and out: it must never
//! panic, and a message it accepts must decode the same way again (no
//! hidden state).
#![no_main]

use bloomgate::feed::wal::pgoutput::decode_in;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for in_stream in [false, true] {
        let first = decode_in(data, in_stream);
        assert_eq!(first, decode_in(data, in_stream));
    }
});
