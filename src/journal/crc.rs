//! CRC-32C (Castagnoli), as the journal's frames use it: the SSE 4.2 instruction where the CPU
//! has it (replaying a large journal is mostly checksumming), a table otherwise. No I/O.

/// Reflected Castagnoli polynomial.
const POLY: u32 = 0x82F6_3B78;

const fn make_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ POLY } else { crc >> 1 };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
}

static TABLE: [u32; 256] = make_table();

/// CRC-32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the CPU supports SSE 4.2, checked just above.
            return unsafe { crc32c_sse42(data) };
        }
    }
    crc32c_table(data)
}

fn crc32c_table(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ u32::from(b)) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u8, _mm_crc32_u64};
    let mut crc = !0u64;
    let mut chunks = data.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        crc = _mm_crc32_u64(crc, u64::from_le_bytes(word));
    }
    let mut crc = crc as u32;
    for &b in chunks.remainder() {
        crc = _mm_crc32_u8(crc, b);
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(data: &[u8], expected: u32) {
        assert_eq!(crc32c(data), expected, "{data:?}");
        assert_eq!(crc32c_table(data), expected, "table, {data:?}");
    }

    #[test]
    fn known_values() {
        // RFC 3720 B.4 and the usual check value.
        check(b"", 0);
        check(b"123456789", 0xE306_9283);
        check(&[0u8; 32], 0x8A91_36AA);
        check(&[0xFFu8; 32], 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        check(&ascending, 0x46DD_794E);
    }

    #[test]
    fn hardware_and_table_agree() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 31 + 7) as u8).collect();
        for start in 0..9 {
            for end in [start, start + 1, start + 7, start + 8, start + 9, 500, 1000] {
                assert_eq!(crc32c(&data[start..end]), crc32c_table(&data[start..end]));
            }
        }
    }
}
