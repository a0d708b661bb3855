//! Multipart upload bodies, fed whole or in random pieces (the unconsumed rest carried over
//! to the next piece, as the reactor does): the same file bytes and the same answer (stored
//! file, or the same refusal) come out; the carried rest stays bounded; the file never exceeds
//! the limit; a stored name never holds `"`, `/`, `\`, CR, LF or any other control character.
#![no_main]
use libfuzzer_sys::fuzz_target;
use relay::files::{UploadError, UploadParse, Uploaded};
use relay::multipart::MAX_PART_HEADER_BYTES;

#[path = "splits.rs"]
mod splits;

const LIMIT: u64 = 1000;

#[derive(Debug, PartialEq)]
enum Outcome {
    Stored(Uploaded, Vec<u8>),
    Refused(UploadError),
}

fn upload(pieces: &[&[u8]]) -> Outcome {
    let mut upload = match UploadParse::new(Some("multipart/form-data; boundary=fz"), LIMIT) {
        Ok(u) => u,
        Err(e) => panic!("the fixed content type is refused: {e:?}"),
    };
    let mut carried = Vec::new();
    let mut file = Vec::new();
    for piece in pieces {
        carried.extend_from_slice(piece);
        let mut to_disk = Vec::new();
        match upload.feed(&carried, &mut to_disk) {
            Ok(used) => {
                carried.drain(..used);
                file.extend_from_slice(&to_disk);
                assert!(file.len() as u64 <= LIMIT);
            }
            Err(e) => return Outcome::Refused(e),
        }
        if upload.is_done() {
            carried.clear(); // the epilogue
        }
        assert!(carried.len() <= MAX_PART_HEADER_BYTES + piece.len() + 80);
    }
    match upload.finish() {
        Ok(meta) => {
            let name = &meta.filename;
            assert!(!name.is_empty() && name.len() <= 255, "{name:?}");
            assert!(!name.contains(['"', '/', '\\', '\r', '\n']), "unsafe stored name {name:?}");
            assert!(!name.chars().any(char::is_control), "control character in {name:?}");
            assert_eq!(meta.size, file.len() as u64);
            Outcome::Stored(meta, file)
        }
        Err(e) => Outcome::Refused(e),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((seed, body)) = splits::seed_and_rest(data) else { return };
    let whole = upload(&[body]);
    let split = upload(&splits::pieces(body, seed));
    assert_eq!(whole, split, "fed whole and fed in pieces disagree");
});
