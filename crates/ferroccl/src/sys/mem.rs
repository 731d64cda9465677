//! Byte copies that stay fast whatever the two buffers' addresses.
//!
//! glibc's `memcpy` (2.36, Debian 12) copies blocks of a few KiB and up with `rep
//! movsb`, and on AMD Zen `rep movsb` runs some twenty times slower when the
//! destination sits a few bytes past the source modulo a page (4 KiB aliasing): on the
//! development machine (AMD EPYC) a 64 KiB copy took 46 µs instead of 1.7 µs when
//! `(dst - src) mod 4096` was 4 to 28, and 1.6 µs at every other offset (1 MiB and
//! larger take another path and were not slow). Which offset a copy gets depends on
//! where the allocator and the kernel put the buffers, so the same program was fast in
//! one run and slow in the next. A copy at such an offset here goes in pieces of 2 KiB,
//! which glibc copies with vector loads and stores instead (1.0 µs for 64 KiB).

/// Bytes per piece when the two addresses alias: below glibc's `rep movsb` threshold.
const PIECE: usize = 2048;

/// Whether a copy of `len` bytes from address `src` to `dst` falls in the slow case
/// (see the module docs): `(dst - src) mod 4096` in `1..64`, and long enough for glibc
/// to take `rep movsb`.
pub(crate) fn aliases(dst: usize, src: usize, len: usize) -> bool {
    len > PIECE && (1..64).contains(&(dst.wrapping_sub(src) % 4096))
}

/// `dst.copy_from_slice(src)`, in pieces where the addresses alias.
///
/// # Panics
/// If the lengths differ (as `copy_from_slice`).
pub(crate) fn copy(dst: &mut [u8], src: &[u8]) {
    if !aliases(dst.as_ptr() as usize, src.as_ptr() as usize, src.len()) {
        dst.copy_from_slice(src);
        return;
    }
    assert_eq!(dst.len(), src.len(), "copy: length mismatch");
    for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
        d.copy_from_slice(s);
    }
}

/// The pieces a raw copy of `len` bytes from `src` to `dst` is made of:
/// `(offset, len)` of each (one piece where the addresses do not alias).
pub(crate) fn pieces(dst: usize, src: usize, len: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = if aliases(dst, src, len) {
        PIECE
    } else {
        len.max(1)
    };
    (0..len).step_by(step).map(move |o| (o, step.min(len - o)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_exact_at_every_offset_and_pieced_only_where_they_alias() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; 24_096];
        for shift in [0usize, 1, 4, 16, 63, 64, 100, 4095] {
            for len in [0usize, 1, 2048, 2049, 10_000, 20_000 - 64] {
                let d = &mut dst[shift..shift + len];
                copy(d, &src[..len]);
                assert_eq!(d, &src[..len], "shift {shift} len {len}");
            }
        }
        assert!(aliases(4096 + 16, 4096, 65536));
        assert!(aliases(8192 + 4, 0, 4096));
        assert!(!aliases(4096, 4096, 65536), "the same offset");
        assert!(!aliases(4096 + 64, 4096, 65536));
        assert!(!aliases(4096 + 16, 4096, 2048), "short copies");
        let p: Vec<_> = pieces(16, 0, 5000).collect();
        assert_eq!(p, vec![(0, 2048), (2048, 2048), (4096, 904)]);
        assert_eq!(pieces(64, 0, 5000).collect::<Vec<_>>(), vec![(0, 5000)]);
        assert_eq!(pieces(64, 0, 0).count(), 0);
    }
}
