//! Multipart upload bodies fed in arbitrary pieces: never a panic, the carried rest stays
//! bounded, and the file never exceeds the limit.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::files::{UploadError, UploadParse};
use relay::multipart::MAX_PART_HEADER_BYTES;

fuzz_target!(|data: &[u8]| {
    let Some((&step, body)) = data.split_first() else { return };
    let step = usize::from(step % 64) + 1;
    let Ok(mut upload) = UploadParse::new(Some("multipart/form-data; boundary=fz"), 1000) else { return };
    let mut carried = Vec::new();
    let mut written = 0usize;
    for piece in body.chunks(step) {
        carried.extend_from_slice(piece);
        let mut to_disk = Vec::new();
        match upload.feed(&carried, &mut to_disk) {
            Ok(used) => {
                carried.drain(..used);
                written += to_disk.len();
                assert!(written <= 1000);
            }
            Err(UploadError::TooLarge | UploadError::Bad(_)) => return,
        }
        assert!(carried.len() <= MAX_PART_HEADER_BYTES + step + 80);
    }
    let _ = upload.finish();
});
