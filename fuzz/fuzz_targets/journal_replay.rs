//! Journal replay (DATA_DIR): any bytes as one to three segments replay to tasks or skipped
//! records, never a panic; every frame the scan keeps is one that checks out, and every task
//! pins only segments that exist.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::journal::codec::{FrameAt, frame_at, segment_header};
use relay::journal::replay::{replay_bytes, scan_segment};

fuzz_target!(|data: &[u8]| {
    let Some((&shape, rest)) = data.split_first() else { return };
    let count = 1 + (shape % 3) as usize;
    let with_header = shape & 0x80 != 0;
    let chunk = rest.len() / count + 1;
    let segments: Vec<Vec<u8>> = rest
        .chunks(chunk)
        .map(|c| {
            let mut s = if with_header { segment_header().to_vec() } else { Vec::new() };
            s.extend_from_slice(c);
            s
        })
        .collect();
    for (i, s) in segments.iter().enumerate() {
        let scan = scan_segment(s, i + 1 == segments.len());
        for f in &scan.frames {
            assert!(matches!(frame_at(&s[f.off..]), FrameAt::Valid { .. }));
        }
    }
    let numbered: Vec<(u32, &[u8])> = segments.iter().enumerate().map(|(i, s)| (i as u32 + 1, s.as_slice())).collect();
    let replayed = replay_bytes(&numbered, 4096);
    for t in &replayed.tasks {
        assert!(t.stored.segs.iter().all(|&s| s == 0 || (1..=numbered.len() as u32).contains(&s)));
    }
});
