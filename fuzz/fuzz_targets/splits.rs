//! Random splits of a fuzz input. The seed comes from the input itself (its first 4 bytes), so
//! libFuzzer explores the split points as it explores the bytes, and a crash replays exactly.

/// The seed (the first 4 bytes) and the rest of the input; `None` when it is too short.
pub fn seed_and_rest(data: &[u8]) -> Option<(u32, &[u8])> {
    let (seed, rest) = data.split_at_checked(4)?;
    Some((u32::from_le_bytes(seed.try_into().ok()?), rest))
}

/// `data` cut into pieces whose lengths follow `seed`: mostly 1 to 16 bytes (so boundaries fall
/// inside every token), now and then up to 4 KiB. The pieces concatenate to `data`.
pub fn pieces(data: &[u8], seed: u32) -> Vec<&[u8]> {
    let mut state = u64::from(seed);
    let mut out = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        // splitmix64: every seed, small ones included, gives well-mixed lengths at once.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = state;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
        let max = if x & 7 == 0 { 4096 } else { 16 };
        let n = (((x >> 8) as usize) % max + 1).min(rest.len());
        let (piece, tail) = rest.split_at(n);
        out.push(piece);
        rest = tail;
    }
    out
}
